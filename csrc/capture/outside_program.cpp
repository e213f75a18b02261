#include "capture/outside_program.h"

#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <mutex>
#include <optional>
#include <vector>

#include "common/flat_map.h"

namespace terra::capture {

namespace detail {
thread_local int outside_program_depth = 0;
}  // namespace detail

namespace {

using detail::outside_program_depth;
// Addresses only, compared while the block runs (its tensors are alive in the block's frames;
// an address reused after one died belongs to another tensor made in the block, or to one that
// fails Region::runs_outside's other conditions first).
thread_local std::vector<const c10::StorageImpl*> t_made;

// Written by the ops of any thread that records (the autograd engine's too), read by the thread
// in a block: under a lock of its own.
struct ProgramWrites {
  std::mutex mu;
  common::FlatMap<const c10::StorageImpl*, std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>> storages{64};
  size_t pruned = 0;
};

ProgramWrites& program_writes() {
  static ProgramWrites* writes = new ProgramWrites();  // (never destroyed: threads may outlive exit)
  return *writes;
}

}  // namespace

OutsideProgram::OutsideProgram() { ++outside_program_depth; }

OutsideProgram::~OutsideProgram() {
  if (--outside_program_depth == 0) t_made.clear();
}

void note_made_outside(const c10::StorageImpl* storage) {
  if (outside_program_depth > 0 && storage != nullptr) t_made.push_back(storage);
}

bool made_outside(const c10::StorageImpl* storage) {
  return storage != nullptr && std::find(t_made.begin(), t_made.end(), storage) != t_made.end();
}

void note_program_write(const c10::Storage& storage) {
  ProgramWrites& w = program_writes();
  std::lock_guard<std::mutex> lock(w.mu);
  auto [entry, fresh] = w.storages.try_emplace(storage.unsafeGetStorageImpl());
  if (!fresh) return;
  entry->emplace(storage.getWeakStorageImpl());
  if (w.storages.size() >= 2 * w.pruned + 64) {
    w.storages.erase_if([](const c10::StorageImpl*, const std::optional<c10::weak_intrusive_ptr<c10::StorageImpl>>& p) {
      return p->expired();
    });
    w.pruned = w.storages.size();
  }
}

bool program_wrote(const c10::StorageImpl* storage) {
  ProgramWrites& w = program_writes();
  std::lock_guard<std::mutex> lock(w.mu);
  return w.storages.find(storage) != nullptr;
}

}  // namespace terra::capture
