#include "capture/explicit_generators.h"

#include <ATen/Context.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <mutex>
#include <vector>

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

}  // namespace

bool python_draws(c10::ArrayRef<c10::IValue> args) {
  for (const c10::IValue& v : args) {
    if (!v.isGenerator()) continue;
    const at::Generator& g = v.toGenerator();
    if (g.defined() && !is_default(g) && !graph_drawn().contains(g)) return true;
  }
  return false;
}

void note_graph_draws(const c10::IValue& arg) {
  if (!arg.isGenerator()) return;
  const at::Generator& g = arg.toGenerator();
  if (g.defined() && !is_default(g)) graph_drawn().add(g);
}

}  // namespace terra::capture
