"""Record files that cannot be used as they are: corrupt, another format version, another
device. They are reported (ProfileRecordWarning), ignored, never a crash, and replaced on save."""

from __future__ import annotations

import json
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


def one_conv_step(batch: int = 2) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3)
    conv(torch.randn(batch, 3, 8, 8)).sum().backward()


def write_valid_record(path: Path, header: dict | None = None) -> None:
    header = header or tp.fake_header()
    selector = _C.profile.Selector(str(path), header)
    key, batch = _C.profile.make_key(
        {"input": [2, 3, 8, 8], "weight": [4, 3, 3, 3], "output": [2, 4, 6, 6], "padding": [0, 0],
         "stride": [1, 1], "dilation": [1, 1], "groups": 1, "dtype": "float32", "layout": "nchw"}, "forward")
    assert selector.run(key, batch, tp.FakeProvider())["ok"]
    selector.flush()


@pytest.mark.parametrize("garbage", [b"", b"{\"format\": \"terra_torch.conv_profile_record\", \"entr",
                                     b"\xff\xfe\x00binary", b"[1, 2, 3]", b"{\"format\": \"something else\"}"])
def test_corrupt_file_is_reported_ignored_and_replaced(tmp_path: Path, garbage: bytes) -> None:
    path = tmp_path / "r.json"
    path.write_bytes(garbage)
    with pytest.warns(tp.ProfileRecordWarning, match="corrupt|not valid JSON|not a profile record"):
        record = tp.load(path)
    assert record.status == "corrupt" and record.entries == ()

    fake = tp.FakeProvider()
    with pytest.warns(tp.ProfileRecordWarning, match="is corrupt"):
        tp.enable(path, provider=fake)
    with pytest.warns(tp.ProfileRecordWarning, match="moved to"):
        one_conv_step()
    tp.disable()
    assert fake.profile_calls == 2  # forward and filter gradient, profiled despite the bad file
    assert (tmp_path / "r.json.bak").read_bytes() == garbage
    assert tp.load(path).status == "ok" and len(tp.load(path).entries) == 2


def test_other_format_version_is_incompatible(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_valid_record(path)
    doc = json.loads(path.read_text())
    doc["header"]["format_version"] = _C.profile.format_version + 1
    path.write_text(json.dumps(doc))
    with pytest.warns(tp.ProfileRecordWarning, match="format version"):
        record = tp.load(path)
    assert record.status == "incompatible" and record.entries == ()

    fake = tp.FakeProvider()
    with pytest.warns(tp.ProfileRecordWarning, match="incompatible"):
        tp.enable(path, provider=fake)
    with pytest.warns(tp.ProfileRecordWarning):
        one_conv_step()
    assert fake.profile_calls == 2


def v1_record(header: dict) -> dict:
    """A format-1 record as the previous build wrote it: legacy algorithm numbers per entry."""
    key, batch = _C.profile.make_key(
        {"input": [2, 3, 8, 8], "weight": [4, 3, 3, 3], "output": [2, 4, 6, 6], "padding": [0, 0],
         "stride": [1, 1], "dilation": [1, 1], "groups": 1, "dtype": "float32", "layout": "nchw"}, "forward")
    algo = {"algo": 1, "math_type": 0, "name": "IMPLICIT_PRECOMP_GEMM", "time_ms": 0.8, "workspace_bytes": 4096}
    return {"format": "terra_torch.conv_profile_record", "header": {**header, "format_version": 1},
            "entries": [{"algorithms": [algo], "id": _C.profile.key_id(key), "key": key, "least_memory": algo,
                         "profiled_batch": batch}]}


def test_a_format_1_record_is_reported_and_profiled_again(tmp_path: Path) -> None:
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(v1_record(tp.fake_header())))
    with pytest.warns(tp.ProfileRecordWarning, match="format version 1"):
        assert tp.load(path).status == "outdated"

    fake = tp.FakeProvider()
    with pytest.warns(tp.ProfileRecordWarning) as caught:
        tp.enable(path, provider=fake)
    assert any(str(path) in str(w.message) and "outdated" in str(w.message) for w in caught), \
        "the warning names the file"
    with pytest.warns(tp.ProfileRecordWarning, match="moved to"):
        one_conv_step()
    assert fake.profile_calls == 2, "the forward entry of the v1 file is not reused"
    tp.disable()
    record = tp.load(path)
    assert record.status == "ok" and record.header.format_version == _C.profile.format_version == 2
    assert len(record.entries) == 2
    assert json.loads(Path(str(path) + ".bak").read_text())["header"]["format_version"] == 1


def test_entries_of_another_device_are_ignored_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    other = {**tp.fake_header(), "device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}
    write_valid_record(path, other)
    record = tp.load(path)  # inspecting it is fine: it is a valid record of that device
    assert record.status == "ok" and record.header.device_name == "NVIDIA A100-SXM4-80GB"
    assert len(record.entries) == 1

    fake = tp.FakeProvider()
    with pytest.warns(tp.ProfileRecordWarning, match="another device.*A100"):
        tp.enable(path, provider=fake)
    assert tp.entries() == []
    with pytest.warns(tp.ProfileRecordWarning):
        one_conv_step()
    assert fake.profile_calls == 2, "the A100 entry must not be used"


def test_a_bad_entry_is_dropped_and_the_rest_used(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_valid_record(path)
    doc = json.loads(path.read_text())
    broken = json.loads(json.dumps(doc["entries"][0]))
    broken["key"]["groups"] = 5
    doc["entries"].append(broken)
    path.write_text(json.dumps(doc))
    with pytest.warns(tp.ProfileRecordWarning, match="entry 1 dropped: invalid key"):
        record = tp.load(path)
    assert record.status == "ok" and len(record.entries) == 1

    fake = tp.FakeProvider()
    with pytest.warns(tp.ProfileRecordWarning, match="entry 1 dropped"):
        tp.enable(path, provider=fake)
    with torch.no_grad():
        torch.manual_seed(0)
        nn.Conv2d(3, 4, 3)(torch.randn(5, 3, 8, 8))
    assert fake.profile_calls == 0


def test_load_gives_typed_entries(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    write_valid_record(path)
    record = tp.load(path)
    (entry,) = record.entries
    assert isinstance(entry.key, tp.ConvKey)
    assert entry.key.role == "forward" and entry.key.input == (3, 8, 8) and entry.profiled_batch == 2
    assert [c.engine for c in entry.configs] == [4, 1, 0]
    assert entry.best.engine == 4 and entry.least_memory.engine == 0
    assert entry.best.knobs == () and entry.best.tag == "FFT" and entry.best.numerical_notes == ()
    assert entry.key.id == json.loads(path.read_text())["entries"][0]["id"]
    assert record.find(entry.key) == entry
    assert tp.load(tmp_path / "absent.json").status == "missing"
