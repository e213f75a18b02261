#include "runtime/known_values.h"

#include <ATen/core/LegacyTypeDispatch.h>

#include "capture/placeholder.h"
#include "capture/terra_key.h"

namespace terra::runtime {

bool KnownValues::small_cpu(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == c10::kStrided && t.numel() <= kMaxKnownElements &&
         !t.is_view() && !t.is_inference();
}

const KnownValues::Known* KnownValues::find(const at::Tensor& t) const {
  const Known* k = known_.find(t.unsafeGetTensorImpl());
  if (k == nullptr || k->impl->expired() || t.is_inference() || k->version != t._version()) return nullptr;
  return k;
}

void KnownValues::learn(const at::Tensor& t) {
  if (!small_cpu(t) || capture::is_placeholder(t) || !t.has_storage() || t.data_ptr() == nullptr) return;
  at::Tensor copy;
  {
    capture::SuspendGuard no_interception;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
    copy = t.clone();
  }
  Known& k = *known_.try_emplace(t.unsafeGetTensorImpl()).first;
  k.impl.emplace(t.getIntrusivePtr());
  k.value = std::move(copy);
  k.version = t._version();
}

bool KnownValues::substitute(c10::ArrayRef<c10::IValue> args, torch::jit::Stack& out) const {
  if (known_.empty()) return false;
  out.clear();
  bool any = false;
  for (const c10::IValue& a : args) {
    if (a.isTensor()) {
      const at::Tensor& t = a.toTensor();
      if (!t.defined()) {
        out.push_back(a);
      } else if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
        out.push_back(a);  // a Python number: its value is its own
      } else if (const Known* k = find(t)) {
        out.emplace_back(k->value);
        any = true;
      } else {
        return false;
      }
    } else if (a.isTensorList() || a.isOptionalTensorList()) {
      return false;
    } else {
      out.push_back(a);
    }
  }
  return any;
}

void KnownValues::follow(const c10::OperatorHandle& op, torch::jit::Stack& known, c10::ArrayRef<at::Tensor> outputs) {
  if (op.hasTag(at::Tag::nondeterministic_seeded) || outputs.empty()) return;
  for (const at::Tensor& t : outputs)
    if (!t.defined() || !t.is_cpu() || t.numel() > kMaxKnownElements) return;
  {
    capture::SuspendGuard no_interception;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the copies are ours, not the program's
    try {
      op.callBoxed(&known);
    } catch (const std::exception&) {
      return;  // the graph's own run raises where eager would; the copies just stay unknown
    }
  }
  size_t k = 0;
  for (const c10::IValue& r : known) {
    if (!r.isTensor()) return;
    if (k >= outputs.size()) break;
    const at::Tensor& out = outputs[k++];
    const at::Tensor& value = r.toTensor();
    if (!value.defined() || !value.is_cpu() || value.numel() > kMaxKnownElements) return;
    Known& entry = *known_.try_emplace(out.unsafeGetTensorImpl()).first;
    const bool in_place = entry.impl && !entry.impl->expired() && entry.value.defined() &&
                          entry.value.unsafeGetTensorImpl() == value.unsafeGetTensorImpl();
    entry.impl.emplace(out.getIntrusivePtr());
    entry.value = value;
    // A fresh placeholder keeps version 0; an argument written in place is bumped once by
    // ADInplaceOrView after this op returns.
    entry.version = out._version() + (in_place ? 1 : 0);
  }
}

void KnownValues::prune() {
  known_.erase_if([](const c10::TensorImpl*, const Known& k) { return !k.impl || k.impl->expired(); });
}

}  // namespace terra::runtime
