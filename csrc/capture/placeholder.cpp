#include "capture/placeholder.h"

#include <mutex>
#include <string>
#include <unordered_map>

#include "capture/terra_key.h"

namespace terra::capture {

namespace {

c10::Storage dataless_storage(const TensorMeta& meta) {
  int64_t extent = meta.storage_offset + 1;
  for (size_t i = 0; i < meta.sizes.size(); ++i) {
    if (meta.sizes[i] == 0) { extent = meta.storage_offset; break; }
    extent += (meta.sizes[i] - 1) * meta.strides[i];
  }
  size_t nbytes = static_cast<size_t>(extent) * c10::elementSize(meta.dtype);
  return c10::Storage(c10::Storage::use_byte_size_t(), nbytes, c10::DataPtr(nullptr, meta.device),
                      /*allocator=*/nullptr, /*resizable=*/false);
}

// torch's data-access error names tensorimpl_type_name(); make it name the producing op.
// One message per operator, built once and kept for the life of the process.
const char* message_for(const c10::OperatorHandle& op) {
  static std::mutex mu;
  static std::unordered_map<const void*, std::string> messages;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = messages.try_emplace(&op.schema());
  if (inserted) {
    it->second = "terra_torch placeholder produced by " + c10::toString(op.operator_name()) +
                 " (it has no data yet: read it with .item()/.tolist()/.numpy() or call "
                 "terra_torch.synchronize())";
  }
  return it->second.c_str();
}

}  // namespace

PlaceholderImpl::PlaceholderImpl(const TensorMeta& meta, const c10::OperatorHandle& producer)
    : PlaceholderImpl(dataless_storage(meta), meta, producer) {}

PlaceholderImpl::PlaceholderImpl(c10::Storage storage, const TensorMeta& meta,
                                 const c10::OperatorHandle& producer)
    : c10::TensorImpl(std::move(storage), terra_keyset(), c10::scalarTypeToTypeMeta(meta.dtype)),
      producer_(producer) {
  set_meta(meta);
  set_storage_access_should_throw();
}

void PlaceholderImpl::set_meta(const TensorMeta& meta) {
  set_sizes_and_strides(meta.sizes, meta.strides, meta.storage_offset);
}

const char* PlaceholderImpl::tensorimpl_type_name() const { return message_for(producer_); }

c10::intrusive_ptr<c10::TensorImpl> PlaceholderImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  auto copy = c10::make_intrusive<PlaceholderImpl>(unsafe_storage(), meta_of(*this), producer_);
  copy->set_version_counter(version_counter);
  copy->set_allow_tensor_metadata_change(allow_tensor_metadata_change);
  return copy;
}

c10::intrusive_ptr<c10::TensorImpl> PlaceholderImpl::shallow_copy_and_detach(
    c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const {
  return shallow_copy_and_detach(static_cast<const c10::VariableVersion&>(version_counter),
                                 allow_tensor_metadata_change);
}

void PlaceholderImpl::shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) {
  copy_tensor_metadata(impl.get(), this, version_counter(), allow_tensor_metadata_change());
  refresh_numel();
  refresh_contiguous();
}

bool is_placeholder(const at::Tensor& t) {
  // Only placeholders carry our backend bit (the TLS include never lands on a tensor).
  return t.defined() && t.unsafeGetTensorImpl()->key_set().has_backend(kTerraBackendBit);
}

at::Tensor make_placeholder(const TensorMeta& meta, const c10::OperatorHandle& producer) {
  return at::Tensor(c10::make_intrusive<PlaceholderImpl>(meta, producer));
}

at::Tensor make_placeholder_view(const at::Tensor& base, const TensorMeta& meta,
                                 const c10::OperatorHandle& producer) {
  // A view's data comes from its base: name the op that produced the base in errors.
  auto* base_placeholder = dynamic_cast<PlaceholderImpl*>(base.unsafeGetTensorImpl());
  const c10::OperatorHandle& origin = base_placeholder ? base_placeholder->producer() : producer;
  return at::Tensor(
      c10::make_intrusive<PlaceholderImpl>(base.unsafeGetTensorImpl()->unsafe_storage(), meta, origin));
}

TensorMeta meta_of(const c10::TensorImpl& t) {
  TensorMeta m;
  m.dtype = c10::typeMetaToScalarType(t.dtype());
  m.device = t.device();
  m.sizes.assign(t.sizes().begin(), t.sizes().end());
  m.strides.assign(t.strides().begin(), t.strides().end());
  m.storage_offset = t.storage_offset();
  m.requires_grad = t.requires_grad();
  return m;
}

}  // namespace terra::capture
