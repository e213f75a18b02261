// StreamSync: the worker stream and the events of co-execution's hand-overs (stream_sync.h).
#include "runtime/stream_sync.h"

#include <c10/util/Exception.h>

#include <optional>

namespace terra::runtime {

StreamSync::StreamSync(c10::Device device) {
  if (device.is_cpu() || !c10::impl::hasDeviceGuardImpl(device.type())) return;
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(device.type());
  if (!device.has_index()) device = c10::Device(device.type(), impl->getDevice().index());
  try {
    // A pool stream, not the default one: on CUDA the legacy default stream would serialize the
    // graph with every other stream of the device, the user's included.
    worker_ = impl->getStreamFromGlobalPool(device);
  } catch (const c10::Error&) {
    return;  // a backend without streams: its work is ordered already
  }
  impl_ = impl;
}

StreamSync StreamSync::for_devices(std::span<const c10::Device> devices) {
  std::optional<c10::Device> found;
  for (const c10::Device& d : devices) {
    if (d.is_cpu() || d.is_meta()) continue;
    if (found && *found != d) return StreamSync();
    found = d;
  }
  return found ? StreamSync(*found) : StreamSync();
}

StreamMark StreamSync::mark_poster() const {
  if (!active()) return nullptr;
  auto event = std::make_shared<c10::Event>(worker_.device_type());
  event->record(impl_->getStream(worker_.device()));
  return event;
}

StreamSync::WorkerScope::WorkerScope(const StreamSync& sync) : impl_(sync.impl_) {
  if (impl_ == nullptr) return;
  saved_device_ = impl_->exchangeDevice(sync.worker_.device());
  saved_stream_ = impl_->exchangeStream(sync.worker_);
}

StreamSync::WorkerScope::~WorkerScope() {
  if (impl_ == nullptr) return;
  impl_->exchangeStream(saved_stream_);
  impl_->uncheckedSetDevice(saved_device_);
}

void StreamSync::worker_waits(const StreamMark& mark) const {
  if (active() && mark) mark->block(worker_);
}

void StreamSync::worker_uses(const c10::DataPtr& data) const {
  if (covers(data.device())) impl_->recordDataPtrOnStream(data, worker_);
}

void StreamSync::reader_joins() const {
  if (!active()) return;
  const c10::Stream reader = impl_->getStream(worker_.device());
  if (reader == worker_) return;  // the user made the worker stream current: ordered already
  c10::Event event(worker_.device_type());
  event.record(worker_);
  event.block(reader);
}

void StreamSync::reader_uses(const c10::DataPtr& data) const {
  if (!covers(data.device())) return;
  const c10::Stream reader = impl_->getStream(worker_.device());
  if (reader != worker_) impl_->recordDataPtrOnStream(data, reader);
}

}  // namespace terra::runtime
