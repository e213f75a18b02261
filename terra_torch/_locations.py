"""Bytecode facts the C++ location tracker asks for once per code object.

The loops of a code object are the ranges [target, jump] of its backward jumps; `dis` knows each
Python version's opcodes and jump encodings, so this stays correct from 3.11 to 3.13.

The guarded ranges are the instructions inside a `try` whose handler is an `except` clause: an
op issued there may raise an exception the program catches, so co-execution checks its
arguments before it lets the graph run it (docs/RUNTIME.md, "Errors only the data can raise").
"""

from __future__ import annotations

import builtins
import dis
import hashlib
import os
from types import CodeType

import torch

# Library code (torch's, ours) catches to re-raise or to fall back; only the user's own
# handlers decide what an exception means for the program.
_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


def _is_backward_jump(opname: str) -> bool:
    # 3.11: JUMP_BACKWARD, JUMP_BACKWARD_NO_INTERRUPT, and POP_JUMP_BACKWARD_IF_TRUE/FALSE/NONE/
    # NOT_NONE (how a `while` loop closes); 3.12+: JUMP_BACKWARD[_NO_INTERRUPT].
    return "JUMP_BACKWARD" in opname


# The opcodes of backward jumps. `co_code` holds one opcode per 2-byte unit (inline caches are
# units of their own, opcode 0), so a code object none of whose units is one of these has no
# loop, and `dis` (about 2.5 us per instruction: the first traced iteration of the demo's
# MLP + Adam spent most of its 13 ms in it, for 24 code objects) is not needed.
_BACKWARD_JUMP_OPCODES = frozenset(op for name, op in dis.opmap.items() if _is_backward_jump(name))


def _may_loop(code: CodeType) -> bool:
    return not _BACKWARD_JUMP_OPCODES.isdisjoint(code.co_code[0::2])


def loop_ranges(code: CodeType, instructions: list[dis.Instruction] | None = None) -> list[tuple[int, int]]:
    """(loop head offset, backward jump offset) for each loop of `code`, sorted by head."""
    if not _may_loop(code):
        return []
    ends: dict[int, int] = {}  # `continue` adds more backward jumps to the same head
    for instr in instructions if instructions is not None else dis.get_instructions(code):
        if _is_backward_jump(instr.opname) and isinstance(instr.argval, int):
            ends[instr.argval] = max(ends.get(instr.argval, 0), instr.offset)
    return sorted(ends.items())


# What torch's kernels raise (c10::Error and its kinds, as torch translates them).
_KERNEL_ERRORS = (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError)
_LOADS = ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_FAST", "LOAD_ATTR", "LOAD_CONST")


def _may_catch_kernel_errors(names: list[str]) -> bool:
    """False only when every class the clause names is a builtin that catches none of
    _KERNEL_ERRORS (`except KeyboardInterrupt`, `except (KeyError, OSError)`); any other name
    (a module attribute, a class of the program) may."""
    for name in names:
        cls = getattr(builtins, name, None)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            return True
        if any(issubclass(err, cls) for err in _KERNEL_ERRORS):
            return True
    return False


def _catches(instructions: list[dis.Instruction], at: dict[int, int], target: int) -> bool:
    """Whether the handler at `target` is an `except` clause that may catch a kernel's error.
    Every handler the compiler makes for a `try`, `with` or `finally` starts by pushing the
    exception; a `with` then calls __exit__ (WITH_EXCEPT_START), a `finally` runs its body and
    re-raises, and an `except` matches the type (CHECK_EXC_MATCH, CHECK_EG_MATCH for except*)
    or, bare, pops it. A chain of clauses tests one type after the other."""
    i = at.get(target)
    if i is None or instructions[i].opname != "PUSH_EXC_INFO":
        return False  # cleanup handlers of except bodies, generators, comprehensions
    follow = instructions[i + 1:]
    if not follow or follow[0].opname == "WITH_EXCEPT_START":
        return False
    if follow[0].opname == "POP_TOP":
        return True  # bare `except:`
    # Clause by clause: a typed clause loads its classes and matches them; when they do not
    # match, a conditional jump leads to the next clause, which is typed, bare, or RERAISE.
    k, names = i + 1, []
    for _ in range(256):
        if k >= len(instructions):
            return False
        ins = instructions[k]
        if ins.opname in _LOADS and isinstance(ins.argval, str):
            names.append(ins.argval)
        elif ins.opname in ("CHECK_EXC_MATCH", "CHECK_EG_MATCH"):
            if _may_catch_kernel_errors(names):
                return True
            jump = instructions[k + 1] if k + 1 < len(instructions) else None
            if jump is None or "JUMP" not in jump.opname or jump.argval not in at:
                return True  # an unfamiliar shape: assume it catches
            k, names = at[jump.argval], []
            if instructions[k].opname == "POP_TOP":
                return True  # a bare `except:` after the typed clauses
            continue
        elif ins.opname in ("RERAISE", "POP_EXCEPT", "WITH_EXCEPT_START", "RETURN_VALUE"):
            return False
        k += 1
    return True


def guarded_ranges(code: CodeType, instructions: list[dis.Instruction] | None = None) -> list[tuple[int, int]]:
    """[start, end) instruction offsets of `code` that an `except` clause of its own covers."""
    if code.co_filename.startswith(_LIBRARY_DIRS):
        return []
    entries = dis.Bytecode(code).exception_entries
    if not entries:
        return []
    if instructions is None:
        instructions = list(dis.get_instructions(code))
    at = {ins.offset: k for k, ins in enumerate(instructions)}
    return sorted((e.start, e.end) for e in entries if _catches(instructions, at, e.target))


def code_identity(code: CodeType) -> int:
    """A 63-bit name for `code` that is the same in every process running the same source: its
    file, qualified name, first line, names and bytecode. Location ids are built from it instead
    of the code object's address, so that a program's traces mean the same after a restart
    (warm start, terra_torch/_warm_start.py). Constants are left out: a nested function's code
    object among them prints its address."""
    h = hashlib.blake2b(digest_size=8)
    for part in (code.co_filename, code.co_qualname, str(code.co_firstlineno), "\0".join(code.co_names)):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    h.update(code.co_code)
    return int.from_bytes(h.digest(), "little") >> 1


def code_facts(code: CodeType) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """What the location tracker caches per code object: its loops, its guarded ranges and its
    identity."""
    both = _may_loop(code) and not code.co_filename.startswith(_LIBRARY_DIRS)  # (then walked once for both)
    instructions = list(dis.get_instructions(code)) if both else None
    return loop_ranges(code, instructions), guarded_ranges(code, instructions), code_identity(code)
