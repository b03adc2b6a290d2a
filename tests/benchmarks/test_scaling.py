"""The scaling scenario's own checks, never a wall time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpipe.benchmarks import _workload, scaling
from kvpipe.benchmarks._workload import Requests

#: One size's child run, in this process: 4 blocks of 2 MiB, requests of 2.
PARAMS: dict[str, Any] = {
    "base_blocks": 4,
    "factor": 1,
    "request_blocks": 2,
    "slice_block_num": 2,
    "concurrency": 2,
    "staging_bytes": 16 << 20,
}


async def test_a_read_that_moves_no_bytes_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The read goes back into the cache the write came from: unless that cache is cleared
    # first, the bytes already there vouch for a read that moved nothing.
    real = _workload.run_requests

    async def reads_nothing(pipe: Any, *, write: bool, **kw: Any) -> Requests:
        if write:
            return await real(pipe, write=True, **kw)
        return Requests(seconds=0.001)  # "complete", but nothing landed in the cache

    monkeypatch.setattr(_workload, "run_requests", reads_nothing)
    with pytest.raises(RuntimeError, match="read back different bytes"):
        await scaling._child_main(PARAMS | {"root": str(tmp_path / "store")})


async def test_one_size_runs(tmp_path: Path) -> None:
    result = await scaling._child_main(PARAMS | {"root": str(tmp_path / "store")})
    assert result["blocks"] == 4 and result["read_seconds"] > 0
