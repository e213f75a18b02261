#!/usr/bin/env bash
# scripts/cuda_compile_check.sh: compile and link terra_torch's CUDA/cuDNN sources
# (csrc/profile/cuda/) against the CUDA build of torch, on a machine without a GPU (issue 17,
# item 5). Not part of scripts/test.sh: it installs a 0.5 GB torch wheel and the nvidia-* wheels
# into a venv of its own and compiles every torch TU again (about half an hour at -j1 on 2 cores,
# less with ccache warm).
#
#   scripts/cuda_compile_check.sh [full|tus]
#     full (default)  configure with TERRA_WITH_CUDA=ON, build _C, then check that every symbol of
#                     _C resolves (dlopen RTLD_NOW after `import torch`) and that the package
#                     imports with _C.profile.with_cuda and, without a GPU, enable() only warns
#     tus             configure, then compile only the csrc/profile/cuda TUs (no link)
#
# Environment: TERRA_CUDA_VENV (default build-cuda/venv), TERRA_CUDA_BUILD (build-cuda/cmake),
# TERRA_CUDA_TORCH_WHEEL (the torch 2.14.1 cu13 wheel under /opt/pypi-more/files), TERRA_CUDA_WHEELS
# (the folder with the nvidia-* wheels; default the torch wheel's), PYTHON (python3.11), JOBS (1),
# CUDA_ROOT (the toolkit: nvcc's TOP, else /usr/local/cuda).
# It never touches .venv or build/. Exit status 0 when everything asked for passed; the first
# thing missing (nvcc, a wheel, a header) is named on stderr.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODE=${1:-full}
VENV=${TERRA_CUDA_VENV:-$ROOT/build-cuda/venv}
BUILD=${TERRA_CUDA_BUILD:-$ROOT/build-cuda/cmake}
TORCH_WHEEL=${TERRA_CUDA_TORCH_WHEEL:-/opt/pypi-more/files/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl}
WHEELS=${TERRA_CUDA_WHEELS:-$(dirname "$TORCH_WHEEL")}
PY=${PYTHON:-python3.11}
JOBS=${JOBS:-1}
PKG=$BUILD/pkg  # a copy of the Python package with the CUDA _C, for the import check

die() { echo "cuda_compile_check: $*" >&2; exit 1; }
case "$MODE" in full|tus) ;; *) die "usage: $0 [full|tus]" ;; esac

# ---- the toolkit ----------------------------------------------------------------------------
command -v nvcc >/dev/null || [ -x "${CUDA_ROOT:-/usr/local/cuda}/bin/nvcc" ] ||
  die "missing: nvcc (no CUDA toolkit on PATH or in ${CUDA_ROOT:-/usr/local/cuda})"
if [ -z "${CUDA_ROOT:-}" ]; then
  top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1 || true)
  CUDA_ROOT=$(readlink -f "${top:-/usr/local/cuda}")
fi
[ -f "$CUDA_ROOT/include/cuda_runtime_api.h" ] || die "missing: $CUDA_ROOT/include/cuda_runtime_api.h (toolkit headers)"
echo "toolkit: $CUDA_ROOT ($("$CUDA_ROOT/bin/nvcc" --version | tail -1))"

# ---- the venv with the CUDA torch -----------------------------------------------------------
[ -f "$TORCH_WHEEL" ] || die "missing: the CUDA torch wheel $TORCH_WHEEL"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  # --no-deps: torch's own requirements pin cuda-toolkit meta packages and triton, which a compile
  # check does not need; the libraries libtorch_cuda.so loads and the headers ATen's CUDA headers
  # include come from these wheels (cuDNN's headers too: that is where cudnn.h is found).
  wheels=()
  for name in nvidia_cudnn_cu13 nvidia_cublas nvidia_cusparse nvidia_cusparselt_cu13 nvidia_cusolver nvidia_cufft \
              nvidia_curand nvidia_cuda_nvrtc nvidia_nvjitlink nvidia_cuda_cupti nvidia_nvtx nvidia_nccl_cu13 \
              nvidia_nvshmem_cu13 nvidia_cufile; do
    w=$(ls "$WHEELS"/"$name"-*.whl 2>/dev/null | sort | tail -1)
    [ -n "$w" ] || die "missing: the $name wheel in $WHEELS"
    wheels+=("$w")
  done
  "$VENV/bin/pip" install -q --no-deps "$TORCH_WHEEL" "${wheels[@]}"
  # Pure-Python requirements of `import torch`, from the configured package index.
  "$VENV/bin/pip" install -q filelock "typing-extensions>=4.10" "sympy>=1.13.3" "networkx>=2.5.1" jinja2 \
    "fsspec>=0.8.5" numpy "setuptools>=77"
fi
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# The toolkit here may have only the compiler and runtime; the wheels have the rest.
NVIDIA_LIBS=$(ls -d "$SITE"/nvidia/*/lib 2>/dev/null | paste -sd: -)
export LD_LIBRARY_PATH=$SITE/torch/lib:$NVIDIA_LIBS:$CUDA_ROOT/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
NVRTC=$(ls "$CUDA_ROOT"/lib64/libnvrtc.so* 2>/dev/null | head -1 || true)
[ -n "$NVRTC" ] || NVRTC=$(ls "$SITE"/nvidia/*/lib/libnvrtc.so* 2>/dev/null | grep -v builtins | head -1 || true)
[ -n "$NVRTC" ] || die "missing: libnvrtc.so (neither in the toolkit nor in the nvidia wheels)"

# ---- configure ------------------------------------------------------------------------------
prefix=$("$VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
args=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTERRA_WITH_CUDA=ON -DTERRA_BUILD_TESTS=OFF
      -DPython3_EXECUTABLE="$VENV/bin/python" -DTERRA_OUTPUT_DIR="$PKG/terra_torch" -DCMAKE_PREFIX_PATH="$prefix"
      -DCUDAToolkit_ROOT="$CUDA_ROOT" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc"
      -DCUDA_nvrtc_LIBRARY="$NVRTC")
echo "cmake ${args[*]}"
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} nice -n 10 cmake "${args[@]}"
grep -q "TERRA_WITH_CUDA=1" "$BUILD/build.ninja" || die "configured, but the CUDA sources are not enabled"

# ---- build ----------------------------------------------------------------------------------
if [ "$MODE" = tus ]; then
  objects=$(ninja -C "$BUILD" -t targets all | sed -n 's|^\(CMakeFiles/_C.dir/csrc/profile/cuda/[^:]*\.o\):.*|\1|p')
  [ -n "$objects" ] || die "no csrc/profile/cuda objects in the build"
  # shellcheck disable=SC2086  # a list of targets
  nice -n 10 ninja -C "$BUILD" -j "$JOBS" $objects
  echo "cuda_compile_check: compiled $(echo "$objects" | wc -w) CUDA TUs"
  exit 0
fi
nice -n 10 cmake --build "$BUILD" --target _C -j "$JOBS"
SO=$(ls "$PKG"/terra_torch/_C*.so)
readelf -d "$SO" | grep NEEDED

# ---- link and import checks -----------------------------------------------------------------
# Every undefined symbol of _C must resolve against what torch loads: dlopen with RTLD_NOW fails
# on the first one that does not, naming it.
"$VENV/bin/python" - "$SO" <<'EOF'
import ctypes, os, sys
import torch  # loads libtorch*, libc10*, libcudnn the way a user's process does
ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_LOCAL)
print("link check: every symbol of", os.path.basename(sys.argv[1]), "resolves")
EOF
# The package with this _C: imports, reports CUDA support, and on this GPU-less machine enable()
# warns once and does nothing (issue 17, item 4).
find "$ROOT/terra_torch" -name '*.py' -printf '%P\n' | while read -r f; do
  mkdir -p "$PKG/terra_torch/$(dirname "$f")"
  cp "$ROOT/terra_torch/$f" "$PKG/terra_torch/$f"
done
# From inside $PKG: the checkout's own terra_torch/ (with the CPU _C) must not shadow the copy.
cd "$PKG"
PKG=$PKG PYTHONPATH=$PKG "$VENV/bin/python" - <<'EOF'
import os, warnings
import torch
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import terra_torch
    from terra_torch import _C, profile as tp
    assert _C.profile.with_cuda, "_C was built without the CUDA sources"
    assert _C.profile.format_version == 2
    if not torch.cuda.is_available():
        tp.enable("/tmp/terra-cuda-check.json")
        tp.enable("/tmp/terra-cuda-check.json")
        assert not tp.is_enabled()
        mine = [w for w in caught if issubclass(w.category, tp.ProfileRecordWarning)]
        assert len(mine) == 1, [str(w.message) for w in mine]
        print("no GPU here: enable() warned once:", mine[0].message)
assert terra_torch.__file__.startswith(os.environ["PKG"]), terra_torch.__file__
print("import check: terra_torch", terra_torch.__file__, "with_cuda", _C.profile.with_cuda)
EOF
echo "cuda_compile_check: ok"
