// cut_segments(): see segments.h for what a segment is and the rules.
#include "emit/segments.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <functional>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "capture/schema_aliases.h"
#include "emit/channel.h"

namespace terra::emit {

namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

bool is_constant(const Value* v) { return v->node()->kind() == c10::prim::Constant; }

// May this node be part of a segment? (segments.h: tensor results, constant non-tensor
// arguments, not random.)
bool fusible(const Node* n) {
  if (!n->kind().is_aten()) return false;
  const c10::FunctionSchema* schema = n->maybeSchema();
  if (schema == nullptr || schema->is_vararg() || schema->is_varret() || n->outputs().empty()) return false;
  for (const Value* out : n->outputs()) {
    if (out->type()->kind() != c10::TypeKind::TensorType) return false;
  }
  for (const Value* in : n->inputs()) {
    const bool tensor = in->type()->kind() == c10::TypeKind::TensorType;
    if (tensor == is_constant(in)) return false;  // a tensor constant, or a number fed at run time
  }
  const auto op = c10::Dispatcher::singleton().findOp({schema->name(), schema->overload_name()});
  return op.has_value() && !op->hasTag(at::Tag::nondeterministic_seeded);
}

// (Any alias annotation counts, a wildcard one too: such a result is never a fresh tensor.)
bool aliases_an_argument(const Node* n, size_t output) {
  const c10::FunctionSchema& schema = n->schema();
  return output < schema.returns().size() && schema.returns()[output].alias_info() != nullptr;
}

// A stretch being cut: its ops in order, and the publishes found between them.
struct Stretch {
  std::vector<Node*> ops;
  std::vector<Node*> publishes;
};

size_t compute_ops(const std::vector<Node*>& ops) {
  size_t n = 0;
  for (const Node* op : ops) {
    bool alias = false;
    for (size_t k = 0; k < op->outputs().size(); ++k) alias = alias || aliases_an_argument(op, k);
    if (!alias) ++n;
  }
  return n;
}

bool used_outside(const Value* v, const std::unordered_set<const Node*>& inside) {
  for (const torch::jit::Use& use : v->uses()) {
    if (!inside.count(use.user)) return true;
  }
  return false;
}

// The argument an in-place op's result `k` is (`Tensor(a!) self -> Tensor(a!)`), or nullopt.
std::optional<size_t> returned_argument(const Node* n, size_t k) {
  const auto alias = capture::aliased_argument(n->schema(), k);
  if (!alias || !alias->written || alias->argument >= n->inputs().size()) return std::nullopt;
  return alias->argument;
}

// Makes `ops` safe to compile and appends the parts to `out`. An aliasing result used after the
// segment must alias there what it aliases in eager. Two kinds can: an in-place op's result is
// its argument (after the call: the argument, which the compiled code wrote in place, or the
// segment's result for it), and a pure view is made again after the call from what it views
// (Cutter::replace). Any other aliasing result used after the segment splits the stretch.
void split_escaping_aliases(std::vector<Node*> ops, std::vector<std::vector<Node*>>& out) {
  if (ops.empty()) return;
  const std::unordered_set<const Node*> inside(ops.begin(), ops.end());
  for (size_t i = 0; i < ops.size(); ++i) {
    for (size_t k = 0; k < ops[i]->outputs().size(); ++k) {
      if (!aliases_an_argument(ops[i], k) || !used_outside(ops[i]->output(k), inside)) continue;
      if (returned_argument(ops[i], k) || capture::makes_views_only(ops[i]->schema())) continue;
      split_escaping_aliases({ops.begin(), ops.begin() + i}, out);
      split_escaping_aliases({ops.begin() + i + 1, ops.end()}, out);
      return;
    }
  }
  out.push_back(std::move(ops));
}

class Cutter {
 public:
  Cutter(Graph& graph, const SegmentOptions& options, const std::vector<bool>& in_place, std::vector<Segment>& segments)
      : graph_(graph), options_(options), in_place_(in_place), segments_(segments), publish_(c10::Symbol::fromQualString(kPublishOp)),
        segment_(c10::Symbol::fromQualString(kSegmentOp)),
        feed_(c10::Symbol::fromQualString(kFeedOp)) {}

  void cut(Block* block) {
    // Collected first: cutting rewrites the block.
    std::vector<Stretch> stretches(1);
    for (Node* n : block->nodes()) {
      for (Block* inner : n->blocks()) cut(inner);
      if (fusible(n)) {
        stretches.back().ops.push_back(n);
      } else if (n->kind() == publish_ && !stretches.back().ops.empty()) {
        stretches.back().publishes.push_back(n);
      } else if (n->kind() == c10::prim::Constant || (options_.feeds_ready && n->kind() == feed_)) {
        // (stays in place, before the segment call)
      } else if (!stretches.back().ops.empty()) {
        stretches.emplace_back();
      }
    }
    for (Stretch& s : stretches) {
      std::vector<std::vector<Node*>> parts;
      split_escaping_aliases(std::move(s.ops), parts);
      for (std::vector<Node*>& part : parts) {
        if (compute_ops(part) >= options_.min_compute_ops) replace(part, s.publishes);
      }
    }
  }

 private:
  // Replaces `ops` by a terra::segment call after the last of them; the publishes among them
  // (of the stretch they came from) move after the call. The body's outputs are the values
  // computed in it that are used after it; aliasing results used after it are made there
  // from those (split_escaping_aliases says how), so that they alias what they do in eager.
  void replace(const std::vector<Node*>& ops, const std::vector<Node*>& publishes) {
    const std::unordered_set<const Node*> inside(ops.begin(), ops.end());
    auto defined_inside = [&](const Value* v) { return inside.count(v->node()) > 0; };
    // The values the body returns, in order of first need.
    std::vector<Value*> outputs;
    std::unordered_set<const Value*> returned;
    std::function<void(Value*)> need = [&](Value* v) {
      if (!defined_inside(v) || returned.count(v)) return;
      Node* op = v->node();
      const size_t k = v->offset();
      if (!aliases_an_argument(op, k)) {
        returned.insert(v);
        outputs.push_back(v);
      } else if (auto j = returned_argument(op, k)) {
        need(op->input(*j));
      } else {
        for (Value* in : op->inputs()) {
          if (in->type()->kind() == c10::TypeKind::TensorType) need(in);
        }
      }
    };
    std::vector<Value*> leaving;
    for (Node* op : ops) {
      for (Value* v : op->outputs()) {
        if (used_outside(v, inside)) {
          leaving.push_back(v);
          need(v);
        }
      }
    }

    auto body = std::make_shared<Graph>();
    std::unordered_map<Value*, Value*> env;
    std::vector<Value*> inputs;
    auto body_value = [&](Value* v) -> Value* {
      if (auto it = env.find(v); it != env.end()) return it->second;
      Value* b = nullptr;
      if (is_constant(v)) {
        b = body->appendNode(body->createClone(v->node(), [](Value*) -> Value* { return nullptr; }))->output();
      } else {
        b = body->addInput()->setType(v->type());
        inputs.push_back(v);
      }
      env.emplace(v, b);
      return b;
    };
    for (Node* op : ops) {
      Node* copy = body->appendNode(body->createClone(op, body_value));
      for (size_t k = 0; k < op->outputs().size(); ++k) env.emplace(op->output(k), copy->output(k));
    }
    for (Value* v : outputs) body->registerOutput(env.at(v));
    if (segments_.size() < in_place_.size() && in_place_[segments_.size()]) {
      segments_.push_back({std::move(body), ops.size()});  // (its ops stay where they are)
      return;
    }

    Node* last = ops.back();
    torch::jit::WithInsertPoint at(last->next());
    Node* list = graph_.insertNode(graph_.createList(c10::TensorType::get(), inputs));
    Value* index = graph_.insertConstant(static_cast<int64_t>(segments_.size()));
    Node* call = graph_.insertNode(graph_.create(segment_, {index, list->output()}, 1));
    call->output()->setType(c10::ListType::ofTensors());
    Node* unpack = graph_.insertNode(graph_.createListUnpack(call->output(), outputs.size()));
    // What stands for a value of the segment after the call.
    std::unordered_map<const Value*, Value*> after;
    for (size_t i = 0; i < outputs.size(); ++i) {
      unpack->output(i)->setType(outputs[i]->type());
      after.emplace(outputs[i], unpack->output(i));
    }
    std::function<Value*(Value*)> value_after = [&](Value* v) -> Value* {
      if (!defined_inside(v)) return v;
      if (auto it = after.find(v); it != after.end()) return it->second;
      Node* op = v->node();
      if (auto j = returned_argument(op, v->offset())) {
        Value* r = value_after(op->input(*j));
        after.emplace(v, r);
        return r;
      }
      Node* view = graph_.insertNode(graph_.createClone(op, value_after));  // a pure view, made again
      for (size_t k = 0; k < op->outputs().size(); ++k) after.emplace(op->output(k), view->output(k));
      return after.at(v);
    };
    for (Value* v : leaving) v->replaceAllUsesWith(value_after(v));
    Node* previous = graph_.insertPoint()->prev();  // the last node made after the call
    for (Node* p : publishes) {
      if (p->isBefore(last)) {  // (publishes after `last` stay where they are)
        p->moveAfter(previous);
        previous = p;
      }
    }
    for (auto it = ops.rbegin(); it != ops.rend(); ++it) (*it)->destroy();
    segments_.push_back({std::move(body), ops.size()});
  }

  Graph& graph_;
  const SegmentOptions& options_;
  const std::vector<bool>& in_place_;
  std::vector<Segment>& segments_;
  const c10::Symbol publish_, segment_, feed_;
};

}  // namespace

SegmentedGraph cut_segments(const std::shared_ptr<Graph>& graph, const SegmentOptions& options,
                            const std::vector<bool>& in_place) {
  SegmentedGraph out;
  out.graph = graph->copy();
  Cutter(*out.graph, options, in_place, out.segments).cut(out.graph->block());
  out.graph->lint();
  return out;
}

}  // namespace terra::emit
