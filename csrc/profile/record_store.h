// The record file of one process: loaded once, consulted in memory, and saved by merging with
// whatever other processes wrote meanwhile. Several jobs (data-parallel ranks, a sweep) commonly
// share one record, so a save takes the file lock, re-reads the file, merges, and replaces it
// atomically; nobody's entries are lost and readers never see a partial file. A file that cannot
// be used (corrupt, other format version, other device) is reported, ignored, and on the next
// save moved aside to "<path>.bak" before a fresh record is written.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "profile/diagnostic.h"
#include "profile/entry.h"
#include "profile/file_io.h"
#include "profile/record_header.h"

namespace terra::profile {

class RecordStore {
 public:
  // An empty path keeps the record in memory only.
  RecordStore(std::string path, RecordHeader current);

  const std::string& path() const { return path_; }
  const RecordHeader& header() const { return current_; }

  // Replaces the in-memory entries with the file's (unsaved entries of this process are kept).
  Diagnostics load();

  // True when another process replaced the file since this one last read or wrote it.
  bool changed_on_disk() const;

  const Entry* find(const ConvKey& key) const;
  void put(Entry entry);  // in memory, marked unsaved
  std::vector<Entry> entries() const;
  size_t unsaved() const { return unsaved_.size(); }

  // Lock, re-read, merge (this process's unsaved entries win, then the file's, then the rest of
  // memory), write atomically. Failures are reported and the entries stay unsaved. Nothing
  // unsaved: nothing is written.
  Diagnostics save();

 private:
  struct Disk {
    bool usable = false;         // exists and belongs to this format and device
    bool unusable_file = false;  // exists but must be ignored
    std::vector<Entry> entries;
    Diagnostics notes;
  };
  Disk read_disk() const;

  std::string path_;
  RecordHeader current_;
  std::map<std::string, Entry> entries_;  // by key id
  std::map<std::string, Entry> unsaved_;
  std::optional<FileStamp> stamp_;
  bool warned_save_failure_ = false;
};

}  // namespace terra::profile
