// Reading a record file and replacing it atomically. Readers never take the lock, so a writer must
// never leave a half-written record under the real name: it writes a temporary file in the same
// directory, flushes it to disk, and renames it over the record (rename is atomic on POSIX).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace terra::profile {

struct FileRead {
  bool exists = false;
  std::string bytes;
  std::string error;  // set when the file exists but cannot be read
};

FileRead read_file(const std::string& path);

// Throws std::system_error on failure; the record is then left as it was.
void replace_file_atomically(const std::string& path, std::string_view bytes);

// What tells us another process replaced the file since we last read it (an inode change after
// rename, or a new mtime or size). nullopt when the file does not exist.
struct FileStamp {
  uint64_t inode = 0;
  int64_t mtime_ns = 0;
  int64_t size = 0;
  bool operator==(const FileStamp&) const = default;
};

std::optional<FileStamp> stamp_of(const std::string& path);

}  // namespace terra::profile
