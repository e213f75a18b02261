// Process-wide active selector; see active.h.
#include "profile/active.h"

#include <atomic>
#include <cstdint>
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
std::atomic<uint64_t>& active_generation() {
  static std::atomic<uint64_t> generation{1};
  return generation;
}
}  // namespace

std::shared_ptr<Selector> active_selector() {
  std::lock_guard<std::mutex> lock(active_mutex());
  return active_slot();
}

std::shared_ptr<Selector> set_active_selector(std::shared_ptr<Selector> selector) {
  std::lock_guard<std::mutex> lock(active_mutex());
  std::swap(active_slot(), selector);
  active_generation().fetch_add(1, std::memory_order_release);
  return selector;
}

Selector* active_selector_for_this_thread() {
  thread_local uint64_t seen = 0;
  thread_local std::shared_ptr<Selector> copy;
  const uint64_t now = active_generation().load(std::memory_order_acquire);
  if (now != seen) {
    std::lock_guard<std::mutex> lock(active_mutex());
    copy = active_slot();
    seen = active_generation().load(std::memory_order_relaxed);
  }
  return copy.get();
}

}  // namespace terra::profile
