"""Profile records through the Python API, on CPU with the fake provider: keys, reuse across
batch sizes and runs, fallbacks, the workspace cap, the environment variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.nn as nn

from terra_torch import _C
from terra_torch import profile as tp


@pytest.fixture(autouse=True)
def _disabled() -> Iterator[None]:
    tp.disable()
    yield
    tp.disable()


def tiny_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(8, 4, 3, stride=2),
                         nn.ReLU(), nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1))


def train_step(model: nn.Module, batch: int) -> torch.Tensor:
    out = model(torch.randn(batch, 3, 16, 16))
    out.sum().backward()
    return out


# Entries a training step of tiny_net needs: conv1 forward + filter gradient (its input needs no
# gradient), conv2 and the transposed conv all three roles.
TINY_NET_ENTRIES = 8


def test_key_excludes_batch_and_maps_transposed() -> None:
    call = {"input": [8, 64, 56, 56], "weight": [64, 64, 3, 3], "output": [8, 64, 56, 56], "padding": [1, 1],
            "stride": [1, 1], "dilation": [1, 1], "groups": 1, "dtype": "float32", "layout": "nchw"}
    key8, batch8 = _C.profile.make_key(call, "forward")
    key32, batch32 = _C.profile.make_key({**call, "input": [32, 64, 56, 56], "output": [32, 64, 56, 56]}, "forward")
    assert key8 == key32 and (batch8, batch32) == (8, 32)
    assert key8["input"] == [64, 56, 56]
    transposed, _ = _C.profile.make_key({**call, "transposed": True}, "forward")
    assert transposed["role"] == "backward_data"
    with pytest.raises(ValueError, match="pass must be"):
        _C.profile.make_key(call, "sideways")


def test_profiles_once_and_reuses_across_batch_sizes(tmp_path: Path) -> None:
    fake = tp.FakeProvider()
    tp.enable(tmp_path / "r.json", provider=fake)
    model = tiny_net()
    train_step(model, 2)
    assert fake.profile_calls == TINY_NET_ENTRIES
    for batch in (1, 5, 16):
        train_step(model, batch)
    assert fake.profile_calls == TINY_NET_ENTRIES, "another batch size must not re-profile"
    s = tp.stats()
    assert s["profiles"] == TINY_NET_ENTRIES
    assert s["record_hits"] == 3 * TINY_NET_ENTRIES
    assert s["failures"] == 0
    assert {e.profiled_batch for e in tp.entries()} == {2}


def test_second_run_uses_the_record_without_profiling(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    tp.enable(path, provider=tp.FakeProvider())
    expected = train_step(tiny_net(), 4)
    tp.disable()

    fake = tp.FakeProvider()
    tp.enable(path, provider=fake)
    got = train_step(tiny_net(), 8)
    assert fake.profile_calls == 0
    assert tp.stats()["record_hits"] == TINY_NET_ENTRIES
    assert got.shape[1:] == expected.shape[1:]


def test_results_are_unchanged_by_the_fake_path(tmp_path: Path) -> None:
    x = torch.randn(2, 3, 16, 16)
    reference = tiny_net()(x)
    tp.enable(tmp_path / "r.json", provider=tp.FakeProvider())
    assert torch.equal(tiny_net()(x), reference)


def test_failing_algorithm_falls_back_to_next_ranked_then_least_memory(tmp_path: Path) -> None:
    fake = tp.FakeProvider()  # fastest first: 4 (FFT-like), 1, 0 (no workspace)
    tp.enable(tmp_path / "r.json", provider=fake)
    conv = nn.Conv2d(3, 8, 3)
    with torch.no_grad():
        conv(torch.randn(2, 3, 8, 8))
    assert fake.attempted == [4]

    fake.set_run_status(4, "out_of_memory")
    with torch.no_grad():
        conv(torch.randn(3, 3, 8, 8))  # a new batch: a new plan for 4, which fails to run
    assert fake.attempted[1:] == [4, 1]
    fake.set_run_status(1, "not_supported")
    with torch.no_grad():
        conv(torch.randn(4, 3, 8, 8))
    assert fake.attempted[3:] == [4, 1, 0]
    s = tp.stats()
    assert (s["fallbacks"], s["profiles"], s["failures"]) == (2, 1, 0)


def test_heuristics_serve_a_batch_no_recorded_configuration_runs_at(tmp_path: Path) -> None:
    # Engine 4 is recorded at batch 2 but cannot build from batch 8; engine 9 was never timed
    # (beyond cuDNN's benchmark limit) but is among the heuristics' choices.
    fake = tp.FakeProvider([{"engine": 4, "time_ms_per_sample": 1.0, "unsupported_from_batch": 8},
                            {"engine": 9, "time_ms_per_sample": 5.0, "in_profile": False}])
    tp.enable(tmp_path / "r.json", provider=fake)
    conv = nn.Conv2d(3, 8, 3)
    with torch.no_grad():
        conv(torch.randn(2, 3, 8, 8))
        assert [c.engine for c in tp.entries()[0].configs] == [4]
        conv(torch.randn(8, 3, 8, 8))
    assert fake.built == [4, 4, 9]
    assert fake.attempted == [4, 9]
    s = tp.stats()
    assert (s["heuristic_runs"], s["profiles"], s["failures"]) == (1, 1, 0)
    assert [c.engine for c in tp.entries()[0].configs] == [4], "a heuristic choice is not written to the record"


def test_steady_calls_run_cached_plans(tmp_path: Path) -> None:
    fake = tp.FakeProvider()
    tp.enable(tmp_path / "r.json", provider=fake)
    model = tiny_net()
    for _ in range(5):
        train_step(model, 2)
    # One plan per (key, exact shape); after the first step every call is one execute.
    assert fake.build_calls == TINY_NET_ENTRIES
    assert fake.execute_calls == 5 * TINY_NET_ENTRIES
    s = tp.stats()
    assert (s["calls"], s["plan_hits"], s["plan_builds"]) == (5 * TINY_NET_ENTRIES, 4 * TINY_NET_ENTRIES,
                                                               TINY_NET_ENTRIES)
    assert set(s) == set(tp.STAT_NAMES)


def test_workspace_cap_bounds_recorded_algorithms(tmp_path: Path) -> None:
    cap = 64 * 1024  # the FFT-like algorithm needs 1 MiB per sample
    tp.enable(tmp_path / "r.json", "64KiB", provider=tp.FakeProvider())
    train_step(tiny_net(), 4)
    entries = tp.entries()
    assert len(entries) == TINY_NET_ENTRIES
    for e in entries:
        assert all(c.workspace_bytes <= cap for c in e.configs)
        assert e.best.engine == 1
        assert e.least_memory.engine == 0


def test_env_var_names_the_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "sub" / "from-env.json"
    monkeypatch.setenv(tp.ENV_RECORD, str(path))
    monkeypatch.setenv(tp.ENV_WORKSPACE_CAP, "2MiB")
    tp.enable(provider=tp.FakeProvider())
    assert tp.active_path() == str(path)
    train_step(tiny_net(), 1)
    tp.disable()
    assert path.exists()
    assert all(c.workspace_bytes <= 2 * 1024 * 1024 for e in tp.load(path).entries for c in e.configs)


def test_enable_without_path_or_env_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tp.ENV_RECORD, raising=False)
    with pytest.raises(ValueError, match=tp.ENV_RECORD):
        tp.enable(provider=tp.FakeProvider())
    assert not tp.is_enabled()


NO_CUDA = not torch.cuda.is_available() or not _C.profile.with_cuda


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter: "once per process" needs a process that has not warned yet."""
    root = Path(__file__).resolve().parents[2]
    full_env = {**os.environ, "PYTHONPATH": str(root), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(not NO_CUDA, reason="checks machines without CUDA")
def test_without_cuda_enable_warns_once_and_does_nothing(tmp_path: Path) -> None:
    r = run_python(f"""
        import warnings
        warnings.simplefilter("always")  # "once" must not depend on the filters
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import torch.nn as nn, torch
            from terra_torch import profile as tp
            for _ in range(3):
                assert tp.enable({str(tmp_path / "r.json")!r}) is None
            tp.enable()  # no path and no variable: still only the one warning, no ValueError
            assert not tp.is_enabled() and tp.active_path() is None
            nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 8, 8))
            assert tp.stats()["calls"] == 0
        mine = [w for w in caught if issubclass(w.category, tp.ProfileRecordWarning)]
        print(len(mine))
        print(mine[0].message if mine else "")
        """, {"TERRA_PROFILE_RECORD": ""})
    assert r.returncode == 0, r.stderr
    count, message = r.stdout.splitlines()[:2]
    assert count == "1", r.stdout
    assert "CUDA" in message and "not used" in message
    assert not (tmp_path / "r.json").exists()


@pytest.mark.skipif(not NO_CUDA, reason="checks machines without CUDA")
def test_without_cuda_the_environment_variable_warns_once_and_does_nothing(tmp_path: Path) -> None:
    # Importing terra_torch reads the variable; calling enable_from_env() or enable() again in the
    # same process adds no second warning.
    r = run_python("""
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import terra_torch
            from terra_torch import profile as tp
            assert tp.enable_from_env() is False
            tp.enable()
            assert not tp.is_enabled()
        mine = [w for w in caught if issubclass(w.category, tp.ProfileRecordWarning)]
        print(len(mine))
        print(mine[0].message if mine else "")
        """, {"TERRA_PROFILE_RECORD": str(tmp_path / "env.json")})
    assert r.returncode == 0, r.stderr
    count, message = r.stdout.splitlines()[:2]
    assert count == "1", r.stdout
    assert tp.ENV_RECORD in message and "CUDA" in message
    assert not (tmp_path / "env.json").exists()


def test_parse_bytes() -> None:
    assert tp.parse_bytes("512MiB") == 512 * 1024**2
    assert tp.parse_bytes("2GB") == 2 * 10**9
    assert tp.parse_bytes("1.5GiB") == 3 * 1024**3 // 2
    assert tp.parse_bytes(" 4096 ") == 4096
    for bad in ("", "-1", "2 apples", "1e9"):
        with pytest.raises(ValueError, match="not a size"):
            tp.parse_bytes(bad)


def test_file_is_sorted_and_untouched_by_a_run_that_only_reuses(tmp_path: Path) -> None:
    for name, batches in (("a.json", (2, 3)), ("b.json", (7,))):
        tp.enable(tmp_path / name, provider=tp.FakeProvider())
        model = tiny_net()
        for b in batches:
            train_step(model, b)
        tp.disable()
    a = (tmp_path / "a.json").read_bytes()
    b = json.loads((tmp_path / "b.json").read_text())
    # Same keys, different profiled batch (and so times): equal except those fields.
    a_doc = json.loads(a)
    assert [e["id"] for e in a_doc["entries"]] == [e["id"] for e in b["entries"]]
    assert [e["id"] for e in a_doc["entries"]] == sorted(e["id"] for e in a_doc["entries"])
    tp.enable(tmp_path / "a.json", provider=tp.FakeProvider())
    train_step(tiny_net(), 9)  # all reused: nothing to save, the file must stay byte-identical
    tp.disable()
    assert (tmp_path / "a.json").read_bytes() == a
