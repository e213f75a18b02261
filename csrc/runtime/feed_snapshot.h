// Feeds of memory Python can write without an op.
//
// The graph reads a fed tensor when it gets there, which in co-execution is later than the
// Python line that passed it. For memory only torch ops write that is the same value: every
// write is an op, and ops run in program order on the graph. A tensor over memory torch did not
// allocate (torch.from_numpy, torch.frombuffer, a DLPack import) can be overwritten by Python
// without an op, and programs do: one numpy buffer refilled each step (`buf[:] = batch`), fed
// as `torch.from_numpy(buf)`. The graph then read the next step's batch. Such a feed is a copy
// made when Python validated the read, which is when eager read it, unless the graph writes
// that memory (emit/written_feeds.h): a copy would hide the write from the array.
//
// Order within the graph matters too: once the graph writes a tensor over such memory (a feed
// it writes, `x[0].mul_(0.5)`), a later feed over the same memory must see that write, which a
// copy taken now, before the graph got there, would not. So memory fed to a written slot is fed
// as it is from then on, while it lives.
//
// Memory torch allocated becomes such memory once Python is handed it as an array
// (note_exported_memory): before, the graph read a replay buffer that Python had already refilled
// through `buf.numpy()`. An array taken before terra_torch was imported is not seen.
//
// Python's own views of such memory are adopted, never given the graph's copy
// (PlaceholderImpl::over_memory). Not covered: memory the graph writes that Python then
// overwrites before the graph got there (docs/RUNTIME.md, "Memory Python writes without an op").
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace terra::runtime {

// Memory Python can write without an op: memory torch did not allocate and that is not shared
// memory from another process (a DataLoader worker's batch, which nothing overwrites), a CPU
// storage without an allocator; and memory torch allocated that Python was handed as an array
// (note_exported_memory).
bool python_writable_memory(const at::Tensor& t);

// `holder`'s memory was handed to Python as an array (`t.numpy()`, `np.asarray(t)`,
// `t.__dlpack__()`): writes through that array are no ops (a replay buffer `buf =
// torch.zeros(...)` refilled through `buf.numpy()[:] = ...`), so while `holder` lives (the array's
// base, which the array keeps alive; or the tensor itself) and still holds that storage, the
// memory is treated as memory torch did not allocate. Any thread; terra_torch/_materialize.py
// calls it for every such export.
void note_exported_memory(const at::Tensor& holder);

// Memory the graph writes, as address ranges of storages (python_writable_memory only: rare):
// two storages can hold the same memory (`torch.from_dlpack(buf)`, `torch.as_tensor(buf.numpy())`),
// and what is known of one must see the graph's write through the other. Each range holds its
// storage weakly: a storage that died frees its address for other memory. Asked by the feeds
// (FeedValues) and by the known values (KnownValues::ever_written). One thread.
class WrittenMemory {
 public:
  void note(const c10::Storage& storage);
  bool overlaps(const c10::Storage& storage) const;
  bool empty() const { return ranges_.empty(); }

 private:
  struct Range {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    const char* begin;
    const char* end;
  };
  std::vector<Range> ranges_;
};

// What the feeds of one PythonRunner hand the graph. Python thread only.
class FeedValues {
 public:
  // `t` itself, or a copy of its elements now (same sizes, strides and math bits) where Python
  // may overwrite its memory and the graph does not write it. `graph_writes`: the slot's
  // FeedSlot::written.
  at::Tensor value(const at::Tensor& t, bool graph_writes);

 private:
  WrittenMemory written_;  // memory fed to slots the graph writes
};

}  // namespace terra::runtime
