"""The sweeps scenario's own checks, never a wall time."""

from __future__ import annotations

from kvpipe.benchmarks.sweeps import SweepBenchConfig, run_sweep_bench


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
