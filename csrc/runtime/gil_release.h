// Why this exists: runtime code blocks (waiting for a graph, running one) on threads that may
// hold the GIL, and while it blocks another thread may need the GIL, for instance to free a
// tensor whose Python object C++ kept alive. Releasing only when held lets the same code run on
// Python threads and on the runtime's own workers, and before or after the interpreter exists.
#pragma once

#include <Python.h>

namespace terra::runtime {

// Releases the GIL for the scope if this thread holds it.
class GilRelease {
 public:
  GilRelease() {
    if (Py_IsInitialized() && PyGILState_Check()) state_ = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state_ != nullptr) PyEval_RestoreThread(state_);
  }
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

}  // namespace terra::runtime
