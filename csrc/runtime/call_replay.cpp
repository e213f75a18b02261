// An optimizer's step() in co-execution: its recording and its replay (runtime/call_replay.h).
// Like the backward replay (backward_replay.cpp), the replay is the PythonRunner's: it steps the
// cursor, posts and claims value-table indices as validate() and claim_outputs() would for the
// same ops, so its half lives here as PythonRunner members.
#include "runtime/call_replay.h"

#include <ATen/EmptyTensor.h>
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstring>

#include "capture/placeholder.h"
#include "capture/region.h"
#include "capture/terra_key.h"
#include "emit/emitted_graph.h"
#include "runtime/feed_snapshot.h"
#include "runtime/python_runner.h"
#include "capture/op_arguments.h"
#include "runtime/runner_helpers.h"
#include "runtime/scalar_arithmetic.h"
#include "trace/hash.h"

namespace terra::runtime {

namespace {

bool same_ref(const capture::ValueRef& a, const capture::ValueRef& b) {
  return a.record == b.record && a.output == b.output && a.external == b.external;
}

CallArgument argument_key(capture::Region& region, const at::Tensor& t) {
  CallArgument a;
  if (!t.defined()) return a;
  if (std::optional<capture::ValueRef> ref = region.produced(t)) {
    a.kind = CallArgument::Kind::kProduced;
    a.ref = *ref;
    return a;
  }
  a.kind = CallArgument::Kind::kTensor;
  return a;
}

bool same_argument(const CallArgument& memo, const CallArgument& now, const at::Tensor& t) {
  if (memo.kind != now.kind) return false;
  switch (memo.kind) {
    case CallArgument::Kind::kNone:
      return true;
    case CallArgument::Kind::kProduced:
      return same_ref(memo.ref, now.ref);
    case CallArgument::Kind::kTensor:
      return memo.impl && !memo.impl->expired() && memo.impl->_unsafe_get_target() == t.unsafeGetTensorImpl();
  }
  return false;
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The caller's numbers a memo keys by value are the ones this call passes.
bool pinned_hold(const CallMemo& m, const std::vector<double>& numbers) {
  return std::all_of(m.pinned.begin(), m.pinned.end(),
                     [&](const auto& p) { return same_bits(numbers.at(p.first), p.second); });
}

double double_of(int64_t bits) {
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

bool is_python_float(const CallExternal& e) {
  return e.argument < 0 && e.number.defined() && e.number.scalar_type() == at::kDouble &&  // (as the arg parser wraps it)
         e.number.unsafeGetTensorImpl()->is_wrapped_number();
}

// Two recordings of a call with numbers, `first` (its numbers kept in recorded_numbers) and
// `second` with `numbers`: the same call if they made the same ops and posts, and every fed float
// that differs between them is a number the caller passed that differs the same way. That number
// becomes the float's parameter in `first`; the numbers that did not differ are pinned (the graph
// may have them as constants). `first` may have been confirmed before with a number pinned that
// `second` changes (a learning rate the graph now feeds): its places are found again.
//
// Which float is which number is told by the two recordings' values together, not by one
// recording's: a constant equal to a number by chance (AdamW's `1 - lr * weight_decay` and Adam's
// beta2 are both 0.999 for lr 1e-2 and weight decay 0.1) is the same in both recordings, where
// the numbers that step, such as the bias corrections, are not. On a failure `first` is left
// half rewritten: the caller drops it.
bool confirm_numbers(CallMemo& first, const CallMemo& second, const std::vector<double>& numbers) {
  const std::vector<double>& before = first.recorded_numbers;
  if (first.steps.size() != second.steps.size() || first.externals_read.size() != second.externals_read.size() ||
      first.argument_outputs.size() != second.argument_outputs.size() || first.version_bumps != second.version_bumps ||
      first.written != second.written || first.result_record != second.result_record || before.size() != numbers.size())
    return false;
  std::vector<bool> used(numbers.size(), false);
  int64_t last = -1;
  // The caller's number for a fed float that was `a` in `first` and is `b` now: -1 a constant,
  // -2 none (the float changed, and no number the caller passed changed that way).
  // Unused numbers first, in the caller's order where they can be (SGD's equal learning rates);
  // a used one where no other fits (fused Adam's lr, which each dtype's fused op receives).
  auto number_for = [&](double a, double b) -> int32_t {
    if (same_bits(a, b)) return -1;
    int64_t found = -1, again = -1;
    for (size_t k = 0; k < numbers.size(); ++k) {
      if (!same_bits(before[k], a) || !same_bits(numbers[k], b)) continue;
      if (used[k]) {
        if (again < 0) again = static_cast<int64_t>(k);
        continue;
      }
      if (found < 0 || (found < last && static_cast<int64_t>(k) > last)) found = static_cast<int64_t>(k);
      if (found > last) break;
    }
    if (found < 0) found = again;
    if (found < 0) return -2;
    used[found] = true;
    last = found;
    return static_cast<int32_t>(found);
  };
  std::vector<bool> external_done(first.externals_read.size(), false);
  auto confirm_external = [&](size_t k) {
    CallExternal& e = first.externals_read[k];
    const CallExternal& f = second.externals_read[k];
    external_done[k] = true;
    if (e.external != f.external || e.argument != f.argument || e.number.defined() != f.number.defined()) return false;
    if (!e.number.defined()) return true;
    if (is_python_float(e) && is_python_float(f))
      return (e.parameter = number_for(*e.number.data_ptr<double>(), *f.number.data_ptr<double>())) != -2;
    e.parameter = -1;
    return e.number.scalar_type() == f.number.scalar_type() &&
           std::memcmp(e.number.data_ptr(), f.number.data_ptr(), e.number.element_size()) == 0;
  };
  // In program order: each op's posts, a wrapped number at its feed.
  for (size_t i = 0; i < first.steps.size(); ++i) {
    ReplayStep& x = first.steps[i];
    const ReplayStep& y = second.steps[i];
    if (x.node != y.node || x.posts.size() != y.posts.size() ||
        !(first.records[i].op.operator_name() == second.records[i].op.operator_name()))
      return false;
    for (size_t k = 0; k < x.posts.size(); ++k) {
      ReplayPost& p = x.posts[k];
      const ReplayPost& q = y.posts[k];
      if (p.kind != q.kind || p.key != q.key || p.external != q.external) return false;
      if (p.kind == ReplayPost::Kind::kDecision && is_scalar_key(p.key)) {
        if ((p.parameter = number_for(double_of(p.value), double_of(q.value))) == -2) return false;
      } else if (p.kind == ReplayPost::Kind::kDecision) {
        if (p.value != q.value) return false;
      } else if (p.kind == ReplayPost::Kind::kFeed) {
        for (size_t e = 0; e < first.externals_read.size(); ++e)
          if (!external_done[e] && first.externals_read[e].external == p.external && !confirm_external(e)) return false;
      }
    }
  }
  for (size_t e = 0; e < first.externals_read.size(); ++e)
    if (!external_done[e] && !confirm_external(e)) return false;
  first.pinned.clear();
  for (size_t k = 0; k < numbers.size(); ++k) {
    if (used[k]) continue;
    if (!same_bits(before[k], numbers[k])) return false;  // (a number that changed reached no op as a fed float)
    first.pinned.emplace_back(static_cast<uint32_t>(k), numbers[k]);
  }
  first.confirmed = true;  // (recorded_numbers stay: a later recording may unpin a number)
  return true;
}

// A 0-dim CPU tensor of `dtype`, made without the dispatcher (number_like, scalar_like).
at::Tensor empty_cpu_scalar(c10::ScalarType dtype) {
  return at::detail::empty_cpu({}, dtype, std::nullopt, std::nullopt, std::nullopt, std::nullopt);
}

// A Python number as the arg parser wraps it, or a constant the call made (CallExternal::number),
// of `recorded`'s dtype and kind: `value`, or `recorded`'s own. Made without the dispatcher (a
// clone through it, autograd included, was half of a replayed Adam step: each parameter's step
// reads three such numbers).
at::Tensor number_like(const at::Tensor& recorded, const double* value) {
  at::Tensor t = empty_cpu_scalar(recorded.scalar_type());
  if (value != nullptr)  // (only wrapped Python floats are the caller's numbers: confirm_numbers)
    *t.data_ptr<double>() = *value;
  else
    std::memcpy(t.data_ptr(), recorded.data_ptr(), recorded.element_size());
  t.unsafeGetTensorImpl()->set_wrapped_number(recorded.unsafeGetTensorImpl()->is_wrapped_number());
  return t;
}

// A tensor the call's ops read that the call made itself, as a constant: a wrapped Python number
// (`buf.mul_(momentum)`), or a 0-dim CPU tensor made from Python data and never written
// (`torch.tensor(1.0)`, which foreach Adam adds to its step counters). Its value follows from the
// key as the numbers the ops receive do (the caller vouches for both).
bool made_constant(const at::Tensor& t) {
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) return true;
  return t.device().is_cpu() && t.dim() == 0 && t.layout() == c10::kStrided && !t.requires_grad() && !t.is_view() &&
         t._version() == 0 && !t.is_complex();
}

// A 0-dim tensor holding `value` with `like`'s options: made without the dispatcher where `like` is
// a CPU float or double (a replayed Adam step teaches each step counter's new value this way), else
// with at::scalar_tensor.
at::Tensor scalar_like(const at::Tensor& like, double value) {
  if (like.device().is_cpu() && like.layout() == c10::kStrided &&
      (like.scalar_type() == at::kFloat || like.scalar_type() == at::kDouble)) {
    at::Tensor t = empty_cpu_scalar(like.scalar_type());
    if (like.scalar_type() == at::kFloat)
      *t.mutable_data_ptr<float>() = static_cast<float>(value);
    else
      *t.mutable_data_ptr<double>() = value;
    return t;
  }
  return at::scalar_tensor(value, like.options());
}

int32_t argument_holding(const std::vector<at::Tensor>& arguments, const c10::TensorImpl* impl) {
  for (size_t j = 0; j < arguments.size(); ++j)
    if (arguments[j].defined() && arguments[j].unsafeGetTensorImpl() == impl) return static_cast<int32_t>(j);
  return -1;
}

}  // namespace

PythonRunner::CallPath PythonRunner::call_per_op(std::string why) {
  ++call_stats_.per_op;
  call_stats_.reason = std::move(why);
  return CallPath::kPerOp;
}

void PythonRunner::call_not_replayable(std::string why) {
  if (call_recording_ && call_recording_->ineligible.empty()) call_recording_->ineligible = std::move(why);
}

std::vector<std::optional<double>> PythonRunner::known_numbers(const std::vector<at::Tensor>& tensors) {
  known_.settle();
  std::vector<std::optional<double>> out;
  out.reserve(tensors.size());
  capture::SuspendGuard not_the_programs;  // (item() of a private copy is no op of the program)
  for (const at::Tensor& t : tensors) {
    std::optional<at::Tensor> v = t.defined() && known_values_enabled_ ? known_.known(t) : std::nullopt;
    if (!v || v->numel() != 1) {
      out.emplace_back();
      continue;
    }
    // (read in place: Adam asks for one per parameter every step, and item() is an op)
    const std::optional<c10::Scalar> s = one_element_value(*v);
    out.emplace_back(s ? s->toDouble() : v->item<double>());
  }
  return out;
}

PythonRunner::CallPath PythonRunner::begin_call(capture::Region& region, int64_t caller_key,
                                                const std::vector<at::Tensor>& arguments,
                                                const std::vector<double>& numbers,
                                                const std::vector<std::pair<at::Tensor, double>>& known_after,
                                                at::Tensor& result) {
  if (call_recording_) return call_per_op("called inside another call being recorded");  // (it records this one's ops)
  if (!in_iteration_ || diverged_ || region.mode() != capture::Mode::CoExec)
    return CallPath::kPerOp;  // not co-executing: the call runs as in eager (not counted)
  if (recording_) return call_per_op("called inside a backward() being recorded");
  CallMemo key;
  key.path = path_;
  key.records_before = region.trace().ops.size();
  key.externals_before = region.trace().externals.size();
  key.caller_key = caller_key;
  key.arguments.reserve(arguments.size());
  for (const at::Tensor& t : arguments) key.arguments.push_back(argument_key(region, t));

  std::vector<const c10::TensorImpl*> fresh;  // (scratch of matches)
  auto matches = [&](const CallMemo& m) {
    if (m.path != key.path || m.caller_key != key.caller_key || m.records_before != key.records_before ||
        m.externals_before != key.externals_before || m.arguments.size() != key.arguments.size() ||
        m.numbers != numbers.size())
      return false;
    for (size_t j = 0; j < m.arguments.size(); ++j)
      if (!same_argument(m.arguments[j], key.arguments[j], arguments[j])) return false;
    // The externals read before the call are the tensors the recorded ops read there (the same
    // parameter object: a program that gave the model a new one reads another external there).
    const auto& externals = region.external_tensors();
    fresh.clear();
    for (const CallExternal& e : m.externals_read) {
      if (static_cast<size_t>(e.external) >= m.externals_before) {
        if (e.argument >= 0) fresh.push_back(arguments[e.argument].unsafeGetTensorImpl());
      } else if (e.argument < 0 ||
                 externals.at(e.external).unsafeGetTensorImpl() != arguments[e.argument].unsafeGetTensorImpl()) {
        return false;
      }
    }
    // And the arguments the recorded call read first are not read yet in this iteration (another
    // tensor stood where one of them stands now): the replay makes them externals in its order.
    if (fresh.empty()) return true;
    std::sort(fresh.begin(), fresh.end());
    for (const at::Tensor& t : externals)
      if (std::binary_search(fresh.begin(), fresh.end(), t.unsafeGetTensorImpl())) return false;
    return true;
  };
  // A memo recorded once, or one that has a number this call changes pinned: this recording may
  // confirm it, or learn which of its floats that number is (confirm_numbers).
  uint64_t confirms = 0;
  for (const CallMemo& m : call_memos_) {
    if (!matches(m)) continue;
    if (!m.confirmed || !pinned_hold(m, numbers)) {
      if (confirms == 0) confirms = m.id;
      continue;
    }
    result = replay_call(region, m, arguments, numbers, known_after);
    ++call_stats_.replayed;
    return CallPath::kReplayed;
  }

  // Not seen yet: the ops run one by one and validate() records every step.
  auto rec = std::make_unique<CallRecording>();
  for (size_t j = 0; j < arguments.size(); ++j)
    if (key.arguments[j].kind == CallArgument::Kind::kTensor) key.arguments[j].impl.emplace(arguments[j].getIntrusivePtr());
  rec->memo = std::move(key);
  rec->memo.numbers = numbers.size();
  rec->numbers = numbers;
  rec->confirms = confirms;
  rec->arguments = arguments;
  for (const at::Tensor& t : arguments) rec->versions_before.push_back(t.defined() ? t._version() : 0);
  rec->sequence_before = at::sequence_number::peek();
  call_recording_ = std::move(rec);
  return CallPath::kRecording;
}

void PythonRunner::record_call_step(const capture::Region& region, const trace::OpKey& key, trace::NodeId node,
                                    bool runs_real) {
  CallRecording& r = *call_recording_;
  if (!r.ineligible.empty()) return;
  if (runs_real) {
    // An op that ran here on values Python knew and only answers a number (Adam's
    // `_get_value(step_t)`, an item() of a known step counter) changes nothing a replay must
    // redo: its record and posts are replayed like any other's. Anything else that needs data
    // does.
    const c10::FunctionSchema& schema = region.trace().ops.back().op.schema();
    const bool only_numbers = std::all_of(schema.returns().begin(), schema.returns().end(), [](const c10::Argument& a) {
      return a.type()->isSubtypeOf(*c10::NumberType::get()) || a.type()->kind() == c10::TypeKind::BoolType;
    });
    if (!only_numbers || capture::writes_an_argument(schema)) return call_not_replayable("an op of the call needs data");
  }
  // (Fed numbers too: the caller's key stands for the Python numbers the ops receive.)
  std::string why = recorded_step(region, key, node, r.memo.steps.emplace_back(), [] { return std::string(); });
  if (!why.empty()) call_not_replayable(std::move(why));
}

void PythonRunner::note_call_outputs(int32_t index, c10::ArrayRef<at::Tensor> outputs) {
  CallRecording& r = *call_recording_;
  if (!r.ineligible.empty() || index < static_cast<int32_t>(r.memo.records_before)) return;
  for (size_t k = 0; k < outputs.size(); ++k) {
    if (!outputs[k].defined()) continue;
    const int32_t j = argument_holding(r.arguments, outputs[k].unsafeGetTensorImpl());
    if (j >= 0)
      r.memo.argument_outputs.push_back(
          {index - static_cast<int32_t>(r.memo.records_before), static_cast<uint32_t>(k), j});
    else
      r.made.push_back(outputs[k].unsafeGetTensorImpl());
  }
}

void PythonRunner::note_call_write(const at::Tensor& t) {
  CallRecording& r = *call_recording_;
  if (!r.ineligible.empty()) return;
  const int32_t j = argument_holding(r.arguments, t.unsafeGetTensorImpl());
  if (j < 0 && std::find(r.made.begin(), r.made.end(), t.unsafeGetTensorImpl()) != r.made.end())
    return;  // (a temporary of the call)
  // (A write the replay could not name: its tensor would keep a stale known value.)
  if (j < 0) return call_not_replayable("the call writes a tensor that is none of its arguments");
  if (std::find(r.memo.written.begin(), r.memo.written.end(), j) == r.memo.written.end()) r.memo.written.push_back(j);
}

bool PythonRunner::end_call(capture::Region& region, bool completed, bool replayable, const at::Tensor& result) {
  std::unique_ptr<CallRecording> owned = std::move(call_recording_);
  if (!owned || !completed || diverged_) return false;
  CallRecording& r = *owned;
  CallMemo& memo = r.memo;
  auto give_up = [&](std::string why) {
    call_stats_.reason = "not replayable: " + std::move(why);
    return false;
  };
  if (!replayable) return give_up("the call changed the Python state it is keyed by (a momentum buffer made, a gradient replaced)");
  if (!r.ineligible.empty()) return give_up(r.ineligible);
  if (at::sequence_number::peek() != r.sequence_before) return give_up("the call created autograd nodes");
  const capture::Trace& trace = region.trace();
  const size_t begin = memo.records_before;
  if (trace.ops.size() - begin != memo.steps.size()) return give_up("an op of the call was not validated");
  memo.records.assign(trace.ops.begin() + static_cast<std::ptrdiff_t>(begin), trace.ops.end());

  // What the records read from outside the iteration: arguments, or numbers the arg parser wrapped.
  const auto& externals = region.external_tensors();
  for (const capture::OpRecord& rec : memo.records)
    for (const capture::OpInput& in : rec.inputs) {
      const int32_t k = in.value.external;
      if (k < 0) continue;
      if (std::any_of(memo.externals_read.begin(), memo.externals_read.end(),
                      [&](const CallExternal& e) { return e.external == k; }))
        continue;
      const at::Tensor& t = externals.at(k);
      CallExternal e;
      e.external = k;
      e.argument = argument_holding(r.arguments, t.unsafeGetTensorImpl());
      if (e.argument < 0) {
        if (static_cast<size_t>(k) < memo.externals_before || !made_constant(t))
          return give_up("the call reads a tensor from outside the iteration that is none of its arguments");
        e.number = number_like(t, nullptr);  // (a value of its own: the op's wrapped number dies with the call)
      }
      memo.externals_read.push_back(std::move(e));
    }
  // Replayed, new externals are made in the order of their indices.
  std::sort(memo.externals_read.begin(), memo.externals_read.end(),
            [](const CallExternal& a, const CallExternal& b) { return a.external < b.external; });
  size_t next = memo.externals_before;
  for (const CallExternal& e : memo.externals_read) {
    if (static_cast<size_t>(e.external) < memo.externals_before) continue;
    if (static_cast<size_t>(e.external) != next++) return give_up("the call made an external it does not read");
  }
  if (next != externals.size()) return give_up("the call made an external it does not read");

  if (result.defined()) {
    // (a placeholder one of the call's ops made, and nothing else: a replay makes it again)
    std::optional<capture::ValueRef> ref = region.produced(result);
    if (!ref || ref->record < static_cast<int32_t>(begin) || !capture::is_placeholder(result) || result.is_view() ||
        argument_holding(r.arguments, result.unsafeGetTensorImpl()) >= 0)
      return give_up("the call returns a tensor that is not a new output of its ops");
    memo.result_record = ref->record - static_cast<int32_t>(begin);
    memo.result_output = static_cast<uint32_t>(ref->output);
    if (!(memo.records[memo.result_record].outputs.at(memo.result_output) == capture::meta_of(result)))
      return give_up("the call returns a tensor that differs from the output it came from");
  }
  for (size_t j = 0; j < r.arguments.size(); ++j)
    memo.version_bumps.push_back(r.arguments[j].defined() ? r.arguments[j]._version() - r.versions_before[j] : 0);
  memo.external_aliases = aliases_after(region, begin);  // (a parameter written in place: that output now)
  memo.path_after = path_;
  ++call_stats_.recorded;
  if (r.confirms != 0) {
    auto first = std::find_if(call_memos_.begin(), call_memos_.end(), [&](const CallMemo& m) { return m.id == r.confirms; });
    if (first != call_memos_.end()) {
      if (confirm_numbers(*first, memo, r.numbers)) return true;
      call_memos_.erase(first);  // (this recording, unconfirmed, takes its place)
    }
  }
  memo.confirmed = r.numbers.empty();
  if (!memo.confirmed) memo.recorded_numbers = r.numbers;
  memo.id = ++call_memo_ids_;
  if (call_memos_.size() >= kMaxCallMemos) call_memos_.erase(call_memos_.begin());
  call_memos_.push_back(std::move(memo));
  return true;
}



at::Tensor PythonRunner::replay_call(capture::Region& region, const CallMemo& memo,
                                     const std::vector<at::Tensor>& arguments, const std::vector<double>& numbers,
                                     const std::vector<std::pair<at::Tensor, double>>& known_after) {
  known_.settle();
  at::Tensor result;
  // The externals first read in the call, made in the recorded order (value_of numbers them).
  for (const CallExternal& e : memo.externals_read) {
    if (static_cast<size_t>(e.external) < memo.externals_before) continue;
    at::Tensor t;
    if (e.argument >= 0) {
      t = arguments.at(e.argument);
    } else if (e.parameter < 0) {
      // A constant: the memo's own tensor is fed again. Nothing writes it (made_constant), the
      // graph only reads it, and a feed holds it while the graph may (a new one per replay was
      // an allocation per wrapped number: 1.3% of the Python thread of an MLP + SGD loop, perf).
      t = e.number;
    } else {
      t = number_like(e.number, &numbers.at(e.parameter));  // (a new one: the graph may still read the last)
    }
    const capture::ValueRef got = region.value_of(t);
    TORCH_CHECK(got.external == e.external, "terra_torch internal error: a replayed call's external input ", e.external,
                " became input ", got.external);
  }
  for (size_t i = 0; i < memo.steps.size(); ++i) {
    const capture::OpRecord& mrec = memo.records[i];
    const ReplayStep& step = memo.steps[i];
    const int32_t index = replay_op(region, mrec, step, numbers);
    // Outputs that are arguments, or the call's result, are claimed as claim_outputs() claims
    // them; the others are temporaries of the call, dead by its end (only their place in the
    // output sequence).
    for (uint32_t k = 0; k < mrec.outputs.size(); ++k) {
      const int64_t tag = emit::EmittedGraph::publish_tag(step.node, k);
      auto out = std::find_if(memo.argument_outputs.begin(), memo.argument_outputs.end(),
                              [&](const CallMemo::ArgumentOutput& a) { return a.record == int32_t(i) && a.output == k; });
      const bool returned = memo.result_record == int32_t(i) && memo.result_output == k;
      if (out == memo.argument_outputs.end() && !returned) {
        if (step.publishes > 0) values_->expect(tag, at::Tensor());
        continue;
      }
      if (returned) result = capture::make_placeholder(mrec.outputs[k], mrec.op);  // (as run_placeholder makes it)
      const at::Tensor& t = returned ? result : arguments.at(out->argument);
      region.set_produced(t, index, static_cast<int32_t>(k));
      note_latest(tag, record_copies_.at(index), t);
      if (step.publishes > 0) expect_output(tag, t);
    }
  }
  // What the ops leave behind on the Python side: versions of the tensors written, and no known
  // value for them (the graph writes them).
  for (size_t j = 0; j < arguments.size(); ++j)
    for (int64_t b = 0; b < memo.version_bumps[j]; ++b) torch::autograd::impl::bump_version(arguments[j]);
  bool writes_python_memory = false;
  for (const int32_t j : memo.written) {
    if (known_values_enabled_) known_.forget(arguments[j]);
    writes_python_memory |= python_writable_memory(arguments[j]);
  }
  apply_aliases(region, memo.records_before, memo.external_aliases);
  path_ = memo.path_after;
  if (known_values_enabled_) {
    capture::SuspendGuard not_the_programs;
    for (const auto& [t, v] : known_after) known_.teach(t, scalar_like(t, v));
  }
  flush();
  // A write into memory Python can read or write without an op (a parameter whose numpy array
  // the program keeps): the graph runs it before Python goes on, as outputs() does for the op.
  if (writes_python_memory) catch_up();
  return result;
}

}  // namespace terra::runtime
