#!/usr/bin/env bash
# scripts/gpu_check.sh: build terra_torch with its CUDA/cuDNN sources on a GPU machine and check the
# convolution profile record there (docs/PROFILE_RECORD.md). Not part of scripts/test.sh: CI has no
# GPU. It uses the machine's own python3 and torch (a CUDA build), installs nothing, and needs no
# network.
#
#   scripts/gpu_check.sh [OUT_DIR]          (OUT_DIR defaults to $OUT, else build-gpu/check)
#
# Steps, each logged to OUT_DIR/log.txt and summed up in OUT_DIR/summary.txt:
#   env      GPU, driver, python/torch/cuDNN versions, the C++ compiler chosen, where nvcc, libnvrtc
#            and cusparse.h are
#   build    cmake -G Ninja -DTERRA_WITH_CUDA=ON into build-gpu/ (torch's CMake prefix from
#            torch.utils.cmake_prefix_path), target _C, -j $JOBS; _C lands in terra_torch/ as
#            scripts/setup.sh's build does, and PYTHONPATH is the repository root. The compiler is
#            the first of $CXX, c++, g++, /usr/bin/g++(-13,-14) whose shared libraries need
#            libstdc++.so: the GPU image's default /opt/gcc/bin/g++ links libstdc++ statically,
#            and such a _C segfaults at its first std::ostream use (two copies of libstdc++'s
#            locale machinery in one process)
#   import   import terra_torch; _C.profile.with_cuda; the device header
#   coexec   scripts/gpu_coexec_check.py: co-execution vs eager on CUDA (MLP, CNN; default and side
#            stream), the graph on a pool stream of its own; writes OUT_DIR/gpu_coexec_check.json
#   selector the selection policy through _C with the scripted provider (profile, save, reload);
#            if it crashes, a cuda-gdb backtrace, and the steps that need it are skipped
#   kernels  terra's cuDNN kernels against PyTorch's on small convolutions (2-d, strided and
#            dilated, grouped, channels_last, float16, bfloat16, float64, 1-d, 3-d, transposed,
#            depthwise): forward and both gradients equal within tolerance, the kernels were
#            called, a second enable reuses the file without profiling, another batch size
#            profiles nothing and then runs cached plans only, a zero workspace cap records only
#            zero-workspace engine configurations; writes OUT_DIR/kernels.json
#   bench    benchmarks/gpu_profile_record.py, sized by $TERRA_GPU_BENCH_ARGS (issue 17, item 6:
#            ResNet-50 and Inception at batch 32, float32, one process per scenario:
#            cudnn.benchmark, a warm record, the warm record at a new batch size; CUDA-event
#            steady steps, host time per conv call and GPU-busy time from torch.profiler, start-up
#            peak and first step; one bfloat16 autocast run), within what is left of
#            $TERRA_GPU_CHECK_BUDGET_S less ~75 s; writes OUT_DIR/gpu_profile_record.json and the
#            records it made (OUT_DIR/<model>-record.json)
#   targets  issue 17's targets from that JSON (steady step within 3%, warm first step <= 1/10,
#            start-up peak <= 1.05x steady, plan hits only, no profile at a new batch, tensor cores)
#   pytest   test/python/test_profile*.py (the fake-provider tests; the CPU-only ones skip)
#   warmup   python -m terra_torch.warmup on a small ResNet-50 input, two batch sizes
#
# Environment: PYTHON (python3), JOBS (nproc), TERRA_GPU_DEPS (extra CMAKE_PREFIX_PATH, e.g. a folder
# with include/nlohmann and share/cmake/nlohmann_json when the machine lacks nlohmann-json),
# TERRA_GPU_CHECK_BUDGET_S (seconds for the whole script, default 510), TERRA_GPU_BENCH_ARGS,
# TERRA_GPU_SKIP_BUILD=1 (reuse the _C already built in terra_torch/).
# Exit status: 0 when every step passed, 1 otherwise (later steps still run where they can).
# Without a CUDA GPU (torch.cuda.is_available() False) it says so and exits 0 having done nothing.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT_DIR=${1:-${OUT:-$ROOT/build-gpu/check}}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=$OUT_DIR/log.txt
SUMMARY=$OUT_DIR/summary.txt
PY=${PYTHON:-python3}
JOBS=${JOBS:-$(nproc)}
BUILD=$ROOT/build-gpu
BUDGET_S=${TERRA_GPU_CHECK_BUDGET_S:-510}
BENCH_ARGS=${TERRA_GPU_BENCH_ARGS:---models resnet50,inception --batch 32 --new-batch 48 --steps 20 --profile-steps 5 --memory-limit-gib 0 --workspace-cap 1GiB --autocast-run --timeout 120}
START=$(date +%s)
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
cd "$ROOT"
: >"$LOG"
: >"$SUMMARY"
exec > >(tee -a "$LOG") 2>&1

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: skipped: no CUDA GPU here ($PY: torch.cuda.is_available() is False or torch is missing)"
  printf '%-8s %-40s\n' all "skipped (no CUDA GPU)" >>"$SUMMARY"
  exit 0
fi

FAILED=0
elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((BUDGET_S - $(date +%s) + START)); }
step() {  # step NAME TIMEOUT_S COMMAND...: runs it, logs, records pass/fail and seconds
  local name=$1 limit=$2 t0 rc
  shift 2
  echo; echo "==== [$name] $(date -u +%H:%M:%S) (t=$(elapsed)s, limit ${limit}s)"
  t0=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout needs a program
    timeout --kill-after=10 "$limit" bash -c "$(declare -f "$1"); $*"
  else
    timeout --kill-after=10 "$limit" "$@"
  fi
  rc=$?
  local status=ok
  [ $rc -eq 0 ] || { status="FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"; FAILED=1; }
  echo "==== [$name] $status in $(($(date +%s) - t0))s"
  printf '%-8s %-40s %4ss\n' "$name" "$status" "$(($(date +%s) - t0))" >>"$SUMMARY"
  return $rc
}

skip() {  # skip NAME REASON
  echo; echo "==== [$1] skipped: $2"
  printf '%-8s %-40s\n' "$1" "skipped ($2)" >>"$SUMMARY"
  FAILED=1
}

# ---- env ------------------------------------------------------------------------------------
env_report() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
  "$PY" - <<'EOF'
import sys, sysconfig, os, torch
print("python", sys.version.split()[0], sys.executable)
print("Python.h:", os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")), sysconfig.get_paths()["include"])
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
print("cmake prefix", torch.utils.cmake_prefix_path)
EOF
  cmake --version | head -1; ninja --version; c++ --version | head -1
  command -v nvcc && nvcc --version | tail -2
  echo "C++ compiler: ${TERRA_CXX:-none found that links libstdc++ dynamically, CMake picks one}"
  echo "CUDA root: $CUDA_ROOT"
  echo "libnvrtc: ${NVRTC:-none found}"
  ls "$CUDA_ROOT/include/cusparse.h" 2>/dev/null || echo "cusparse.h: not in the toolkit (CMake takes the nvidia wheels' headers)"
}

# The toolkit: the folder nvcc reports as its TOP (nvcc may be a wrapper script), else /usr/local/cuda.
CUDA_ROOT=""
if command -v nvcc >/dev/null; then
  top=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
  [ -n "$top" ] && CUDA_ROOT=$(readlink -f "$top")
fi
[ -z "$CUDA_ROOT" ] && [ -x /usr/local/cuda/bin/nvcc ] && CUDA_ROOT=$(readlink -f /usr/local/cuda)
# libnvrtc, which torch's CMake config asks for: the toolkit's, else the nvidia wheels'.
NVRTC=$(ls "$CUDA_ROOT"/lib64/libnvrtc.so* "$CUDA_ROOT"/lib/libnvrtc.so* "$CUDA_ROOT"/targets/*/lib/libnvrtc.so* 2>/dev/null | head -1)
NVRTC_IN_TOOLKIT=1
if [ -z "$NVRTC" ]; then
  NVRTC_IN_TOOLKIT=0
  NVRTC=$("$PY" -c "import glob, os, nvidia; print(next(iter(sorted(h for b in nvidia.__path__ for h in glob.glob(os.path.join(b, '*', 'lib', 'libnvrtc.so*')) if 'builtins' not in h)), ''))" 2>/dev/null)
fi
ARCH=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null || echo 9.0)
# A C++ compiler that links libstdc++ dynamically. A wrapper that adds -static-libstdc++ (as
# /opt/gcc/bin/g++ does on the GPU image) gives _C its own copy of parts of libstdc++ beside the
# process's shared one, and the first std::ostream insertion then crashes (locale facet ids differ).
pick_cxx() {
  local src cxx
  src=$(mktemp --suffix=.cpp)
  printf '#include <sstream>\nstd::string f(long v) { std::ostringstream s; s << v; return s.str(); }\n' >"$src"
  for cxx in ${CXX:-} c++ g++ /usr/bin/g++ /usr/bin/g++-13 /usr/bin/g++-14; do
    command -v "$cxx" >/dev/null || continue
    if "$cxx" -shared -fPIC "$src" -o "$src.so" 2>/dev/null && readelf -d "$src.so" | grep -q 'libstdc++'; then
      echo "$(command -v "$cxx")"; return 0
    fi
  done
  return 1
}
TERRA_CXX=$(pick_cxx || true)
export PY JOBS ROOT BUILD TERRA_CXX CUDA_ROOT NVRTC NVRTC_IN_TOOLKIT ARCH TERRA_GPU_DEPS="${TERRA_GPU_DEPS:-}"

step env 60 env_report

# ---- build ----------------------------------------------------------------------------------
build() {
  local prefix
  prefix=$("$PY" -c 'import torch; print(torch.utils.cmake_prefix_path)') || return 1
  local args=(-S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTERRA_WITH_CUDA=ON
              -DPython3_EXECUTABLE="$(command -v "$PY")" -DTERRA_OUTPUT_DIR="$ROOT/terra_torch"
              "-DCMAKE_PREFIX_PATH=$prefix${TERRA_GPU_DEPS:+;$TERRA_GPU_DEPS}")
  if [ -n "$CUDA_ROOT" ]; then
    args+=(-DCUDAToolkit_ROOT="$CUDA_ROOT" -DCUDA_TOOLKIT_ROOT_DIR="$CUDA_ROOT" -DCMAKE_CUDA_COMPILER="$CUDA_ROOT/bin/nvcc")
  fi
  [ "$NVRTC_IN_TOOLKIT" = 0 ] && [ -n "$NVRTC" ] && args+=(-DCUDA_nvrtc_LIBRARY="$NVRTC")
  [ -n "$TERRA_CXX" ] && args+=(-DCMAKE_CXX_COMPILER="$TERRA_CXX" -DCMAKE_CUDA_HOST_COMPILER="$TERRA_CXX")
  echo "cmake ${args[*]}"
  TORCH_CUDA_ARCH_LIST=$ARCH cmake "${args[@]}" || return 1
  cmake --build "$BUILD" --target _C -j "$JOBS" || return 1
  ls -la "$ROOT"/terra_torch/_C*.so
  readelf -d "$ROOT"/terra_torch/_C*.so | grep NEEDED
}
if [ -n "${TERRA_GPU_SKIP_BUILD:-}" ]; then
  echo "TERRA_GPU_SKIP_BUILD set: using the _C already in terra_torch/"
elif ! step build 330 build; then
  echo "build failed; nothing else can run"; cat "$SUMMARY"; exit 1
fi

# ---- import ---------------------------------------------------------------------------------
step import 60 "$PY" -c '
import torch, terra_torch
from terra_torch import _C, profile as tp
print("terra_torch", terra_torch.__version__, "from", terra_torch.__file__)
assert _C.profile.with_cuda, "_C built without CUDA"
print("header", tp.cuda_header())
'

# ---- coexec ---------------------------------------------------------------------------------
# Co-execution on CUDA: eager vs terra_torch.wrap on an MLP and a CNN, on the default stream and a
# side stream; the graph must run on a pool stream of its own (docs/RUNTIME.md, "Streams").
step coexec 150 "$PY" scripts/gpu_coexec_check.py "$OUT_DIR/gpu_coexec_check.json"

# ---- selector -------------------------------------------------------------------------------
# The selection policy through this build's _C with the scripted provider (no GPU work): profile,
# save, reload. If it crashes, cuda-gdb (which also debugs host-only programs) prints where.
SELECTOR_PY=$(mktemp --suffix=.py)
cat >"$SELECTOR_PY" <<'EOF'
import os, sys, tempfile
from terra_torch import _C, profile as tp
path = os.path.join(tempfile.mkdtemp(), "selector.json")
call = {"input": [2, 3, 8, 8], "weight": [4, 3, 3, 3], "output": [2, 4, 6, 6], "padding": [0, 0], "stride": [1, 1],
        "dilation": [1, 1], "groups": 1, "dtype": "float32", "layout": "nchw"}
for attempt in range(2):
    selector = _C.profile.Selector(path, tp.fake_header())
    print("load", selector.load(), flush=True)
    key, batch = _C.profile.make_key(call, "forward")
    print("key", _C.profile.key_id(key), "batch", batch, flush=True)
    outcome = selector.run(key, batch, tp.FakeProvider())
    print("run", outcome, flush=True)
    assert outcome["ok"] and outcome["source"] == ("profiled" if attempt == 0 else "record"), outcome
    print("flush", selector.flush(), "stats", selector.stats(), flush=True)
print(open(path).read())
EOF
SELECTOR_OK=1
if ! step selector 60 "$PY" -X faulthandler "$SELECTOR_PY"; then
  SELECTOR_OK=0
  GDB=$(command -v cuda-gdb || ls "$CUDA_ROOT"/bin/cuda-gdb 2>/dev/null || true)
  if [ -n "$GDB" ]; then
    step gdb 150 "$GDB" -q -batch -ex "set pagination off" -ex "set print thread-events off" -ex run -ex "bt 30" \
      -ex "info registers rip rsp" -ex "info sharedlibrary _C" --args "$PY" "$SELECTOR_PY"
  fi
fi

# ---- kernels --------------------------------------------------------------------------------
if [ "$SELECTOR_OK" = 0 ]; then
  skip kernels "the selector step crashed"
else step kernels 120 "$PY" - "$OUT_DIR/kernels.json" <<'EOF'
import json, os, sys, tempfile, time, warnings
import torch
import torch.nn.functional as F
from terra_torch import profile as tp

out_path = sys.argv[1]
dev = torch.device("cuda")
torch.backends.cudnn.allow_tf32 = False   # float32 in FMA math: tight comparisons
torch.backends.cudnn.benchmark = False
TOL = {torch.float32: 2e-4, torch.float64: 1e-10, torch.float16: 2e-2, torch.bfloat16: 5e-2}

# name, op, x shape, w shape, kwargs, dtype, channels_last
CASES = [
    ("conv2d_3x3", F.conv2d, (8, 16, 32, 32), (32, 16, 3, 3), dict(padding=1), torch.float32, False),
    ("conv2d_stride_dilation", F.conv2d, (8, 16, 33, 33), (32, 16, 3, 3), dict(stride=2, padding=2, dilation=2), torch.float32, False),
    ("conv2d_groups", F.conv2d, (8, 32, 16, 16), (64, 8, 3, 3), dict(padding=1, groups=4), torch.float32, False),
    ("conv2d_channels_last", F.conv2d, (8, 16, 32, 32), (32, 16, 3, 3), dict(padding=1), torch.float32, True),
    ("conv2d_float16", F.conv2d, (8, 16, 32, 32), (32, 16, 3, 3), dict(padding=1), torch.float16, False),
    ("conv2d_bfloat16_cl", F.conv2d, (8, 16, 32, 32), (32, 16, 3, 3), dict(padding=1), torch.bfloat16, True),
    ("conv2d_float64", F.conv2d, (4, 8, 16, 16), (8, 8, 3, 3), dict(padding=1), torch.float64, False),
    ("conv2d_1x7", F.conv2d, (8, 32, 17, 17), (48, 32, 1, 7), dict(padding=(0, 3)), torch.float32, False),
    ("conv1d", F.conv1d, (8, 16, 100), (32, 16, 5), dict(padding=2), torch.float32, False),
    ("conv3d", F.conv3d, (4, 8, 8, 16, 16), (16, 8, 3, 3, 3), dict(padding=1), torch.float32, False),
    ("conv_transpose2d", F.conv_transpose2d, (8, 32, 16, 16), (32, 16, 4, 4), dict(stride=2, padding=1), torch.float32, False),
    ("conv_transpose2d_groups", F.conv_transpose2d, (8, 32, 16, 16), (32, 8, 3, 3),
     dict(stride=2, padding=1, output_padding=1, groups=2), torch.float32, False),
    ("depthwise", F.conv2d, (8, 32, 16, 16), (32, 1, 3, 3), dict(padding=1, groups=32), torch.float32, False),
]


def make(case, batch=None):
    name, op, xs, ws, kw, dtype, cl = case
    g = torch.Generator(device="cpu").manual_seed(0)
    xs = (batch or xs[0],) + tuple(xs[1:])
    x = torch.randn(xs, generator=g, dtype=torch.float64).to(dev, dtype)
    w = (torch.randn(ws, generator=g, dtype=torch.float64) / (ws[1] * 9) ** 0.5).to(dev, dtype)
    b = torch.randn(w.shape[1] * kw.get("groups", 1) if op is F.conv_transpose2d else ws[0], generator=g,
                    dtype=torch.float64).to(dev, dtype)
    if cl and x.dim() == 4:
        x, w = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
    return x, w, b


def run(case, batch=None):
    name, op, xs, ws, kw, dtype, cl = case
    x, w, b = make(case, batch)
    x.requires_grad_(True), w.requires_grad_(True), b.requires_grad_(True)
    y = op(x, w, b, **kw)
    gy = torch.randn(y.shape, generator=torch.Generator(device="cpu").manual_seed(1), dtype=torch.float64).to(dev, dtype)
    y.backward(gy)
    torch.cuda.synchronize()
    return [t.detach().double().cpu() for t in (y, x.grad, w.grad, b.grad)]


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
          "cases": [], "checks": {}}
ok = True
tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "kernels-record.json")
refs = {c[0]: run(c) for c in CASES}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tp.enable(path, "256MiB")
    for case in CASES:
        before = tp.stats()["calls"]
        t = time.perf_counter()
        got = run(case)
        errs = [rel_err(g, r) for g, r in zip(got, refs[case[0]])]
        calls = tp.stats()["calls"] - before
        good = max(errs) <= TOL[case[5]]
        # The record must see PyTorch's cuDNN work; depthwise and float64 convolutions may go to
        # PyTorch's own kernels instead (its backend choice), so their calls are only reported.
        if case[0] not in ("depthwise", "conv2d_float64"):
            good = good and calls > 0
        ok &= good
        report["cases"].append({"name": case[0], "ok": good, "rel_err[y,dx,dw,db]": errs, "selector_calls": calls,
                                "seconds": time.perf_counter() - t})
        print(f"{case[0]:26s} {'ok' if good else 'MISMATCH':8s} calls {calls:2d} errs " + " ".join(f"{e:.1e}" for e in errs))
    first = tp.stats()
    tp.disable()
    report["checks"]["first_run_stats"] = first
    rec = tp.load(path)
    report["checks"]["record_status"], report["checks"]["record_entries"] = rec.status, len(rec.entries)
    ok &= rec.status == "ok" and len(rec.entries) > 0 and first["profiles"] > 0 and first["failures"] == 0
    # Second process-like run: the same file, no profiling; then another batch size, still none.
    tp.enable(path, "256MiB")
    for case in CASES:
        run(case)
    second = tp.stats()
    for case in CASES:
        run(case, batch=5)
    third = tp.stats()
    tp.disable()
    report["checks"]["second_run_stats"], report["checks"]["other_batch_stats"] = second, third
    ok &= second["profiles"] == 0 and second["record_hits"] > 0 and third["profiles"] == 0
    # Format 2: after each problem's first call only cached plans run (one build per problem).
    tp.enable(path, "256MiB")
    for case in CASES:
        run(case)
    before = tp.stats()
    for case in CASES:
        run(case)
    after = tp.stats()
    tp.disable()
    steady = {k: after[k] - before[k] for k in after}
    report["checks"]["steady_stats"] = steady
    ok &= steady["calls"] > 0 and steady["plan_hits"] == steady["calls"] and steady["plan_builds"] == 0
    # A zero cap: only algorithms without workspace are recorded, and results still match.
    path0 = os.path.join(tmp, "zero-cap.json")
    tp.enable(path0, 0)
    zero_ok = all(max(rel_err(g, r) for g, r in zip(run(c), refs[c[0]])) <= TOL[c[5]] for c in CASES)
    zero = tp.stats()
    tp.disable()
    ws = [c.workspace_bytes for e in tp.load(path0).entries for c in e.configs]
    report["checks"]["zero_cap"] = {"results_match": zero_ok, "stats": zero, "max_recorded_workspace": max(ws or [0])}
    ok &= zero_ok and max(ws or [0]) == 0
report["warnings"] = sorted({str(w.message)[:300] for w in caught})
with open(path) as f:
    report["record_head"] = f.read()[:4000]
report["ok"] = bool(ok)
with open(out_path, "w") as f:
    json.dump(report, f, indent=1)
print(json.dumps(report["checks"], indent=1))
print("warnings:", *report["warnings"], sep="\n  ")
print("kernels:", "ok" if ok else "FAILED")
sys.exit(0 if ok else 1)
EOF
fi

# ---- bench ----------------------------------------------------------------------------------
BENCH_LEFT=$(($(left) - (SELECTOR_OK ? 75 : 10)))  # keeps ~60 s for pytest and warmup, which follow
if [ "$BENCH_LEFT" -lt 60 ]; then
  echo "bench: only ${BENCH_LEFT}s left of the ${BUDGET_S}s budget; skipped"
  printf '%-8s %-40s\n' bench "skipped (budget)" >>"$SUMMARY"; FAILED=1
else
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  step bench $((BENCH_LEFT + 10)) "$PY" benchmarks/gpu_profile_record.py $BENCH_ARGS --time-budget "$BENCH_LEFT" \
    --record-dir "$OUT_DIR" --out "$OUT_DIR/gpu_profile_record.json"
fi

# ---- targets --------------------------------------------------------------------------------
if [ -f "$OUT_DIR/gpu_profile_record.json" ]; then
  step targets 20 "$PY" - "$OUT_DIR/gpu_profile_record.json" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
targets = doc.get("targets", [])
for t in targets:
    print(f"{t['model']:10s} {t['name']:45s} {'met' if t['met'] else 'MISSED'}: {t['detail']}")
sys.exit(0 if targets and all(t["met"] for t in targets) else 1)
EOF
fi

# ---- pytest ---------------------------------------------------------------------------------
XDIST=()
"$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 8)  # its subprocess tests dominate; run them side by side
if [ "$SELECTOR_OK" = 0 ]; then skip pytest "the selector step crashed"; else
step pytest 90 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" test/python/test_profile.py test/python/test_profile_record_file.py \
  test/python/test_profile_warmup.py test/python/test_profile_concurrency.py
fi

# ---- warmup CLI -----------------------------------------------------------------------------
WARM=$(mktemp -d)
if [ "$SELECTOR_OK" = 0 ]; then skip warmup "the selector step crashed"; else
step warmup 60 "$PY" -m terra_torch.warmup --model benchmarks.gpu_profile_record:resnet50 --input-shape 8,3,224,224 \
  --batch-sizes 8,16 --record "$WARM/resnet50-warmup.json" --workspace-cap 1GiB --quiet
fi

rm -f "$OUT_DIR"/*.lock

echo; echo "==== summary (t=$(elapsed)s)"; cat "$SUMMARY"
exit $FAILED
