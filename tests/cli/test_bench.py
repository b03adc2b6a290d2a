"""``kvpipe bench`` smoke run: every scenario end to end, tiny sizes, no timing asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpipe.cli import main


def test_file_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(
        [
            "bench",
            "--sizes",
            "256KiB",
            "--mib",
            "4",
            "--rounds",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    (rec,) = results["file"]
    assert rec["block_size"] == "256KiB" and rec["blocks"] >= 16
    for op in ("write", "read"):
        assert rec[op]["rounds"] == 1
        assert rec[op]["gbps_median"] > 0 and rec[op]["ratio_median"] > 0
    assert "| 256KiB |" in md.read_text()
    assert list(tmp_path.glob("kvpipe-bench-*")) == []  # cleaned up
    assert "pipeline GB/s" in capsys.readouterr().out


def test_mooncake_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(
        [
            "bench",
            "--scenario",
            "mooncake",
            "--sizes",
            "256KiB",
            "--mib",
            "4",
            "--rounds",
            "1",
            "--slice-mib",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    assert "file" not in results
    local, remote = results["mooncake"]
    assert (local["placement"], remote["placement"]) == ("local", "remote")
    # the data was where the placement says: a segment of another process for "remote"
    assert local["segment_host"] != remote["segment_host"]
    for rec in (local, remote):
        assert rec["block_size"] == "256KiB" and rec["blocks"] >= 16
        assert rec["value_bytes"] == rec["block_bytes"] + 48
        assert rec["pipeline"]["slice_block_num"] == (1 << 20) // rec["value_bytes"]
        for op, baseline in (("write", "put_from"), ("write", "upsert_from"), ("read", "get_into")):
            assert rec[op]["rounds"] == 1
            assert rec[op]["gbps_median"] > 0 and rec[op][f"{baseline}_gbps_median"] > 0
            assert rec[op]["ratio_median"] > 0
        assert rec["write"]["ratio_vs_put_from"] > 0 and rec["write"]["ratio_vs_upsert_from"] > 0
    text = md.read_text()
    assert "| 256KiB | this process | write |" in text
    assert "| 256KiB | another process | read |" in text
    assert "io_threads=2" in text
    assert "direct client" in capsys.readouterr().out
