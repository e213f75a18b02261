"""The extension loads against the installed torch, and the version gates refuse what they must."""

import subprocess
import sys

import pytest
import torch

import terra_torch
from terra_torch import _C, _torch_gate


def test_extension_matches_installed_torch():
    compiled = _C.compiled_torch_version.split(".")[:2]
    running = torch.__version__.split("+")[0].split(".")[:2]
    assert compiled == running
    assert isinstance(_C.with_cuda, bool)


@pytest.mark.parametrize("version", ["2.11.0", "2.13.0+cpu", "2.14.1+cu130", "2.14.0a0+git123"])
def test_gate_accepts_supported(version):
    _torch_gate.check(version)


@pytest.mark.parametrize("version", ["2.10.2", "2.15.0", "3.0.0", "1.13.1"])
def test_gate_rejects_unsupported_with_range(version):
    with pytest.raises(ImportError, match=r"torch>=2\.11,<2\.15; found torch " + version.replace(".", r"\.")):
        _torch_gate.check(version)


def test_gate_rejects_unreadable_version():
    with pytest.raises(ImportError, match="cannot read"):
        _torch_gate.check("nightly")


def test_abi_check_rejects_other_minor_release():
    with pytest.raises(RuntimeError, match="was compiled against torch"):
        _C.check_torch_abi("2.99.0")
    _C.check_torch_abi(torch.__version__)


def test_import_with_unsupported_torch_fails_clearly():
    # A fresh interpreter whose torch claims to be 2.10: importing terra_torch must name the range.
    code = "import torch; torch.__version__ = '2.10.0'; import terra_torch"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "terra_torch supports torch>=2.11,<2.15; found torch 2.10.0" in proc.stderr
