// The PythonRunner of co-execution (docs/RUNTIME.md, last sections): while the
// user's Python runs an iteration, every aten op it issues comes here (capture::CoExecHook). The
// op is validated against the TraceGraph by the Cursor in O(1); then the decisions the Cursor
// took, the external tensors the op reads and the go-ahead for side effects are posted to the
// GraphRunner, and the op returns placeholders. Python waits only when it needs data.
//
// When an op does not match (a divergence), the graph finishes what Python validated and stops,
// every live placeholder is materialized from the value table, and the rest of the iteration
// runs eagerly in the capture region (which records it, so the new path can be merged).
#pragma once

#include <c10/util/FunctionRef.h>

#include <chrono>
#include <cstdlib>
#include <deque>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/env.h"
#include "common/flat_map.h"
#include <vector>

#include "capture/coexec_hook.h"
#include "runtime/backward_replay.h"
#include "runtime/call_replay.h"
#include "emit/captured_program.h"
#include "emit/emitted_graph.h"
#include "runtime/feed_snapshot.h"
#include "runtime/channels.h"
#include "runtime/early_batches.h"
#include "runtime/graph_runner.h"
#include "runtime/known_values.h"
#include "runtime/op_check_plan.h"
#include "runtime/value_table.h"
#include "trace/cursor.h"
#include "trace/hash.h"
#include "trace/program.h"

namespace terra::runtime {

struct PythonRunnerStats {
  int64_t ops = 0;             // ops validated
  int64_t placeholders = 0;    // ops answered with placeholders
  int64_t reads = 0;           // ops that waited for data
  int64_t stall_ns = 0;        // Python blocked waiting for the graph
  int64_t divergences = 0;
  int64_t materialized = 0;    // placeholders given their value
  int64_t known_reads = 0;     // reads answered from values Python knew (runtime/known_values.h)
  int64_t known_reads_waited = 0;  // of them, reads that blocked until the graph published a value
  int64_t known_reads_published = 0;  // of them, reads of values the graph had published (no recipe run)
  int64_t known_reads_close = 0;  // of them, reads that waited for the value itself, a few outputs past their recipe's wait
  int64_t known_reads_recipe_waited = 0;  // of them, reads that waited for a graph value and then ran recipes
  int64_t early_reads = 0;     // reads that waited only for the values they read (read_horizon)
  int64_t posted_decisions = 0;  // decisions (with gates and scalars) and feeds sent to the graph
  int64_t posted_feeds = 0;
  int64_t early_batches = 0;   // batches sent before they filled: the graph waited for one of their posts
};

// Co-execution sends posts in batches of this many (and whenever Python waits or an iteration
// ends, or the graph sits idle waiting for a post the batch holds): the graph trails Python by at
// most a batch, and a busy graph is woken once per batch, not per op.
inline constexpr size_t kPostBatch = 32;

// Co-execution lets Python start an iteration while at most this many earlier ones are still
// running on the graph. Without a bound a graph-bound program (the graph slower than Python:
// large kernels, a GPU) ran hundreds of iterations ahead, and every one kept its batch and its
// placeholders' values alive until the graph reached it: memory grew with the run's length. Two
// is enough for overlap: the graph always has the next iteration's posts when it finishes one.
inline constexpr int64_t kMaxIterationsAhead = 2;

// How the graph is driven: co-execution posts as Python goes, so the graph runs alongside;
// lazy keeps the posts until Python needs a value and then waits for the graph (serialized,
// the LazyTensor-like baseline).
enum class Drive { kCoExec, kLazy };

class PythonRunner final : public capture::CoExecHook {
 public:
  // `program`, `structured`, `emitted` and `node_frames` (per node, "file:line in function" of
  // its first record, for error messages) must outlive the runner (the Session owns them). The
  // runner adds to `program`'s check keys the ops the graph failed in.
  // `executor`: what runs the graph (default: a TorchScriptExecutor of emitted.graph).
  PythonRunner(emit::CapturedProgram& program, const trace::Program& structured,
               const emit::EmittedGraph& emitted, Drive drive,
               const std::vector<std::vector<std::string>>* node_frames = nullptr,
               std::shared_ptr<Executor> executor = nullptr);
  ~PythonRunner() override;

  // ---- iteration boundaries (Python thread) ----
  void begin_iteration();
  // Sends the iteration's last decisions; a program that ended where the graph goes on is a
  // divergence too, unless `partial` (synchronize() ended the iteration early: the graph is
  // stopped and placeholders materialized, but nothing was learned). Returns true if the
  // iteration diverged (at any point).
  bool end_iteration(bool partial = false);
  bool diverged() const { return diverged_; }
  const std::string& divergence_reason() const { return reason_; }
  // The record index at which the iteration diverged (-1: at its end, or not at all).
  int32_t divergence_record() const { return divergence_record_; }
  // The iteration diverged at a node the graph could not express (EmittedGraph::unsupported):
  // generating the graph again would not change that, so the program need not trace again.
  bool diverged_at_unsupported() const { return diverged_ && at_unsupported_; }

  // Waits until the graph has run every op Python validated, and nothing else (what
  // synchronize and materialize wait for first; alone: before Python touches state the graph's
  // ops use without an op of their own, a random generator's: terra_torch/_rng.py).
  void catch_up();
  // Waits until the graph has computed everything Python validated, then gives every live
  // placeholder its value (they stay linked: a later read refreshes them). With `finish`, also
  // waits for every started graph iteration (the iteration must have ended).
  void synchronize(bool finish);
  // Gives `t` its current value (a placeholder, or a tensor the graph updates).
  void materialize(const at::Tensor& t);
  // Stops the graph for good (the Session is regenerating it or going away); live placeholders
  // get their values first.
  void shut_down();

  // ---- backward() calls (runtime/backward_replay.h; Python thread) ----
  enum class BackwardPath {
    kPerOp,      // run the engine; nothing to do afterwards (end_backward is harmless)
    kRecording,  // run the engine, then end_backward(): it becomes a memo if it qualifies
    kReplayed,   // done: the engine must not run
  };
  BackwardPath begin_backward(capture::Region& region, const BackwardCall& call);
  // After the engine returned (`completed`) or raised.
  void end_backward(capture::Region& region, bool completed);
  struct BackwardStats {
    int64_t replayed = 0;
    int64_t recorded = 0;
    int64_t per_op = 0;  // calls that had to run the engine (and why, last time)
    std::string reason;
  };
  const BackwardStats& backward_stats() const { return backward_stats_; }

  // ---- an optimizer's step() (runtime/call_replay.h; Python thread) ----
  enum class CallPath {
    kPerOp,      // run it; nothing to do afterwards (end_call is harmless)
    kRecording,  // run it, then end_call(): it becomes a memo if it qualifies
    kReplayed,   // done: the Python function must not run
  };
  // `caller_key`: equal only where the function would issue the same ops with the same Python
  // numbers for these `arguments` (undefined: None). Replayed, `result` is what the call
  // returns (undefined: None).
  // `numbers`: the floats the function computes in this call that change from call to call
  // (CallMemo::numbers); `known_after`: values small tensors it writes will have (Adam's step
  // counters), which Python knows without waiting once a replay has written them.
  CallPath begin_call(capture::Region& region, int64_t caller_key, const std::vector<at::Tensor>& arguments,
                      const std::vector<double>& numbers,
                      const std::vector<std::pair<at::Tensor, double>>& known_after, at::Tensor& result);
  // The values Python knows for `tensors` (runtime/known_values.h), without an op; nullopt where
  // it knows none or a tensor has more than one element.
  std::vector<std::optional<double>> known_numbers(const std::vector<at::Tensor>& tensors);
  // After the function returned `result` (undefined: None, or not a tensor) (`completed`) or
  // raised; `replayable` false: the caller saw it change Python state a replay would not (a
  // momentum buffer made).
  // Returns whether the call was kept as a memo.
  bool end_call(capture::Region& region, bool completed, bool replayable, const at::Tensor& result);
  struct CallStats {
    int64_t replayed = 0;
    int64_t recorded = 0;
    int64_t per_op = 0;
    std::string reason;
  };
  const CallStats& call_stats() const { return call_stats_; }
  // Ops a DataLoader (or an outside_program() block) ran for real, unrecorded.
  int64_t outside_ops() const { return outside_ops_; }
  void ran_outside() override { ++outside_ops_; }

  PythonRunnerStats stats() const { return stats_; }
  RunnerStats graph_stats() const { return runner_->stats(); }
  // The program runs on the Python thread for now (GraphRunner::release_pool).
  void release_worker_pool() { runner_->release_pool(); }
  std::vector<std::pair<int64_t, int64_t>> graph_spans() const { return runner_->spans(); }
  ChannelStats channel_stats() const { return channel_->stats(); }
  size_t table_size() const { return values_->size(); }

  // ---- capture::CoExecHook ----
  Verdict admit(const capture::Region& region, const capture::OpRecord& rec, int32_t index,
                c10::ArrayRef<c10::IValue> args, size_t num_outputs, int64_t fewest_elements) override;
  Verdict validate(const capture::Region& region, const capture::OpRecord& rec, int32_t index,
                   c10::ArrayRef<c10::IValue> args, size_t num_outputs, bool needs_data, bool host) override;
  void materialize_inputs(c10::ArrayRef<c10::IValue> args) override;
  void outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs) override;
  bool check_first(const capture::OpRecord& rec) override;
  Verdict check_raised(const capture::Region& region, const capture::OpRecord& rec, int32_t index) override;
  bool known_read_arguments(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                            torch::jit::Stack& out) override;
  void refuse(int32_t index, std::string why) override {
    if (!diverged_) diverge(std::move(why), index);
  }
  // Its link and its claim on the graph's value go: a later read feeds the tensor itself, and
  // materialization leaves it alone (binding the empty() value would overwrite its memory).
  void outside_memory(const at::Tensor& t) override;
  void storage_replaced(const at::Tensor& self, const at::Tensor& from) override;

 private:
  struct Link {  // a tensor whose current value lives in the value table
    std::optional<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> impl;  // always set
    int64_t index = -1;
    bool expired() const { return !impl || impl->expired(); }
  };
  // What Python sends, in the channel's own form (gates and scalars are decisions in their own
  // key ranges), so that a batch goes out as it was collected.
  using Post = ConcurrentChannel::Post;
  static Post decision(int64_t site, int64_t value) { return {Post::Kind::kDecision, site, value, {}}; }
  static Post gate(int64_t node) { return {Post::Kind::kDecision, kGateKeyBase + node, 1, {}}; }
  // A scalar slot's value in the channel's encoding (emitted_graph.h, ScalarUse).
  static Post scalar_bits(int64_t slot, int64_t bits) { return {Post::Kind::kDecision, kScalarKeyBase + slot, bits, {}}; }
  static std::string describe_scalar_change(const capture::OpRecord& rec, const emit::EmittedGraph::ScalarUse& use,
                                            const c10::IValue& now);
  static Post feed(int64_t slot, at::Tensor t) { return {Post::Kind::kFeed, slot, -1, std::move(t)}; }
  static Post deferred_feed(int64_t slot, int64_t index, at::Tensor t) {
    return {Post::Kind::kDeferredFeed, slot, index, std::move(t)};
  }

  Verdict diverge(std::string reason, int32_t record);
  void stop_and_materialize(const std::string& why);
  void post(Post p);  // kept until flush() (co-execution: at most kPostBatch of them)
  void flush();
  // Waits until the graph has published `count` values of the output sequence; throws if it
  // failed, was cancelled, or is blocked on something Python has not sent (it never will).
  void wait_for_graph(int64_t count);
  void wait_published(int64_t count);
  // The graph failed in an op Python had let through (an error only the data could raise, in an
  // op no except clause covers): names that op in `error` and learns its check key, so that it
  // is checked first from now on. Needs the value table as the failure left it.
  std::string describe_failure(const std::string& error);
  // Cancels the graph, waits out every started graph iteration (ignoring their errors: a failed
  // one, or the ones the cancel stopped) and resets the runner for the next iteration.
  void stop_graph(const std::string& why);
  // The channel was found cancelled: waits for the graph's iterations to end and rethrows the
  // error of one that failed, described (returns if none failed: Python cancelled it).
  void surface_failure();
  // After the graph failed: stop_graph(), gives live placeholders the values the graph had
  // computed, clears the value table, ends the open iteration's co-execution (its rest records
  // real ops) and throws `error`. Placeholders whose values the graph had not computed stay
  // without one (an op that reads one raises, Region::handle).
  [[noreturn]] void recover_from_failure(const std::string& error);
  // Before a placeholder over part of a storage is given its value: its base placeholder, when it
  // has one in the value table, gets its whole value, or, for a part that records no base (`.data`
  // of a view), the value the table holds for the whole storage fills it (see refresh).
  void bind_base_first(const at::Tensor& part);
  void refresh(const at::Tensor& holder, const at::Tensor& value);
  // How much of the output sequence a read of `args` waits for (python_runner.cpp).
  int64_t read_horizon(c10::ArrayRef<c10::IValue> args) const;
  // The value-table entry holding `t`'s value: its link, or, for a placeholder without one,
  // the newest link over the same memory and metadata (autograd's copy of a saved output).
  std::optional<int64_t> linked_index(const at::Tensor& t) const;
  bool in_loop(trace::NodeId n) const;
  // Whether known values may answer for `op` at all (on, not diverged, no collective); drops a
  // planned recipe and settles the previous op's versions.
  bool known_values_answer(const c10::OperatorHandle& op);
  // The known values of `args` into known_args_ (false: some tensor has none; a recipe may be
  // planned for its outputs instead, the smallest of which has `fewest_elements`).
  bool known_arguments(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, int64_t fewest_elements);
  // outputs() without the known values: the value-table claims and links of the outputs.
  void claim_outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs);
  // Claims the value the graph publishes under `tag` for `t`, and links `t` to it where Python
  // may read it later (a placeholder, or a tensor already linked: an in-place op's output).
  void expect_output(int64_t tag, const at::Tensor& t);
  // The copy (EmittedGraph::copy_hash) the cursor stands in at `node`; 0 outside unrolled loops.
  uint64_t copy_here(trace::NodeId node);
  // `t` is now the latest output `tag` (publish_tag) of its node: for the loop check in validate().
  void note_latest(int64_t tag, uint64_t copy, const at::Tensor& t);
  // Record `index` ran `node` in copy `copy`: its outputs are now the latest of that node and copy.
  void note_run(int32_t index, trace::NodeId node, uint64_t copy, size_t num_outputs);
  // A checked read: output `output` of record `record` is among `producers` and the latest-run of them.
  bool reads_latest(const std::vector<emit::EmittedGraph::ReadProducer>& producers, int32_t record,
                    uint32_t output) const;
  void drain_outcomes(bool block);
  // Waits (GIL released, counted as a stall) until fewer than `n` started iterations are still
  // running on the graph; an iteration's failure is rethrown.
  void wait_until_in_flight_below(int64_t n);
  // backward_replay.cpp
  BackwardPath per_op(std::string why);
  void not_replayable(std::string why);
  void record_step(const capture::Region& region, const trace::OpKey& key, trace::NodeId node, bool runs_real);
  void replay(capture::Region& region, const BackwardMemo& memo, const AutogradReach& reach, const BackwardCall& call);
  // The op validate() just checked as a ReplayStep (its cursor key, loop frames and the posts in
  // plan_, feeds named by external index); empty, or why it cannot be replayed. `fed_number`
  // answers the same for a post of a fed Python number.
  std::string recorded_step(const capture::Region& region, const trace::OpKey& key, trace::NodeId node,
                            ReplayStep& step, c10::function_ref<std::string()> fed_number);
  // A recorded op replayed: its record appended, the cursor stepped, its posts sent, the run
  // noted (and a node that publishes without outputs claimed); returns the record's index.
  // `numbers`: the values of parameterized posts (ReplayPost::parameter).
  int32_t replay_op(capture::Region& region, const capture::OpRecord& rec, const ReplayStep& step,
                    c10::ArrayRef<double> numbers = {});
  // After a replay: each external a recorded call left resolved to one of its outputs resolves to
  // the replayed output, and is its latest one for the loop check.
  void apply_aliases(capture::Region& region, size_t records_before, const std::vector<BackwardMemo::Alias>& aliases);
  // call_replay.cpp
  CallPath call_per_op(std::string why);
  void call_not_replayable(std::string why);
  void record_call_step(const capture::Region& region, const trace::OpKey& key, trace::NodeId node, bool runs_real);
  void note_call_outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs);
  void note_call_write(const at::Tensor& t);
  at::Tensor replay_call(capture::Region& region, const CallMemo& memo, const std::vector<at::Tensor>& arguments,
                         const std::vector<double>& numbers,
                         const std::vector<std::pair<at::Tensor, double>>& known_after);
  // Which fed floats of a recorded call are the caller's numbers; false if not all were used.

  emit::CapturedProgram& program_;
  const std::vector<std::vector<std::string>>* node_frames_;
  const trace::Program& structured_;
  const emit::EmittedGraph& emitted_;
  const OpCheckPlan check_plan_;  // what validate() asks of emitted_, per node and input
  const Drive drive_;
  std::shared_ptr<ConcurrentChannel> channel_;
  std::shared_ptr<ValueTable> values_;
  std::unique_ptr<GraphRunner> runner_;
  trace::Cursor cursor_;
  std::vector<trace::LoopFrame> loops_;  // scratch
  std::vector<uint32_t> copy_;           // scratch: the cursor's copy index
  std::vector<Post> pending_;            // not yet sent (lazy mode: until Python needs data)
  FeedValues feed_values_;               // a fed tensor or a copy of it (runtime/feed_snapshot.h)
  // The tensors of the feeds sent in each iteration (its number: started_), held here until the
  // graph has finished that iteration. A tensor with a Python object whose last C++ reference
  // other than the object's goes on the worker makes the worker take the GIL there
  // (c10::intrusive_ptr calls decref_pyobject when the count falls to 1), a wake-up and a wait on
  // both threads per fed tensor; released here, that happens on the Python thread, which holds it.
  std::deque<std::pair<int64_t, std::vector<at::Tensor>>> kept_feeds_;
  // Emptied lists of kept_feeds_, reused by the next iterations (a new list per iteration cost
  // its growth's allocations: 6 per step of an SGD MLP).
  std::vector<std::vector<at::Tensor>> spare_feed_lists_;
  // Drops the kept feeds of the iterations the graph has finished (the GIL must be held).
  void release_kept_feeds();
  std::vector<Post> plan_;               // scratch: one op's feeds, checked before any is posted
  std::vector<int64_t> bits_;            // scratch: one scalar's encoding
  std::vector<trace::NodeId> record_nodes_;  // this iteration: record index -> node
  std::vector<uint64_t> record_copies_;      // this iteration: record index -> its copy (copy_here)
  // Open addressing: nearly every output of an iteration inserts a link, and the next iteration
  // drops the dead ones; a node-based map paid a malloc and a free for each.
  common::FlatMap<const c10::TensorImpl*, Link> links_;
  // links_.size() after its last pruning: expired links are pruned when the table has doubled
  // since (a walk per iteration cost as much as the placeholders the program keeps for good).
  size_t links_pruned_ = 0;
  void forget_links() {  // (with the value table: the recipes name its indices)
    links_.clear();
    links_pruned_ = 0;
    known_.forget_recipes();
  }
  // This iteration, per (node, output) (key: its publish tag) and, in unrolled loops, per copy
  // of it (key: latest_key): the record that last ran it, for the checked reads
  // (reads_latest), and the storage (and offset) of its latest output, for the loop check in
  // validate(). Storage, not TensorImpl: autograd unpacks saved outputs into fresh TensorImpls
  // over the same storage. Open addressing, emptied (not freed) per iteration: every output of
  // every op writes it.
  struct Latest {
    std::pair<const void*, int64_t> where{nullptr, 0};
    int32_t record = -1;
  };
  common::FlatMap<uint64_t, Latest> latest_;
  // latest_'s key for one copy of (node, output) (publish tags, the other keys, stay below 2^40).
  static uint64_t latest_key(int64_t tag, uint64_t copy) {
    return trace::hash_combine(static_cast<uint64_t>(tag), copy) | (uint64_t(1) << 63);
  }
  int64_t started_ = 0, waited_ = 0;  // graph iterations
  // Whether this iteration sends a batch of posts early, when the idle graph waits for one of
  // its posts (post(); the policy and why: runtime/early_batches.h). read_waits_ counts the reads
  // Python waited for (wait_published), which is what turns it on.
  EarlyBatchPolicy early_batches_;
  bool send_early_ = false;
  int64_t read_waits_ = 0;
  bool in_iteration_ = false;
  bool diverged_ = false;
  bool at_unsupported_ = false;
  bool stopped_ = false;
  std::string reason_;
  int32_t divergence_record_ = -1;
  PythonRunnerStats stats_;
  // backward(): the nodes the cursor matched so far in this iteration, hashed (part of a memo's
  // key), the call being recorded, and the memos of this graph.
  uint64_t path_ = 0;
  std::unique_ptr<BackwardRecording> recording_;
  AutogradReach reach_;  // scratch of begin_backward (reach_into)
  std::vector<BackwardMemo> memos_;
  BackwardStats backward_stats_;
  // step(): the call being recorded, and the memos of this graph.
  std::unique_ptr<CallRecording> call_recording_;
  std::vector<CallMemo> call_memos_;
  uint64_t call_memo_ids_ = 0;
  CallStats call_stats_;
  int64_t outside_ops_ = 0;
  KnownValues known_;
  // An admitted op whose arguments Python knew (admit -> outputs, which follows them to the op's
  // outputs): its record and operator. Its known values are in known_args_, the tensors it writes
  // in known_written_ (the arguments are gone from the stack by then).
  struct Follow {
    int32_t index;
    c10::OperatorHandle op;
  };
  std::optional<Follow> follow_;
  // An admitted op that writes memory Python can read without an op (a parameter whose array
  // `w_np = p.detach().numpy()` Python keeps; numpy memory): outputs() lets the graph run it
  // before Python goes on (catch_up), so that a later read through the array, which no op
  // announces, finds the write done, and a later write through it comes after the graph's.
  int32_t sync_after_ = -1;
  torch::jit::Stack known_args_;
  c10::SmallVector<at::Tensor, 4> known_written_;
  // TERRA_KNOWN_VALUES=0 turns known values off (to compare).
  const bool known_values_enabled_ = !common::switched_off("TERRA_KNOWN_VALUES");
  // synchronize(true) ran: the next begin_iteration() takes the known copies again from memory
  // (KnownValues::relearn_from_memory).
  bool relearn_known_ = false;
};

}  // namespace terra::runtime
