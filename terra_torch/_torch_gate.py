"""The torch version gate: terra_torch hooks torch's C++ dispatcher, so it only runs with the
torch releases it was built and tested for. Checked before the extension is loaded, so a wrong
torch gives a sentence instead of an undefined-symbol error."""

from __future__ import annotations

import re

SUPPORTED_MIN = (2, 11)  # inclusive
SUPPORTED_MAX = (2, 15)  # exclusive


def parse(version: str) -> tuple[int, int]:
    """'2.13.0+cpu' -> (2, 13)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"terra_torch: cannot read the torch version {version!r}")
    return int(match.group(1)), int(match.group(2))


def check(version: str) -> None:
    """Raises ImportError naming the supported range when `version` is outside it."""
    found = parse(version)
    if not (SUPPORTED_MIN <= found < SUPPORTED_MAX):
        lo = ".".join(map(str, SUPPORTED_MIN))
        hi = ".".join(map(str, SUPPORTED_MAX))
        raise ImportError(
            f"terra_torch supports torch>={lo},<{hi}; found torch {version}. "
            f"Install a supported release, e.g. `pip install torch==2.13.0`."
        )
