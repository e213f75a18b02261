"""`python -m terra_torch.warmup` and scripts/warmup_profile_cache.py as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import terra_torch
from terra_torch import profile as tp

REPO = Path(__file__).resolve().parents[2]

MODEL = """
import torch.nn as nn

def build():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, stride=2, groups=2), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))

def not_a_model():
    return 42
"""


def run_warmup(tmp_path: Path, *args: str, script: bool = False) -> subprocess.CompletedProcess[str]:
    (tmp_path / "warmup_tiny_model.py").write_text(MODEL)
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(terra_torch.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), package_root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(REPO / "scripts" / "warmup_profile_cache.py")] if script else \
          [sys.executable, "-m", "terra_torch.warmup"]
    return subprocess.run(cmd + list(args), env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_fake_provider_run_writes_the_record(tmp_path: Path) -> None:
    record = tmp_path / "r.json"
    r = run_warmup(tmp_path, "--model", "warmup_tiny_model:build", "--input-shape", "4,3,16,16",
                   "--record", str(record), "--batch-sizes", "4,6", "--fake-provider")
    assert r.returncode == 0, r.stderr
    assert "[##############################] 4/4 convolutions" in r.stderr
    assert "5 entries; this run profiled 5, reused 5" in r.stdout
    loaded = tp.load(record)
    assert loaded.status == "ok" and loaded.header.device_name == tp.FAKE_DEVICE_NAME
    assert {e.key.role for e in loaded.entries} == {"forward", "backward_data", "backward_filter"}
    assert {e.profiled_batch for e in loaded.entries} == {4}

    again = run_warmup(tmp_path, "--model", "warmup_tiny_model:build", "--input-shape", "2,3,16,16",
                       "--record", str(record), "--fake-provider", "--quiet", "--workspace-cap", "1MiB")
    assert again.returncode == 0, again.stderr
    assert "this run profiled 0, reused 5" in again.stdout
    assert "convolutions" not in again.stderr


def test_script_wrapper_and_help(tmp_path: Path) -> None:
    r = run_warmup(tmp_path, "--help", script=True)
    assert r.returncode == 0
    for option in ("--model", "--input-shape", "--record", "--batch-sizes", "--workspace-cap", "--device",
                   "--dtype", "--channels-last", "--eval", "--fake-provider", "--quiet"):
        assert option in r.stdout
    record = tmp_path / "eval.json"
    r = run_warmup(tmp_path, "--model", "warmup_tiny_model:build", "--input-shape", "2,3,8,8", "--record",
                   str(record), "--fake-provider", "--eval", script=True)
    assert r.returncode == 0, r.stderr
    assert {e.key.role for e in tp.load(record).entries} == {"forward"}


@pytest.mark.parametrize("args, message", [
    (["--input-shape", "2,3,8,8", "--record", "r.json"], "--model"),
    (["--model", "warmup_tiny_model", "--input-shape", "2,3,8,8", "--record", "r.json"], "package.module:factory"),
    (["--model", "warmup_tiny_model:build", "--input-shape", "2,x,8", "--record", "r.json"], "comma-separated integers"),
    (["--model", "warmup_tiny_model:build", "--input-shape", "2,3", "--record", "r.json"], "at least 3 positive"),
    (["--model", "warmup_tiny_model:build", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--batch-sizes", "0"], "positive integers"),
    (["--model", "warmup_tiny_model:build", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--workspace-cap", "lots"], "not a size"),
    (["--model", "warmup_tiny_model:missing", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--fake-provider"], "has no attribute 'missing'"),
    (["--model", "no_such_module_xyz:build", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--fake-provider"], "No module named"),
    (["--model", "warmup_tiny_model:not_a_model", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--fake-provider"], "not a torch.nn.Module"),
    (["--model", "warmup_tiny_model:build", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--fake-provider", "--device", "cuda"], "--device cpu only"),
    (["--model", "warmup_tiny_model:build", "--input-shape", "2,3,8,8", "--record", "r.json",
      "--device", "cpu"], "needs a CUDA device"),
])
def test_bad_arguments_exit_2_with_a_clear_error(tmp_path: Path, args: list[str], message: str) -> None:
    r = run_warmup(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert "error:" in r.stderr and message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of CPU-only machines")
def test_without_cuda_it_says_profiling_needs_a_cuda_device(tmp_path: Path) -> None:
    r = run_warmup(tmp_path, "--model", "warmup_tiny_model:build", "--input-shape", "2,3,8,8",
                   "--record", str(tmp_path / "r.json"))
    assert r.returncode == 1
    assert "needs a CUDA device" in r.stderr and "--fake-provider" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "r.json").exists()
