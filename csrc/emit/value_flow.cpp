// Builds the copy-level variables of value_flow.h from the recorded traces.
#include "emit/value_flow.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "trace/hash.h"

namespace terra::emit {

namespace {

uint64_t hash_copy(uint64_t h, const CopyIndex& c) {
  for (const uint32_t i : c) h = trace::hash_combine(h, i);
  return h;
}

uint64_t pair_key(trace::NodeId n, uint32_t i) { return (static_cast<uint64_t>(n) << 32) | i; }

// The loop nodes around `n`, outermost first.
std::vector<trace::NodeId> enclosing_loops(const trace::TraceGraph& g, trace::NodeId n) {
  std::vector<trace::NodeId> out;
  for (trace::NodeId loop = g.graph(g.node(n).graph).loop; loop != trace::kNoNode;
       loop = g.graph(g.node(loop).graph).loop) {
    out.push_back(loop);
  }
  std::reverse(out.begin(), out.end());
  return out;
}

bool unrolled(const trace::Program& p, trace::NodeId loop) {
  return loop < p.loops.size() && p.loops[loop].unrolled > 0;
}

}  // namespace

size_t ValueFlow::KeyHash::operator()(const Key& k) const noexcept {
  return static_cast<size_t>(hash_copy(trace::mix64(pair_key(k.node, k.index)), k.copy));
}

std::vector<std::vector<uint32_t>> trip_indices(const trace::Trace& trace) {
  struct Level {
    uint64_t loop_id;
    uint32_t iteration;
    uint32_t trip;
  };
  std::vector<Level> open;
  std::vector<std::vector<uint32_t>> out;
  out.reserve(trace.ops.size());
  for (const trace::OpRecord& op : trace.ops) {
    const auto& frames = op.loops;
    size_t keep = 0;
    bool next = false;
    while (keep < open.size() && keep < frames.size()) {
      if (frames[keep].loop_id != open[keep].loop_id || frames[keep].iteration < open[keep].iteration) break;
      ++keep;
      if (frames[keep - 1].iteration > open[keep - 1].iteration) {
        next = true;
        break;
      }
    }
    open.resize(keep, Level{});
    if (next) {
      open[keep - 1].iteration = frames[keep - 1].iteration;
      ++open[keep - 1].trip;
    }
    for (size_t d = keep; d < frames.size(); ++d) open.push_back({frames[d].loop_id, frames[d].iteration, 0});
    std::vector<uint32_t> trips(open.size());
    for (size_t d = 0; d < open.size(); ++d) trips[d] = open[d].trip;
    out.push_back(std::move(trips));
  }
  return out;
}

ValueFlow::ValueFlow(const trace::TraceGraph& graph, const trace::Program& program,
                     std::span<const trace::Trace> traces, std::span<const std::vector<trace::NodeId>> record_nodes) {
  fed_.resize(graph.num_nodes());
  copied_.resize(graph.num_nodes(), 0);
  for (trace::NodeId n = 0; n < graph.num_nodes(); ++n)
    for (const trace::NodeId loop : enclosing_loops(graph, n)) copied_[n] |= unrolled(program, loop);
  std::unordered_map<Key, std::vector<Item>, KeyHash> seen;
  std::vector<std::vector<CopyIndex>> copies(traces.size());
  for (size_t t = 0; t < traces.size(); ++t) copies[t] = observe(graph, program, traces[t], record_nodes[t], seen);
  for (auto& [key, items] : seen) {
    std::sort(items.begin(), items.end());
    items.erase(std::unique(items.begin(), items.end()), items.end());
  }
  widen(traces, record_nodes, copies, seen);
  CopyIndex copy;
  add_fallbacks(graph, program, program.root, copy, seen);
  for (auto& [key, items] : seen) reads_.emplace(key, intern(std::move(items)));
  std::unordered_map<Key, bool, KeyHash> selected;
  for (size_t t = 0; t < traces.size(); ++t) find_selected(traces[t], record_nodes[t], copies[t], selected);
  for (const auto& [key, yes] : selected) {
    if (!yes) continue;
    const std::vector<Item> items = sets_.at(reads_.at(key)).first;  // a copy: intern() grows sets_
    std::vector<VarId>& vars = choices_[key];
    for (const Item& i : items) vars.push_back(intern({i}));
  }
  producers_.resize(num_vars_);
  for (const auto& [items, var] : sets_)
    for (const Item& i : items) producers_[var].push_back(Producer{i.node, i.output, i.any, i.copy});
  set_index_.clear();
  sets_.clear();
}

std::vector<CopyIndex> record_copies(const trace::TraceGraph& graph, const trace::Program& program,
                                     const trace::Trace& trace, const std::vector<trace::NodeId>& nodes) {
  const auto trips = trip_indices(trace);
  std::unordered_map<trace::NodeId, std::vector<trace::NodeId>> loops_of;
  std::vector<CopyIndex> copies(trace.ops.size());
  for (size_t r = 0; r < trace.ops.size(); ++r) {
    auto [it, inserted] = loops_of.try_emplace(nodes[r]);
    if (inserted) it->second = enclosing_loops(graph, nodes[r]);
    const auto& loops = it->second;
    if (loops.size() != trips[r].size())
      throw std::logic_error("terra_torch: record " + std::to_string(r) + " has " + std::to_string(trips[r].size()) +
                             " loop frames but its node lies in " + std::to_string(loops.size()) + " loops");
    for (size_t d = 0; d < loops.size(); ++d)
      if (unrolled(program, loops[d])) copies[r].push_back(trips[r][d]);
  }
  return copies;
}

std::vector<CopyIndex> ValueFlow::observe(const trace::TraceGraph& graph, const trace::Program& program,
                                          const trace::Trace& trace, const std::vector<trace::NodeId>& nodes,
                                          std::unordered_map<Key, std::vector<Item>, KeyHash>& seen) {
  const std::vector<CopyIndex> copies = record_copies(graph, program, trace, nodes);
  std::unordered_map<trace::NodeId, std::vector<trace::NodeId>> loops_of;
  for (size_t r = 0; r < trace.ops.size(); ++r) {
    auto [it, inserted] = loops_of.try_emplace(nodes[r]);
    if (inserted) it->second = enclosing_loops(graph, nodes[r]);
  }
  // Latest record that wrote each producer copy, to find reads of an overwritten one.
  std::unordered_map<Key, uint32_t, KeyHash> latest;
  for (size_t r = 0; r < trace.ops.size(); ++r) {
    const trace::NodeId n = nodes[r];
    const auto& inputs = trace.ops[r].inputs;
    if (fed_[n].size() < inputs.size()) fed_[n].resize(inputs.size(), false);
    for (uint32_t s = 0; s < inputs.size(); ++s) {
      const trace::ValueRef& in = inputs[s];
      if (in.kind == trace::ValueRef::Kind::kFeed) {
        fed_[n][s] = true;
        continue;
      }
      seen[Key{n, s, copies[r]}].push_back(Item{nodes[in.index], in.output, copies[in.index], false});
      const auto it = latest.find(Key{nodes[in.index], in.output, copies[in.index]});
      if (it != latest.end() && it->second != in.index) note_stale(program, trace, in.index, static_cast<uint32_t>(r), loops_of.at(nodes[in.index]));
    }
    for (uint32_t k = 0; k < trace.ops[r].num_outputs; ++k) latest[Key{n, k, copies[r]}] = static_cast<uint32_t>(r);
  }
  return copies;
}

void ValueFlow::widen(std::span<const trace::Trace> traces, std::span<const std::vector<trace::NodeId>> record_nodes,
                      const std::vector<std::vector<CopyIndex>>& copies,
                      std::unordered_map<Key, std::vector<Item>, KeyHash>& seen) const {
  std::unordered_map<Key, bool, KeyHash> allowed;  // false once a trace read an older execution
  for (auto& [key, items] : seen) {
    const bool names_copies = std::any_of(items.begin(), items.end(), [](const Item& i) { return !i.copy.empty(); });
    if (names_copies) allowed.emplace(key, true);
  }
  if (allowed.empty()) return;
  for (size_t t = 0; t < traces.size(); ++t) {
    const trace::Trace& trace = traces[t];
    const std::vector<trace::NodeId>& nodes = record_nodes[t];
    std::unordered_map<uint64_t, uint32_t> latest;  // (node, output) -> the record that last ran any copy of it
    for (size_t r = 0; r < trace.ops.size(); ++r) {
      const auto& inputs = trace.ops[r].inputs;
      for (uint32_t s = 0; s < inputs.size(); ++s) {
        const trace::ValueRef& in = inputs[s];
        if (in.kind == trace::ValueRef::Kind::kFeed) continue;
        const auto ok = allowed.find(Key{nodes[r], s, copies[t][r]});
        if (ok == allowed.end() || !ok->second) continue;
        int64_t last = -1;
        for (const Item& i : seen.at(ok->first)) {
          const auto it = latest.find(pair_key(i.node, i.output));
          if (it != latest.end()) last = std::max<int64_t>(last, it->second);
        }
        ok->second = last == static_cast<int64_t>(in.index);
      }
      for (uint32_t k = 0; k < trace.ops[r].num_outputs; ++k) latest[pair_key(nodes[r], k)] = static_cast<uint32_t>(r);
    }
  }
  for (const auto& [key, ok] : allowed) {
    if (!ok) continue;
    std::vector<Item>& items = seen.at(key);
    for (Item& i : items) {
      i.any = true;
      i.copy.clear();
    }
    std::sort(items.begin(), items.end());
    items.erase(std::unique(items.begin(), items.end()), items.end());
  }
}

void ValueFlow::find_selected(const trace::Trace& trace, const std::vector<trace::NodeId>& nodes,
                              const std::vector<CopyIndex>& copies,
                              std::unordered_map<Key, bool, KeyHash>& selected) const {
  std::unordered_map<Key, uint32_t, KeyHash> latest;  // producer copy -> record that last wrote it
  for (size_t r = 0; r < trace.ops.size(); ++r) {
    const trace::NodeId n = nodes[r];
    const auto& inputs = trace.ops[r].inputs;
    for (uint32_t s = 0; s < inputs.size(); ++s) {
      const trace::ValueRef& in = inputs[s];
      if (in.kind == trace::ValueRef::Kind::kFeed) continue;
      const Key key{n, s, copies[r]};
      auto [mark, fresh] = selected.try_emplace(key, false);
      if (mark->second) continue;
      const std::vector<Item>& items = sets_.at(reads_.at(key)).first;
      if (items.size() < 2) continue;
      // Python names the producer it read by node, output and copy: an "any copy" item names none.
      if (std::any_of(items.begin(), items.end(), [](const Item& i) { return i.any; })) continue;
      const Item read{nodes[in.index], in.output, copies[in.index], false};
      int64_t best = -1;
      const Item* last = nullptr;
      for (const Item& i : items) {
        const auto it = latest.find(Key{i.node, i.output, i.copy});
        if (it != latest.end() && static_cast<int64_t>(it->second) > best) {
          best = it->second;
          last = &i;
        }
      }
      if (last != nullptr && !(*last == read)) mark->second = true;
    }
    for (uint32_t k = 0; k < trace.ops[r].num_outputs; ++k) latest[Key{n, k, copies[r]}] = static_cast<uint32_t>(r);
  }
}

// The loop to flatten is the outermost prim::Loop around the producer whose iteration the
// consumer is not in any more: a later iteration of it overwrote the value. (Loops inside it
// may need flattening too; the next round of emission finds them.)
void ValueFlow::note_stale(const trace::Program& program, const trace::Trace& trace, uint32_t producer,
                           uint32_t consumer, const std::vector<trace::NodeId>& loops) {
  const auto& p = trace.ops[producer].loops;
  const auto& c = trace.ops[consumer].loops;
  for (size_t d = 0; d < loops.size() && d < p.size(); ++d) {
    const bool same_iteration = d < c.size() && c[d].loop_id == p[d].loop_id && c[d].iteration == p[d].iteration;
    if (same_iteration || unrolled(program, loops[d])) continue;
    if (std::find(stale_loops_.begin(), stale_loops_.end(), p[d].loop_id) == stale_loops_.end())
      stale_loops_.push_back(p[d].loop_id);
    return;
  }
}

// Every copy the program can run gets a read set; copies no trace ran read "any copy" of the
// node-level producers.
void ValueFlow::add_fallbacks(const trace::TraceGraph& graph, const trace::Program& program, trace::ProgId p,
                              CopyIndex& copy, std::unordered_map<Key, std::vector<Item>, KeyHash>& seen) {
  const trace::ProgNode& pn = program.at(p);
  if (pn.kind == trace::ProgKind::kBlock) {
    for (const trace::NodeId n : pn.ops) {
      const trace::Node& node = graph.node(n);
      for (uint32_t s = 0; s < node.inputs.size(); ++s) {
        Key key{n, s, copy};
        if (seen.count(key)) continue;
        std::vector<Item> items;
        for (const trace::Source& src : node.inputs[s])
          if (src.kind == trace::Source::Kind::kNode) items.push_back(Item{src.id, src.output, {}, true});
        if (!items.empty()) seen.emplace(std::move(key), std::move(items));
      }
    }
    return;
  }
  if (pn.kind == trace::ProgKind::kUnrolled) {
    for (uint32_t i = 0; i < pn.trip_count; ++i) {
      copy.push_back(i);
      add_fallbacks(graph, program, pn.children[0], copy, seen);
      copy.pop_back();
    }
    return;
  }
  for (const trace::ProgId c : pn.children) add_fallbacks(graph, program, c, copy, seen);
}

VarId ValueFlow::intern(std::vector<Item> set) {
  uint64_t h = 0;
  for (const Item& i : set) h = hash_copy(trace::hash_combine(h, pair_key(i.node, i.output) * 2 + i.any), i.copy);
  auto& bucket = set_index_[h];
  for (const uint32_t e : bucket)
    if (sets_[e].first == set) return sets_[e].second;
  const VarId v = num_vars_++;
  for (const Item& i : set) {
    if (i.any) writes_any_[pair_key(i.node, i.output)].push_back(v);
    else writes_[Key{i.node, i.output, i.copy}].push_back(v);
  }
  bucket.push_back(static_cast<uint32_t>(sets_.size()));
  sets_.emplace_back(std::move(set), v);
  return v;
}

VarId ValueFlow::read(trace::NodeId node, uint32_t slot, const CopyIndex& copy) const {
  const auto it = reads_.find(Key{node, slot, copy});
  return it == reads_.end() ? kNoVar : it->second;
}

bool ValueFlow::fed(trace::NodeId node, uint32_t slot) const {
  return node < fed_.size() && slot < fed_[node].size() && fed_[node][slot];
}

void ValueFlow::assigned_by(trace::NodeId node, uint32_t output, const CopyIndex& copy, std::vector<VarId>& out) const {
  if (auto it = writes_.find(Key{node, output, copy}); it != writes_.end())
    out.insert(out.end(), it->second.begin(), it->second.end());
  if (auto it = writes_any_.find(pair_key(node, output)); it != writes_any_.end())
    out.insert(out.end(), it->second.begin(), it->second.end());
}

}  // namespace terra::emit
