"""Memory store throughput: the whole pipeline versus plain numpy doing the same data
movement, in the same run.

Per block size, interleaved rounds (after one warm-up) of four contenders, each writing N
blocks from a layer-major cache and reading them back into another cache:

- ``pipeline``: ``pipe.write`` over a :class:`~kvpipe.MemoryStore` (dedup probe, gather
  into staging, XXH3 trailer, the store's copy of each value into a fresh ``bytes``), then
  ``pipe.read`` (probe, copy out of the store into staging, verify, scatter). Requests of
  ``request_bytes`` in ``slice_bytes`` slices, ``concurrency`` in flight; both pipelines
  stay open for the whole size, as a server keeps its pipeline.
- ``pipeline_nocheck``: the same with ``verify_checksums=False`` (no XXH3 pass; the key
  digest in the trailer is still checked).
- ``plain1`` / ``plain2`` (the baseline; the faster of the two counts each round): plain
  numpy, one or two threads (halves of the blocks), per slice of the same size: **write** =
  gather each block's 2 x layers per-layer segments from the cache into a contiguous
  staging buffer (one slice-assignment per segment over the slice's blocks), then a copy
  of each block into fresh memory held in a dict (``ndarray.copy()``, as the store copies
  each value into a fresh ``bytes``); **read** = copy each stored value into the staging
  buffer, then scatter the segments into the cache. numpy copies release the GIL. No keys,
  no checksums, no trailer, no actors, no event loop.

Every contender reads into a cache cleared before the read and compared with the source
after it (both untimed). The ratio is the median over rounds of (pipeline / the faster
baseline of that round).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt
from anyio.to_thread import run_sync

from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from .._layout import CacheLayout
from .._plan import CopySegment, layout_segments
from ..backends.memory import MemoryStore
from ..pipeline import open_pipeline
from ._measure import THROUGHPUT_COPY_THREADS, Measurement, Timer, interleave
from ._workload import random_cache, run_requests, same_bytes, scrub
from .filestore import LAYOUTS

__all__ = ("CONTENDERS", "MemoryBenchConfig", "PlainCopies", "run_memory_bench")

#: Contender names, in the order they run each round.
CONTENDERS: Final = ("pipeline", "pipeline_nocheck", "plain1", "plain2")
BASELINES: Final = ("plain1", "plain2")


@final
@dataclass(frozen=True, slots=True)
class MemoryBenchConfig:
    """What to run.

    Attributes:
        sizes: Keys of :data:`~kvpipe.benchmarks.filestore.LAYOUTS`.
        total_bytes: Bytes one round writes (and reads) per contender.
        rounds: Recorded rounds (after one warm-up).
        request_bytes: Bytes per pipeline request (blocks: at least 1).
        slice_bytes: Bytes per slice (``slice_block_num``), and the baseline's chunk.
        concurrency: Pipeline requests in flight.
    """

    sizes: tuple[str, ...] = ("256KiB", "2MiB", "8MiB")
    total_bytes: int = 256 << 20
    rounds: int = 7
    request_bytes: int = 32 << 20
    slice_bytes: int = 8 << 20
    concurrency: int = 4

    def shape(self, layout: CacheLayout) -> tuple[int, int, int]:
        """(blocks per round, blocks per request, blocks per slice) for ``layout``."""
        nbytes = layout.block_nbytes
        per = max(1, self.request_bytes // nbytes)
        return max(per, self.total_bytes // nbytes), per, max(1, self.slice_bytes // nbytes)


@final
class PlainCopies:
    """The baseline: plain numpy gather + ``bytes`` copy (write), copy + scatter (read)."""

    def __init__(self, src: KVCache, dst: KVCache, chunk: int) -> None:
        self.segments: tuple[CopySegment, ...] = layout_segments(src.layout)
        self.src, self.dst, self.chunk = src.byte_rows, dst.byte_rows, chunk
        self.nbytes = src.layout.block_nbytes
        self.store: dict[int, npt.NDArray[np.uint8]] = {}
        self._stages = [np.empty((chunk, self.nbytes), np.uint8) for _ in range(2)]

    def _chunks(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(first block, its cache block, count) per slice of blocks ``[lo, hi)``; block
        ``b`` lives in cache block ``b % cache blocks``."""
        wrap = len(self.src[0])
        first = lo
        while first < hi:
            count = min(self.chunk, hi - first, wrap - first % wrap)
            yield first, first % wrap, count
            first += count

    def write(self, lo: int, hi: int, part: int = 0) -> None:
        """Gather blocks ``[lo, hi)`` slice by slice and copy each into fresh memory."""
        stage = self._stages[part]
        for first, c, count in self._chunks(lo, hi):
            for seg in self.segments:
                stage[:count, seg.offset : seg.offset + seg.nbytes] = self.src[seg.tensor][
                    c : c + count
                ]
            for i in range(count):
                self.store[first + i] = stage[i].copy()

    def read(self, lo: int, hi: int, part: int = 0) -> None:
        """Copy blocks ``[lo, hi)`` out of the store and scatter them, slice by slice."""
        stage = self._stages[part]
        for first, c, count in self._chunks(lo, hi):
            for i in range(count):
                stage[i] = self.store[first + i]
            for seg in self.segments:
                self.dst[seg.tensor][c : c + count] = stage[
                    :count, seg.offset : seg.offset + seg.nbytes
                ]

    def flat(self, n: int) -> npt.NDArray[np.uint8]:
        """The first ``n`` blocks gathered into one contiguous ``(n, block bytes)`` array."""
        out = np.empty((n, self.nbytes), np.uint8)
        for seg in self.segments:
            out[:, seg.offset : seg.offset + seg.nbytes] = self.src[seg.tensor][:n]
        return out

    def run(self, fn: Callable[[int, int, int], None], n: int, threads: int) -> None:
        """``fn`` over ``n`` blocks with one thread, or two threads on the two halves."""
        if threads == 1:
            fn(0, n, 0)
            return
        half = n // 2
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(fn, 0, half, 0), pool.submit(fn, half, n, 1)]
            for f in futures:
                f.result()


async def _bench_size(
    name: str, cfg: MemoryBenchConfig, tick: Callable[[str], None]
) -> dict[str, Any]:
    layout = CacheLayout.gqa(**LAYOUTS[name])  # type: ignore[arg-type]
    nbytes = layout.block_nbytes
    n, per, slice_blocks = cfg.shape(layout)
    src = random_cache(layout, n)
    dsts = {c: create_kv_cache(layout, n) for c in ("pipeline", "pipeline_nocheck", "plain")}
    plain = PlainCopies(src, dsts["plain"], slice_blocks)
    write_m, read_m = Measurement(n * nbytes), Measurement(n * nbytes)
    state = {"round": 0, "recording": False}
    store = MemoryStore()

    def config(check: bool) -> PipelineConfig:
        return PipelineConfig(
            slice_block_num=slice_blocks,
            copy_threads=THROUGHPUT_COPY_THREADS,
            verify_checksums=check,
            staging_bytes=max(64 << 20, 2 * cfg.concurrency * slice_blocks * (nbytes + 64)),
        )

    async def checked(contender: str, dst: KVCache) -> None:
        """What ``contender`` just read into the cleared ``dst`` is the source (untimed)."""
        if not await run_sync(same_bytes, src, dst):
            raise RuntimeError(f"memory bench: {contender} read back different bytes")

    def record(contender: str, w: float, r: float) -> None:
        if state["recording"]:
            write_m.add(contender, w)
            read_m.add(contender, r)
        tick(f"memory {name}: {contender}")

    async with (
        open_pipeline(src, store, config=config(True), namespace="on") as w_on,
        open_pipeline(dsts["pipeline"], store, config=config(True), namespace="on") as r_on,
        open_pipeline(src, store, config=config(False), namespace="off") as w_off,
        open_pipeline(
            dsts["pipeline_nocheck"], store, config=config(False), namespace="off"
        ) as r_off,
    ):

        def pipeline_round(contender: str, wpipe: Any, rpipe: Any) -> Callable[[], Any]:
            async def go() -> float:
                state["round"] += 1
                tag = state["round"]
                shape: dict[str, Any] = {
                    "blocks": n,
                    "per_request": per,
                    "concurrency": cfg.concurrency,
                }
                w = await run_requests(wpipe, tag=tag, write=True, **shape)
                await run_sync(scrub, dsts[contender])
                r = await run_requests(rpipe, tag=tag, write=False, **shape)
                await checked(contender, dsts[contender])
                await store.delete(store.keys())
                record(contender, w.seconds, r.seconds)
                return w.seconds

            return go

        def plain_round(threads: int) -> Callable[[], Any]:
            async def go() -> float:
                async with Timer() as tw:
                    await run_sync(plain.run, plain.write, n, threads)
                await run_sync(scrub, dsts["plain"])
                async with Timer() as tr:
                    await run_sync(plain.run, plain.read, n, threads)
                await checked(f"plain{threads}", dsts["plain"])
                plain.store.clear()
                record(f"plain{threads}", tw.seconds, tr.seconds)
                return tw.seconds

            return go

        def warmed(r: int) -> None:
            state["recording"] = True

        await interleave(
            {
                "pipeline": pipeline_round("pipeline", w_on, r_on),
                "pipeline_nocheck": pipeline_round("pipeline_nocheck", w_off, r_off),
                "plain1": plain_round(1),
                "plain2": plain_round(2),
            },
            cfg.rounds,
            warmed,
        )
    out: dict[str, Any] = {
        "block_size": name,
        "block_bytes": nbytes,
        "blocks": n,
        "pipeline": {
            "request_blocks": per,
            "slice_block_num": slice_blocks,
            "concurrency": cfg.concurrency,
        },
    }
    for op, m in (("write", write_m), ("read", read_m)):
        rec = m.summary("pipeline", list(BASELINES))
        nocheck = m.summary("pipeline_nocheck", list(BASELINES))
        rec["nocheck_gbps_median"] = nocheck["gbps_median"]
        rec["nocheck_ratio_median"] = nocheck["ratio_median"]
        out[op] = rec
    return out


async def run_memory_bench(
    cfg: MemoryBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run every block size; one JSON-ready record each."""
    return [await _bench_size(name, cfg, tick) for name in cfg.sizes]
