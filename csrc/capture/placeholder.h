// Placeholder tensors: right sizes, strides, dtype, device and autograd history; no data.
//
// The PythonRunner hands these out instead of running kernels. They carry our dispatch key, so
// every op on them comes back to the interceptor; their storage is dataless so that views alias
// their base; reading their data raises an error that names the op that produced them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include "capture/trace_record.h"

namespace terra::capture {

constexpr c10::BackendComponent kTerraBackendBitForPlaceholders = c10::BackendComponent::PrivateUse3Bit;

class PlaceholderImpl : public c10::TensorImpl {
 public:
  // A fresh placeholder with its own (dataless) storage.
  PlaceholderImpl(const TensorMeta& meta, const c10::OperatorHandle& producer);
  // Shares `storage` with another placeholder (a shallow copy).
  PlaceholderImpl(c10::Storage storage, const TensorMeta& meta, const c10::OperatorHandle& producer);
  // A view: shares `storage` with its base and has the dispatch keys `keys` as given (torch's
  // own views are built this way: see make_placeholder_view).
  PlaceholderImpl(c10::TensorImpl::ImplType view, c10::Storage storage, c10::DispatchKeySet keys, const TensorMeta& meta,
                  const c10::OperatorHandle& producer);

  const c10::OperatorHandle& producer() const { return producer_; }

  // Gives this placeholder its value and turns it into an ordinary tensor of its device: the
  // shared (dataless) storage receives real memory holding `value` laid out as this tensor's
  // sizes/strides say, so views of the same base see it too once they are bound. Used when the
  // runtime materializes a placeholder (a fetch, or a fall back to eager).
  void bind(const at::Tensor& value);
  // An alias of a bound placeholder (autograd's saved copy, a shallow copy) shares its memory
  // but still carries our key: make it an ordinary tensor too. False if the storage has no data.
  bool adopt();
  bool is_bound() const { return !key_set_.has_backend(kTerraBackendBitForPlaceholders); }
  // A view made over the memory of a tensor that was no placeholder (a parameter's detach,
  // torch.from_numpy's lift_fresh): that memory is its value once the graph has run the writes
  // Python validated, so it is adopted, never given the graph's value (see over_memory_).
  bool over_memory() const { return over_memory_; }
  void set_over_memory() { over_memory_ = true; }
  // See restride_placeholder.
  void restride(const TensorMeta& meta);
  const char* tensorimpl_type_name() const override;

  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& version_counter, bool allow_tensor_metadata_change) const override;
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& version_counter, bool allow_tensor_metadata_change) const override;
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override;

 private:
  void set_meta(const TensorMeta& meta);
  c10::OperatorHandle producer_;
  // The graph's value of such a view can be a copy (a fed numpy buffer, runtime/feed_snapshot.h):
  // written back, it overwrote what numpy had written there since (`obs += 1`, then
  // `x.tolist()` put the old batch back into `obs`).
  bool over_memory_ = false;
};

// True for a placeholder that has no value yet.
bool is_placeholder(const at::Tensor& t);
// A placeholder whose storage got memory through an alias becomes an ordinary tensor; true if
// `t` is (now) an ordinary tensor.
bool adopt_if_backed(const at::Tensor& t);
// Whether some tensor among `args` (lists included) is a placeholder without a value; the ones
// whose storage has memory (an alias autograd saved of a placeholder given its value) become
// ordinary tensors on the way (adopt_if_backed).
bool has_unbacked_placeholder(c10::ArrayRef<c10::IValue> args);
// A placeholder's dataless storage gets memory of `device` (uninitialized), the first time one of
// the tensors over it is given a value; a storage that has memory keeps it.
void give_memory(c10::StorageImpl& storage, c10::DeviceType device);
// Binds `placeholder` (which must be a PlaceholderImpl) to `value`; see PlaceholderImpl::bind.
void bind_placeholder(const at::Tensor& placeholder, const at::Tensor& value);
at::Tensor make_placeholder(const TensorMeta& meta, const c10::OperatorHandle& producer);
at::Tensor make_placeholder_view(const at::Tensor& base, const TensorMeta& meta,
                                 const c10::OperatorHandle& producer);
// An in-place op changed `placeholder`'s metadata (transpose_, as_strided_, resize_): it takes
// `meta`'s sizes, strides and offset; its dataless storage grows if the new extent needs more.
void restride_placeholder(const at::Tensor& placeholder, const TensorMeta& meta);
TensorMeta meta_of(const c10::TensorImpl& t);
// An undefined tensor (a gradient nobody needs) has dtype Undefined and nothing else.
inline TensorMeta meta_of(const at::Tensor& t) { return t.defined() ? meta_of(*t.unsafeGetTensorImpl()) : TensorMeta{}; }

}  // namespace terra::capture
