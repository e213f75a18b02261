"""Correctness of a cell: its loss trajectory and final-state digest against eager's.

Every runner runs the same program from the same seed for the same number of steps, so the
trajectories compare step by step. Verdicts, from best to worst:
  bitwise  every loss and digest value identical to eager's (what terra_torch promises);
  close    every loss and digest value within |x - ref| <= RTOL * max(1, |ref|) (fused kernels
           reassociate floating point, reductions run in another order);
  drift    the losses are not bitwise but agree to rounding level (within EARLY_RTOL) for the
           first EARLY_STEPS steps, and leave RTOL (losses or digest) only later: rounding
           differences amplified by training itself (momentum, BatchNorm, a GAN). Not a proven
           error, not the same result either;
  WRONG    the run finished but differs beyond that: a silently wrong result;
  error    the run failed; `prefix` says whether the steps before the failure already differed.
terra_torch promises eager's results bit for bit, so for its co-execution runners a `close` or
`drift` result against a deterministic eager is a MISMATCH (`terra_verdict`), never a pass.
Eager itself is checked by running it twice (determinism). The graph-only bound replays recorded
iterations instead of running the program, so `replay_verdict` judges it by its own check (each
recorded iteration replayed from a snapshot of the state before it, bitwise against eager) and by
the steps it did run as the program (step 0 and the recorded steps, against eager's).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

RTOL = 1e-3
EARLY_STEPS = 10
EARLY_RTOL = 1e-5

Value = float | str | None


def as_float(value: Value) -> float:
    """JSON-loaded loss value to float ('nan'/'inf' strings and None included)."""
    if value is None:
        return math.nan
    return float(value)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _error(a: float, b: float) -> float:
    """Error of a against reference b in units of the tolerance (<= 1 is within tolerance)."""
    if _same(a, b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / (RTOL * max(1.0, abs(b)))


def compare_series(ref: Sequence[Value], got: Sequence[Value]) -> dict[str, Any]:
    """Step-by-step comparison over the common prefix."""
    n = min(len(ref), len(got))
    r = [as_float(v) for v in ref[:n]]
    g = [as_float(v) for v in got[:n]]
    errors = [_error(a, b) for a, b in zip(g, r)]
    first_diff = next((k for k in range(n) if not _same(g[k], r[k])), None)
    first_bad = next((k for k in range(n) if errors[k] > 1.0), None)
    rel = [abs(a - b) / max(1.0, abs(b)) if math.isfinite(a) and math.isfinite(b)
           else (0.0 if _same(a, b) else math.inf) for a, b in zip(g, r)]
    return {
        "compared": n,
        "bitwise": first_diff is None,
        "within_tol": first_bad is None,
        "first_diff_step": first_diff,
        "first_bad_step": first_bad,
        "max_rel_err": max(rel, default=0.0),
        "early_max_rel_err": max(rel[:EARLY_STEPS], default=0.0),
    }


def verdict(ref: dict[str, Any], cell: dict[str, Any]) -> dict[str, Any]:
    """The correctness verdict of `cell` against the eager reference result `ref`."""
    if cell.get("status") == "unavailable":
        return {"verdict": "n/a"}
    if not ref.get("losses"):
        return {"verdict": "no reference"}
    losses = compare_series(ref["losses"], cell.get("losses") or [])
    digest = None
    if ref.get("digest") is not None and cell.get("digest") is not None:
        digest = compare_series(ref["digest"], cell["digest"])
    out = {"losses": losses, "digest": digest}
    finished = cell.get("status") == "ok" and losses["compared"] == len(ref["losses"])
    if not finished:
        prefix = "bitwise" if losses["bitwise"] else "close" if losses["within_tol"] else "WRONG"
        out.update(verdict="error", prefix=prefix if losses["compared"] else "none")
        return out
    out["verdict"] = _finished_verdict(losses, digest)
    return out


def _finished_verdict(losses: dict[str, Any], digest: dict[str, Any] | None) -> str:
    parts = [losses] + ([digest] if digest else [])
    if all(p["bitwise"] for p in parts):
        return "bitwise"
    if all(p["within_tol"] for p in parts):
        return "close"
    if _drifts(losses):
        return "drift"  # a final state further apart follows from that; the digest adds nothing
    return "WRONG"


def _drifts(losses: dict[str, Any]) -> bool:
    """Not bitwise, rounding-level agreement early, beyond RTOL (if at all) only later."""
    late = losses["first_bad_step"] is None or losses["first_bad_step"] >= EARLY_STEPS
    return not losses["bitwise"] and losses["early_max_rel_err"] <= EARLY_RTOL and late


def determinism(eager: dict[str, Any]) -> str:
    """'deterministic' when eager's second run matched its first bit for bit."""
    rerun = eager.get("rerun")
    if not rerun:
        return "not checked"
    if "error" in rerun or len(rerun.get("losses") or []) != len(eager.get("losses") or []):
        return "rerun failed"
    same = compare_series(eager.get("losses") or [], rerun.get("losses") or [])
    same_digest = compare_series(eager.get("digest") or [], rerun.get("digest") or [])
    return "deterministic" if same["bitwise"] and same_digest["bitwise"] else "NOT deterministic"


def replay_verdict(ref: dict[str, Any], cell: dict[str, Any]) -> dict[str, Any]:
    """Verdict of a graph-only cell: its replay check plus the program steps it ran for real."""
    if cell.get("status") == "unavailable":
        return {"verdict": "n/a"}
    if cell.get("status") != "ok":
        return {"verdict": "error", "prefix": "none", "basis": "replay"}
    stats = cell.get("stats") or {}
    check = stats.get("replay_check") or {}
    plan = stats.get("plan") or {}
    first = int(plan.get("first_recorded_step", 1))
    ran = (cell.get("losses") or [])[:first] + list(plan.get("recorded_losses") or [])
    expected = (ref.get("losses") or [])[:len(ran)]
    steps = compare_series(expected, ran)
    replay_ok = check.get("verdict") == "bitwise"
    verdict = "bitwise" if steps["bitwise"] and replay_ok and steps["compared"] == len(ran) else "WRONG"
    return {"verdict": verdict, "basis": "replay", "losses": steps, "digest": None,
            "replay": {k: check.get(k) for k in ("verdict", "iterations", "losses_bitwise",
                                                 "state_tensors_checked", "unmapped_externals",
                                                 "mismatches")}}


def terra_verdict(ref: dict[str, Any], cell: dict[str, Any]) -> dict[str, Any]:
    """`verdict`, except that anything short of bitwise is a MISMATCH when eager is deterministic:
    co-execution runs eager's own kernels in eager's order, so there is no rounding excuse."""
    out = verdict(ref, cell)
    if out["verdict"] in ("close", "drift") and determinism(ref) == "deterministic":
        out["tolerance_class"] = out["verdict"]
        out["verdict"] = "MISMATCH"
    return out
