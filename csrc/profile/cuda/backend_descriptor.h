// RAII and typed attribute access over cuDNN's backend (graph) API descriptors
// (cudnnBackendCreateDescriptor / SetAttribute / GetAttribute / Finalize / Destroy, cudnn_graph.h).
// Only cudnn.h is needed: no torch, no cudnn-frontend (docs/PROFILE_RECORD.md says why).
#pragma once

#include <cudnn.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace terra::profile::cuda {

// A failed cuDNN call, with the status kept so that callers can tell "not supported" from a
// real error (RunStatus in provider.h).
class CudnnError : public std::runtime_error {
 public:
  CudnnError(cudnnStatus_t status, const std::string& what)
      : std::runtime_error(what + ": " + cudnnGetErrorString(status)), status(status) {}
  const cudnnStatus_t status;
};

inline void check(cudnnStatus_t status, const char* what) {
  if (status != CUDNN_STATUS_SUCCESS) throw CudnnError(status, what);
}

class Descriptor {
 public:
  Descriptor() = default;
  explicit Descriptor(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &desc_), "cudnnBackendCreateDescriptor");
  }
  ~Descriptor() { reset(); }
  Descriptor(Descriptor&& other) noexcept : desc_(std::exchange(other.desc_, nullptr)) {}
  Descriptor& operator=(Descriptor&& other) noexcept {
    if (this != &other) {
      reset();
      desc_ = std::exchange(other.desc_, nullptr);
    }
    return *this;
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;

  cudnnBackendDescriptor_t get() const { return desc_; }
  explicit operator bool() const { return desc_ != nullptr; }

  template <typename T>
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values,
                  int64_t count, const char* what) {
    check(cudnnBackendSetAttribute(desc_, name, type, count, values), what);
    return *this;
  }
  template <typename T>
  Descriptor& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T& value,
                  const char* what) {
    return set(name, type, &value, 1, what);
  }
  Descriptor& set(cudnnBackendAttributeName_t name, const Descriptor& value, const char* what) {
    cudnnBackendDescriptor_t raw = value.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw, 1, what);
  }
  Descriptor& finalize(const char* what) {
    check(cudnnBackendFinalize(desc_), what);
    return *this;
  }
  // Finalize that reports instead of throwing: "this configuration does not build" is an answer.
  cudnnStatus_t try_finalize() { return cudnnBackendFinalize(desc_); }

  template <typename T>
  T get_scalar(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const char* what) const {
    T value{};
    int64_t count = 0;
    check(cudnnBackendGetAttribute(desc_, name, type, 1, &count, &value), what);
    return value;
  }
  // Every element of an array attribute of plain values (at most `limit`).
  template <typename T>
  std::vector<T> get_array(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t limit,
                           const char* what) const {
    std::vector<T> values(static_cast<size_t>(limit));
    int64_t count = 0;
    check(cudnnBackendGetAttribute(desc_, name, type, limit, &count, values.data()), what);
    values.resize(static_cast<size_t>(std::min(count, limit)));
    return values;
  }

 private:
  void reset() {
    if (desc_) cudnnBackendDestroyDescriptor(desc_);
    desc_ = nullptr;
  }
  cudnnBackendDescriptor_t desc_ = nullptr;
};

// An array attribute whose elements are descriptors (heuristic results, knob choices, an engine
// config's engine): cuDNN fills descriptors the caller created, of the type it names.
inline std::vector<Descriptor> get_descriptors(const Descriptor& owner, cudnnBackendAttributeName_t name,
                                               cudnnBackendDescriptorType_t element_type, int64_t limit,
                                               const char* what) {
  std::vector<Descriptor> out;
  out.reserve(static_cast<size_t>(limit));
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < limit; ++i) {
    out.emplace_back(element_type);
    raw.push_back(out.back().get());
  }
  int64_t count = 0;
  check(cudnnBackendGetAttribute(owner.get(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, limit, &count, raw.data()), what);
  out.resize(static_cast<size_t>(std::min(count, limit)));
  return out;
}

// How many elements an array attribute has (a GetAttribute asking for none).
inline int64_t element_count(const Descriptor& owner, cudnnBackendAttributeName_t name,
                             cudnnBackendAttributeType_t type, const char* what) {
  int64_t count = 0;
  check(cudnnBackendGetAttribute(owner.get(), name, type, 0, &count, nullptr), what);
  return count;
}

}  // namespace terra::profile::cuda
