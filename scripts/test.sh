#!/usr/bin/env bash
# Runs every test: setup, then the GoogleTest suites through CTest, then pytest.
# Exits non-zero on any failure; its last line is pytest's summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j 2
exec .venv/bin/python -m pytest test/python -q "$@"
