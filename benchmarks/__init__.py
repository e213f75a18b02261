"""Benchmarks for terra_torch against eager PyTorch and the peers a user would pick instead.

Exists so that `python -m benchmarks.run` works from the repository root: the programs
(benchmarks/programs), the harness that runs them under each runner (benchmarks/harness) and the
results (benchmarks/results) live in one importable package. See docs/BENCHMARKS.md.
"""
