// The one PYBIND11_MODULE of terra_torch._C. Each component adds its bindings through an
// init_* function declared in python/bindings.h, so that the module is assembled in one place.
#include <torch/extension.h>

#include <torch/version.h>

#include "common/version.h"
#include "python/bindings.h"

namespace {

#define TERRA_STR2(x) #x
#define TERRA_STR(x) TERRA_STR2(x)
constexpr const char* kCompiledTorch =
    TERRA_STR(TORCH_VERSION_MAJOR) "." TERRA_STR(TORCH_VERSION_MINOR) "." TERRA_STR(TORCH_VERSION_PATCH);

// The extension is compiled against one torch; running it with another minor release is an
// ABI mismatch that crashes later in obscure ways, so refuse at import with the remedy.
void check_torch_abi(const std::string& runtime_version) {
  auto compiled = terra::parse_version(kCompiledTorch);
  auto running = terra::parse_version(runtime_version);
  TORCH_CHECK(compiled && running, "terra_torch: cannot parse torch versions '", kCompiledTorch,
              "' / '", runtime_version, "'");
  TORCH_CHECK(terra::same_minor_release(*compiled, *running),
              "terra_torch._C was compiled against torch ", kCompiledTorch,
              " but torch ", runtime_version,
              " is installed; rebuild it: pip install -e . --no-build-isolation");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "terra_torch C++ core";
  m.attr("compiled_torch_version") = kCompiledTorch;
  m.attr("with_cuda") = static_cast<bool>(TERRA_WITH_CUDA);
  m.def("check_torch_abi", &check_torch_abi, "Raise if torch's minor release differs from the build's");
  terra::python::init_capture(m);
  terra::python::init_profile(m);
  terra::python::init_emit(m);
  terra::python::init_runtime(m);
  terra::python::init_fused(m);
  terra::python::init_session(m);
}
