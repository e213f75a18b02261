"""Warm start: a program's traces kept across runs, so that a restarted job co-executes from its
first iteration instead of tracing again (docs/RUNTIME.md, "Warm start").

What is kept is the input of everything else: the traces the session merged (the TraceGraph,
the generated graph and its tables are made from them again, deterministically, in milliseconds;
compiled segments have their own cache, terra_torch/_fused.py). One file per program:

    $TERRA_CACHE_DIR/programs/<key>.json   (TERRA_CACHE_DIR defaults to ~/.cache/terra_torch)

The key names what the traces are valid for: the program's name, the code object of the frame
that calls it (file, qualified name, first line), the module's structure (submodule types,
parameter and buffer names, shapes, dtypes, devices) or, for a step function, its first call's
arguments, torch's and terra_torch's versions and Python's. Inside, the file records the source files the traces' locations run through and a hash
of each: one that changed makes the entry stale. (Locations themselves are built from code
identities, bytecode included: capture/program_location.h. A change the file hashes miss still
only costs a divergence and a fallback, never a wrong number: co-execution checks every op.)

A corrupt, foreign or stale entry is ignored with one warning and replaced when the program is
kept again. Writers take a lock on the folder and rename a complete file into place, so readers
never see half a file and concurrent writers never interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import CodeType
from typing import Any, Iterator

import torch

from terra_torch import _fused

logger = logging.getLogger("terra_torch")

# /2: host bookkeeping ops (no tensor in or out) leave no record, so a /1 program has nodes no
# iteration reaches.
FORMAT = "terra_torch.kept_program/2"
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(__file__) + os.sep
_FRAME = re.compile(r"^(.*):\d+ in [^:]*$")  # LocationTracker::describe: "file:line in function"


def directory_from(option: bool | str | os.PathLike[str] | None) -> Path | None:
    """Where a program's entry lives, from wrap()'s `warm_start` (None: the TERRA_WARM_START
    environment variable, "1" for the default folder, a path for that one, unset or "0" for
    none); None when warm start is off."""
    if option is None:
        env = os.environ.get("TERRA_WARM_START", "")
        option = False if env in ("", "0") else True if env == "1" else env
    if option is False:
        return None
    if option is True:
        return _fused.cache_root() / "programs"
    if isinstance(option, (str, os.PathLike)):
        return Path(option)
    raise TypeError(f"terra_torch: warm_start must be a bool or a folder path, got {type(option).__name__}")


def module_structure(module: torch.nn.Module) -> list[Any]:
    """What a wrapped module's traces depend on besides the code: its submodules' types and its
    tensors' names, shapes, dtypes, devices and requires_grad (a model moved to the GPU, or one
    with a wider layer, is another program)."""
    out: list[Any] = []
    for name, m in module.named_modules():
        out.append(["module", name, f"{type(m).__module__}.{type(m).__qualname__}"])
    for kind, tensors in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in tensors:
            out.append([kind, name, list(t.shape), str(t.dtype), str(t.device), bool(t.requires_grad)])
    return out


def argument_structure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """What a step function's traces depend on in its first call's arguments: tensors' shapes,
    dtypes and devices, modules' structure (module_structure), other values' types."""
    def describe(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ["tensor", list(v.shape), str(v.dtype), str(v.device), bool(v.requires_grad)]
        if isinstance(v, torch.nn.Module):
            return ["module", module_structure(v)]
        return ["value", f"{type(v).__module__}.{type(v).__qualname__}"]

    return [describe(a) for a in args] + [[k, describe(v)] for k, v in sorted(kwargs.items())]


def _code_name(code: CodeType) -> list[Any]:
    return [code.co_filename, code.co_qualname, code.co_firstlineno]


def program_key(name: str, caller: CodeType | None, structure: list[Any]) -> tuple[str, dict[str, Any]]:
    """The entry's file name and what it was made of (kept in the file, to tell a foreign entry)."""
    from terra_torch import __version__ as terra_version

    identity = {"format": FORMAT, "program": name, "caller": _code_name(caller) if caller is not None else None,
                "structure": structure, "torch": torch.__version__, "terra_torch": terra_version,
                "python": sys.version.split()[0]}
    text = json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32], identity


def _file_hash(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def source_files(program_text: str) -> dict[str, str]:
    """The user's source files the kept traces' locations run through, with their hashes (torch's
    and terra_torch's own are covered by the versions in the key; "<stdin>" has no file)."""
    frames = json.loads(program_text).get("frames", [])
    files: dict[str, str] = {}
    for _location, lines in frames:
        for line in lines:
            m = _FRAME.match(line)
            if m is None:
                continue
            path = m.group(1)
            if path in files or path.startswith((_TORCH_DIR, _OWN_DIR)) or not os.path.isfile(path):
                continue
            digest = _file_hash(path)
            if digest is not None:
                files[path] = digest
    return files


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class KeptProgram:
    """One program's entry: load() at its first iteration, save() after each graph build."""

    def __init__(self, folder: Path, name: str, caller: CodeType | None, structure: list[Any]) -> None:
        self.key, self.identity = program_key(name, caller, structure)
        self.path = folder / f"{self.key}.json"
        self.name = name

    def ignore(self, why: str) -> None:
        """The one warning of an entry that cannot be used: it is traced again and kept anew."""
        warnings.warn(f"terra_torch: ignoring the kept program {self.path} of {self.name} ({why}); "
                      "tracing it again and keeping it anew", stacklevel=5)

    def load(self) -> str | None:
        """The kept program's text, or None: no entry (a cold start), or one ignored with a
        warning (corrupt, foreign or stale)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.ignore(f"unreadable: {e}")
            return None
        try:
            entry = json.loads(raw)
            identity, files, program = entry["identity"], entry["files"], entry["program"]
            if not isinstance(program, str) or not isinstance(files, dict):
                raise TypeError("wrong field types")
        except (ValueError, KeyError, TypeError) as e:
            self.ignore(f"corrupt: {e}")
            return None
        if identity != self.identity:
            differs = sorted(k for k in set(identity) | set(self.identity) if identity.get(k) != self.identity.get(k))
            self.ignore(f"foreign: made for another {', '.join(differs)}")
            return None
        changed = [p for p, digest in files.items() if _file_hash(p) != digest]
        if changed:
            self.ignore(f"stale: {changed[0]} changed since it was kept")
            return None
        return program

    def save(self, program_text: str) -> None:
        entry = {"identity": self.identity, "files": source_files(program_text), "saved": time.time(),
                 "program": program_text}
        data = json.dumps(entry).encode()
        folder = self.path.parent
        with _locked(folder):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{self.key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
