// Reads the Python side answers itself (docs/RUNTIME.md, "Known values").
//
// Optimizers keep their step counters in small CPU tensors and read them every step:
// torch.optim.Adam's single-tensor path does `step_t += 1` and then `step_t.item()` for every
// parameter (torch/optim/adam.py, _get_value). In co-execution each `.item()` would wait until the
// graph has run everything Python issued before it, so Python and the graph take turns instead of
// overlapping. But the value follows from values Python already knows: the counter was read once,
// and `+= 1` is an op Python can run itself on a one-element tensor in a microsecond.
//
// So the PythonRunner keeps a *known value* beside small CPU tensors (at most kMaxKnownElements
// elements): a private copy, valid while the tensor's version counter says nobody wrote it since.
//   - a read that waited for the graph (the first `.item()`) makes its small CPU inputs known;
//   - an op whose tensor inputs are all known (or Python numbers) and whose outputs are small CPU
//     tensors is also run on the copies, so its outputs become known (in-place ops: the written
//     tensor's copy is updated and its version moves with autograd's bump);
//   - a read whose inputs are all known runs on the copies and does not wait.
// The graph still runs every op (its values are the real ones); the copies only answer reads, and
// the same kernels on the same bits give the same bits. Anything else that writes such a tensor
// bumps its version (autograd's in-place ops, an eager iteration), so its copy is ignored from then
// on, until a read that waits makes it known again. Random ops are never run on copies. Tensors
// made under torch.inference_mode() have no version counter to trust a copy by: they are never
// known and no recipe reads or makes one (their reads wait for the graph).
//
// Example (Adam, iteration 10, one parameter):
//     step_t += 1        -> placeholder path; the copy of step_t (known since iteration 3) += 1
//     step_t.item()      -> 11.0 from the copy; no wait
//
// A *recipe* covers the small values computed from the graph's: a functional op whose one output
// is a small CPU tensor and whose tensor arguments are known, fresh, or small placeholders no op
// has written is kept (with copies of the known arguments and each placeholder's index in the
// output sequence). A read of its output waits only until those indices are published, then runs
// the op on their values; the graph runs in program order, so waiting for the op itself would
// wait for everything before it:
//     loss = criterion(model(x), y)   -> placeholder, output 41 of the sequence
//     loss.backward()                 -> replayed: outputs 42..140 (the graph runs them next)
//     if loss > avg: ...              -> gt: a recipe (loss: index 41, avg: known); the read
//                                        waits for output 41, not for the backward
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/FunctionRef.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "common/flat_map.h"
#include "runtime/feed_snapshot.h"

namespace terra::runtime {

inline constexpr int64_t kMaxKnownElements = 4;

class KnownValues {
 public:
  // `t` has its current value (it was just materialized): remember a copy if it is small.
  void learn(const at::Tensor& t);
  // The index of a placeholder's value in the output sequence (its link), if it has one.
  using LinkOf = c10::function_ref<std::optional<int64_t>(const at::Tensor&)>;
  // What a read may ask of the graph's side: links, and the value at an index of the output
  // sequence, waited for (nullopt: it is gone).
  struct GraphValues {
    LinkOf link;
    c10::function_ref<std::optional<at::Tensor>(int64_t)> published;
    // The value at an index if the graph has published it already (no wait).
    c10::function_ref<std::optional<at::Tensor>(int64_t)> published_now;
    // Whether the graph has published the value at an index already (no wait, nothing taken).
    c10::function_ref<bool(int64_t)> ready;
  };

  // `args` with every tensor replaced by its known value (a Python number stands for itself);
  // false if some tensor argument has none (or a list of tensors is passed), or none is known.
  // With `graph` (a read), a placeholder no op has written takes the graph's value if it is
  // published already, else its recipe's, else the graph's value waited for; still true only if
  // some argument was known, published already or had a recipe.
  bool substitute(c10::ArrayRef<c10::IValue> args, torch::jit::Stack& out, const GraphValues* graph = nullptr);
  // Whether the last substitute() waited for a read value itself rather than run its recipe
  // (kCloseOutputs).
  bool waited_close() const { return waited_close_; }
  // How many recipe ops the last substitute() ran on the Python side.
  int recipe_runs() const { return recipe_runs_; }
  // Before an op Python answers with placeholders (and could not follow): plans a recipe if it
  // qualifies; keep_recipe() attaches it to the op's output, any other call drops it.
  // `fewest_elements`: the smallest output's size (INT64_MAX: unknown), which rules most ops out
  // before their arguments are looked up (keep_recipe's limits, applied early).
  void plan_recipe(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, LinkOf link,
                   int64_t fewest_elements = std::numeric_limits<int64_t>::max());
  void keep_recipe(c10::ArrayRef<at::Tensor> outputs);
  void drop_planned() { planned_.reset(); }
  // A tensor a co-executed op writes (the graph writes it later): it is never fresh.
  void note_written(const at::Tensor& t);
  // Whether some co-executed op wrote `t`'s storage (through `t` or any view of it), or memory
  // Python writes without an op that `t`'s storage shares with another storage the graph wrote
  // (`torch.from_dlpack(buf)`, `torch.as_tensor(buf.numpy())`); true when that can no longer be
  // told (too many written storages).
  bool ever_written(const at::Tensor& t) const {
    return written_overflow_ || !t.has_storage() || was_written(t.storage().unsafeGetStorageImpl()) ||
           (!written_memory_.empty() && written_memory_.overlaps(t.unsafeGetTensorImpl()->unsafe_storage()));
  }
  // `t`'s memory holds its value now: it has memory, and no co-executed op wrote that storage
  // (only such ops leave writes pending in the graph). A real tensor nothing wrote, a view of one.
  bool memory_is_value(const at::Tensor& t) const {
    return !ever_written(t) && t.unsafeGetTensorImpl()->unsafe_storage().data() != nullptr;
  }
  // After an op Python answered with placeholders, whose arguments substitute() replaced in
  // `known`: runs it on them (below autograd, without interception) and keeps the results as
  // the values of `outputs` (the op's outputs, flattened) if they are all small CPU tensors, and
  // of `written` (the tensors the op writes in place, list elements flattened, in schema order).
  void follow(const c10::OperatorHandle& op, torch::jit::Stack& known, c10::ArrayRef<at::Tensor> written,
              c10::ArrayRef<at::Tensor> outputs);
  // The value Python knows for `t`, if any (a private copy: never written by the graph).
  std::optional<at::Tensor> known(const at::Tensor& t) const {
    const Known* k = find(t);
    return k != nullptr ? std::optional<at::Tensor>(k->value) : std::nullopt;
  }
  // `t` holds `v` now (a call replay wrote it with a value its caller computed).
  void teach(const at::Tensor& t, const at::Tensor& v) { learn_value(t, v); }
  // `t` is written by an op Python does not follow.
  void forget(const at::Tensor& t) {
    if (!t.defined()) return;
    if (!known_.empty()) known_.erase(t.unsafeGetTensorImpl());
    note_written(t);
  }
  // Forgets everything (the graph failed: what it had not computed never happened).
  void clear() {
    known_.clear();
    unsettled_.clear();
    pruned_known_ = 0;
    forget_recipes();
  }
  // Every known tensor's memory is its value now: the graph ran everything Python issued, every
  // placeholder got its memory (PythonRunner::synchronize(true)), and no co-executed op has run
  // since (called at the first co-executed iteration after that). Copies are taken again from
  // memory, with the tensors' current versions. Without this, a step counter that eager iterations
  // advanced in between (a version the copy does not know) and that the previous co-executed
  // stretch wrote (so not fresh) was unknown again, and the first co-executed iteration waited for
  // the graph at each counter's read (gpt at 2 threads: 28 waits, 7-9 ms, about three eager
  // steps, at every switch of the speed check). The written storages are kept: forgetting them
  // (tried) let a later read trust memory that a write the graph had pending still changed (a
  // DDP GAN's losses differed from eager's at step 31).
  void relearn_from_memory();
  // The output sequence restarts: the recipes' indices would name other values.
  void forget_recipes() {
    recipes_.clear();
    pruned_recipes_ = 0;
    planned_.reset();
  }
  // The ops that wrote known tensors have returned through autograd: their versions are final.
  // Called before every op, and at the end of an iteration.
  void settle();
  // Dead entries may have piled up (checked once per iteration).
  bool wants_pruning() const {
    return crowded(known_, pruned_known_) || crowded(recipes_, pruned_recipes_) ||
           written_.size() > 2 * pruned_written_ + kWrittenPruneSlack;
  }
  // Drops the entries of tensors that died, from each table that wants it.
  void prune();
  bool empty() const { return known_.empty(); }
  size_t size() const { return known_.size(); }

 private:
  struct Known {
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;
    at::Tensor value;
    int64_t version = 0;  // the tensor's version counter when `value` was its value
    bool settled = true;  // false between an op that wrote it and the next op (settle())
  };
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  // A tensor argument of a recipe that is not copied: a placeholder, whose value is its own
  // recipe's or output `index` of the sequence (-1: none; it is not published), or a real tensor
  // no op has written (`index` -1), read from its memory. The recipe holds a placeholder's
  // storage, not the tensor: the value table keeps a dataless placeholder's value while its
  // storage lives, and the tensor would keep its autograd graph (the activations) alive.
  struct Recipe;
  struct RecipeInput {
    size_t arg = 0;
    int32_t element = -1;  // the element of a tensor-list argument (`cat`); -1: the argument itself
    bool placeholder = true;
    int64_t index = -1;
    int64_t version = 0;  // the tensor's version when the op read it
    std::optional<WeakImpl> impl;
    c10::Storage storage;
    // The placeholder's own recipe, if it had one: held here, it runs after the placeholder died
    // (the temporaries of `(torch.arange(n) + k).unsqueeze(0)`, each read by the next op only).
    std::shared_ptr<const Recipe> recipe;
  };
  struct Recipe {
    std::optional<c10::OperatorHandle> op;
    torch::jit::Stack args;  // private copies of known and fresh tensors; None for placeholders
    c10::SmallVector<RecipeInput, 2> inputs;
    std::optional<WeakImpl> impl;  // the output
    // Which of the op's tensor outputs (flattened) `impl` is, for an op that makes several views
    // (`unbind` of nanoGPT's `for i in ix`, `split`); -1: its only one.
    int32_t output = -1;
    int64_t version = 0;
    bool needs_graph = false;  // some placeholder input has no recipe
    // The longest chain of recipes its inputs hold (RecipeInput::recipe), itself included: a
    // running average `avg = 0.9 * avg + 0.1 * loss` would chain every iteration's recipe.
    int depth = 1;
  };
  // Depth of recipes run for one read (a recipe's placeholder may have a recipe of its own), and
  // the most elements a recipe's tensors have. A recipe whose value needs nothing from the graph
  // (`x.abs().max()` of a batch) may have an output this large; one that waits for the graph only
  // a small one (kMaxKnownElements).
  // HuggingFace's masking code reads `(packed_sequence_mask[:, -1] == 0).all()` at the end of
  // 14 ops that start from `arange` (transformers/masking_utils.py, find_packed_sequence_indices):
  // every decoder forward without an attention mask. kMaxRecipeRuns bounds the ops one read may
  // run (a value two recipes read is run once per read: `resolved_`).
  static constexpr int kMaxRecipeDepth = 24;
  static constexpr int kMaxRecipeRuns = 64;
  static constexpr int64_t kMaxRecipeElements = 4096;
  // The most outputs of one op that get recipes (`unbind` of a batch of indices: one per row).
  static constexpr size_t kMaxRecipeOutputs = 64;
  // A read whose recipe must wait for the graph anyway (for the placeholder the chain starts
  // from) waits for the read value itself instead when the graph is at most this many outputs
  // further: the graph runs the few ops, and Python does not run them again. `update.abs().mean()
  // < tol` in a convergence loop: the recipe waited for `update`, then ran abs, mean and lt on the
  // Python thread (~24k instructions per read, callgrind; docs/RUNTIME.md, "Known values"). A
  // read after a backward the graph has not run (`loss > avg` after `loss.backward()`) is
  // further than this and keeps its recipe.
  static constexpr int64_t kCloseOutputs = 8;
  // The latest output index a recipe chain waits for (a placeholder input with neither a known
  // value nor a recipe of its own); -1 if none, or if one of those is published already (the
  // recipe then runs without a wait).
  int64_t latest_wait(const Recipe& r, const GraphValues& graph, int depth) const;
  // `t`'s value from a recipe (placeholder inputs: known, their own recipe, or the graph's);
  // learned when found.
  bool resolve(const at::Tensor& t, at::Tensor& v, const GraphValues& graph, int depth);
  // The value recipe `r` computes, its inputs still as they were when its op ran.
  bool run_recipe(const Recipe& r, at::Tensor& v, const GraphValues& graph, int depth);
  // The values run_recipe() computed during one read (cleared by substitute()), and the count.
  std::vector<std::pair<const Recipe*, at::Tensor>> resolved_;
  int recipe_runs_ = 0;
  bool waited_close_ = false;  // the last substitute() waited for a read value itself (waited_close())
  void learn_value(const at::Tensor& t, const at::Tensor& v);
  static bool small_cpu(const at::Tensor& t);
  static at::Tensor copy_of(const at::Tensor& t);  // a private copy, made below autograd
  const Known* find(const at::Tensor& t) const;
  bool fresh(const at::Tensor& t) const;
  bool was_written(const void* storage) const;

  common::FlatMap<const c10::TensorImpl*, Known> known_;
  // The storage of every tensor a co-executed op wrote, views included, held weakly: a storage
  // that died frees its address for a fresh tensor. Bounded; past the bound nothing is fresh.
  static constexpr size_t kMaxWritten = 1 << 20;
  static constexpr size_t kPruneSlack = 64, kWrittenPruneSlack = 4096;  // (wants_pruning)
  // Whether a table is walked for its dead entries: when it has doubled since its last pruning
  // (a program may keep many alive, and a walk per iteration would cost as much as they), and
  // holds at least half as many entries as it has slots (a walk visits every slot: a table once
  // grown to thousands and pruned back to a few was walked whole every ~64 inserts, 85k
  // instructions on every other iteration of the trip_count benchmark program, callgrind).
  template <typename Table>
  static bool crowded(const Table& table, size_t pruned) {
    return table.size() > std::max(2 * pruned + kPruneSlack, table.capacity() / 2);
  }
  std::unordered_map<const void*, c10::weak_intrusive_ptr<c10::StorageImpl>> written_;
  // Written storages over memory Python writes without an op, which another storage may share.
  WrittenMemory written_memory_;
  std::vector<const c10::TensorImpl*> unsettled_;
  common::FlatMap<const c10::TensorImpl*, std::shared_ptr<const Recipe>> recipes_;  // by output
  std::optional<Recipe> planned_;  // between plan_recipe and keep_recipe
  bool written_overflow_ = false;
  size_t pruned_known_ = 0, pruned_recipes_ = 0, pruned_written_ = 0;  // sizes after the last prune()
};

}  // namespace terra::runtime
