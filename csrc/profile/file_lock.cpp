// flock-based FileLock; see file_lock.h.
#include "profile/file_lock.h"

#include <cerrno>
#include <system_error>

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

namespace terra::profile {

FileLock::FileLock(const std::string& lock_path) {
  fd_ = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "cannot open lock file " + lock_path);
  while (::flock(fd_, LOCK_EX) != 0) {
    if (errno == EINTR) continue;  // a signal interrupted the wait; keep waiting
    int err = errno;
    ::close(fd_);
    throw std::system_error(err, std::generic_category(), "cannot lock " + lock_path);
  }
}

FileLock::~FileLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
}

std::string lock_path_for(const std::string& record_path) { return record_path + ".lock"; }

}  // namespace terra::profile
