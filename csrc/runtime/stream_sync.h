// Why this exists: co-execution hands tensors between two threads, the user's Python thread and
// the GraphRunner's worker. On a device with streams (CUDA, or any backend whose guard impl has a
// stream pool) each thread issues work on its own *current* stream, and work on two streams is
// unordered unless an event orders it. The graph therefore runs on a stream of its own, taken
// from the device's pool, and every hand-over carries an event:
//   Python posts feeds / gates / an iteration  -> event on Python's current stream, the worker
//                                                 stream waits on it before using them;
//   Python reads what the graph computed        -> event on the worker stream, Python's current
//                                                 stream waits on it (no host sync);
//   memory crosses streams                      -> the caching allocator is told the other stream
//                                                 uses it, so it is not reused too early.
// CPU programs (and programs on several accelerators, which keep the old behaviour: the worker
// thread's current streams) get an inactive StreamSync: every call returns at its first branch.
// Only c10 headers, so that this compiles fast and its test links libc10 alone (docs/RUNTIME.md,
// "Streams").
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <exception>
#include <memory>
#include <span>

namespace terra::runtime {

// An event a producing stream left for a consuming one; null when there is nothing to wait for.
// Shared, because one event covers a whole batch of posts.
using StreamMark = std::shared_ptr<const c10::Event>;

class StreamSync {
 public:
  StreamSync() = default;  // inactive
  // Active for `device` when its backend hands out pool streams; inactive otherwise (CPU).
  explicit StreamSync(c10::Device device);
  // For a program whose tensors live on `devices`: the single non-CPU device among them, else
  // inactive (none: a CPU program; several: one worker stream could not order them all).
  static StreamSync for_devices(std::span<const c10::Device> devices);

  bool active() const { return impl_ != nullptr; }
  // Whether memory on `device` is handed over with events (the worker stream's device only).
  bool covers(c10::Device device) const { return active() && device == worker_.device(); }
  // The stream the graph runs on; the default CPU stream when inactive.
  c10::Stream worker_stream() const { return worker_; }

  // ---- the posting thread (Python): before what it posts reaches the worker ----
  // An event after the work the caller's current stream has been given so far (which produced
  // what the caller is about to post). Null when inactive.
  StreamMark mark_poster() const;

  // ---- the worker thread ----
  // The worker stream (and its device) is current on this thread for the scope: every kernel
  // the graph launches goes there.
  class WorkerScope {
   public:
    explicit WorkerScope(const StreamSync& sync);
    ~WorkerScope();
    WorkerScope(const WorkerScope&) = delete;
    WorkerScope& operator=(const WorkerScope&) = delete;

   private:
    const c10::impl::DeviceGuardImplInterface* impl_;
    c10::Device saved_device_ = c10::Device(c10::kCPU);
    c10::Stream saved_stream_ = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
  };
  // The worker stream waits for `mark` (null: nothing to wait for) before it uses what came
  // with it.
  void worker_waits(const StreamMark& mark) const;
  // Memory the poster's stream allocated and the worker stream now reads: the allocator must not
  // hand it out again before the worker stream's work on it is done.
  void worker_uses(const c10::DataPtr& data) const;

  // ---- the reading thread (Python), after the graph has issued what Python reads ----
  // The caller's current stream waits for everything issued on the worker stream so far. Python
  // only reads after the graph published every value Python validated, so this covers the
  // values read, and it costs one event per read instead of one per published value.
  void reader_joins() const;
  // Memory the worker stream allocated and the caller's current stream now uses.
  void reader_uses(const c10::DataPtr& data) const;

  // reader_joins() when the scope ends normally, not when it unwinds (a failed wait read nothing).
  class JoinOnExit {
   public:
    explicit JoinOnExit(const StreamSync& sync) : sync_(sync), exceptions_(std::uncaught_exceptions()) {}
    ~JoinOnExit() noexcept(false) {
      if (sync_.active() && std::uncaught_exceptions() == exceptions_) sync_.reader_joins();
    }
    JoinOnExit(const JoinOnExit&) = delete;
    JoinOnExit& operator=(const JoinOnExit&) = delete;

   private:
    const StreamSync& sync_;
    int exceptions_;
  };

 private:
  const c10::impl::DeviceGuardImplInterface* impl_ = nullptr;  // null: inactive
  c10::Stream worker_ = c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
};

}  // namespace terra::runtime
