"""The sweeps scenario's own checks, never a wall time."""

from __future__ import annotations

from typing import Any

import pytest

from kvpipe.benchmarks import sweeps
from kvpipe.benchmarks._workload import Requests
from kvpipe.benchmarks.sweeps import SweepBenchConfig, SweepPoint, run_sweep_bench

#: The concurrency sweep's first point alone: 4 blocks of 2 MiB, one recorded round.
TINY = SweepBenchConfig(
    sweeps=("concurrency",),
    total_bytes=8 << 20,
    cache_bytes=8 << 20,
    staging_bytes=16 << 20,
    rounds=1,
    concurrency_max=1,
)
#: One block-size point: 4 blocks of 256 KiB in one request, with the plain baseline.
SMALL_BLOCKS = (SweepPoint("block_size", "256KiB", "256KiB", 4, 2, 2),)


def reads_move_only(first: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pipeline's reads after the ``first`` ones report complete but move nothing."""
    real = sweeps.run_requests
    reads = [0]

    async def fake(pipe: Any, *, write: bool, **kw: Any) -> Requests:
        if not write:
            reads[0] += 1
            if reads[0] > first:
                return Requests(seconds=0.001)
        return await real(pipe, write=write, **kw)

    monkeypatch.setattr(sweeps, "run_requests", fake)


async def test_a_recorded_read_that_moves_no_bytes_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every round reads into the same cache: unless each read goes into a cleared cache and
    # is checked, the warm-up round's bytes vouch for every later round.
    reads_move_only(1, monkeypatch)
    with pytest.raises(RuntimeError, match="read back different bytes"):
        await run_sweep_bench(TINY)


async def test_the_plain_baseline_does_not_vouch_for_the_pipelines_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # In the block-size sweep the plain baseline scatters into the pipeline's cache too,
    # after the pipeline's read: the pipeline's read must be checked before it.
    monkeypatch.setitem(sweeps.SWEEPS, "block_size", SMALL_BLOCKS)
    reads_move_only(0, monkeypatch)
    cfg = SweepBenchConfig(sweeps=("block_size",), total_bytes=1, cache_bytes=1, rounds=1)
    with pytest.raises(RuntimeError, match="read back different bytes"):
        await run_sweep_bench(cfg)


async def test_fewer_blocks_than_the_cache_holds() -> None:
    # Blocks past the ones a round moves are never read: only those it moved are compared.
    (rec,) = await run_sweep_bench(
        SweepBenchConfig(
            sweeps=("concurrency",),
            total_bytes=8 << 20,
            cache_bytes=16 << 20,
            staging_bytes=16 << 20,
            rounds=1,
            concurrency_max=1,
        )
    )
    assert rec["blocks"] == 4 and rec["read"]["gbps_median"] > 0
