// Registers the terra:: channel operators that generated graphs call, and the thread-local
// ChannelSource they talk to.
//
// Every schema uses AliasAnalysisKind::CONSERVATIVE (BRIEF, "Channel ops in graphs"): a
// conservative op in a non-aten namespace counts as having side effects (Node::hasSideEffects),
// so dead-code elimination keeps it, constant propagation does not run it at compile time even
// with a constant site id, CSE does not merge two of them, and alias analysis treats its tensor
// arguments as written and its results as wildcards, so no mutation moves across it.
#include <torch/library.h>

#include "emit/channel.h"

namespace terra::emit {

namespace {

thread_local ChannelSource* t_current = nullptr;

ChannelSource& require(const char* op) {
  TORCH_CHECK(t_current != nullptr, "terra_torch: ", op,
              " ran with no ChannelSource installed on this thread (a generated graph must run "
              "inside a ChannelScope)");
  return *t_current;
}

int64_t case_select(int64_t site) { return require(kCaseSelectOp).case_select(site); }
bool loop_cond(int64_t site) { return require(kLoopCondOp).loop_cond(site); }

at::Tensor feed(int64_t slot) {
  at::Tensor t = require(kFeedOp).feed(slot);
  TORCH_CHECK(t.defined(), "terra_torch: feed slot ", slot, " received no tensor");
  return t;
}

std::optional<at::Tensor> feed_or_none(int64_t slot) {
  at::Tensor t = require(kFeedOrNoneOp).feed(slot);
  if (!t.defined()) return std::nullopt;
  return t;
}

void gate(int64_t node) { require(kGateOp).gate(node); }

double feed_scalar(int64_t slot) { return require(kFeedScalarOp).feed_scalar(slot); }

void publish(int64_t tag, const std::optional<at::Tensor>& value) {
  require(kPublishOp).publish(tag, value.has_value() ? *value : at::Tensor());
}

// With no source installed this is a no-op: that is the case while a capture region records a
// terra::fetch marker (the interceptor runs the real kernel after recording it).
void fetch(int64_t slot, const at::Tensor& value) {
  if (t_current != nullptr) t_current->fetch(slot, value);
}

}  // namespace

ChannelSource* current_channel() { return t_current; }

double ChannelSource::feed_scalar(int64_t slot) {
  TORCH_CHECK(false, "terra_torch: this channel cannot feed scalar slot ", slot, " (co-execution graphs only)");
}

ChannelScope::ChannelScope(ChannelSource* source) : saved_(t_current) { t_current = source; }
ChannelScope::~ChannelScope() { t_current = saved_; }

}  // namespace terra::emit

TORCH_LIBRARY(terra, m) {
  using c10::AliasAnalysisKind;
  // No tensor arguments: a catch-all kernel is the only one the dispatcher can pick.
  m.def(torch::schema("case_select(int site) -> int", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::case_select);
  m.def(torch::schema("loop_cond(int site) -> bool", AliasAnalysisKind::CONSERVATIVE), &terra::emit::loop_cond);
  m.def(torch::schema("feed(int slot) -> Tensor", AliasAnalysisKind::CONSERVATIVE), &terra::emit::feed);
  m.def(torch::schema("feed_or_none(int slot) -> Tensor?", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::feed_or_none);
  m.def(torch::schema("gate(int node) -> ()", AliasAnalysisKind::CONSERVATIVE), &terra::emit::gate);
  m.def(torch::schema("feed_scalar(int slot) -> float", AliasAnalysisKind::CONSERVATIVE), &terra::emit::feed_scalar);
  // A catch-all kernel: publish only ever runs inside generated graphs, never in a capture region.
  m.def(torch::schema("publish(int tag, Tensor? value) -> ()", AliasAnalysisKind::CONSERVATIVE),
        &terra::emit::publish);
  // fetch has a tensor argument and gets backend kernels only (below): a catch-all kernel would
  // win over the capture layer's PrivateUse3 fallback, and a terra::fetch called inside a
  // capture region must be recorded (terra_torch.graph uses it to mark the values Python reads).
  m.def(torch::schema("fetch(int slot, Tensor value) -> ()", AliasAnalysisKind::CONSERVATIVE));
}

// fetch returns nothing, so autograd has nothing to do; the fallthrough also covers
// AutogradPrivateUse3, which has no fallback of its own while a capture region is open.
TORCH_LIBRARY_IMPL(terra, Autograd, m) { m.impl("fetch", torch::CppFunction::makeFallthrough()); }
TORCH_LIBRARY_IMPL(terra, CPU, m) { m.impl("fetch", &terra::emit::fetch); }
TORCH_LIBRARY_IMPL(terra, CUDA, m) { m.impl("fetch", &terra::emit::fetch); }
TORCH_LIBRARY_IMPL(terra, Meta, m) { m.impl("fetch", &terra::emit::fetch); }
