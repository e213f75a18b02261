"""Shared by every test file: a test that fails midway must not leave its iteration open (or a
graph running) for the next one."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _close_every_program():
    yield
    from terra_torch import runtime

    runtime.close_all()
