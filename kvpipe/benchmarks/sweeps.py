"""Sweeps: how throughput and per-request latency change with ``slice_block_num``, block size
and concurrency, over the memory store.

Each sweep varies one setting around a fixed workload (:data:`SWEEPS`); every point writes
``total_bytes`` as requests of its shape and reads them back, with the pipeline's defaults
otherwise (checksums on, ``io_threads=8``), ``copy_threads=2`` and ``staging_bytes`` fixed
for all points. The caches hold ``cache_bytes`` (request ``j`` uses cache blocks from ``j *
request_blocks`` modulo its size), so every point moves the same bytes through caches of
the same size.

Rounds are interleaved over the points of a sweep (A B C D A B C D ...) after one warm-up
round of every point; all of a sweep's pipelines stay open meanwhile. Every read (the
plain baseline's too) goes into a cache cleared before it and is compared with the source
after it (both untimed). Throughput is the median over rounds; latency percentiles are over
every request of every recorded round, from the call to its result (after the request got
one of the ``concurrency`` turns).
The block-size sweep also runs the plain-numpy baseline of :mod:`.memory` at each size
(two threads), for the fraction of it the pipeline reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Final, final

from anyio.to_thread import run_sync

from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from ..backends.memory import MemoryStore
from ..pipeline import Pipeline, open_pipeline
from ._measure import THROUGHPUT_COPY_THREADS, Timer
from ._workload import (
    median,
    model_layout,
    percentiles,
    random_cache,
    run_requests,
    same_bytes,
    scrub,
)
from .memory import PlainCopies

__all__ = ("SWEEPS", "SweepBenchConfig", "SweepPoint", "run_sweep_bench")

_SIZES: Final = ("256KiB", "512KiB", "1MiB", "2MiB", "4MiB", "8MiB")


@final
@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One workload: block size, blocks per request, blocks per slice, requests in flight."""

    sweep: str
    x: int | str
    size: str
    request_blocks: int
    slice_block_num: int
    concurrency: int


def _points() -> dict[str, tuple[SweepPoint, ...]]:
    nbytes = {s: model_layout(s).block_nbytes for s in _SIZES}
    return {
        # 2 MiB blocks, requests of 64 blocks (1024 tokens), 2 in flight
        "slice_block_num": tuple(
            SweepPoint("slice_block_num", n, "2MiB", 64, n, 2) for n in (1, 4, 16, 64)
        ),
        # requests of 32 MiB in slices of 8 MiB, 4 in flight
        "block_size": tuple(
            SweepPoint("block_size", s, s, max(1, (32 << 20) // b), max(1, (8 << 20) // b), 4)
            for s, b in nbytes.items()
        ),
        # 2 MiB blocks, requests of 4 blocks (64 tokens) in one slice
        "concurrency": tuple(SweepPoint("concurrency", c, "2MiB", 4, 4, c) for c in (1, 4, 16, 64)),
    }


#: The points of every sweep.
SWEEPS: Final = _points()


@final
@dataclass(frozen=True, slots=True)
class SweepBenchConfig:
    """What to run.

    Attributes:
        sweeps: Keys of :data:`SWEEPS`.
        total_bytes: Bytes one round of a point writes (and reads).
        cache_bytes: Bytes of each cache (blocks wrap around it).
        staging_bytes: The pipelines' staging, the same for every point.
        rounds: Recorded rounds (after one warm-up).
        concurrency_max: Leave out concurrency points above it (smoke runs).
    """

    sweeps: tuple[str, ...] = ("slice_block_num", "block_size", "concurrency")
    total_bytes: int = 512 << 20
    cache_bytes: int = 128 << 20
    staging_bytes: int = 256 << 20
    rounds: int = 3
    concurrency_max: int = 64


@dataclass
class _Point:
    spec: SweepPoint
    src: KVCache
    dst: KVCache
    blocks: int
    wpipe: Pipeline | None = None
    rpipe: Pipeline | None = None
    plain: PlainCopies | None = None


async def _sweep(
    name: str, cfg: SweepBenchConfig, tick: Callable[[str], None]
) -> list[dict[str, Any]]:
    specs = [p for p in SWEEPS[name] if p.concurrency <= cfg.concurrency_max]
    caches: dict[str, tuple[KVCache, KVCache]] = {}
    points: list[_Point] = []
    for spec in specs:
        layout = model_layout(spec.size)
        nbytes = layout.block_nbytes
        cache_blocks = max(spec.request_blocks, cfg.cache_bytes // nbytes)
        if spec.size not in caches:
            caches[spec.size] = (
                random_cache(layout, cache_blocks),
                create_kv_cache(layout, cache_blocks),
            )
        src, dst = caches[spec.size]
        blocks = max(spec.request_blocks, cfg.total_bytes // nbytes)
        points.append(_Point(spec, src, dst, blocks))
    seconds: dict[int, dict[str, list[float]]] = {}
    latencies: dict[int, dict[str, list[float]]] = {}
    tag = [0]
    async with AsyncExitStack() as stack:
        for p in points:
            config = PipelineConfig(
                slice_block_num=p.spec.slice_block_num,
                staging_bytes=cfg.staging_bytes,
                copy_threads=THROUGHPUT_COPY_THREADS,
            )
            store = MemoryStore()
            p.wpipe = await stack.enter_async_context(open_pipeline(p.src, store, config=config))
            p.rpipe = await stack.enter_async_context(open_pipeline(p.dst, store, config=config))
            if name == "block_size":
                p.plain = PlainCopies(p.src, p.dst, p.spec.slice_block_num)
        for r in range(cfg.rounds + 1):
            for i, p in enumerate(points):
                assert p.wpipe is not None and p.rpipe is not None
                tag[0] += 1
                shape: dict[str, Any] = {
                    "blocks": p.blocks,
                    "per_request": p.spec.request_blocks,
                    "concurrency": p.spec.concurrency,
                    "cache_blocks": p.src.num_blocks,
                }
                moved = min(p.blocks, p.dst.num_blocks)  # the cache blocks a round reads
                w = await run_requests(p.wpipe, tag=tag[0], write=True, **shape)
                await run_sync(scrub, p.dst, moved)
                rd = await run_requests(p.rpipe, tag=tag[0], write=False, **shape)
                await _check(f"sweep {name} {p.spec.x}", p, moved)
                mem = p.wpipe.store
                assert isinstance(mem, MemoryStore)
                await mem.delete(mem.keys())
                tick(f"sweep {name}: {p.spec.x} (round {r})")
                runs = {"write": w.seconds, "read": rd.seconds}
                if p.plain is not None:
                    plain = p.plain
                    async with Timer() as tw:
                        await run_sync(plain.run, plain.write, p.blocks, 2)
                    await run_sync(scrub, p.dst, moved)
                    async with Timer() as tr:
                        await run_sync(plain.run, plain.read, p.blocks, 2)
                    await _check(f"sweep {name} {p.spec.x}: plain", p, moved)
                    plain.store.clear()
                    runs |= {"plain_write": tw.seconds, "plain_read": tr.seconds}
                if r == 0:
                    continue
                for k, v in runs.items():
                    seconds.setdefault(i, {}).setdefault(k, []).append(v)
                lat = latencies.setdefault(i, {"write": [], "read": []})
                lat["write"] += w.latencies
                lat["read"] += rd.latencies
    out = []
    for i, p in enumerate(points):
        nbytes = p.blocks * p.src.layout.block_nbytes
        rec: dict[str, Any] = {
            "sweep": name,
            "x": p.spec.x,
            "block_size": p.spec.size,
            "block_bytes": p.src.layout.block_nbytes,
            "blocks": p.blocks,
            "request_blocks": p.spec.request_blocks,
            "slice_block_num": p.spec.slice_block_num,
            "concurrency": p.spec.concurrency,
            "rounds": cfg.rounds,
        }
        for op in ("write", "read"):
            rec[op] = {
                "gbps_median": round(nbytes / median(seconds[i][op]) / 1e9, 3),
                "gbps_best": round(nbytes / min(seconds[i][op]) / 1e9, 3),
                "latency_ms": percentiles(latencies[i][op], 1e3),
            }
            if f"plain_{op}" in seconds[i]:
                ratios = [
                    b / a for a, b in zip(seconds[i][op], seconds[i][f"plain_{op}"], strict=True)
                ]
                rec[op]["plain_gbps_median"] = round(
                    nbytes / median(seconds[i][f"plain_{op}"]) / 1e9, 3
                )
                rec[op]["ratio_median"] = round(median(ratios), 3)
        out.append(rec)
    return out


async def _check(who: str, p: _Point, blocks: int) -> None:
    """What ``who`` just read into the cleared ``p.dst`` is the source (untimed).

    Raises:
        RuntimeError: It is not.
    """
    if not await run_sync(same_bytes, p.src, p.dst, blocks):
        raise RuntimeError(f"{who}: read back different bytes")


async def run_sweep_bench(
    cfg: SweepBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run every sweep; one JSON-ready record per point."""
    out: list[dict[str, Any]] = []
    for name in cfg.sweeps:
        out += await _sweep(name, cfg, tick)
    return out
