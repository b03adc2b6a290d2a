"""File store throughput: the whole pipeline versus raw file I/O of the same bytes.

Per block size: the pipeline writes N blocks (gather from a layer-major cache, checksum, one
file per block through the file store with its durability) and reads them back into another
cache (verify, scatter). Store and pipelines stay open for every round, as a server keeps
them; each round writes new blocks and deletes them afterwards (untimed), as the baselines
delete their files. The baselines write the same payload bytes from one contiguous buffer,
one file per block, with the same ``fdatasync`` policy — through the page cache with one
thread and with four, and with ``O_DIRECT`` (whole pages) with four — and read those files
back the same way; each round's ratio is against the fastest of them.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
from ._measure import Measurement, Timer, interleave

__all__ = ("LAYOUTS", "FileBenchConfig", "run_filestore_bench")

#: A GQA layout per block size (bf16): 256 KiB, 2 MiB (Llama-3-8B, 16 tokens), 8 MiB.
LAYOUTS: Final = {
    "256KiB": {"num_layers": 8, "num_kv_heads": 8, "head_dim": 64, "block_size": 16},
    "2MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16},
    "8MiB": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 64},
}


@final
@dataclass(frozen=True, slots=True)
class FileBenchConfig:
    """What to run.

    Attributes:
        sizes: Keys of :data:`LAYOUTS`.
        total_bytes: Bytes one round writes (and reads) per contender.
        rounds: Recorded rounds (after one warm-up).
        durability: The file store's and the baseline's fsync policy.
        directory: Where the files go (on the disk being measured).
        request_blocks: Blocks per pipeline request; requests run concurrently.
        cold_reads: Evict the written files from the page cache before reading them back
            (both contenders), so reads measure the disk, not memory copies.
        store_threads: The file store's ``threads``.
        slice_mib: Slices carry at least this many MiB (and at least 8 blocks).
    """

    sizes: tuple[str, ...] = ("256KiB", "2MiB", "8MiB")
    cold_reads: bool = True
    total_bytes: int = 256 << 20
    rounds: int = 5
    durability: str = "data"
    directory: str = "."
    request_blocks: int = 32
    store_threads: int = FileStore.DEFAULT_THREADS
    slice_mib: int = 8


def _raw_write(
    root: str, buf: np.ndarray, threads: int, durability: str, direct: bool = False
) -> None:
    """Write each row of ``buf`` to its own file under ``root``, ``threads`` at a time, with
    ``durability``'s syncs; ``direct``: with ``O_DIRECT`` (rows page-aligned whole pages)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)

    def one(i: int) -> None:
        fd = os.open(os.path.join(root, f"{i}.blk"), flags, 0o600)
        try:
            view = memoryview(buf[i]).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            if durability != "none":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        if durability == "full":
            dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(dfd)
            os.close(dfd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(buf))))


def _page_aligned_copy(rows: np.ndarray) -> np.ndarray:
    """A copy of 2-D ``rows`` in anonymous (page-aligned) memory; rows must be whole pages."""
    assert rows.shape[1] % mmap.PAGESIZE == 0, "direct I/O baseline needs whole pages"
    out = np.frombuffer(mmap.mmap(-1, rows.nbytes), np.uint8).reshape(rows.shape)
    out[:] = rows
    return out


def drop_cached(root: str) -> int:
    """Evict every file under ``root`` from the page cache (``POSIX_FADV_DONTNEED``).

    Works without privileges for clean pages, i.e. after ``fdatasync``: the next reads come
    from the disk. Returns the number of files advised.
    """
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def _raw_read(root: str, out: np.ndarray, threads: int, direct: bool = False) -> None:
    """Read the files :func:`_raw_write` wrote back into the rows of ``out``."""
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def one(i: int) -> None:
        fd = os.open(os.path.join(root, f"{i}.blk"), flags)
        try:
            view = memoryview(out[i]).cast("B")
            got = 0
            while got < len(view):
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise OSError("short read")
                got += n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(out))))


async def _bench_size(
    name: str, cfg: FileBenchConfig, tick: Callable[[str], None]
) -> dict[str, Any]:
    layout = CacheLayout.gqa(**LAYOUTS[name])  # type: ignore[arg-type]
    nbytes = layout.block_nbytes
    n = max(cfg.request_blocks, cfg.total_bytes // nbytes)
    src = create_kv_cache(layout, n)
    dst = create_kv_cache(layout, n)
    rng = np.random.default_rng(0)
    for rows in src.byte_rows:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    contiguous = np.concatenate([np.ascontiguousarray(r) for r in src.byte_rows], axis=1)
    readback = np.empty_like(contiguous)
    direct_src = _page_aligned_copy(contiguous)
    direct_out = _page_aligned_copy(np.zeros_like(contiguous))
    workdir = tempfile.mkdtemp(prefix=f"kvpipe-bench-{name}-", dir=cfg.directory)
    round_no = [0]
    config = PipelineConfig(
        slice_block_num=max(8, (cfg.slice_mib << 20) // nbytes),
        staging_bytes=max(512 << 20, 64 * nbytes),
    )
    write_m, read_m = Measurement(n * nbytes), Measurement(n * nbytes)
    store_root = os.path.join(workdir, "store")
    store = FileStore(
        store_root,
        durability=cfg.durability,  # type: ignore[arg-type]
        threads=cfg.store_threads,
    )

    async def pipeline_round(wpipe: Any, rpipe: Any) -> float:
        round_no[0] += 1
        w = await _move(wpipe, n, cfg.request_blocks, round_no[0], write=True, cache=src)
        if cfg.cold_reads:
            await anyio.to_thread.run_sync(drop_cached, os.path.join(store_root, "blocks"))
        r = await _move(rpipe, n, cfg.request_blocks, round_no[0], write=False, cache=dst)
        await store.delete(_round_keys(wpipe, n, cfg.request_blocks, round_no[0], layout))
        write_m.add("pipeline", w)
        read_m.add("pipeline", r)
        tick(f"{name} pipeline")
        return w

    def raw_round(threads: int, direct: bool = False) -> Callable[[], Any]:
        label = f"direct{threads}" if direct else f"raw{threads}"

        async def go() -> float:
            root = os.path.join(workdir, label)
            os.makedirs(root, exist_ok=True)
            data, out = (direct_src, direct_out) if direct else (contiguous, readback)
            async with Timer() as tw:
                await anyio.to_thread.run_sync(
                    _raw_write, root, data, threads, cfg.durability, direct
                )
            if cfg.cold_reads:
                await anyio.to_thread.run_sync(drop_cached, root)
            async with Timer() as tr:
                await anyio.to_thread.run_sync(_raw_read, root, out, threads, direct)
            await anyio.to_thread.run_sync(shutil.rmtree, root)
            write_m.add(label, tw.seconds)
            read_m.add(label, tr.seconds)
            tick(f"{name} {'direct' if direct else 'raw'} x{threads}")
            return tw.seconds

        return go

    baselines = ["raw1", "raw4", "direct4"]
    try:
        async with (
            store,
            open_pipeline(src, store, config=config, namespace="bench") as wpipe,
            open_pipeline(dst, store, config=config, namespace="bench") as rpipe,
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
    finally:
        await anyio.to_thread.run_sync(shutil.rmtree, workdir, True)
    # drop the warm-up round recorded by the closures
    for m in (write_m, read_m):
        m.seconds = {k: v[1:] for k, v in m.seconds.items()}
    assert np.array_equal(readback, contiguous)
    assert np.array_equal(direct_out, contiguous)
    return {
        "block_size": name,
        "block_bytes": nbytes,
        "blocks": n,
        "durability": cfg.durability,
        "cold_reads": cfg.cold_reads,
        "direct_writes": int(statistics.get("direct_writes", 0)),
        "store_threads": cfg.store_threads,
        "slice_block_num": config.slice_block_num,
        "request_blocks": cfg.request_blocks,
        "write": _summary(write_m, baselines),
        "read": _summary(read_m, baselines),
    }


def _summary(m: Measurement, baselines: list[str]) -> dict[str, Any]:
    """The pipeline against every baseline, and against the page-cache ones alone."""
    out = m.summary("pipeline", baselines)
    out["ratio_vs_buffered"] = round(m.ratio("pipeline", ["raw1", "raw4"]), 3)
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


def _round_keys(pipe: Any, n: int, per: int, round_no: int, layout: CacheLayout) -> list[str]:
    """The keys :func:`_move` wrote in round ``round_no`` (to delete them afterwards)."""
    keys: list[str] = []
    for first in range(0, n, per):
        tokens = _tokens(first, min(per, n - first), layout.block_size, round_no)
        keys += block_keys(pipe.scope, as_tokens(tokens), layout.block_size, False).keys
    return keys


def _tokens(first: int, count: int, block_size: int, round_no: int) -> np.ndarray:
    """The tokens of the request writing blocks ``first .. first + count`` in a round."""
    tokens = np.arange(first * 1000, first * 1000 + count * block_size)
    return tokens + round_no * 10**9


async def run_filestore_bench(
    cfg: FileBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run every block size; one JSON-ready record each."""
    return [await _bench_size(name, cfg, tick) for name in cfg.sizes]
