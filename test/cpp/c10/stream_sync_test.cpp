// StreamSync's protocol against a recording fake device (links libc10 only, no GPU needed).
//
// The fake models what stream ordering guarantees with vector clocks: a kernel launched on a
// stream advances that stream's own entry; recording an event snapshots the stream's clock;
// blocking a stream on an event merges the snapshot into it. Work A on stream S is ordered
// before a later point of stream T exactly when T's clock has S's entry at or past A. So a
// skipped record, a skipped block, a block before its record, or an event on the wrong stream
// all leave the consumer's clock behind the producer's work, and the checks below fail.
#include "runtime/stream_sync.h"

#include <gtest/gtest.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

namespace terra::runtime {
namespace {

using c10::Device;
using c10::DeviceType;
using c10::Stream;
using Clock = std::map<c10::StreamId, int64_t>;

constexpr DeviceType kFake = DeviceType::PrivateUse1;

struct Work {  // a kernel: the stream it ran on and that stream's clock entry after it
  c10::StreamId stream;
  int64_t tick;
};

class FakeDevice final : public c10::impl::DeviceGuardImplInterface {
 public:
  explicit FakeDevice(DeviceType type, bool pool = true) : type_(type), pool_(pool) {}

  // ---- what tests look at ----
  Work launch(const Stream& s) {
    std::lock_guard lock(mu_);
    return {s.id(), ++clocks_[s.id()][s.id()]};
  }
  bool ordered_before(const Work& w, const Stream& later) {
    std::lock_guard lock(mu_);
    return clocks_[later.id()][w.stream] >= w.tick;
  }
  int64_t calls() {
    std::lock_guard lock(mu_);
    return calls_;
  }
  std::set<c10::StreamId> pool_streams() {
    std::lock_guard lock(mu_);
    return pool_ids_;
  }
  std::vector<std::pair<const void*, c10::StreamId>> data_ptr_records() {
    std::lock_guard lock(mu_);
    return data_ptrs_;
  }
  std::vector<c10::StreamId> recorded_on() {  // stream of every event record, in order
    std::lock_guard lock(mu_);
    return recorded_on_;
  }
  std::vector<c10::StreamId> blocked() {  // stream of every block, in order
    std::lock_guard lock(mu_);
    return blocked_;
  }
  // Another stream the user could make current (like torch.cuda.Stream()).
  Stream user_stream(c10::DeviceIndex index = 0) { return Stream(Stream::UNSAFE, Device(type_, index), 900 + index); }

  // ---- DeviceGuardImplInterface ----
  DeviceType type() const override { return type_; }
  Device exchangeDevice(Device d) const override {
    count();
    return Device(type_, std::exchange(tls_device(), d.index()));
  }
  Device getDevice() const override {
    count();
    return Device(type_, tls_device());
  }
  void setDevice(Device d) const override {
    count();
    tls_device() = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override {
    count();
    tls_device() = d.index();
  }
  Stream getStream(Device d) const override {
    count();
    auto it = tls_streams().find(d.index());
    return it == tls_streams().end() ? Stream(Stream::DEFAULT, d) : it->second;
  }
  Stream getDefaultStream(Device d) const override {
    count();
    return Stream(Stream::DEFAULT, d);
  }
  Stream getStreamFromGlobalPool(Device d, bool = false) const override {
    count();
    if (!pool_) throw c10::Error({__func__, __FILE__, __LINE__}, "no streams on this fake");
    std::lock_guard lock(mu_);
    const c10::StreamId id = 100 + static_cast<c10::StreamId>(pool_ids_.size());
    pool_ids_.insert(id);
    return Stream(Stream::UNSAFE, d, id);
  }
  Stream exchangeStream(Stream s) const override {
    Stream old = getStream(s.device());
    tls_streams().insert_or_assign(s.device_index(), s);
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 2; }
  void record(void** event, const Stream& s, const c10::DeviceIndex, const c10::EventFlag) const override {
    count();
    std::lock_guard lock(mu_);
    if (*event == nullptr) *event = reinterpret_cast<void*>(static_cast<intptr_t>(++next_event_));
    events_[*event] = clocks_[s.id()];
    recorded_on_.push_back(s.id());
  }
  void block(void* event, const Stream& s) const override {
    count();
    std::lock_guard lock(mu_);
    blocked_.push_back(s.id());
    Clock& mine = clocks_[s.id()];
    for (const auto& [stream, tick] : events_.at(event)) mine[stream] = std::max(mine[stream], tick);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    count();
    std::lock_guard lock(mu_);
    events_.erase(event);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data, const Stream& s) const override {
    count();
    std::lock_guard lock(mu_);
    data_ptrs_.emplace_back(data.get(), s.id());
  }

 private:
  void count() const {
    std::lock_guard lock(mu_);
    ++calls_;
  }
  // Thread-local like a real backend's current device and streams (one map per fake type is
  // enough: each test thread talks to one fake).
  static c10::DeviceIndex& tls_device() {
    thread_local c10::DeviceIndex d = 0;
    return d;
  }
  static std::map<c10::DeviceIndex, Stream>& tls_streams() {
    thread_local std::map<c10::DeviceIndex, Stream> s;
    return s;
  }

  DeviceType type_;
  bool pool_;
  mutable std::mutex mu_;
  mutable int64_t calls_ = 0;
  mutable intptr_t next_event_ = 0;
  mutable std::set<c10::StreamId> pool_ids_;
  mutable std::map<c10::StreamId, Clock> clocks_;
  mutable std::map<void*, Clock> events_;
  mutable std::vector<std::pair<const void*, c10::StreamId>> data_ptrs_;
  mutable std::vector<c10::StreamId> recorded_on_, blocked_;
};

// Leaked on purpose, as c10's registry requires. CPU gets a fake too: libc10 alone registers no
// CPU guard, and a fake one would see any call StreamSync made for a CPU program.
FakeDevice* const fake = new FakeDevice(kFake);
FakeDevice* const fake_cpu = new FakeDevice(DeviceType::CPU);
FakeDevice* const fake_no_streams = new FakeDevice(DeviceType::IPU, /*pool=*/false);
const c10::impl::DeviceGuardImplRegistrar register_fake(kFake, fake);
const c10::impl::DeviceGuardImplRegistrar register_cpu(DeviceType::CPU, fake_cpu);
const c10::impl::DeviceGuardImplRegistrar register_no_streams(DeviceType::IPU, fake_no_streams);

// The last element, or a value no stream or pointer has when there is none (a skipped call fails
// the comparison instead of reading past the end).
template <typename T>
T last(const std::vector<T>& v, T none) {
  return v.empty() ? none : v.back();
}

// Runs `f` on a new thread, as the GraphRunner's worker runs the graph.
template <typename F>
void on_worker(F f) {
  std::thread t(f);
  t.join();
}

// The Python thread's current stream is a user stream for the scope (torch.cuda.stream(s)).
struct UserStream {
  explicit UserStream(Stream s) : saved(fake->exchangeStream(s)) {}
  ~UserStream() { fake->exchangeStream(saved); }
  Stream saved;
};

TEST(StreamSync, WorkerRunsOnAPoolStreamMadeCurrentForTheRun) {
  StreamSync sync(Device(kFake, 1));
  ASSERT_TRUE(sync.active());
  const Stream worker = sync.worker_stream();
  EXPECT_EQ(worker.device(), Device(kFake, 1));
  EXPECT_TRUE(fake->pool_streams().count(worker.id()));
  EXPECT_NE(worker, fake->getStream(Device(kFake, 1)));  // not the poster's (default) stream

  on_worker([&] {
    const Stream before = fake->getStream(Device(kFake, 1));
    EXPECT_EQ(fake->getDevice().index(), 0);
    {
      StreamSync::WorkerScope scope(sync);
      EXPECT_EQ(fake->getStream(Device(kFake, 1)), worker);
      EXPECT_EQ(fake->getDevice().index(), 1);  // factories without an index land there too
    }
    EXPECT_EQ(fake->getStream(Device(kFake, 1)), before);
    EXPECT_EQ(fake->getDevice().index(), 0);
  });
}

TEST(StreamSync, WorkerStreamWaitsForWhatThePosterIssuedBeforeItPosted) {
  StreamSync sync(Device(kFake, 0));
  UserStream user(fake->user_stream());
  const Work feed_producer = fake->launch(fake->user_stream());
  const size_t records = fake->recorded_on().size();
  const StreamMark mark = sync.mark_poster();
  ASSERT_NE(mark, nullptr);
  ASSERT_EQ(fake->recorded_on().size(), records + 1);
  EXPECT_EQ(last(fake->recorded_on(), c10::StreamId(-1)), fake->user_stream().id());  // the poster's current stream
  const Work after_post = fake->launch(fake->user_stream());

  on_worker([&] {
    StreamSync::WorkerScope scope(sync);
    EXPECT_FALSE(fake->ordered_before(feed_producer, sync.worker_stream()));
    sync.worker_waits(mark);
    EXPECT_EQ(last(fake->blocked(), c10::StreamId(-1)), sync.worker_stream().id());
    EXPECT_TRUE(fake->ordered_before(feed_producer, sync.worker_stream()));
    // Only what was issued before the post: the graph does not wait for Python's later work.
    EXPECT_FALSE(fake->ordered_before(after_post, sync.worker_stream()));
    sync.worker_waits(nullptr);  // a post that needed no event
  });
}

TEST(StreamSync, FeedMemoryIsRecordedOnTheWorkerStream) {
  StreamSync sync(Device(kFake, 0));
  int on_device = 0, elsewhere = 0, other_index = 0;
  const size_t before = fake->data_ptr_records().size();
  sync.worker_uses(c10::DataPtr(&on_device, Device(kFake, 0)));
  sync.worker_uses(c10::DataPtr(&elsewhere, Device(DeviceType::CPU)));
  sync.worker_uses(c10::DataPtr(&other_index, Device(kFake, 1)));
  const auto records = fake->data_ptr_records();
  ASSERT_EQ(records.size(), before + 1);
  EXPECT_EQ(last(records, std::make_pair(static_cast<const void*>(nullptr), c10::StreamId(-1))), std::make_pair(static_cast<const void*>(&on_device), sync.worker_stream().id()));
}

TEST(StreamSync, ReaderStreamWaitsForTheGraphsWorkAndKeepsTheMemory) {
  StreamSync sync(Device(kFake, 0));
  UserStream user(fake->user_stream());
  Work value_producer{};
  on_worker([&] {
    StreamSync::WorkerScope scope(sync);
    value_producer = fake->launch(fake->getStream(Device(kFake, 0)));  // the graph's kernel
  });
  EXPECT_EQ(value_producer.stream, sync.worker_stream().id());
  EXPECT_FALSE(fake->ordered_before(value_producer, fake->user_stream()));
  sync.reader_joins();
  EXPECT_EQ(last(fake->recorded_on(), c10::StreamId(-1)), sync.worker_stream().id());
  EXPECT_EQ(last(fake->blocked(), c10::StreamId(-1)), fake->user_stream().id());
  EXPECT_TRUE(fake->ordered_before(value_producer, fake->user_stream()));

  int value = 0;
  sync.reader_uses(c10::DataPtr(&value, Device(kFake, 0)));
  EXPECT_EQ(last(fake->data_ptr_records(), std::make_pair(static_cast<const void*>(nullptr), c10::StreamId(-1))), std::make_pair(static_cast<const void*>(&value), fake->user_stream().id()));
}

TEST(StreamSync, JoinOnExitJoinsOnlyWhenTheScopeEndsNormally) {
  StreamSync sync(Device(kFake, 0));
  UserStream user(fake->user_stream());
  Work w{};
  on_worker([&] {
    StreamSync::WorkerScope scope(sync);
    w = fake->launch(sync.worker_stream());
  });
  try {
    StreamSync::JoinOnExit join(sync);
    throw std::runtime_error("the wait failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(fake->ordered_before(w, fake->user_stream()));
  { StreamSync::JoinOnExit join(sync); }
  EXPECT_TRUE(fake->ordered_before(w, fake->user_stream()));
}

TEST(StreamSync, CpuProgramsMakeNoDeviceCalls) {
  const int64_t cpu_calls = fake_cpu->calls(), device_calls = fake->calls();
  StreamSync sync(Device(DeviceType::CPU));
  EXPECT_FALSE(sync.active());
  EXPECT_EQ(sync.mark_poster(), nullptr);
  on_worker([&] {
    StreamSync::WorkerScope scope(sync);
    sync.worker_waits(nullptr);
    int x = 0;
    sync.worker_uses(c10::DataPtr(&x, Device(DeviceType::CPU)));
  });
  sync.reader_joins();
  int y = 0;
  sync.reader_uses(c10::DataPtr(&y, Device(DeviceType::CPU)));
  { StreamSync::JoinOnExit join(sync); }
  EXPECT_FALSE(StreamSync::for_devices(std::vector<Device>{Device(DeviceType::CPU), Device(DeviceType::CPU)}).active());
  EXPECT_EQ(fake_cpu->calls(), cpu_calls);
  EXPECT_EQ(fake->calls(), device_calls);
}

TEST(StreamSync, PicksTheOneAcceleratorOfAProgram) {
  const std::vector<Device> mixed{Device(DeviceType::CPU), Device(kFake, 1), Device(DeviceType::CPU)};
  const StreamSync one = StreamSync::for_devices(mixed);
  ASSERT_TRUE(one.active());
  EXPECT_EQ(one.worker_stream().device(), Device(kFake, 1));
  // Two devices: one worker stream cannot order both, so the policy is off.
  EXPECT_FALSE(StreamSync::for_devices(std::vector<Device>{Device(kFake, 0), Device(kFake, 1)}).active());
  EXPECT_FALSE(StreamSync::for_devices(std::vector<Device>{}).active());
}

TEST(StreamSync, BackendWithoutPoolStreamsStaysInactive) {
  StreamSync sync(Device(DeviceType::IPU, 0));
  EXPECT_FALSE(sync.active());
  const int64_t calls = fake_no_streams->calls();
  EXPECT_EQ(sync.mark_poster(), nullptr);
  sync.reader_joins();
  EXPECT_EQ(fake_no_streams->calls(), calls);
}

}  // namespace
}  // namespace terra::runtime
