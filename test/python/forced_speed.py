"""A speed check whose decisions a test chooses (test_speed_check.py, ddp_programs.py)."""

from __future__ import annotations

from terra_torch._speed import SpeedCheck


class Forced(SpeedCheck):
    """Co-executes and runs eagerly in turns: `schedule` is a list of (mode, iterations)."""

    def __init__(self, schedule: list[tuple[str, int]]) -> None:
        super().__init__(True, probe=(0, 0))
        self.plan = [m for m, n in schedule for _ in range(n)]
        self.seen = 0

    def observe(self, mode: str, seconds: float, iteration: int, waited: float | None = None) -> str:
        self.seen += 1
        return self.plan[min(self.seen, len(self.plan) - 1)]
