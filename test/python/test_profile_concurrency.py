"""Two processes writing one record at the same time: no corrupt file, no lost entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import terra_torch
from terra_torch import profile as tp

# Each writer profiles its own convolutions (distinct channel counts), one save per convolution,
# and checks after every one that the file on disk is whole.
WRITER = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from terra_torch import profile as tp
    warnings.simplefilter("error", tp.ProfileRecordWarning)
    path, offset, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tp.enable(path, provider=tp.FakeProvider())
    with torch.no_grad():
        for i in range(count):
            channels = 1 + 2 * i + offset
            torch.nn.Conv2d(channels, 2, 1)(torch.randn(1, channels, 2, 2))
            record = tp.load(path)
            assert record.status == "ok", record
    tp.disable()
""")


def test_two_writer_processes_never_corrupt_and_both_survive(tmp_path: Path) -> None:
    path = tmp_path / "shared.json"
    count = 30
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(terra_torch.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(offset), str(count)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for offset in (0, 1)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out

    record = tp.load(path)
    assert record.status == "ok" and record.problems == ()
    assert len(record.entries) == 2 * count
    assert sorted(e.key.input[0] for e in record.entries) == list(range(1, 2 * count + 1))
    assert not [f for f in os.listdir(tmp_path) if ".tmp." in f], "a temporary file was left behind"
    json.loads(path.read_text())
