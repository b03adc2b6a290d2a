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
