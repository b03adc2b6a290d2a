"""What the issue-7 scenarios share: a model layout per block size, caches of random bytes,
requests driven at a fixed concurrency with their latencies, percentiles.

Block sizes of the sweeps come from one model, Llama-3-8B's KV cache (32 layers, 8 KV heads,
head dim 128, bf16: 128 KiB per token), with 2 to 64 tokens per block; every block is 64
per-layer segments (key and value of each layer), as in a paged-attention cache.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, final

import anyio
import numpy as np

from .._cache import KVCache, create_kv_cache
from .._layout import CacheLayout
from ..pipeline import Pipeline

__all__ = (
    "MODEL_BLOCK_TOKENS",
    "CpuWatch",
    "Requests",
    "model_layout",
    "percentiles",
    "random_cache",
    "rss_bytes",
    "scrub",
    "run_requests",
    "same_bytes",
)

#: Tokens per block of the model layout, by block size.
MODEL_BLOCK_TOKENS: Final = {
    "256KiB": 2,
    "512KiB": 4,
    "1MiB": 8,
    "2MiB": 16,
    "4MiB": 32,
    "8MiB": 64,
}


def model_layout(size: str) -> CacheLayout:
    """Llama-3-8B's cache layout (bf16) with blocks of ``size`` (a key of
    :data:`MODEL_BLOCK_TOKENS`)."""
    return CacheLayout.gqa(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=MODEL_BLOCK_TOKENS[size]
    )


def random_cache(layout: CacheLayout, n: int, seed: int = 0) -> KVCache:
    """A host cache of ``n`` blocks filled with random bytes (every page touched)."""
    cache = create_kv_cache(layout, n)
    rng = np.random.default_rng(seed)
    for rows in cache.byte_rows:
        rows[:] = np.frombuffer(rng.bytes(rows.size), np.uint8).reshape(rows.shape)
    return cache


def same_bytes(a: KVCache, b: KVCache, blocks: int | None = None) -> bool:
    """Whether the first ``blocks`` blocks (all by default) of two caches are equal."""
    n = blocks if blocks is not None else a.num_blocks
    return all(np.array_equal(x[:n], y[:n]) for x, y in zip(a.byte_rows, b.byte_rows, strict=True))


def scrub(cache: KVCache, blocks: int | None = None) -> None:
    """Zero the first ``blocks`` blocks (all by default) of ``cache``, so that what a read
    then leaves there is what that read moved (blocking)."""
    n = blocks if blocks is not None else cache.num_blocks
    for rows in cache.byte_rows:
        rows[:n] = 0


@final
@dataclass
class Requests:
    """One batch of requests: its wall time and each request's latency (seconds)."""

    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)


async def run_requests(
    pipe: Pipeline,
    *,
    blocks: int,
    per_request: int,
    concurrency: int,
    tag: int,
    write: bool,
    cache_blocks: int | None = None,
    offset: int = 0,
    stream: int | None = None,
) -> Requests:
    """Write (or read) ``blocks`` blocks as requests of ``per_request`` blocks, at most
    ``concurrency`` of them in flight (a server's concurrent sequences).

    Request ``j`` is its own sequence (tokens offset by ``tag``, so another tag is another
    set of keys); its blocks live in cache blocks ``first .. first + per_request`` modulo
    ``cache_blocks`` (default: the whole cache, no wrap), plus ``offset``. ``stream`` is passed
    to every call (a device cache's producer stream). A request's latency runs from the call
    to its result, after it got its turn.

    Raises:
        RuntimeError: A request did not complete.
    """
    bs = pipe.cache.layout.block_size
    wrap = cache_blocks or pipe.cache.num_blocks
    limit = anyio.Semaphore(concurrency)
    out = Requests()
    failures: list[Any] = []

    async def one(first: int) -> None:
        count = min(per_request, blocks - first)
        tokens = np.arange(first * bs, (first + count) * bs, dtype=np.int64) + tag * 10**10
        ids = (np.arange(first, first + count) % wrap + offset).astype(np.int64)
        call = pipe.write if write else pipe.read
        async with limit:
            started = time.perf_counter()
            result = await (
                call(tokens, ids) if stream is None else call(tokens, ids, stream=stream)
            )
            out.latencies.append(time.perf_counter() - started)
        if not result.complete:
            failures.append(result)

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for first in range(0, blocks, per_request):
            tg.start_soon(one, first)
    out.seconds = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"benchmark request incomplete: {failures[0]}")
    return out


def percentiles(samples: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """p50 / p99 / max (and the count) of ``samples`` times ``scale``, rounded to 4 digits."""
    if not samples:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    arr = np.asarray(samples, dtype=np.float64) * scale
    return {
        "p50": round(float(np.percentile(arr, 50)), 4),
        "p99": round(float(np.percentile(arr, 99)), 4),
        "max": round(float(arr.max()), 4),
        "n": len(samples),
    }


def median(values: Sequence[float]) -> float:
    """The median of ``values``."""
    return float(statistics.median(values))


def rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the best we have
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@final
class CpuWatch:
    """How busy the rest of the machine was over a span: CPU time of every process (from
    ``/proc/stat``) minus this process's and its reaped children's (``os.times``), as a % of
    all cores. ``None`` where ``/proc/stat`` is missing."""

    def __init__(self) -> None:
        self._start = self._snap()

    @staticmethod
    def _snap() -> tuple[float, float, float] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return busy, own, time.monotonic()

    def others_pct(self) -> float | None:
        """% of all cores used by other processes since construction."""
        end = self._snap()
        if end is None or self._start is None:
            return None
        busy, own, wall = (e - s for e, s in zip(end, self._start, strict=True))
        cores = os.cpu_count() or 1
        return round(max(0.0, busy - own) / max(wall, 1e-9) / cores * 100, 1)
