"""The file scenario's own checks, never a wall time."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvpipe.benchmarks import filestore
from kvpipe.benchmarks.filestore import FileBenchConfig, run_filestore_bench
from kvpipe.cli._bench_tables import file_markdown, file_table


def tiny(tmp_path: Path) -> FileBenchConfig:
    """8 blocks of 256 KiB, one durability, one recorded round."""
    return FileBenchConfig(
        sizes=("256KiB",),
        total_bytes=1,
        rounds=1,
        durabilities=("none",),
        directory=str(tmp_path),
        request_blocks=8,
    )


async def test_a_cold_read_that_moves_no_bytes_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cold read goes into the cache the hot read just filled: it must be checked on
    # its own, or a cold read that moved nothing passes on the hot read's bytes.
    real = filestore._move
    reads = [0]

    async def cold_reads_nothing(pipe: Any, *args: Any, write: bool, **kw: Any) -> float:
        if not write:
            reads[0] += 1
            if reads[0] % 2 == 0:
                return 0.001  # "complete", but nothing landed in the cache
        return await real(pipe, *args, write=write, **kw)

    monkeypatch.setattr(filestore, "_move", cold_reads_nothing)
    with pytest.raises(RuntimeError, match="cold"):
        await run_filestore_bench(tiny(tmp_path))


async def test_runs_and_cleans_up(tmp_path: Path) -> None:
    (record,) = await run_filestore_bench(tiny(tmp_path))
    assert record["blocks"] == 8 and record["read_cold"]["rounds"] == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("baseline", "who", "key"),
    [
        ("raw_read", "raw1", (1, False)),
        ("raw_read", "direct4", (4, True)),
        ("hand_read", "hand2", (2, False)),
    ],
)
async def test_a_contender_read_that_moves_no_bytes_is_caught(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    baseline: str,
    who: str,
    key: tuple[int, bool],
) -> None:
    # Every contender reads into a buffer of its own that must be cleared before each read
    # and checked after it: otherwise only the first read (the warm-up's hot one) has to
    # bring anything, and every later one passes on its bytes.
    real = getattr(filestore, baseline)
    calls = [0]

    def first_read_only(root: str, out: Any, threads: int, direct: bool = False) -> None:
        """``who`` reads only once (the warm-up's hot read); the others always."""
        if (threads, direct) == key:
            calls[0] += 1
            if calls[0] > 1:
                return
        real(root, out, threads, *([direct] if baseline == "raw_read" else []))

    monkeypatch.setattr(filestore, baseline, first_read_only)
    with pytest.raises(RuntimeError, match=f"{who}'s cold read"):
        await run_filestore_bench(tiny(tmp_path))
    assert os.listdir(tmp_path) == []


async def test_the_page_cache_table_has_no_o_direct_read(tmp_path: Path) -> None:
    # An O_DIRECT read skips the page cache (it comes from the device even with the file
    # cached), so it has no place among the page-cache reads, nor in their best-of ratio.
    (record,) = await run_filestore_bench(tiny(tmp_path))
    hot, cold = record["read_hot"], record["read_cold"]
    assert not any(k.startswith(("direct4_", "ratio_vs_direct4")) for k in hot)
    assert cold["direct4_gbps_median"] > 0 and "ratio_vs_direct4" in cold
    headers = {
        line.split(" | ")[2]: line
        for line in file_markdown([record])
        if line.startswith("| block | durability |")
    }
    assert "O_DIRECT" not in headers["read, page cache"]
    assert "O_DIRECT x4 GB/s" in headers["read, evicted"]
    assert "O_DIRECT x4 GB/s" in headers["write"]
    file_table([record])  # renders without the missing column
