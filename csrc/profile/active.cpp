// Process-wide active selector; see active.h.
#include "profile/active.h"

#include <mutex>

namespace terra::profile {

namespace {
std::mutex& active_mutex() {
  static std::mutex mu;
  return mu;
}
std::shared_ptr<Selector>& active_slot() {
  static std::shared_ptr<Selector> slot;
  return slot;
}
}  // namespace

std::shared_ptr<Selector> active_selector() {
  std::lock_guard<std::mutex> lock(active_mutex());
  return active_slot();
}

std::shared_ptr<Selector> set_active_selector(std::shared_ptr<Selector> selector) {
  std::lock_guard<std::mutex> lock(active_mutex());
  std::swap(active_slot(), selector);
  return selector;
}

}  // namespace terra::profile
