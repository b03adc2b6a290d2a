"""The memory scenario's own checks, never a wall time."""

from __future__ import annotations

from typing import Any

import pytest

from kvpipe.benchmarks import memory
from kvpipe.benchmarks._workload import Requests
from kvpipe.benchmarks.memory import MemoryBenchConfig, run_memory_bench

#: 4 blocks of 256 KiB, requests of 4 blocks, two recorded rounds.
TINY = MemoryBenchConfig(sizes=("256KiB",), total_bytes=1, rounds=2, request_bytes=1 << 20)


async def test_a_recorded_read_that_moves_no_bytes_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every round reads into the same cache: each round's read must be checked on its own,
    # or the warm-up round's bytes vouch for every later one.
    real = memory.run_requests
    reads = [0]

    async def only_first_read_moves(pipe: Any, *, write: bool, **kw: Any) -> Requests:
        if not write:
            reads[0] += 1
            if reads[0] > 2:  # the warm-up round of both pipeline contenders reads
                return Requests(seconds=0.001)  # "complete", but nothing landed
        return await real(pipe, write=write, **kw)

    monkeypatch.setattr(memory, "run_requests", only_first_read_moves)
    with pytest.raises(RuntimeError, match="read back different bytes"):
        await run_memory_bench(TINY)


async def test_runs() -> None:
    (record,) = await run_memory_bench(TINY)
    assert record["blocks"] == 4 and record["read"]["rounds"] == 2
