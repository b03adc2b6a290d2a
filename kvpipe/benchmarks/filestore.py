"""File store throughput: the whole pipeline versus plain file I/O of the same bytes.

Per block size and durability: the pipeline writes N blocks (gather from a layer-major cache,
checksum, one file per block through the file store) and reads them back into another cache
(verify, scatter) twice: hot, with the files in the page cache (read through it once,
untimed: files written with ``O_DIRECT`` are not there), and cold, evicted from it
(``POSIX_FADV_DONTNEED`` after ``fdatasync``); each read goes into a cleared cache and
is checked against the source (untimed). Store and pipelines stay open for every round,
as a server keeps them; each round writes new blocks and deletes them afterwards (untimed).

The contenders (:mod:`._file_baselines`): raw writes and reads of the same payload bytes
from and into one contiguous buffer, one file per block, with the same ``fdatasync`` policy,
through the page cache with one thread and with four, hot and cold, and with ``O_DIRECT``
(whole pages) with four, cold only (an ``O_DIRECT`` read skips the page cache); and the
hand-written read-then-scatter (each file into one buffer, then its rows into a layer-major
cache, no checksum) with one and two threads, reading the raw ×1 files. Every contender's
read, too, goes into a cleared buffer (or cache) and is checked right after it, untimed.
Ratios are medians of per-round ratios.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, final

import anyio
import numpy as np

from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from .._keys import as_tokens, block_keys
from .._layout import CacheLayout
from ..backends.file import FileStore
from ..pipeline import open_pipeline
from ._file_baselines import (
    drop_cached,
    hand_read,
    page_aligned_copy,
    raw_read,
    raw_write,
    warm_cached,
)
from ._measure import THROUGHPUT_COPY_THREADS, Measurement, Timer, interleave
from ._workload import same_bytes, scrub

__all__ = ("LAYOUTS", "FileBenchConfig", "drop_cached", "run_filestore_bench")

#: A GQA layout per block size (bf16): 256 KiB, 2 MiB (Llama-3-8B, 16 tokens), 8 MiB.
LAYOUTS: Final = {
    "256KiB": {"num_layers": 8, "num_kv_heads": 8, "head_dim": 64, "block_size": 16},
    "2MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16},
    "8MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 64},
}
#: Write contenders, and read contenders (the hand-written ones read the raw ×1 files). An
#: ``O_DIRECT`` read skips the page cache (it reads the device even where the file is
#: cached), so ``direct4`` reads only cold: it is no page-cache read.
WRITERS: Final = ("raw1", "raw4", "direct4")
HOT_READERS: Final = ("raw1", "raw4", "hand1", "hand2")
COLD_READERS: Final = ("raw1", "raw4", "direct4", "hand1", "hand2")


@final
@dataclass(frozen=True, slots=True)
class FileBenchConfig:
    """What to run.

    Attributes:
        sizes: Keys of :data:`LAYOUTS`.
        total_bytes: Bytes one round writes (and reads) per contender.
        rounds: Recorded rounds (after one warm-up).
        durabilities: The file store's and the contenders' fsync policies, one record each.
        directory: Where the files go (on the disk being measured).
        request_blocks: Blocks per pipeline request; requests run concurrently.
        store_threads: The file store's ``threads``.
        slice_mib: Slices carry at least this many MiB (and at least 8 blocks).
        cached_writes: The file store's ``cached_writes``.
    """

    sizes: tuple[str, ...] = ("256KiB", "2MiB", "8MiB")
    total_bytes: int = 256 << 20
    rounds: int = 5
    durabilities: tuple[str, ...] = ("data", "none")
    directory: str = "."
    request_blocks: int = 32
    store_threads: int = FileStore.DEFAULT_THREADS
    slice_mib: int = 8
    cached_writes: bool = False


@final
class _Round:
    """One block size's data and what each contender's rounds measured."""

    def __init__(self, layout: CacheLayout, n: int) -> None:
        self.n = n
        self.src = create_kv_cache(layout, n)
        self.dst = create_kv_cache(layout, n)
        self.hand = create_kv_cache(layout, n)
        rng = np.random.default_rng(0)
        for rows in self.src.byte_rows:
            rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
        self.contiguous = np.concatenate(
            [np.ascontiguousarray(r) for r in self.src.byte_rows], axis=1
        )
        self.readback = np.empty_like(self.contiguous)
        self.direct_src = page_aligned_copy(self.contiguous)
        self.direct_out = page_aligned_copy(np.zeros_like(self.contiguous))
        nbytes = n * layout.block_nbytes
        self.write, self.hot, self.cold = (Measurement(nbytes) for _ in range(3))


async def _bench_size(
    name: str, cfg: FileBenchConfig, tick: Callable[[str], None]
) -> list[dict[str, Any]]:
    layout = CacheLayout.gqa(**LAYOUTS[name])  # type: ignore[arg-type]
    n = max(cfg.request_blocks, cfg.total_bytes // layout.block_nbytes)
    config = PipelineConfig(
        slice_block_num=max(8, (cfg.slice_mib << 20) // layout.block_nbytes),
        copy_threads=THROUGHPUT_COPY_THREADS,
        staging_bytes=max(512 << 20, 64 * layout.block_nbytes),
    )
    records = []
    for durability in cfg.durabilities:
        data = _Round(layout, n)
        workdir = tempfile.mkdtemp(prefix=f"kvpipe-bench-{name}-", dir=cfg.directory)
        try:
            statistics = await _bench_durability(name, durability, cfg, config, data, workdir, tick)
        finally:
            await anyio.to_thread.run_sync(shutil.rmtree, workdir, True)
        records.append(
            {
                "block_size": name,
                "block_bytes": layout.block_nbytes,
                "blocks": n,
                "durability": durability,
                "direct_writes": int(statistics.get("direct_writes", 0)),
                "store_threads": cfg.store_threads,
                "cached_writes": cfg.cached_writes,
                "slice_block_num": config.slice_block_num,
                "request_blocks": cfg.request_blocks,
                "write": _summary(data.write, WRITERS),
                "read_hot": _summary(data.hot, HOT_READERS),
                "read_cold": _summary(data.cold, COLD_READERS),
            }
        )
    return records


async def _bench_durability(
    name: str,
    durability: str,
    cfg: FileBenchConfig,
    config: PipelineConfig,
    data: _Round,
    workdir: str,
    tick: Callable[[str], None],
) -> dict[str, float]:
    """Interleaved rounds of the pipeline and every contender for one durability; the
    store's statistics."""
    n, round_no = data.n, [0]
    store_root = os.path.join(workdir, "store")
    store = FileStore(
        store_root,
        durability=durability,  # type: ignore[arg-type]
        threads=cfg.store_threads,
        cached_writes=cfg.cached_writes,
    )
    blocks = os.path.join(store_root, "blocks")

    async def in_thread(fn: Callable[..., Any], *args: Any) -> float:
        async with Timer() as t:
            await anyio.to_thread.run_sync(fn, *args)
        return t.seconds

    async def checked(who: str, which: str, same: Awaitable[bool]) -> None:
        """A contender's read, into a cleared buffer, checked right after it (untimed)."""
        if not await same:
            raise RuntimeError(f"file bench: {who}'s {which} read brought back other bytes")

    async def pipeline_round(wpipe: Any, rpipe: Any) -> float:
        async def read_checked(which: str) -> float:
            """One timed read of every block into a cleared ``data.dst``, then its check
            (both untimed): each read must bring the bytes itself."""
            await anyio.to_thread.run_sync(scrub, data.dst)
            seconds = await _move(
                rpipe, n, cfg.request_blocks, round_no[0], write=False, cache=data.dst
            )
            if not await anyio.to_thread.run_sync(same_bytes, data.src, data.dst):
                raise RuntimeError(
                    f"file bench: the pipeline's {which} read brought back other bytes"
                )
            return seconds

        round_no[0] += 1
        w = await _move(wpipe, n, cfg.request_blocks, round_no[0], write=True, cache=data.src)
        await anyio.to_thread.run_sync(warm_cached, blocks)
        hot = await read_checked("hot")
        await anyio.to_thread.run_sync(drop_cached, blocks)
        cold = await read_checked("cold")
        await store.delete(_round_keys(wpipe, n, cfg.request_blocks, round_no[0], data))
        data.write.add("pipeline", w)
        data.hot.add("pipeline", hot)
        data.cold.add("pipeline", cold)
        tick(f"{name} {durability} pipeline")
        return w

    def raw_round(threads: int, direct: bool = False) -> Callable[[], Any]:
        label = f"direct{threads}" if direct else f"raw{threads}"
        hands = ("hand1", "hand2") if label == "raw1" else ()

        async def go() -> float:
            root = os.path.join(workdir, label)
            os.makedirs(root, exist_ok=True)
            src, out = (
                (data.direct_src, data.direct_out) if direct else (data.contiguous, data.readback)
            )
            w = await in_thread(raw_write, root, src, threads, durability, direct)
            data.write.add(label, w)
            # an O_DIRECT read comes from the device, cached or not: it reads cold only
            reads = ((data.hot, "hot"), (data.cold, "cold"))[1 if direct else 0 :]
            for m, which in reads:
                if m is data.hot:
                    await anyio.to_thread.run_sync(warm_cached, root)
                else:
                    await anyio.to_thread.run_sync(drop_cached, root)
                await anyio.to_thread.run_sync(out.fill, 0)
                m.add(label, await in_thread(raw_read, root, out, threads, direct))
                await checked(label, which, anyio.to_thread.run_sync(np.array_equal, out, src))
                for hand in hands:
                    if m is data.cold:
                        await anyio.to_thread.run_sync(drop_cached, root)
                    await anyio.to_thread.run_sync(scrub, data.hand)
                    rows = data.hand.byte_rows
                    m.add(hand, await in_thread(hand_read, root, rows, int(hand[-1])))
                    same = anyio.to_thread.run_sync(same_bytes, data.src, data.hand)
                    await checked(hand, which, same)
            await anyio.to_thread.run_sync(shutil.rmtree, root)
            tick(f"{name} {durability} {label}")
            return w

        return go

    async with (
        store,
        open_pipeline(data.src, store, config=config, namespace="bench") as wpipe,
        open_pipeline(data.dst, store, config=config, namespace="bench") as rpipe,
    ):
        await interleave(
            {
                "pipeline": lambda: pipeline_round(wpipe, rpipe),
                "raw1": raw_round(1),
                "raw4": raw_round(4),
                "direct4": raw_round(4, direct=True),
            },
            cfg.rounds,
        )
        statistics = dict(store.statistics())
    # drop the warm-up round recorded by the closures
    for m in (data.write, data.hot, data.cold):
        m.seconds = {k: v[1:] for k, v in m.seconds.items()}
    return statistics


def _summary(m: Measurement, contenders: tuple[str, ...]) -> dict[str, Any]:
    """The pipeline against the best contender of each round, and against each one."""
    out = m.summary("pipeline", list(contenders))
    for c in contenders:
        out[f"ratio_vs_{c}"] = round(m.ratio("pipeline", [c]), 3)
    return out


async def _move(
    pipe: Any, n: int, per: int, round_no: int, *, write: bool, cache: KVCache
) -> float:
    """Write or read all ``n`` blocks as concurrent requests; returns the seconds."""
    failures: list[Any] = []

    async def one(first: int) -> None:
        count = min(per, n - first)
        tokens = _tokens(first, count, cache.layout.block_size, round_no)
        ids = np.arange(first, first + count)
        result = await (pipe.write(tokens, ids) if write else pipe.read(tokens, ids))
        if not result.complete:
            failures.append(result)

    async with Timer() as t, anyio.create_task_group() as tg:
        for first in range(0, n, per):
            tg.start_soon(one, first)
    if failures:
        raise RuntimeError(f"benchmark request incomplete: {failures[0]}")
    return t.seconds


def _round_keys(pipe: Any, n: int, per: int, round_no: int, data: _Round) -> list[str]:
    """The keys :func:`_move` wrote in round ``round_no`` (to delete them afterwards)."""
    layout = data.src.layout
    keys: list[str] = []
    for first in range(0, n, per):
        tokens = _tokens(first, min(per, n - first), layout.block_size, round_no)
        keys += block_keys(pipe.scope, as_tokens(tokens), layout.block_size, False)
    return keys


def _tokens(first: int, count: int, block_size: int, round_no: int) -> np.ndarray:
    """The tokens of the request writing blocks ``first .. first + count`` in a round."""
    tokens = np.arange(first * 1000, first * 1000 + count * block_size)
    return tokens + round_no * 10**9


async def run_filestore_bench(
    cfg: FileBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run every block size and durability; one JSON-ready record each."""
    return [rec for name in cfg.sizes for rec in await _bench_size(name, cfg, tick)]
