#!/usr/bin/env python3
"""Fill a convolution profile record before training; a thin wrapper around
`python -m terra_torch.warmup` (same options, see --help) for people who look in scripts/."""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    try:
        from terra_torch.warmup import main
    except ImportError:
        # Not installed: use the checkout this script sits in.
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from terra_torch.warmup import main

    sys.exit(main())
