#include "capture/draw_side.h"

#include <ATen/Context.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "capture/trace_record.h"

namespace terra::capture {

namespace {

bool is_default(const at::Generator& g) {
  const c10::Device device = g.device();
  // (lazyInitDevice inside defaultGenerator is a no-op here: a generator of that device exists)
  return g == at::globalContext().defaultGenerator(device);
}

// The explicit generators the graph has drawn from, held weakly: a dead one is forgotten, so
// that a new generator at its address starts on Python's side. Rarely more than a few.
class GraphDrawn {
 public:
  bool contains(const at::Generator& g) {
    std::lock_guard<std::mutex> lock(mu_);
    forget_dead();
    return std::any_of(drawn_.begin(), drawn_.end(),
                       [&](const Weak& w) { return w._unsafe_get_target() == g.unsafeGetGeneratorImpl(); });
  }
  void add(const at::Generator& g) {
    std::lock_guard<std::mutex> lock(mu_);
    forget_dead();
    for (const Weak& w : drawn_)
      if (w._unsafe_get_target() == g.unsafeGetGeneratorImpl()) return;
    drawn_.emplace_back(g.getIntrusivePtr());
  }

 private:
  using Weak = c10::weak_intrusive_ptr<c10::GeneratorImpl>;
  void forget_dead() {
    drawn_.erase(std::remove_if(drawn_.begin(), drawn_.end(), [](const Weak& w) { return w.expired(); }),
                 drawn_.end());
  }
  std::mutex mu_;
  std::vector<Weak> drawn_;
};

GraphDrawn& graph_drawn() {
  static GraphDrawn* drawn = new GraphDrawn();  // never destroyed: ops may run during exit
  return *drawn;
}

// Per device type: the graph has drawn from that device's default generator. Read for every
// factory a region intercepts: a relaxed atomic, no lock.
constexpr size_t kDeviceTypes = static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES);
std::array<std::atomic<bool>, kDeviceTypes> g_default_drawn{};

size_t slot(c10::DeviceType type) { return std::min(static_cast<size_t>(type), kDeviceTypes - 1); }

bool python_draws_defaults() {
  static const bool on = [] {
    const char* v = std::getenv("TERRA_PYTHON_DRAWS");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return on;
}

// The device an op draws on when it takes no generator: its first tensor's, else its `device`
// argument's (a factory), else the CPU (a factory's default).
c10::Device draw_device(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) return v.toTensor().device();
    if (v.isTensorList() && !v.toTensorList().empty()) return v.toTensorList().get(0).device();
  }
  const auto& schema = op.schema().arguments();
  for (size_t i = 0; i < args.size() && i < schema.size(); ++i)
    if (args[i].isDevice() && schema[i].name() == "device") return args[i].toDevice();
  return c10::Device(c10::kCPU);
}

// The generator `op` draws from: an explicit one (`explicit_out` set), or the default generator
// of the returned device.
c10::Device generator_of(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args, at::Generator* explicit_out) {
  for (const c10::IValue& v : args) {
    if (!v.isGenerator()) continue;
    const at::Generator& g = v.toGenerator();
    if (!g.defined()) continue;
    if (is_default(g)) return g.device();
    *explicit_out = g;
    return g.device();
  }
  return draw_device(op, args);
}

}  // namespace

bool python_draws(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  if (!op.hasTag(at::Tag::nondeterministic_seeded)) return false;
  at::Generator explicit_generator;
  const c10::Device device = generator_of(op, args, &explicit_generator);
  if (explicit_generator.defined()) return !graph_drawn().contains(explicit_generator);
  return python_draws_defaults() && !g_default_drawn[slot(device.type())].load(std::memory_order_relaxed);
}

void note_graph_draws(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
  if (!op.hasTag(at::Tag::nondeterministic_seeded)) return;
  at::Generator explicit_generator;
  const c10::Device device = generator_of(op, args, &explicit_generator);
  if (explicit_generator.defined()) graph_drawn().add(explicit_generator);
  else g_default_drawn[slot(device.type())].store(true, std::memory_order_relaxed);
}

void note_graph_draws(const OpRecord& rec) {
  if (!rec.op.hasTag(at::Tag::nondeterministic_seeded)) return;
  const c10::Device device = rec.outputs.empty() ? c10::Device(c10::kCPU) : rec.outputs[0].device;
  g_default_drawn[slot(device.type())].store(true, std::memory_order_relaxed);
}

}  // namespace terra::capture
