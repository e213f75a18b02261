#include "runtime/known_values.h"

#include <cstring>

#include <ATen/core/LegacyTypeDispatch.h>

#include "capture/dense_copy.h"
#include "capture/op_arguments.h"
#include "capture/placeholder.h"
#include "capture/schema_aliases.h"
#include "capture/terra_key.h"
#include "common/env.h"
#include "runtime/scalar_arithmetic.h"

namespace terra::runtime {

namespace {

// A tensor made under torch.inference_mode() has no version counter to trust a copy by
// (known_values.h): never known, never in a recipe.
bool untracked(const at::Tensor& t) { return t.is_inference(); }

}  // namespace

bool KnownValues::small_cpu(const at::Tensor& t) {
  return t.defined() && t.is_cpu() && t.layout() == c10::kStrided && t.numel() <= kMaxKnownElements &&
         !t.is_view() && !untracked(t);
}

const KnownValues::Known* KnownValues::find(const at::Tensor& t) const {
  const Known* k = known_.find(t.unsafeGetTensorImpl());
  if (k == nullptr || !k->settled || k->impl->expired() || untracked(t) || k->version != t._version())
    return nullptr;
  return k;
}

void KnownValues::learn(const at::Tensor& t) {
  if (!small_cpu(t) || capture::is_placeholder(t) || !t.has_storage() || t.data_ptr() == nullptr) return;
  Known& k = *known_.try_emplace(t.unsafeGetTensorImpl()).first;
  k.impl.emplace(t.getIntrusivePtr());
  k.value = copy_of(t);
  k.version = t._version();
}

at::Tensor KnownValues::copy_of(const at::Tensor& t) {
  if (std::optional<at::Tensor> copy = capture::copy_dense_cpu(t)) return *std::move(copy);
  capture::SuspendGuard no_interception;
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
  return t.clone();
}

bool KnownValues::was_written(const void* storage) const {
  const auto it = written_.find(storage);
  return it != written_.end() && !it->second.expired();  // (a dead one's address is another storage now)
}

bool KnownValues::fresh(const at::Tensor& t) const {
  // A real small CPU tensor that no co-executed op ever wrote (torch.tensor(1.0), made by Python
  // outside the interceptor): only such ops leave writes pending in the graph, so its memory is
  // its value now. Written storages are remembered, so a view of a written tensor is not fresh.
  return small_cpu(t) && !capture::is_placeholder(t) && memory_is_value(t);
}

bool KnownValues::substitute(c10::ArrayRef<c10::IValue> args, torch::jit::Stack& out, const GraphValues* graph) {
  if (known_.empty() && (graph == nullptr || recipes_.empty())) return false;
  out.clear();
  resolved_.clear();
  recipe_runs_ = 0;
  waited_close_ = false;
  bool any = false;
  // The known value of one tensor argument (itself for Python numbers and fresh tensors).
  auto value_of = [&](const at::Tensor& t, at::Tensor& v) {
    if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) {
      v = t;
      return true;
    }
    if (t.numel() <= kMaxKnownElements) {  // (the only ones known or fresh; most ops' first tensor is larger)
      if (const Known* k = find(t)) {
        v = k->value;
        any = true;
        return true;
      }
      if (fresh(t)) {
        v = copy_of(t);  // the op may write it, and only the graph may write the real one
        any = true;
        return true;
      }
    }
    if (graph == nullptr || !capture::is_placeholder(t)) return false;
    // The graph's value at `t`'s index is `t`'s while no op has written it since.
    const std::optional<int64_t> index = ever_written(t) ? std::nullopt : graph->link(t);
    // Published already: taken rather than running the recipe again on this thread (a recipe
    // saves a wait only while the graph is behind; each row of indices the graph computed,
    // `for j in idx`, ran the unbind again).
    // A recipe that would wait for the graph a few outputs before this one: this one is waited
    // for instead (kCloseOutputs).
    static const bool close_waits = !common::switched_off("TERRA_CLOSE_WAITS");  // (an A/B switch)
    if (index) {
      std::optional<at::Tensor> got = graph->published_now(*index);
      if (!got && close_waits) {
        const std::shared_ptr<const Recipe>* found = recipes_.find(t.unsafeGetTensorImpl());
        const int64_t latest = found != nullptr && *found ? latest_wait(**found, *graph, 0) : -1;
        if (latest >= 0 && *index - latest <= kCloseOutputs && (got = graph->published(*index))) waited_close_ = true;
      }
      if (got) {
        v = *std::move(got);
        any = true;
        return true;
      }
    }
    if (resolve(t, v, *graph, 0)) {
      any = true;
      return true;
    }
    if (!index) return false;
    std::optional<at::Tensor> got = graph->published(*index);
    if (!got) return false;
    v = *got;
    return true;
  };
  at::Tensor v;
  for (const c10::IValue& a : args) {
    if (a.isTensor()) {
      if (!value_of(a.toTensor(), v)) return false;
      out.emplace_back(v);
    } else if (a.isTensorList()) {
      // A foreach op on step counters (Adam's _foreach_add_(steps, tensor(1.0)) on CPU).
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : a.toTensorList().vec()) {
        if (!value_of(t, v)) return false;
        list.push_back(v);
      }
      out.emplace_back(std::move(list));
    } else if (a.isOptionalTensorList()) {
      return false;
    } else {
      out.push_back(a);
    }
  }
  return any;
}

void KnownValues::plan_recipe(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, LinkOf link,
                              int64_t fewest_elements) {
  planned_.reset();
  // (First what most ops fail: no output keep_recipe() would take, or an optimizer's op that
  // writes its arguments.)
  if (fewest_elements > kMaxRecipeElements) return;
  if (capture::writes_an_argument(op.schema()) || op.hasTag(at::Tag::nondeterministic_seeded)) return;
  // A recipe that needs the graph is kept only for an output of at most kMaxKnownElements.
  const bool may_need_graph = fewest_elements <= kMaxKnownElements;
  Recipe r;
  // Tensors to copy (argument, list element, source), copied only once the recipe turns out to
  // need the graph for another argument: most ops whose tensors are all real end up with none.
  struct Copy {
    size_t arg;
    int32_t element;
    at::Tensor source;  // (a list's elements are temporaries of the loop below)
  };
  c10::SmallVector<Copy, 4> copies;
  bool copied_writable = false;  // (such a copy is a reason for a recipe by itself)
  bool takes_tensors = false;
  // One tensor argument, or one element of a tensor list: false if the recipe cannot read it. A
  // tensor it takes as it is (undefined, a wrapped Python number) goes to `as_is`.
  auto take = [&](size_t i, int32_t element, const at::Tensor& t, bool& as_is) {
    as_is = !t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number();
    if (as_is) return true;
    takes_tensors = true;
    const int64_t n = t.numel();
    if (n > kMaxRecipeElements || !t.is_cpu() || t.layout() != c10::kStrided) return false;  // (most ops end here)
    if (const Known* k = n <= kMaxKnownElements ? find(t) : nullptr) {
      copies.push_back({i, element, k->value});  // (a followed in-place op updates the known copy)
      return true;
    }
    if (capture::is_placeholder(t)) {
      if (untracked(t)) return false;
      // (a live output at that address is `t` itself: the entry is its recipe)
      const std::shared_ptr<const Recipe>* own = recipes_.find(t.unsafeGetTensorImpl());
      const bool has_recipe = own != nullptr && *own && (*own)->impl && !(*own)->impl->expired();
      if (!has_recipe && (n > kMaxKnownElements || !may_need_graph)) return false;
      if (ever_written(t)) return false;
      const std::optional<int64_t> index = link(t);
      if (!index && !has_recipe) return false;
      const bool held = has_recipe && (*own)->depth < kMaxRecipeDepth;
      if (held) r.depth = std::max(r.depth, (*own)->depth + 1);
      r.inputs.push_back({i, element, true, index.value_or(-1), t._version(), WeakImpl(t.getIntrusivePtr()), t.storage(),
                          held ? *own : nullptr});
      r.needs_graph |= !has_recipe;
      return true;
    }
    if (untracked(t) || !memory_is_value(t)) return false;
    // A real tensor no op wrote: its memory is its value (the batch `x` of `x.abs().max()`).
    if (n <= kMaxKnownElements) {
      copies.push_back({i, element, t});
      return true;
    }
    // Read when the recipe runs, which is later: only memory that changes by ops alone (whose
    // versions say so). Memory Python writes without an op is copied now, as the graph's feed
    // of it is (runtime/feed_snapshot.h): read at the recipe's run, an observation buffer the
    // environment refilled through numpy between `m = obs.max()` and `m.item()` gave the new
    // maximum.
    if (python_writable_memory(t)) {
      copies.push_back({i, element, t});
      copied_writable = true;
      return true;
    }
    r.inputs.push_back({i, element, false, -1, t._version(), WeakImpl(t.getIntrusivePtr()), c10::Storage()});
    return true;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const c10::IValue& a = args[i];
    if (a.isOptionalTensorList()) return;
    bool as_is = false;
    if (a.isTensorList()) {
      // (`cat` of values with recipes: each element is an input of its own; read in place, as a
      // foreach op's list of every parameter mostly ends at its first element)
      const c10::ArrayRef<c10::IValue> elements = a.toListRef();
      c10::List<at::Tensor> list;
      list.reserve(elements.size());
      for (size_t e = 0; e < elements.size(); ++e) {
        const at::Tensor& t = elements[e].toTensor();
        if (!take(i, static_cast<int32_t>(e), t, as_is)) return;
        list.push_back(as_is ? t : at::Tensor());  // (filled in when the recipe runs)
      }
      r.args.emplace_back(std::move(list));
      continue;
    }
    if (!a.isTensor()) {
      r.args.push_back(a);
      continue;
    }
    if (!take(i, -1, a.toTensor(), as_is)) return;
    if (as_is) r.args.push_back(a);
    else r.args.emplace_back();  // (filled in when the recipe runs)
  }
  // An op that takes no tensor at all (`arange`, `zeros`, `full`) computes its value from the
  // numbers alone, on the Python thread as well as in the graph; `empty` and its kin leave memory
  // unwritten, which no recipe may stand for.
  const bool from_numbers = !takes_tensors && std::strstr(op.schema().name().c_str(), "empty") == nullptr;
  if (r.inputs.empty() && !copied_writable && !from_numbers) return;
  for (const Copy& c : copies) {
    if (c.element < 0) r.args[c.arg] = copy_of(c.source);
    else r.args[c.arg].toTensorList().set(static_cast<size_t>(c.element), copy_of(c.source));
  }
  r.op = op;
  planned_ = std::move(r);
}

void KnownValues::keep_recipe(c10::ArrayRef<at::Tensor> outputs) {
  if (!planned_) return;
  Recipe r = std::move(*planned_);
  planned_.reset();
  if (outputs.empty() || outputs.size() > kMaxRecipeOutputs) return;
  auto qualifies = [&](const at::Tensor& out) {
    return out.defined() && out.is_cpu() && !untracked(out) &&
           out.numel() <= (r.needs_graph ? kMaxKnownElements : kMaxRecipeElements);
  };
  auto keep = [&](Recipe&& kept, const at::Tensor& out, int32_t output) {
    kept.impl.emplace(out.getIntrusivePtr());
    kept.version = out._version();
    kept.output = output;
    *recipes_.try_emplace(out.unsafeGetTensorImpl()).first = std::make_shared<const Recipe>(std::move(kept));
  };
  if (outputs.size() == 1) {
    if (qualifies(outputs[0])) keep(std::move(r), outputs[0], -1);
    return;
  }
  // One recipe per output, each running the whole op and taking its own output: the rows of
  // `for i in ix` are read one by one, each as its own read. Only for ops that make views
  // (unbind, split, chunk): a computation with several outputs may depend on the thread's state
  // at the read (the LSTM layer's kernel on CPU reads GradMode: capture/grad_mode_kernels.h;
  // its `output` came out an ulp apart under no_grad).
  if (!capture::results_are_views(r.op->schema())) return;
  for (size_t k = 0; k < outputs.size(); ++k)
    if (qualifies(outputs[k])) keep(Recipe(r), outputs[k], static_cast<int32_t>(k));
}

void KnownValues::learn_value(const at::Tensor& t, const at::Tensor& v) {
  if (!v.defined() || !v.is_cpu() || v.numel() > kMaxKnownElements || untracked(t)) return;
  Known& k = *known_.try_emplace(t.unsafeGetTensorImpl()).first;
  k.impl.emplace(t.getIntrusivePtr());
  k.value = copy_of(v);  // private: a followed in-place op writes the copy, never the graph's tensor
  k.version = t._version();
  k.settled = true;
}

int64_t KnownValues::latest_wait(const Recipe& r, const GraphValues& graph, int depth) const {
  if (depth >= kMaxRecipeDepth) return -1;
  int64_t latest = -1;
  for (const RecipeInput& in : r.inputs) {
    if (!in.placeholder) continue;
    int64_t wait = -1;
    if (in.recipe) {
      wait = latest_wait(*in.recipe, graph, depth + 1);
    } else {
      // (as run_recipe reads it: a known value first, the graph's published one otherwise)
      at::Tensor p;
      if (auto impl = in.impl->lock()) p = at::Tensor(std::move(impl));
      if (p.defined() && find(p) != nullptr) continue;
      if (in.index < 0) return -1;  // (the recipe cannot run; the read takes another way)
      if (graph.ready(in.index)) return -1;  // runs without a wait
      wait = in.index;
    }
    latest = std::max(latest, wait);
  }
  return latest;
}

bool KnownValues::resolve(const at::Tensor& t, at::Tensor& v, const GraphValues& graph, int depth) {
  if (const Known* k = find(t)) {
    v = k->value;
    return true;
  }
  const std::shared_ptr<const Recipe>* found = recipes_.find(t.unsafeGetTensorImpl());
  // A recipe gives the value its op computed: still `t`'s only while nothing wrote `t` since.
  // (Keyed by address: a live `impl` is `t` itself.)
  if (found == nullptr || !*found) return false;
  const std::shared_ptr<const Recipe> recipe = *found;  // (the recursion may prune the table)
  if (!recipe->impl || recipe->impl->expired() || recipe->version != t._version() || ever_written(t)) return false;
  if (!run_recipe(*recipe, v, graph, depth)) return false;
  learn_value(t, v);
  return true;
}

bool KnownValues::run_recipe(const Recipe& r, at::Tensor& v, const GraphValues& graph, int depth) {
  for (const auto& [done, value] : resolved_)
    if (done == &r) {
      v = value;
      return true;
    }
  if (depth >= kMaxRecipeDepth || recipe_runs_ >= kMaxRecipeRuns) return false;
  torch::jit::Stack stack = r.args;
  // (a list is shared by its copies: the recipe's own stays as planned)
  for (c10::IValue& a : stack)
    if (a.isTensorList()) a = a.toTensorList().copy();
  for (const RecipeInput& in : r.inputs) {
    at::Tensor p;
    if (auto impl = in.impl->lock()) p = at::Tensor(std::move(impl));
    // The tensor's value now is the one the op read if nothing has written it since. A placeholder
    // that died since (the temporary `x.mean()` of `x.mean() > 0`) was written only if its
    // storage was, which the written record says.
    const bool unchanged = p.defined() ? p._version() == in.version && !ever_written(p)
                                       : in.placeholder && in.storage.unsafeGetStorageImpl() != nullptr &&
                                             !was_written(in.storage.unsafeGetStorageImpl());
    at::Tensor value;
    if (!in.placeholder) {
      if (!unchanged) return false;
      value = p;
    } else if (!unchanged) {
      // Written since the op read it, and so, possibly, is the graph's value at its index: an
      // in-place op writes the tensor it published, and a view (`weight.t()` in F.linear) is
      // published over memory the optimizer updates later. Read after the step, the value of
      // `loss` came out of the new weight and the old bias (a known copy). The read waits.
      return false;
    } else if (const Known* k = p.defined() ? find(p) : nullptr) {
      value = k->value;
    } else if (in.recipe ? run_recipe(*in.recipe, value, graph, depth + 1)
                         : p.defined() && resolve(p, value, graph, depth + 1)) {
      if (p.defined()) learn_value(p, value);
    } else {
      if (in.index < 0) return false;
      std::optional<at::Tensor> got = graph.published(in.index);
      if (!got) return false;
      value = *got;
      if (p.defined()) learn_value(p, value);
    }
    if (in.element < 0) stack[in.arg] = value;
    else stack[in.arg].toTensorList().set(static_cast<size_t>(in.element), value);
  }
  ++recipe_runs_;
  {
    capture::SuspendGuard no_interception;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // not an op of the user's program
    try {
      if (!run_scalar_arithmetic(*r.op, stack)) r.op->callBoxed(&stack);
    } catch (const std::exception&) {
      return false;  // the graph raises where eager would; the read waits for it
    }
  }
  if (r.output < 0) {
    if (stack.size() != 1 || !stack[0].isTensor()) return false;
    v = stack[0].toTensor();
  } else {
    int32_t k = r.output;  // (counted over the tensor outputs, lists flattened, as outputs() gave them)
    at::Tensor picked;
    for (const c10::IValue& out : stack) {
      if (out.isTensor()) {
        if (k-- == 0) picked = out.toTensor();
      } else if (out.isTensorList()) {
        const c10::List<at::Tensor> list = out.toTensorList();
        if (k >= 0 && static_cast<size_t>(k) < list.size()) picked = list.get(static_cast<size_t>(k));
        k -= static_cast<int32_t>(list.size());
      }
    }
    if (!picked.defined()) return false;
    v = std::move(picked);
  }
  resolved_.emplace_back(&r, v);
  return true;
}

void KnownValues::relearn_from_memory() {
  known_.erase_if([](const c10::TensorImpl*, Known& k) {
    if (!k.impl) return true;
    const c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> impl = k.impl->lock();
    if (!impl) return true;
    const at::Tensor t(impl);
    if (!t.has_storage() || t.data_ptr() == nullptr || untracked(t)) return true;  // (no memory to read)
    k.value = copy_of(t);
    k.version = t._version();
    k.settled = true;
    return false;
  });
  unsettled_.clear();
}

void KnownValues::note_written(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return;
  if (written_.size() >= kMaxWritten) {
    written_overflow_ = true;  // from now on no tensor counts as fresh (safe, only slower)
    return;
  }
  const c10::Storage& storage = t.unsafeGetTensorImpl()->unsafe_storage();
  const auto it = written_.find(storage.unsafeGetStorageImpl());
  // An optimizer writes the same parameters and moments every step: an entry that still names
  // this storage stays as it is (assigning it again took and dropped a weak reference, two
  // atomic writes to a storage the worker's kernels use at the same time).
  if (it == written_.end())
    written_.emplace(storage.unsafeGetStorageImpl(), storage.getWeakStorageImpl());
  else if (it->second.expired())
    it->second = storage.getWeakStorageImpl();
  // (Asked every time: Python may have been handed the memory as an array since.)
  if (python_writable_memory(t)) written_memory_.note(storage);
}

void KnownValues::follow(const c10::OperatorHandle& op, torch::jit::Stack& known, c10::ArrayRef<at::Tensor> written,
                         c10::ArrayRef<at::Tensor> outputs) {
  for (const at::Tensor& t : written) note_written(t);
  if (op.hasTag(at::Tag::nondeterministic_seeded) || (outputs.empty() && written.empty())) return;
  for (const at::Tensor& t : outputs)
    if (!t.defined() || !t.is_cpu() || t.numel() > kMaxKnownElements) return;
  // The copies the op writes (arguments written in place), in the order of `written`.
  c10::SmallVector<at::Tensor, 4> written_copies;
  capture::for_each_written(op, known, [&](const at::Tensor& t) { written_copies.push_back(t); });
  if (written_copies.size() != written.size()) return;
  {
    capture::SuspendGuard no_interception;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // the copies are ours, not the program's
    try {
      if (!run_scalar_arithmetic(op, known)) op.callBoxed(&known);
    } catch (const std::exception&) {
      return;  // the graph's own run raises where eager would; the copies just stay unknown
    }
  }
  // Arguments written in place: their copies were updated in place. Whether autograd bumps a
  // version after this op returns depends on the op (ADInplaceOrView does for add_; a foreach
  // op's version bumps come from inside its kernel, which co-execution never runs), so the
  // version is settled at the next op (settle()).
  for (size_t w = 0; w < written.size(); ++w) {
    const at::Tensor& t = written[w];
    if (!t.defined() || untracked(t)) continue;
    Known& entry = *known_.try_emplace(t.unsafeGetTensorImpl()).first;
    entry.impl.emplace(t.getIntrusivePtr());
    entry.value = written_copies[w];
    entry.version = t._version();
    entry.settled = false;
    unsettled_.push_back(t.unsafeGetTensorImpl());
  }
  size_t k = 0;
  for (const c10::IValue& r : known) {
    if (!r.isTensor()) return;
    if (k >= outputs.size()) break;
    const at::Tensor& out = outputs[k++];
    const at::Tensor& value = r.toTensor();
    if (!value.defined() || !value.is_cpu() || value.numel() > kMaxKnownElements || untracked(out)) return;
    Known& entry = *known_.try_emplace(out.unsafeGetTensorImpl()).first;
    const bool in_place = entry.impl && !entry.impl->expired() && entry.value.defined() &&
                          entry.value.unsafeGetTensorImpl() == value.unsafeGetTensorImpl();
    entry.impl.emplace(out.getIntrusivePtr());
    entry.value = value;
    entry.version = out._version();
    if (in_place) {  // (also a written argument: settled at the next op)
      if (entry.settled) unsettled_.push_back(out.unsafeGetTensorImpl());
      entry.settled = false;
    }
  }
}

void KnownValues::settle() {
  for (const c10::TensorImpl* impl : unsettled_) {
    Known* k = known_.find(impl);
    if (k == nullptr || k->settled) continue;
    k->settled = true;
    if (!k->impl || k->impl->expired()) continue;
    k->version = impl->version_counter().current_version();
  }
  unsettled_.clear();
}

void KnownValues::prune() {
  // Each table only when it has doubled itself: the written storages outnumber the recipes by
  // thousands, and walking them whenever the recipes had grown by 64 (a few per iteration on a
  // loop that reads its loss) cost ~14k instructions per iteration on average (callgrind, the
  // branches benchmark program).
  if (crowded(known_, pruned_known_)) {
    known_.erase_if([](const c10::TensorImpl*, const Known& k) { return !k.impl || k.impl->expired(); });
    pruned_known_ = known_.size();
  }
  if (crowded(recipes_, pruned_recipes_)) {
    recipes_.erase_if([](const c10::TensorImpl*, const std::shared_ptr<const Recipe>& r) {
      return !r || !r->impl || r->impl->expired();
    });
    pruned_recipes_ = recipes_.size();
  }
  if (written_.size() > 2 * pruned_written_ + kWrittenPruneSlack) {
    for (auto it = written_.begin(); it != written_.end();) it = it->second.expired() ? written_.erase(it) : std::next(it);
    pruned_written_ = written_.size();
  }
}

}  // namespace terra::runtime
