"""The floor under benchmarks.capture_overhead: the same 1,000-op chain of 8x8 add / mul / relu,
intercepted by a boxed dispatcher kernel that records nothing (benchmarks/dispatch_floor.cpp,
compiled on first use, about a minute). No capture scheme built on a boxed fallback can cost less
than these rows. Run: .venv/bin/python -m benchmarks.dispatch_floor
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from torch.utils import cpp_extension

from benchmarks.capture_overhead import chain, time_per_op

ROWS = [
    (0, "fallback returns its input"),
    (1, "  + GIL taken and given back"),
    (2, "  + a fresh dataless TensorImpl"),
    (3, "fallback runs the real kernel"),
    (4, "  + GIL taken and given back"),
]


def load_floor():
    source = pathlib.Path(__file__).with_name("dispatch_floor.cpp")
    return cpp_extension.load(name="terra_dispatch_floor", sources=[str(source)],
                              extra_cflags=["-O2", "-std=c++20"], verbose=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions (median reported)")
    args = parser.parse_args()
    floor = load_floor()
    torch.set_num_threads(1)
    x, y = torch.randn(8, 8), torch.randn(8, 8)

    def intercepted(mode: int):
        def run(a, b) -> None:
            floor.on(mode)
            try:
                chain(a, b)
            finally:
                floor.off()
        return run

    eager = time_per_op(lambda a, b: chain(a, b), x, y, args.reps)
    print(f"torch {torch.__version__}, 8x8 ops, median of {args.reps}")
    print(f"{'':<34} {'us/op':>8} {'x eager':>8}")
    print(f"{'eager':<34} {eager:8.2f} {1.0:8.2f}")
    for mode, name in ROWS:
        us = time_per_op(intercepted(mode), x, y, args.reps)
        print(f"{name:<34} {us:8.2f} {us / eager:8.2f}")


if __name__ == "__main__":
    main()
