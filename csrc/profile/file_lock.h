// An exclusive advisory lock (flock) on a sidecar file, held while a record is read, merged and
// replaced. The lock lives on "<record>.lock" rather than on the record itself because the record
// is replaced by rename: a lock on the old inode would not exclude a writer that opened the new
// one. The sidecar is never deleted, for the same reason.
#pragma once

#include <string>

namespace terra::profile {

class FileLock {
 public:
  // Blocks until the lock is held. Throws std::system_error when the lock file cannot be opened.
  explicit FileLock(const std::string& lock_path);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

std::string lock_path_for(const std::string& record_path);

}  // namespace terra::profile
