#include "emit/written_feeds.h"

#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <string_view>
#include <unordered_set>

#include "capture/op_arguments.h"
#include "emit/channel.h"

namespace terra::emit {

namespace {

using torch::jit::Node;
using torch::jit::Value;

// Whether `op` (one of the terra:: channel ops) only reads its tensors: they are the graph's
// hand-offs to Python (publish, fetch) and its waits (gate).
bool channel_reader(const Node* n) {
  const std::string_view kind = n->kind().toQualString();
  return kind == kPublishOp || kind == kFetchOp || kind == kGateOp;
}

class WriteFinder {
 public:
  bool written(const Value* v) {
    if (!seen_.insert(v).second) return false;  // (an If output reached along two branches)
    for (const torch::jit::Use& use : v->uses())
      if (use_writes(use)) return true;
    return false;
  }

 private:
  bool use_writes(const torch::jit::Use& use) {
    const Node* user = use.user;
    if (user->kind() == c10::prim::Return) {
      // A block's result: an If's output carries it on; anything else (a loop body's carried
      // value) is not followed.
      const Node* owner = user->owningBlock()->owningNode();
      if (owner == nullptr || owner->kind() != c10::prim::If) return true;
      return written(owner->outputs().at(use.offset));
    }
    if (user->kind() == c10::prim::unchecked_cast) return written(user->output());
    if (user->kind().is_prim()) return true;  // (lists, tuples, loops: not followed)
    if (channel_reader(user)) return false;
    const c10::FunctionSchema* schema = user->maybeSchema();
    if (schema == nullptr || user->kind().toQualString() == std::string_view(kBoxedCallOp)) return true;
    if (use.offset >= schema->arguments().size()) return true;  // (varargs)
    if ((use.offset == capture::kRunningMeanArgument || use.offset == capture::kRunningVarArgument) &&
        capture::writes_running_statistics(*schema))
      return true;  // (whether it trains or not: written in training, read as it is otherwise)
    const c10::AliasInfo* alias = schema->arguments()[use.offset].alias_info();
    if (alias == nullptr) return false;  // read only
    if (alias->isWrite()) return true;
    // A view: its outputs that share the argument's alias set are the same memory.
    for (size_t r = 0; r < schema->returns().size() && r < user->outputs().size(); ++r) {
      const c10::AliasInfo* out = schema->returns()[r].alias_info();
      if (out == nullptr) continue;
      for (const c10::Symbol& set : alias->beforeSets())
        if (out->beforeSets().count(set) && written(user->outputs()[r])) return true;
    }
    return false;
  }

  std::unordered_set<const Value*> seen_;
};

void visit(torch::jit::Block* block, EmittedGraph& out) {
  const c10::Symbol feed = c10::Symbol::fromQualString(kFeedOp);
  const c10::Symbol feed_or_none = c10::Symbol::fromQualString(kFeedOrNoneOp);
  for (Node* n : block->nodes()) {
    for (torch::jit::Block* b : n->blocks()) visit(b, out);
    if (n->kind() != feed && n->kind() != feed_or_none) continue;
    const std::optional<c10::IValue> slot = torch::jit::toIValue(n->input(0));
    if (!slot || !slot->isInt() || slot->toInt() < 0 || static_cast<size_t>(slot->toInt()) >= out.feeds.size()) continue;
    // (A slot read in several copies of an unrolled loop has one feed op per copy.)
    FeedSlot& fs = out.feeds[static_cast<size_t>(slot->toInt())];
    fs.written = fs.written || WriteFinder().written(n->output());
  }
}

}  // namespace

void mark_written_feeds(EmittedGraph& out) {
  for (FeedSlot& fs : out.feeds) fs.written = false;
  visit(out.graph->block(), out);
}

}  // namespace terra::emit
