"""Shared by every test file: a test that fails midway must not leave its iteration open (or a
graph running) for the next one."""

from __future__ import annotations

import os

import pytest

# Every generated graph is linted (Graph::lint: each value defined before its uses, blocks well
# formed); a user's program skips it (csrc/runtime/session.cpp, Session::build). Set before any
# graph is built: the runtime reads it once. Subprocesses the tests start inherit it.
os.environ.setdefault("TERRA_LINT_GRAPHS", "1")


@pytest.fixture(autouse=True)
def _close_every_program():
    yield
    from terra_torch import runtime

    runtime.close_all()


@pytest.fixture(autouse=True)
def _no_speed_check_by_default(monkeypatch):
    """Tests count co-executed iterations to see a mechanism at work (the backward fast path,
    run-ahead, reads); the speed check may send a program to eager after ~30 iterations where
    the graph is the limit (terra_torch/_speed.py, "Probe"), and on a loaded machine it
    would decide those counts. The check itself is tested with a SpeedCheck a test installs
    (test_speed_check.py), which this variable does not reach."""
    monkeypatch.setenv("TERRA_SPEED_CHECK", "0")
