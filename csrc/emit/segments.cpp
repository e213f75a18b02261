// cut_segments(): see segments.h for what a segment is and the rules.
#include "emit/segments.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "capture/op_arguments.h"
#include "capture/schema_aliases.h"
#include "emit/channel.h"

namespace terra::emit {

namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;

bool is_constant(const Value* v) { return v->node()->kind() == c10::prim::Constant; }

bool is_tensor(const Value* v) { return v->type()->kind() == c10::TypeKind::TensorType; }

}  // namespace

const std::vector<ScalarOperand>& scalar_operands() {
  // Each one is rewritten by terra_torch/_fused.py (_SCALAR_OPERAND_REWRITES) into tensor ops
  // that take the number as a 0-dim tensor; a test checks that every entry has its rewrite.
  static const std::vector<ScalarOperand> table = {
      {"aten::addcdiv", "", "value"},   {"aten::addcdiv_", "", "value"},  {"aten::addcmul", "", "value"},
      {"aten::addcmul_", "", "value"},  {"aten::add", "Tensor", "alpha"}, {"aten::add_", "Tensor", "alpha"},
      {"aten::sub", "Tensor", "alpha"}, {"aten::sub_", "Tensor", "alpha"}, {"aten::add", "Scalar", "other"},
      {"aten::add_", "Scalar", "other"}, {"aten::sub", "Scalar", "other"}, {"aten::sub_", "Scalar", "other"},
      {"aten::mul", "Scalar", "other"}, {"aten::mul_", "Scalar", "other"}, {"aten::div", "Scalar", "other"},
      {"aten::div_", "Scalar", "other"}, {"aten::lerp", "Scalar", "weight"}, {"aten::lerp_", "Scalar", "weight"},
      {"aten::pow", "Tensor_Scalar", "exponent"}, {"aten::pow_", "Scalar", "exponent"},
  };
  return table;
}

bool is_scalar_operand(const Node* n, size_t input) {
  const c10::FunctionSchema* schema = n->maybeSchema();
  if (schema == nullptr || input >= schema->arguments().size()) return false;
  if (n->input(input)->type()->kind() != c10::TypeKind::FloatType) return false;
  const std::string& argument = schema->arguments()[input].name();
  for (const ScalarOperand& s : scalar_operands()) {
    if (schema->name() == s.op && schema->overload_name() == s.overload && argument == s.argument) return true;
  }
  return false;
}

namespace {

// May this node be part of a segment? (segments.h: tensor results, constant non-tensor
// arguments or scalar operands, not random.)
bool fusible(const Node* n) {
  if (!n->kind().is_aten()) return false;
  const c10::FunctionSchema* schema = n->maybeSchema();
  if (schema == nullptr || schema->is_vararg() || schema->is_varret() || n->outputs().empty()) return false;
  for (const Value* out : n->outputs()) {
    if (!is_tensor(out)) return false;
  }
  for (size_t i = 0; i < n->inputs().size(); ++i) {
    const Value* in = n->input(i);
    if (is_tensor(in) == is_constant(in) && !is_scalar_operand(n, i)) return false;  // a tensor constant, or a number
  }
  const auto op = c10::Dispatcher::singleton().findOp({schema->name(), schema->overload_name()});
  return op.has_value() && !op->hasTag(at::Tag::nondeterministic_seeded);
}

// (Any alias annotation counts, a wildcard one too: such a result is never a fresh tensor.)
bool aliases_an_argument(const Node* n, size_t output) {
  const c10::FunctionSchema& schema = n->schema();
  return output < schema.returns().size() && schema.returns()[output].alias_info() != nullptr;
}

// A stretch being cut: its ops in order, and the publishes and fetches found between them.
struct Stretch {
  std::vector<Node*> ops;
  std::vector<Node*> publishes;
  std::vector<Node*> fetches;
};

bool is_number(const Value* v) {
  const c10::TypeKind k = v->type()->kind();
  return k == c10::TypeKind::IntType || k == c10::TypeKind::FloatType || k == c10::TypeKind::BoolType ||
         k == c10::TypeKind::NumberType;
}

// Does `n` (or a node in its blocks) read a value that `ops` compute?
bool reads_any(const Node* n, const std::unordered_set<const Node*>& ops) {
  for (const Value* in : n->inputs()) {
    if (ops.count(in->node())) return true;
  }
  for (const Block* b : n->blocks()) {
    for (const Node* inner : b->nodes()) {
      if (reads_any(inner, ops)) return true;
    }
    for (const Value* out : b->outputs()) {
      if (ops.count(out->node())) return true;
    }
  }
  return false;
}

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
        fetch_(c10::Symbol::fromQualString(kFetchOp)) {
    for (const char* feed : kFeedOps) feeds_.insert(c10::Symbol::fromQualString(feed));
  }

  void cut(Block* block) {
    // Collected first: cutting rewrites the block.
    std::vector<Stretch> stretches(1);
    std::unordered_set<const Node*> open;  // the ops of stretches.back()
    for (Node* n : block->nodes()) {
      for (Block* inner : n->blocks()) cut(inner);
      Stretch& s = stretches.back();
      if (fusible(n)) {
        s.ops.push_back(n);
        open.insert(n);
      } else if (n->kind() == publish_ && !s.ops.empty()) {
        s.publishes.push_back(n);
      } else if (n->kind() == fetch_ && !s.ops.empty()) {
        s.fetches.push_back(n);
      } else if (stays_in_place(n) && !reads_any(n, open)) {
        // (stays where it is, before the segment call)
      } else if (!s.ops.empty()) {
        stretches.emplace_back();
        open.clear();
      }
    }
    for (Stretch& s : stretches) {
      std::vector<std::vector<Node*>> parts;
      split_escaping_aliases(std::move(s.ops), parts);
      for (std::vector<Node*>& part : parts) {
        if (compute_ops(part) >= options_.min_compute_ops) replace(part, s.publishes, s.fetches);
      }
    }
  }

 private:
  // Replaces `ops` by a terra::segment call after the last of them; the publishes among them
  // (of the stretch they came from) move after the call. The body's outputs are the values
  // computed in it that are used after it; aliasing results used after it are made there
  // from those (split_escaping_aliases says how), so that they alias what they do in eager.
  // A node that may sit between a stretch's ops without ending it, provided it reads nothing
  // they compute: it reads no tensor's data and has no effect, so it may run before the segment
  // call. The optimizers' per-parameter steps are full of these: whether a gradient is None
  // (feed_or_none, __is__, an If choosing a tensor), and the step size a Python float computes.
  bool stays_in_place(const Node* n) const {
    const c10::Symbol k = n->kind();
    if (k == c10::prim::Constant) return true;
    if (feeds_.count(k)) return options_.feeds_ready;  // (in co-execution a feed waits for Python)
    if (k == c10::aten::__is__ || k == c10::aten::__isnot__ || k == c10::prim::unchecked_cast) return true;
    if (k == c10::prim::If) {
      for (const Block* b : n->blocks()) {
        for (const Node* inner : b->nodes()) {
          if (!stays_in_place(inner)) return false;
        }
      }
      return true;
    }
    if (!k.is_aten() || !n->blocks().empty() || n->outputs().empty()) return false;  // arithmetic on numbers:
    for (const Value* v : n->inputs()) {
      if (!is_number(v)) return false;
    }
    for (const Value* v : n->outputs()) {
      if (!is_number(v)) return false;
    }
    return true;
  }

  // A fetch between the ops moves after the segment call, as a publish does; where an op after it
  // writes in place, it reads a copy taken where it was (a fusible aten::clone, which joins the
  // ops): Python must read the value the program had at the fetch. Returns the ops, with the copies.
  std::vector<Node*> take_fetch_copies(std::vector<Node*> ops, const std::vector<Node*>& fetches) {
    for (Node* f : fetches) {
      if (!ops.front()->isBefore(f) || !f->isBefore(ops.back())) continue;
      auto after = std::find_if(ops.begin(), ops.end(), [&](const Node* op) { return f->isBefore(op); });
      if (std::none_of(after, ops.end(), [](const Node* op) { return capture::writes_an_argument(op->schema()); })) continue;
      torch::jit::WithInsertPoint at(f);
      Value* copy = graph_.insert(c10::aten::clone, {f->input(1)});
      f->replaceInput(1, copy);
      ops.insert(after, copy->node());
    }
    return ops;
  }

  void replace(const std::vector<Node*>& cut_ops, const std::vector<Node*>& publishes,
               const std::vector<Node*>& fetches) {
    const std::vector<Node*> ops = take_fetch_copies(cut_ops, fetches);
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
      } else if (v->type()->kind() == c10::TypeKind::FloatType) {
        // A scalar operand (is_scalar_operand): it comes in as a 0-dim float64 tensor, and the
        // body takes the number back, bit for bit, for the op as it was; _fused.py compiles the
        // op as tensor ops on that tensor.
        Value* t = body->addInput()->setType(c10::TensorType::get());
        inputs.push_back(v);
        b = body->appendNode(body->create(c10::aten::Float, {t}, 1))->output()->setType(c10::FloatType::get());
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
    for (Value*& v : inputs) {
      if (v->type()->kind() == c10::TypeKind::FloatType) {
        v = graph_.insertNode(graph_.create(c10::prim::NumToTensor, {v}, 1))->output()->setType(c10::TensorType::get());
      }
    }
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
    for (Node* f : fetches) {
      if (ops.front()->isBefore(f) && f->isBefore(last)) {
        f->moveAfter(previous);
        previous = f;
      }
    }
    for (auto it = ops.rbegin(); it != ops.rend(); ++it) (*it)->destroy();
    segments_.push_back({std::move(body), ops.size()});
  }

  Graph& graph_;
  const SegmentOptions& options_;
  const std::vector<bool>& in_place_;
  std::vector<Segment>& segments_;
  const c10::Symbol publish_, segment_, fetch_;
  std::unordered_set<c10::Symbol> feeds_;  // every terra::feed* op (all wait for Python in co-execution)
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
