"""Instructions per co-executed step on the Python thread, per function (callgrind).

Wall and CPU time on the shared development machine move by 10-50% when another tenant runs,
and its VM has no hardware counters (`perf stat -e instructions` reports "not supported"), so a
change that removes a few percent of the Python thread's work is invisible in a wall-clock
ratio. Callgrind counts instructions, which load does not move: this runs
`benchmarks.coexec_profile` under it twice (N and 2N steps), once per thread output file, and
divides the difference of the Python thread's counts by N, so that start-up, tracing and graph
generation cancel out. Per function it prints the inclusive count per step.

    python -m benchmarks.callgrind_step --optimizer adam --steps 200 [--match 'terra::']

Takes about 4 minutes for 200 steps of the MLP on this machine (valgrind runs the threads one at
a time). What it cannot show: cache misses, lock contention and futex wake-ups (kernel work is
not counted), which perf sample fractions show (docs/ARCHITECTURE.md, "Per-op cost"). Spinning is
turned off (TERRA_SPIN_US=0) so that waits, which valgrind's thread serialisation lengthens, add
no instructions.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.coexec_profile import OPTIMIZERS

ROOT = Path(__file__).resolve().parent.parent


def run(steps: int, optimizer: str, eager: bool, out_dir: Path, program: str | None = None) -> Path:
    """Runs the profile loop under callgrind; returns the Python thread's output file."""
    for old in out_dir.glob("cg.*"):
        old.unlink()
    cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--dump-instr=no",
           "--compress-strings=no", f"--callgrind-out-file={out_dir}/cg.%p",
           sys.executable, "-m", "benchmarks.coexec_profile", "--optimizer", optimizer, "--steps", str(steps)]
    if eager:
        cmd.append("--eager")
    if program is not None:
        cmd += ["--program", program]
    env = dict(os.environ, TERRA_SPEED_CHECK="0", TERRA_SPIN_US="0")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"callgrind run failed:\n{done.stderr[-3000:]}")
    threads = sorted(out_dir.glob("cg.*-01"))
    if not threads:
        raise SystemExit(f"no per-thread output in {out_dir}")
    return threads[0]


def inclusive(path: Path, exclusive: bool = False) -> Counter:
    """Inclusive (or, with `exclusive`, self) instructions per function name (the largest entry
    where a name repeats)."""
    out = subprocess.run(["callgrind_annotate", f"--inclusive={'no' if exclusive else 'yes'}", "--threshold=100", str(path)],
                         capture_output=True, text=True, check=True).stdout
    counts: Counter = Counter()
    for line in out.splitlines():
        if "=>" in line:
            continue
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if not m:
            continue
        name = re.sub(r"\s*\[[^\]]*\]\s*$", "", m.group(2))
        if ":" in name.split("(")[0]:
            name = name.split(":", 1)[1]  # drop the source file
        if name.endswith("'2"):
            continue  # callgrind's recursion levels
        counts[name] = max(counts[name], int(m.group(1).replace(",", "")))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    p.add_argument("--steps", type=int, default=200, help="N: the two runs take N and 2N steps")
    p.add_argument("--eager", action="store_true", help="the same loop eagerly")
    p.add_argument("--match", default="terra::", help="regular expression: which functions to list")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--program", default=None, help="a benchmark program (benchmarks/programs) instead of the MLP")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep the two runs' outputs in this folder; a folder that has them already is read "
                        "instead of running again (one run, several listings)")
    p.add_argument("--self", dest="exclusive", action="store_true",
                   help="per function, the instructions spent in it alone (callee's excluded)")
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None or shutil.which("callgrind_annotate") is None:
        print("valgrind (callgrind) is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    def measure(tmp: Path) -> tuple[Counter, Counter]:
        counts = []
        for name, steps in (("short", args.steps), ("long", 2 * args.steps)):
            folder = tmp / name
            folder.mkdir(parents=True, exist_ok=True)
            kept = sorted(folder.glob("cg.*-01"))
            path = kept[0] if kept and args.keep is not None else run(steps, args.optimizer, args.eager, folder,
                                                                       args.program)
            counts.append(inclusive(path, args.exclusive))
        return counts[0], counts[1]

    if args.keep is not None:
        a, b = measure(args.keep)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            a, b = measure(Path(tmp))
    per_step = {k: (b[k] - a.get(k, 0)) / args.steps for k in b}
    total = per_step.get("PROGRAM TOTALS", 0.0)
    print(f"{'eager' if args.eager else 'terra'} {args.program or args.optimizer}: {total:,.0f} instructions per step "
          "on the Python thread (callgrind)")
    pattern = re.compile(args.match)
    rows = [(v, k) for k, v in per_step.items() if pattern.search(k) and k != "PROGRAM TOTALS"]
    for v, k in sorted(rows, reverse=True)[: args.top]:
        print(f"{v:12,.0f} {100 * v / total:5.1f}%  {k[:140]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
