"""Bytecode facts the C++ location tracker asks for once per code object.

The loops of a code object are the ranges [target, jump] of its backward jumps; `dis` knows each
Python version's opcodes and jump encodings, so this stays correct from 3.11 to 3.13.
"""

from __future__ import annotations

import dis
from types import CodeType


def _is_backward_jump(opname: str) -> bool:
    # 3.11: JUMP_BACKWARD, JUMP_BACKWARD_NO_INTERRUPT, and POP_JUMP_BACKWARD_IF_TRUE/FALSE/NONE/
    # NOT_NONE (how a `while` loop closes); 3.12+: JUMP_BACKWARD[_NO_INTERRUPT].
    return "JUMP_BACKWARD" in opname


def loop_ranges(code: CodeType) -> list[tuple[int, int]]:
    """(loop head offset, backward jump offset) for each loop of `code`, sorted by head."""
    ends: dict[int, int] = {}  # `continue` adds more backward jumps to the same head
    for instr in dis.get_instructions(code):
        if _is_backward_jump(instr.opname) and isinstance(instr.argval, int):
            ends[instr.argval] = max(ends.get(instr.argval, 0), instr.offset)
    return sorted(ends.items())
