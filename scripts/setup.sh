#!/usr/bin/env bash
# Idempotent setup on a fresh Debian machine: system packages, .venv with torch 2.13.0 (the CPU
# wheel on disk), Python packages, and the build. A second run with nothing changed only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

APT_PACKAGES=(cmake ninja-build ccache nlohmann-json3-dev libgtest-dev graphviz g++)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { echo "[setup] creating .venv"; "$PY" -m venv .venv; }
VPY=$ROOT/.venv/bin/python

TORCH_WANT=${TERRA_TORCH_VERSION:-2.13.0}
have_torch=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [ "$have_torch" != "$TORCH_WANT" ]; then
  echo "[setup] pip install torch==$TORCH_WANT"
  "$VPY" -m pip install -q "torch==$TORCH_WANT"
fi
"$VPY" - <<'PYEOF' || { echo "[setup] pip install numpy pytest matplotlib"; "$VPY" -m pip install -q numpy pytest matplotlib; }
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in ("numpy", "pytest", "matplotlib")) else 1)
PYEOF
# The test extra (pyproject.toml): tiny HuggingFace models built from configs (random weights, no
# downloads). It does not depend on torch, so the CPU torch above stays; tests skip without it.
"$VPY" -c 'import transformers' 2>/dev/null || { echo "[setup] pip install transformers"; "$VPY" -m pip install -q transformers || echo "[setup] transformers could not be installed: its tests will be skipped"; }

# Build: configure once, then let ninja decide what is stale (a no-op build takes < 1 s).
export CCACHE_DIR=${CCACHE_DIR:-$HOME/.cache/ccache}
if [ ! -f build/CMakeCache.txt ] || ! grep -q "^TERRA_OUTPUT_DIR:PATH=$ROOT/terra_torch$" build/CMakeCache.txt; then
  cmake -S . -B build -G Ninja -DPython3_EXECUTABLE="$VPY" -DTERRA_OUTPUT_DIR="$ROOT/terra_torch" >/dev/null
fi
cmake --build build -j "${MAX_JOBS:-2}"

# Register the package in the venv (editable: the source tree is the package).
# (Checked from / so that the current directory does not make the import succeed by accident.)
installed=$(cd / && "$VPY" -c 'import terra_torch,os;print(os.path.dirname(terra_torch.__file__))' 2>/dev/null || true)
if [ "$installed" != "$ROOT/terra_torch" ]; then
  echo "[setup] pip install -e . --no-build-isolation (registering the extension built above)"
  ext=$(ls terra_torch/_C*.so | head -n 1)
  TERRA_PREBUILT_EXTENSION="$ROOT/$ext" "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
fi
echo "[setup] ready: $("$VPY" -c 'import torch, terra_torch; print("torch", torch.__version__, "terra_torch", terra_torch.__version__)')"
