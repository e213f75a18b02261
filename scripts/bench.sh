#!/usr/bin/env bash
# Runs the benchmarks: setup (idempotent), then `python -m benchmarks.run` with the venv's Python.
# Arguments pass through, e.g. `scripts/bench.sh --quick`, `scripts/bench.sh --only gpt --runners
# compile,lazy`. Results land in benchmarks/results/<quick|full>/ (see docs/BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m benchmarks.run "$@"
