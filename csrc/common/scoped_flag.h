// A thread-local flag set for a scope: true while the guard lives, its previous value again on
// every path out (an exception included), so scopes nest. Each use names what the flag means
// (capture/region.cpp, HandlingOnThisThread; capture/host_filled_tensors.cpp, HostFactories).
#pragma once

namespace terra::common {

class ScopedFlag {
 public:
  explicit ScopedFlag(bool& flag) : flag_(flag), before_(flag) { flag = true; }
  ~ScopedFlag() { flag_ = before_; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;

 private:
  bool& flag_;
  bool before_;
};

}  // namespace terra::common
