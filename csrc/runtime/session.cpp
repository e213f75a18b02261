#include "runtime/session.h"

#include "common/env.h"

#include "runtime/fused_executor.h"

#include <torch/csrc/jit/ir/ir.h>

#include "common/clock.h"

#include <nlohmann/json.hpp>

#include <unordered_set>

#include "capture/trace_json.h"
#include "capture/value_checks.h"
#include "emit/graph_emitter.h"
#include "trace/case_assignment.h"
#include "trace/cursor.h"

namespace terra::runtime {

Session::~Session() {
  // A destructor must not throw (at interpreter exit that would terminate the process): a
  // runner whose graph failed is simply stopped.
  try {
    shut_down();
  } catch (const std::exception& e) {
    TORCH_WARN("terra_torch: stopping a program's graph failed: ", e.what());
  }
}

void Session::shut_down() {
  if (runner_) runner_->shut_down();
  if (fused_) fused_->close();
}

bool Session::add(const capture::Region& region) {
  TORCH_CHECK(!region.is_open(), "terra_torch: a region must be closed before its trace is merged");
  bool covered = false;
  if (program_.num_traces() > 0) {
    const trace::Trace t = program_.translate(region.trace());
    const trace::Program current = trace::assign_cases(program_.graph());
    trace::Cursor cursor(current);
    covered = true;
    last_uncovered_ = -1;
    for (size_t i = 0; i < t.ops.size(); ++i) {
      if (!cursor.step(t.ops[i]).matched) {
        covered = false;
        last_uncovered_ = static_cast<int64_t>(i);
        break;
      }
    }
    if (covered && !cursor.finish().matched) {
      covered = false;
      last_uncovered_ = static_cast<int64_t>(t.ops.size());
    }
  } else {
    last_uncovered_ = 0;
  }
  const uint32_t index = program_.add(region.trace());
  for (const uint64_t key : region.raised()) program_.add_check(key);  // checked first from now on
  // Described now, while the region's code objects are at hand (needs the GIL, which the
  // caller holds): pictures label nodes with these frames.
  const auto& nodes = program_.record_nodes(index);
  node_frames_.resize(program_.graph().num_nodes());
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (!node_frames_[nodes[i]].empty()) continue;
    node_frames_[nodes[i]] = const_cast<capture::Region&>(region).locations().describe(region.trace().ops[i].location);
  }
  if (options_.keep_traces) keep(region.trace());
  return covered;
}

void Session::build() {
  spare_region_.reset();  // its hook is the runner replaced here
  if (runner_) {
    runner_->shut_down();
    runner_.reset();
  }
  const std::vector<std::vector<trace::NodeId>> before = program_.all_record_nodes();
  // Graph::lint() checks the emitter's work (every value defined before its uses, blocks well
  // formed). It was a quarter of a build's time (the demo's MLP: 71 of 291 perf samples), paid at
  // every build a program makes while it runs: the test suite turns it on (TERRA_LINT_GRAPHS=1,
  // test/python/conftest.py), the emitter's own tests always lint.
  static const bool lint = common::switched_on("TERRA_LINT_GRAPHS");
  emitted_ = emit::emit_program(program_, structured_, {.optimize = options_.optimize, .lint = lint, .coexec = true});
  if (program_.all_record_nodes() != before) remap_node_frames(before);
  fused_.reset();
  // Co-execution: a feed waits for Python, who may wait for a value before it posts the feed,
  // so segments end at feeds (emit::SegmentOptions::feeds_ready).
  if (options_.fused) fused_ = std::make_shared<FusedExecutor>(emitted_->graph, emit::SegmentOptions{.feeds_ready = false});
  runner_ = std::make_unique<PythonRunner>(program_, *structured_, *emitted_, options_.drive, &node_frames_, fused_);
  ++builds_;
}

namespace {
constexpr const char* kProgramFormat = "terra_torch.program/1";
}  // namespace

void Session::keep(const capture::Trace& trace) {
  const auto token_of = [this](const void* identity) {
    const auto [it, inserted] = tokens_.try_emplace(identity, next_token_);
    if (inserted) ++next_token_;
    return it->second;
  };
  try {
    kept_traces_.push_back(capture::trace_to_json(trace, token_of).dump());
  } catch (const std::invalid_argument& e) {
    if (unkept_.empty()) unkept_ = e.what();
    return;
  }
  for (const capture::OpRecord& rec : trace.ops)
    kept_ops_.try_emplace(capture::check_key(rec.location, rec.op), rec.location, rec.op.operator_name());
}

std::string Session::export_program() const {
  TORCH_CHECK(options_.keep_traces, "terra_torch: this session keeps no traces (SessionOptions::keep_traces)");
  if (!unkept_.empty()) throw std::invalid_argument(unkept_);
  nlohmann::json checks = nlohmann::json::array();
  for (const uint64_t key : program_.checks()) {
    const auto it = kept_ops_.find(key);
    if (it != kept_ops_.end())
      checks.push_back({it->second.first, it->second.second.name, it->second.second.overload_name});
  }
  // Pictures' frames by the location in each node's key (what import_program finds them by).
  nlohmann::json frames = nlohmann::json::array();
  std::unordered_set<uint64_t> framed;
  for (size_t n = 0; n < node_frames_.size() && n < program_.graph().num_nodes(); ++n) {
    const uint64_t location = program_.graph().node(static_cast<trace::NodeId>(n)).key.location;
    if (!node_frames_[n].empty() && framed.insert(location).second) frames.push_back({location, node_frames_[n]});
  }
  // The traces are spliced in as the text keep() wrote (not parsed again).
  std::string out = nlohmann::json{{"format", kProgramFormat}, {"checks", checks}, {"frames", frames}}.dump();
  out.pop_back();  // the closing brace
  out += ",\"traces\":[";
  for (size_t i = 0; i < kept_traces_.size(); ++i) out += (i ? "," : "") + kept_traces_[i];
  out += "]}";
  return out;
}

void Session::import_program(const std::string& text) {
  TORCH_CHECK(program_.num_traces() == 0 && !runner_, "terra_torch: a program can only be imported into a new session");
  std::vector<capture::Trace> traces;
  std::vector<std::string> texts;
  std::vector<uint64_t> checks;
  std::unordered_map<uint64_t, std::vector<std::string>> frames;
  uint64_t max_token = 0;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    if (!j.is_object() || j.value("format", "") != kProgramFormat)
      throw std::invalid_argument("terra_torch: not a kept program of format " + std::string(kProgramFormat));
    for (const auto& t : j.at("traces")) {
      traces.push_back(capture::trace_from_json(t));
      texts.push_back(t.dump());
      for (const auto& e : t.at("externals")) max_token = std::max(max_token, e.at("token").get<uint64_t>());
    }
    for (const auto& c : j.at("checks")) {
      const auto op = c10::Dispatcher::singleton().findSchema({c.at(1).get<std::string>(), c.at(2).get<std::string>()});
      if (op) checks.push_back(capture::check_key(c.at(0).get<uint64_t>(), *op));
    }
    for (const auto& f : j.at("frames")) frames.emplace(f.at(0).get<uint64_t>(), f.at(1).get<std::vector<std::string>>());
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("terra_torch: a kept program is malformed: ") + e.what());
  }
  try {
    for (const capture::Trace& t : traces) program_.add(t);
  } catch (...) {
    program_ = emit::CapturedProgram();
    throw;
  }
  node_frames_.assign(program_.graph().num_nodes(), {});
  for (size_t n = 0; n < node_frames_.size(); ++n) {
    const trace::Node& node = program_.graph().node(static_cast<trace::NodeId>(n));
    if (node.kind != trace::NodeKind::kOp) continue;
    if (const auto it = frames.find(node.key.location); it != frames.end()) node_frames_[n] = it->second;
  }
  for (const uint64_t key : checks) program_.add_check(key);
  if (options_.keep_traces) {
    // Kept as read; this process's own tokens start above the file's, so that no object of
    // this run is taken for one of the earlier run's.
    next_token_ = max_token + 1;
    kept_traces_ = std::move(texts);
    for (const capture::Trace& t : traces)
      for (const capture::OpRecord& rec : t.ops)
        kept_ops_.try_emplace(capture::check_key(rec.location, rec.op), rec.location, rec.op.operator_name());
  }
}

// Flattening a loop merged every trace again: node ids changed, the records did not.
void Session::remap_node_frames(const std::vector<std::vector<trace::NodeId>>& before) {
  std::vector<std::vector<std::string>> frames(program_.graph().num_nodes());
  for (size_t t = 0; t < before.size(); ++t) {
    const auto& now = program_.record_nodes(static_cast<uint32_t>(t));
    for (size_t r = 0; r < now.size() && r < before[t].size(); ++r)
      if (frames[now[r]].empty() && before[t][r] < node_frames_.size()) frames[now[r]] = node_frames_[before[t][r]];
  }
  node_frames_ = std::move(frames);
}

PythonRunner& Session::runner() {
  TORCH_CHECK(runner_ != nullptr, "terra_torch: no graph has been generated yet");
  return *runner_;
}

Session::IterationSpan Session::counters_now() {
  IterationSpan now;
  now.start_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(common::Clock::now().time_since_epoch()).count();
  if (runner_ != nullptr) {
    const PythonRunnerStats p = runner_->stats();
    now.stall_ns = p.stall_ns;
    now.decisions = p.posted_decisions;
    now.feeds = p.posted_feeds;
    now.reads = p.reads;
  }
  return now;
}

std::shared_ptr<capture::Region> Session::open_region(PyFrameObject* stop_frame, bool ignore_outermost_loops,
                                                      int64_t iteration) {
  PythonRunner& r = runner();
  open_span_ = counters_now();
  open_span_.iteration = iteration;
  std::shared_ptr<capture::Region> region;
  if (spare_region_ != nullptr && spare_region_.use_count() == 1 && !spare_region_->is_open()) {
    region = spare_region_;
    region->reuse(stop_frame);
  } else {
    region = std::make_shared<capture::Region>(&r, stop_frame);
    spare_region_ = region;
  }
  region->locations().ignore_outermost_loops(ignore_outermost_loops);
  region->open();
  try {
    r.begin_iteration();
  } catch (...) {
    region->close();
    throw;
  }
  return region;
}

bool Session::close_region(capture::Region& region, bool partial) {
  // The iteration is logged on every path (Python counts it whether or not ending it raised).
  struct LogSpan {
    Session& s;
    ~LogSpan() { s.log_span(); }
  } log{*this};
  bool diverged = true;
  try {
    diverged = runner().end_iteration(partial);
  } catch (...) {
    region.close();
    throw;
  }
  region.close();
  return diverged;
}

void Session::log_span() {
  // Counters are cumulative, so the iteration's own are the differences.
  const IterationSpan now = counters_now();
  IterationSpan span = open_span_;
  span.end_ns = now.start_ns;
  span.stall_ns = now.stall_ns - open_span_.stall_ns;
  span.decisions = now.decisions - open_span_.decisions;
  span.feeds = now.feeds - open_span_.feeds;
  span.reads = now.reads - open_span_.reads;
  python_stall_ns_ += span.stall_ns;
  python_exec_ns_ += std::max<int64_t>(0, span.end_ns - span.start_ns - span.stall_ns);
  if (spans_.size() >= kMaxIterationSpans) spans_.pop_front();
  spans_.push_back(span);
}

}  // namespace terra::runtime
