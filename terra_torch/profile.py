"""Persisted convolution profile records: the replacement for `torch.backends.cudnn.benchmark`.

`cudnn.benchmark` re-profiles every convolution in every new process and for every new batch
size (its key includes the batch), and while profiling it allocates workspace for the hungriest
algorithm, which is the start-up memory spike of pytorch #15872. A profile record (seed 001)
keeps the choices in a JSON file keyed without the batch size: profiled once, under a workspace
cap, reused by later runs and other batch sizes. See docs/PROFILE_RECORD.md.

    import terra_torch.profile as tp
    tp.enable("~/.cache/terra/conv-h200.json", workspace_cap_bytes=2 << 30)
    ...train...            # PyTorch's own cuDNN convolutions now consult the record
    tp.disable()           # or let the process end: the record is saved as it grows

Or set TERRA_PROFILE_RECORD=path (and optionally TERRA_PROFILE_WORKSPACE_CAP=2GiB): importing
terra_torch calls `enable_from_env()`. On a machine without CUDA (or a build of terra_torch without
it) both warn once and do nothing, so one training script serves CPU and GPU machines. Tests use
`enable(path, provider=FakeProvider())`, which routes CPU convolutions through the same selection
policy with a scripted provider.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from terra_torch import _C

_P = _C.profile

logger = logging.getLogger("terra_torch.profile")

ENV_RECORD = "TERRA_PROFILE_RECORD"
ENV_WORKSPACE_CAP = "TERRA_PROFILE_WORKSPACE_CAP"

#: Scripted provider for tests: ``FakeProvider([{"engine": 1, "time_ms_per_sample": 2.0,
#: "workspace_per_sample": 1024, "run_status": "ok", "unsupported_from_batch": 0,
#: "in_heuristics": True, "in_profile": True}, ...])``; with no argument, three engines shaped like
#: cuDNN's forward set. Counters: profile_calls, heuristics_calls, build_calls, execute_calls;
#: `attempted` lists the engine of every execute, `built` of every plan build.
FakeProvider = _P.FakeProvider

FAKE_DEVICE_NAME = "terra_torch fake device"


class ProfileRecordWarning(UserWarning):
    """A record could not be used as is (corrupt, other device, ...), or a convolution fell back."""


# ---- the record as data ---------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """One cuDNN engine configuration (graph API): the engine's global index and its knob choices
    identify the kernel; the rest was measured at the entry's profiled batch."""
    engine: int
    knobs: tuple[tuple[int, int], ...]  # (cudnnBackendKnobType_t, value), sorted by type
    tag: str
    numerical_notes: tuple[str, ...]
    time_ms: float
    workspace_bytes: int

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        return cls(engine=d["engine"], knobs=tuple(tuple(k) for k in d["knobs"]), tag=d["tag"],
                   numerical_notes=tuple(d["numerical_notes"]), time_ms=d["time_ms"],
                   workspace_bytes=d["workspace_bytes"])


@dataclass(frozen=True)
class ConvKey:
    role: str  # "forward", "backward_data" or "backward_filter"
    input: tuple[int, ...]  # without batch
    filter: tuple[int, ...]
    output: tuple[int, ...]  # without batch
    padding: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    dtype: str
    compute_type: str
    layout: str
    math_mode: str
    deterministic: bool

    @property
    def id(self) -> str:
        """The canonical one-line form, as in the file's "id" fields."""
        return _P.key_id(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConvKey:
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


@dataclass(frozen=True)
class Entry:
    key: ConvKey
    profiled_batch: int
    configs: tuple[EngineConfig, ...]  # fastest first
    least_memory: EngineConfig

    @property
    def best(self) -> EngineConfig:
        return self.configs[0]


@dataclass(frozen=True)
class Header:
    format_version: int
    device_name: str
    compute_capability: str
    cudnn_version: int
    cuda_version: int
    torch_version: str


@dataclass(frozen=True)
class Record:
    path: str
    status: str  # "ok", "missing", "corrupt", "outdated" (format 1) or "incompatible"
    header: Optional[Header]
    entries: tuple[Entry, ...]
    problems: tuple[str, ...]

    def find(self, key: ConvKey) -> Optional[Entry]:
        return next((e for e in self.entries if e.key == key), None)


def _entries_from_canonical(text: str) -> tuple[Optional[Header], tuple[Entry, ...]]:
    doc = json.loads(text)
    header = Header(**doc["header"])
    entries = tuple(
        Entry(
            key=ConvKey.from_dict(e["key"]),
            profiled_batch=e["profiled_batch"],
            configs=tuple(EngineConfig.from_dict(c) for c in e["configs"]),
            least_memory=EngineConfig.from_dict(e["least_memory"]),
        )
        for e in doc["entries"]
    )
    return header, entries


def load(path: Union[str, os.PathLike[str]]) -> Record:
    """Reads a record for inspection. Never raises for bad content: a corrupt, outdated (format 1)
    or incompatible file gives a Record with that status, no entries, and a ProfileRecordWarning."""
    path = os.fspath(os.path.expanduser(path))
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return Record(path, "missing", None, (), ())
    decoded = _P.decode_record(text)
    problems = tuple(decoded["problems"])
    for problem in problems:
        warnings.warn(f"profile record {path}: {problem}", ProfileRecordWarning, stacklevel=2)
    if decoded["status"] != "ok":
        return Record(path, decoded["status"], None, (), problems)
    header, entries = _entries_from_canonical(decoded["canonical"])
    return Record(path, "ok", header, entries, problems)


# ---- sizes ----------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4,
          "tib": 1024**4}


def parse_bytes(text: Union[str, int]) -> int:
    """'512MiB', '2GB', '1.5g', '1048576' -> bytes. Raises ValueError with the accepted forms."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a byte count cannot be negative")
        return text
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use e.g. 1073741824, 512MiB, 2GB or 1.5GiB")
    return int(float(match.group(1)) * _UNITS[unit])


# ---- enabling -------------------------------------------------------------------------------

_lock = threading.Lock()
_selector: Optional[Any] = None  # _C.profile.Selector
_fake_mode: Optional[_FakeConvolutionMode] = None
_cuda_kernels = False


def _emit(diagnostics: Sequence[tuple[str, str]]) -> None:
    for level, message in diagnostics:
        if level == "warning":
            warnings.warn(message, ProfileRecordWarning, stacklevel=3)
        elif level == "info":
            logger.info("%s", message)
        else:
            logger.debug("%s", message)


def fake_header() -> dict[str, Any]:
    return {"device_name": FAKE_DEVICE_NAME, "compute_capability": "0.0", "cudnn_version": 0,
            "cuda_version": 0, "torch_version": torch.__version__}


def cuda_header(device: Optional[int] = None) -> dict[str, Any]:
    """The header a record gets on this CUDA device. Raises RuntimeError without CUDA."""
    _require_cuda()
    index = torch.cuda.current_device() if device is None else device
    header = dict(_P.cuda_device_header(index))
    header["torch_version"] = torch.__version__
    header.pop("format_version", None)
    return header


def _why_no_cuda() -> Optional[str]:
    """Why this process cannot use a CUDA record, or None when it can."""
    if not torch.cuda.is_available():
        return ("convolution profile records need a CUDA device: torch.cuda.is_available() is False "
                f"(torch {torch.__version__}). For tests on CPU pass provider=FakeProvider().")
    if not _P.with_cuda:
        return ("terra_torch._C was built without CUDA/cuDNN support, so it cannot profile "
                "convolutions; rebuild it on a machine with the CUDA toolkit and a CUDA build of torch "
                "(pip install -e . --no-build-isolation).")
    return None


def _require_cuda() -> None:
    why = _why_no_cuda()
    if why is not None:
        raise RuntimeError(why)


_warned_no_cuda = False


def _warn_no_cuda_once(why: str, stacklevel: int) -> None:
    # Once per process, whatever the warning filters say: a script shared between CPU and GPU
    # machines calls enable() (or sets the variable) unconditionally, and must neither crash nor
    # repeat itself on the CPU ones (issue 17, item 4).
    global _warned_no_cuda
    if _warned_no_cuda:
        return
    _warned_no_cuda = True
    warnings.warn(f"{why} The profile record is not used; convolutions run as PyTorch chooses.",
                  ProfileRecordWarning, stacklevel=stacklevel + 1)


def enable(path: Union[str, os.PathLike[str], None] = None, workspace_cap_bytes: Union[int, str, None] = None,
           *, provider: Optional[Any] = None, device: Optional[int] = None,
           save_each_profile: bool = True) -> None:
    """Makes convolutions use the profile record at `path` (default: $TERRA_PROFILE_RECORD).

    workspace_cap_bytes bounds the workspace of every algorithm profiled or run, so profiling
    cannot overshoot memory (default: $TERRA_PROFILE_WORKSPACE_CAP, else no cap, as cuDNN's own
    benchmark). provider=FakeProvider(...) runs the policy on CPU convolutions for tests; without
    it, on a machine without a CUDA device or with a build of terra_torch without CUDA, it warns
    once (ProfileRecordWarning) and does nothing. Enabling again replaces the previous record
    (which is saved first).
    """
    global _selector, _fake_mode, _cuda_kernels
    if provider is None:
        # Before any argument check: a script shared with GPU machines may rely on settings
        # (the variable, a path) that only those have.
        why = _why_no_cuda()
        if why is not None:
            _warn_no_cuda_once(why, stacklevel=2)
            return
    if path is None:
        path = os.environ.get(ENV_RECORD)
        if not path:
            raise ValueError(f"enable() needs a record path, or {ENV_RECORD} set to one")
    if workspace_cap_bytes is None and os.environ.get(ENV_WORKSPACE_CAP):
        workspace_cap_bytes = os.environ[ENV_WORKSPACE_CAP]
    cap = None if workspace_cap_bytes is None else parse_bytes(workspace_cap_bytes)
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if provider is None:
        header = cuda_header(device)
    elif isinstance(provider, FakeProvider):
        header = fake_header()
    else:
        raise TypeError(f"provider must be a terra_torch.profile.FakeProvider, not {type(provider).__name__}")
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)

    disable()
    with _lock:
        selector = _P.Selector(path, header, cap, save_each_profile)
        _emit(selector.load())
        _P.set_active(selector)
        _selector = selector
        if provider is None:
            _P.install_cuda_kernels()
            _cuda_kernels = True
        else:
            _fake_mode = _FakeConvolutionMode(selector, provider)
            _fake_mode.__enter__()
    logger.info("profile record %s enabled (%d entries, workspace cap %s)", path,
                len(_entries_from_canonical(selector.entries_json())[1]),
                "none" if cap is None else f"{cap} bytes")


def disable() -> None:
    """Stops using the record and saves what is unsaved. A no-op when nothing is enabled."""
    global _selector, _fake_mode, _cuda_kernels
    with _lock:
        selector, mode, kernels = _selector, _fake_mode, _cuda_kernels
        _selector, _fake_mode, _cuda_kernels = None, None, False
        if selector is None:
            return
        if kernels:
            _P.uninstall_cuda_kernels()
        if mode is not None:
            mode.__exit__(None, None, None)
        _P.set_active(None)
    _emit(selector.drain())
    _emit(selector.flush())


def enable_from_env() -> bool:
    """Enables the record named by $TERRA_PROFILE_RECORD, if set. Warns instead of raising (it is
    called at import): without CUDA once per process, as enable(). Returns whether a record is
    enabled."""
    if not os.environ.get(ENV_RECORD):
        return False
    why = _why_no_cuda()
    if why is not None:
        _warn_no_cuda_once(f"{ENV_RECORD} is set but the record is not used: {why}", stacklevel=2)
        return False
    try:
        enable()
    except (RuntimeError, ValueError, OSError) as e:
        warnings.warn(f"{ENV_RECORD} is set but the record is not used: {e}", ProfileRecordWarning,
                      stacklevel=2)
        return False
    return is_enabled()


def is_enabled() -> bool:
    return _selector is not None


def flush() -> None:
    """Saves unsaved entries now and reports what happened since the last report."""
    selector = _selector
    if selector is not None:
        _emit(selector.drain())
        _emit(selector.flush())


def stats() -> dict[str, int]:
    """Counters of the enabled record: calls, plan_hits (a cached execution plan ran), plan_builds,
    record_hits (a cache miss found its entry), profiles, heuristic_runs, fallbacks, failures. All
    zero when nothing is enabled."""
    selector = _selector
    if selector is None:
        return {k: 0 for k in STAT_NAMES}
    _emit(selector.drain())
    return dict(selector.stats())


STAT_NAMES = ("calls", "plan_hits", "plan_builds", "record_hits", "profiles", "heuristic_runs", "fallbacks",
              "failures")


def entries() -> list[Entry]:
    """The entries the enabled record holds in memory (loaded, profiled, merged)."""
    selector = _selector
    return [] if selector is None else list(_entries_from_canonical(selector.entries_json())[1])


def active_path() -> Optional[str]:
    selector = _selector
    return None if selector is None else selector.path


atexit.register(disable)


# ---- the CPU path for the fake provider -----------------------------------------------------

_LAYOUTS = {4: ("nchw", "nhwc", torch.channels_last), 5: ("ncdhw", "ndhwc", torch.channels_last_3d)}
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
           torch.float64: "float64"}


def _layout(x: torch.Tensor, w: torch.Tensor) -> str:
    # As ATen's cudnn_conv_suggest_memory_format: channels-last if input or weight is.
    first, last, fmt = _LAYOUTS.get(w.dim(), ("nc", "nc", None))
    if fmt is None or x.dtype == torch.float64:
        return first
    for t in (x, w):
        if t.is_contiguous(memory_format=fmt) and not t.is_contiguous():
            return last
    return first


def conv_call(x: torch.Tensor, w: torch.Tensor, y_shape: Sequence[int], stride: Sequence[int],
              padding: Sequence[int], dilation: Sequence[int], transposed: bool, groups: int) -> dict[str, Any]:
    """The framework call dict for _C.profile.make_key, shaped as the CUDA kernels see it:
    1-d convolutions become 2-d ones with a unit height (ATen's view4d)."""
    xs, ws, ys = list(x.shape), list(w.shape), list(y_shape)
    spatial = w.dim() - 2
    stride, padding, dilation = ([int(v) for v in p] * (spatial if len(p) == 1 else 1)
                                 for p in (stride, padding, dilation))
    layout = _layout(x, w)
    if w.dim() == 3:
        xs.insert(2, 1), ws.insert(2, 1), ys.insert(2, 1)
        stride, padding, dilation = [1] + stride, [0] + padding, [1] + dilation
        layout = "nchw"
    return {"input": xs, "weight": ws, "output": ys, "stride": stride, "padding": padding,
            "dilation": dilation, "groups": int(groups), "transposed": bool(transposed),
            "dtype": _DTYPES.get(x.dtype, str(x.dtype).replace("torch.", "")), "layout": layout,
            "allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "deterministic": bool(torch.backends.cudnn.deterministic
                                  or torch.are_deterministic_algorithms_enabled())}


class _FakeConvolutionMode(TorchDispatchMode):
    """Routes every aten convolution (forward and backward) through the selection policy with a
    fake provider, then computes it on the CPU as usual. It exercises key derivation, record
    reuse and fallbacks end to end without a GPU; it does not change any result."""

    def __init__(self, selector: Any, provider: Any) -> None:
        super().__init__()
        self.selector = selector
        self.provider = provider

    def _select(self, call: dict[str, Any], pass_: str) -> None:
        key, batch = _P.make_key(call, pass_)
        outcome = self.selector.run(key, batch, self.provider)
        _emit(self.selector.drain())
        if outcome["ok"]:
            logger.debug("%s %s batch %d: %s (%s)", pass_, _P.key_id(key), batch,
                         outcome["config"]["tag"], outcome["source"])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        aten = torch.ops.aten
        if func is aten.convolution.default:
            x, w, _bias, stride, padding, dilation, transposed, _out_pad, groups = args[:9]
            self._select(conv_call(x, w, out.shape, stride, padding, dilation, transposed, groups), "forward")
        elif func is aten.convolution_backward.default:
            gy, x, w, _bias_sizes, stride, padding, dilation, transposed, _out_pad, groups, mask = args[:11]
            call = conv_call(x, w, gy.shape, stride, padding, dilation, transposed, groups)
            if mask[0]:
                self._select(call, "grad_input")
            if mask[1]:
                self._select(call, "grad_weight")
        return out
