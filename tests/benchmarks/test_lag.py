"""The lag scenario's own checks, never a wall time."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpipe.benchmarks import lag
from kvpipe.benchmarks._workload import Requests
from kvpipe.benchmarks.lag import LagBenchConfig, run_lag_bench

#: 16 blocks of 2 MiB, one recorded round, no idle wait.
TINY = LagBenchConfig(stores=("memory",), memory_bytes=1, idle_seconds=0.0, rounds=1)


async def test_a_pipeline_read_that_moves_no_bytes_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plain-copies phase scatters the source into a cache too: it must not be the
    # pipeline's, or the pipeline's reads are never checked.
    real = lag.run_requests

    async def reads_nothing(pipe: Any, *, write: bool, **kw: Any) -> Requests:
        if write:
            return await real(pipe, write=True, **kw)
        return Requests()  # "complete", but nothing landed in the cache

    monkeypatch.setattr(lag, "run_requests", reads_nothing)
    with pytest.RaisesGroup(
        pytest.RaisesExc(RuntimeError, match="memory read back different bytes"),
        allow_unwrapped=True,
        flatten_subgroups=True,
    ):
        await run_lag_bench(replace(TINY, directory=str(tmp_path)))


async def test_runs_and_reports_every_phase(tmp_path: Path) -> None:
    rows = await run_lag_bench(replace(TINY, directory=str(tmp_path)))
    assert {r["phase"] for r in rows} <= {"idle", "plain copies", "memory write", "memory read"}
    assert {"memory write", "memory read"} <= {r["phase"] for r in rows}
    assert os.listdir(tmp_path) == []
