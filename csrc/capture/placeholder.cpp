#include "capture/placeholder.h"

#include <mutex>
#include <string>
#include <unordered_map>

#include "capture/terra_key.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/LegacyTypeDispatch.h>

namespace terra::capture {

namespace {

// Bytes from the storage's start to the end of the last element `meta` reaches.
size_t extent_bytes(const TensorMeta& meta) {
  int64_t extent = meta.storage_offset + 1;
  for (size_t i = 0; i < meta.sizes.size(); ++i) {
    if (meta.sizes[i] == 0) { extent = meta.storage_offset; break; }
    extent += (meta.sizes[i] - 1) * meta.strides[i];
  }
  return static_cast<size_t>(extent) * c10::elementSize(meta.dtype);
}

c10::Storage dataless_storage(const TensorMeta& meta) {
  return c10::Storage(c10::Storage::use_byte_size_t(), extent_bytes(meta), c10::DataPtr(nullptr, meta.device),
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

// The autocast key of the device: torch's TensorImpl constructor adds it from a tensor's backend
// bit, and ours (PrivateUse3) has none. Without it an op whose tensors were all placeholders
// skipped autocast: under torch.autocast("cpu", torch.bfloat16) cross_entropy's log_softmax,
// which autocast runs in float32, ran in bfloat16 (eager's casts went missing).
c10::DispatchKeySet autocast_keys(c10::Device device) {
  return c10::getAutocastRelatedKeySetFromBackend(
      c10::toBackendComponent(c10::computeDispatchKey(std::nullopt, std::nullopt, device)));
}

}  // namespace

PlaceholderImpl::PlaceholderImpl(const TensorMeta& meta, const c10::OperatorHandle& producer)
    : PlaceholderImpl(dataless_storage(meta), meta, producer) {}

PlaceholderImpl::PlaceholderImpl(c10::Storage storage, const TensorMeta& meta,
                                 const c10::OperatorHandle& producer)
    : c10::TensorImpl(std::move(storage), terra_keyset() | autocast_keys(meta.device), c10::scalarTypeToTypeMeta(meta.dtype)),
      producer_(producer) {
  set_meta(meta);
  // Storage access itself stays allowed: the autograd engine asks a gradient's storage for its
  // use count before accumulating into it. Data access still fails (a dataless storage is "not
  // allocated", which typed data_ptr<T>() checks), and terra_torch/_materialize.py turns
  // Python-level reads of a placeholder into its value or an error naming its producer.
}

PlaceholderImpl::PlaceholderImpl(c10::TensorImpl::ImplType view, c10::Storage storage, c10::DispatchKeySet keys,
                                 const TensorMeta& meta, const c10::OperatorHandle& producer)
    : c10::TensorImpl(view, std::move(storage), keys, c10::scalarTypeToTypeMeta(meta.dtype)), producer_(producer) {
  set_meta(meta);
}

void PlaceholderImpl::set_meta(const TensorMeta& meta) {
  set_sizes_and_strides(meta.sizes, meta.strides, meta.storage_offset);
}

void PlaceholderImpl::restride(const TensorMeta& meta) {
  c10::StorageImpl* storage = storage_.unsafeGetStorageImpl();
  // (a dataless storage: bind() allocates nbytes() when the first alias gets its value)
  if (storage->data() == nullptr && extent_bytes(meta) > storage->nbytes()) storage->set_nbytes(extent_bytes(meta));
  set_meta(meta);
}

const char* PlaceholderImpl::tensorimpl_type_name() const { return message_for(producer_); }

c10::intrusive_ptr<c10::TensorImpl> PlaceholderImpl::shallow_copy_and_detach(
    const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const {
  if (is_bound())  // an ordinary tensor now: its copies are ordinary tensors too
    return c10::TensorImpl::shallow_copy_and_detach(version_counter, allow_tensor_metadata_change);
  auto copy = c10::make_intrusive<PlaceholderImpl>(unsafe_storage(), meta_of(*this), producer_);
  if (over_memory_) copy->set_over_memory();
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

void give_memory(c10::StorageImpl& storage, c10::DeviceType device) {
  if (storage.data() != nullptr) return;
  c10::Allocator* allocator = c10::GetAllocator(device);
  storage.set_data_ptr_noswap(allocator->allocate(storage.nbytes()));
  storage.set_allocator(allocator);
}

void PlaceholderImpl::bind(const at::Tensor& value) {
  TORCH_CHECK(!is_bound(), "terra_torch: placeholder produced by ", c10::toString(producer_.operator_name()),
              " is already bound");
  TORCH_CHECK(value.scalar_type() == c10::typeMetaToScalarType(dtype()) && value.sizes() == sizes() &&
                  value.device() == device(),
              "terra_torch: cannot bind a placeholder of ", c10::toString(producer_.operator_name()), " (",
              c10::typeMetaToScalarType(dtype()), sizes(), " on ", device(), ") to a value of ", value.scalar_type(),
              value.sizes(), " on ", value.device());
  give_memory(*storage_.unsafeGetStorageImpl(), device().type());  // (first of its aliases to be bound)
  // From now on this is an ordinary tensor of its device: our backend bit gives way to the
  // device's, and data access is allowed again.
  auto device_keys = c10::DispatchKeySet(c10::computeDispatchKey(std::nullopt, std::nullopt, device()));
  key_set_ = key_set_.remove_backend(kTerraBackendBitForPlaceholders) |
             (device_keys & c10::DispatchKeySet(c10::DispatchKeySet::RAW, c10::full_backend_mask));
  storage_access_should_throw_ = false;
  at::Tensor self(c10::intrusive_ptr<c10::TensorImpl>::unsafe_reclaim_from_nonowning(this));
  SuspendGuard no_interception;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
  // Broadcast dimensions (stride 0, from expand) share memory: copy one element along them.
  at::Tensor dst = self, src = value;
  for (int64_t d = dst.dim() - 1; d >= 0; --d) {
    if (dst.stride(d) == 0 && dst.size(d) > 1) {
      dst = dst.narrow(d, 0, 1);
      src = src.narrow(d, 0, 1);
    }
  }
  dst.copy_(src);
}

bool PlaceholderImpl::adopt() {
  if (is_bound()) return true;
  if (storage_.unsafeGetStorageImpl()->data() == nullptr && storage_.nbytes() > 0) return false;
  auto device_keys = c10::DispatchKeySet(c10::computeDispatchKey(std::nullopt, std::nullopt, device()));
  key_set_ = key_set_.remove_backend(kTerraBackendBitForPlaceholders) |
             (device_keys & c10::DispatchKeySet(c10::DispatchKeySet::RAW, c10::full_backend_mask));
  storage_access_should_throw_ = false;
  return true;
}

bool adopt_if_backed(const at::Tensor& t) {
  if (!is_placeholder(t)) return true;
  auto* impl = dynamic_cast<PlaceholderImpl*>(t.unsafeGetTensorImpl());
  return impl != nullptr && impl->adopt();
}

bool has_unbacked_placeholder(c10::ArrayRef<c10::IValue> args) {
  auto unbacked = [](const c10::IValue& v) { return v.isTensor() && !adopt_if_backed(v.toTensor()); };
  for (const c10::IValue& v : args) {
    if (unbacked(v)) return true;
    if (v.isTensorList() || v.isOptionalTensorList())
      for (const c10::IValue& e : v.toListRef())
        if (unbacked(e)) return true;
  }
  return false;
}

void bind_placeholder(const at::Tensor& placeholder, const at::Tensor& value) {
  auto* impl = dynamic_cast<PlaceholderImpl*>(placeholder.unsafeGetTensorImpl());
  TORCH_CHECK(impl != nullptr, "terra_torch: bind_placeholder needs a placeholder tensor");
  impl->bind(value);
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
  // As torch's views: an inference tensor exactly when its base is, whatever the mode. A view of
  // a parameter taken under torch.inference_mode() is an ordinary tensor, which autograd's view
  // kernel (ADInplaceOrView, which runs for such a base) gives a version counter; made like a
  // fresh tensor in that mode it was an inference tensor, and that kernel raised.
  c10::DispatchKeySet keys = terra_keyset() | autocast_keys(meta.device);
  if (!base.is_inference()) keys = keys | c10::getAutogradRelatedKeySetFromBackend(kTerraBackendBit);
  auto view = c10::make_intrusive<PlaceholderImpl>(c10::TensorImpl::VIEW, base.unsafeGetTensorImpl()->unsafe_storage(),
                                                   keys, meta, origin);
  if (!is_placeholder(base) || (base_placeholder != nullptr && base_placeholder->over_memory())) view->set_over_memory();
  return at::Tensor(std::move(view));
}

void restride_placeholder(const at::Tensor& placeholder, const TensorMeta& meta) {
  auto* impl = dynamic_cast<PlaceholderImpl*>(placeholder.unsafeGetTensorImpl());
  TORCH_CHECK(impl != nullptr && !impl->is_bound(), "terra_torch: restride_placeholder needs a placeholder without a value");
  impl->restride(meta);
}

TensorMeta meta_of(const c10::TensorImpl& t) {
  TensorMeta m;
  m.dtype = c10::typeMetaToScalarType(t.dtype());
  m.device = t.device();
  m.sizes.assign(t.sizes().begin(), t.sizes().end());
  m.strides.assign(t.strides().begin(), t.strides().end());
  m.storage_offset = t.storage_offset();
  m.requires_grad = t.requires_grad();
  m.conj = t.is_conj();
  m.neg = t.is_neg();
  return m;
}

}  // namespace terra::capture
