// Loading, merging and saving of record files; see record_store.h for the rules.
#include "profile/record_store.h"

#include <cstdio>
#include <exception>

#include "profile/file_lock.h"
#include "profile/record_json.h"

namespace terra::profile {

RecordStore::RecordStore(std::string path, RecordHeader current)
    : path_(std::move(path)), current_(std::move(current)) {}

RecordStore::Disk RecordStore::read_disk() const {
  Disk disk;
  FileRead file = read_file(path_);
  if (!file.exists) return disk;
  if (!file.error.empty()) {
    disk.unusable_file = true;
    disk.notes.push_back(warning("cannot read profile record " + path_ + ": " + file.error));
    return disk;
  }
  Decoded decoded = decode(file.bytes);
  if (decoded.status != DecodeStatus::ok) {
    disk.unusable_file = true;
    const char* what = decoded.status == DecodeStatus::outdated       ? "outdated"
                       : decoded.status == DecodeStatus::incompatible ? "incompatible"
                                                                       : "corrupt";
    std::string why = decoded.problems.empty() ? "" : ": " + decoded.problems.front();
    disk.notes.push_back(warning(std::string("profile record ") + path_ + " is " + what + why +
                                 "; it is ignored and convolutions are profiled again"));
    return disk;
  }
  if (auto mismatch = device_mismatch(decoded.record.header, current_)) {
    disk.unusable_file = true;
    disk.notes.push_back(warning("profile record " + path_ + " belongs to another device: " +
                                 *mismatch + "; its " + std::to_string(decoded.record.entries.size()) +
                                 " entries are ignored"));
    return disk;
  }
  for (const std::string& problem : decoded.problems)
    disk.notes.push_back(warning("profile record " + path_ + ": " + problem));
  disk.usable = true;
  disk.entries = std::move(decoded.record.entries);
  return disk;
}

Diagnostics RecordStore::load() {
  if (path_.empty()) return {};
  stamp_ = stamp_of(path_);  // before reading: a write that races the read shows up as a change
  Disk disk = read_disk();
  Diagnostics out = std::move(disk.notes);
  entries_.clear();
  for (Entry& e : disk.entries) entries_[e.key.id()] = std::move(e);
  for (const auto& [id, e] : unsaved_) entries_[id] = e;
  if (disk.usable)
    out.push_back(info("loaded " + std::to_string(disk.entries.size()) + " entries from profile record " +
                       path_));
  return out;
}

bool RecordStore::changed_on_disk() const {
  if (path_.empty()) return false;
  return stamp_of(path_) != stamp_;
}

const Entry* RecordStore::find(const ConvKey& key) const {
  auto it = entries_.find(key.id());
  return it == entries_.end() ? nullptr : &it->second;
}

void RecordStore::put(Entry entry) {
  std::string id = entry.key.id();
  entries_[id] = entry;
  unsaved_[id] = std::move(entry);
}

std::vector<Entry> RecordStore::entries() const {
  std::vector<Entry> out;
  for (const auto& [id, e] : entries_) out.push_back(e);
  return out;
}

Diagnostics RecordStore::save() {
  if (path_.empty() || unsaved_.empty()) {
    unsaved_.clear();
    return {};
  }
  Diagnostics out;
  try {
    FileLock lock(lock_path_for(path_));
    const bool changed = stamp_of(path_) != stamp_;
    Disk disk = read_disk();
    // The same file was already reported when it was loaded; only a new one is worth a word.
    if (changed)
      for (Diagnostic& d : disk.notes) out.push_back(std::move(d));
    std::map<std::string, Entry> merged = entries_;
    size_t from_others = 0;
    for (Entry& e : disk.entries) {
      std::string id = e.key.id();
      if (!entries_.count(id)) ++from_others;
      merged[id] = std::move(e);
    }
    for (const auto& [id, e] : unsaved_) merged[id] = e;
    if (disk.unusable_file) {
      std::string backup = path_ + ".bak";
      if (std::rename(path_.c_str(), backup.c_str()) == 0)
        out.push_back(warning("the unusable profile record was moved to " + backup));
    }
    Record record{current_, {}};
    for (const auto& [id, e] : merged) record.entries.push_back(e);
    replace_file_atomically(path_, encode(record));
    stamp_ = stamp_of(path_);  // still under the lock: this is our own write
    out.push_back(debug("saved " + std::to_string(unsaved_.size()) + " new entries to profile record " + path_ +
                       " (" + std::to_string(record.entries.size()) + " in all, " +
                       std::to_string(from_others) + " added by other processes)"));
    entries_ = std::move(merged);
    unsaved_.clear();
  } catch (const std::exception& e) {
    if (!warned_save_failure_)
      out.push_back(warning(std::string("cannot save profile record: ") + e.what() +
                            "; profiles are kept in memory for this process only"));
    warned_save_failure_ = true;
  }
  return out;
}

}  // namespace terra::profile
