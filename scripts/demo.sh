#!/usr/bin/env bash
# The main job: a real training loop under terra_torch, with its result (see scripts/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec .venv/bin/python scripts/demo.py "$@"
