#!/usr/bin/env bash
# The main job in one command: setup (idempotent), then train a small model eagerly and under
# terra_torch.wrap from the same seed and print both speeds, whether losses and parameters matched
# bit for bit, and the runtime's phases and fallbacks (scripts/demo.py; about 10 s). Exit status 0
# only when terra_torch reproduced eager's results. Arguments pass through (--steps, --threads).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec .venv/bin/python scripts/demo.py "$@"
