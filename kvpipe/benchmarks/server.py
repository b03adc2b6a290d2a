"""Embedded in a real async server: an ASGI app on uvicorn answers a steady stream of small
HTTP requests from another process while the same process, on the same event loop, offloads
and reloads 2 MiB blocks at full speed — through kvpipe, and through a hand-written offload.

The server: a plain ASGI callable (``200 ok``) served by uvicorn on the bench's own asyncio
loop (uvloop under ``kvpipe bench``), 127.0.0.1. The client (:mod:`._http_client`, its own
process, standard library only) sends GETs over keep-alive connections at a fixed rate, open
loop: each request's latency runs from its *scheduled* send time, so a stalled server is
charged for everything that queued behind the stall.

Phases, interleaved per round after a warm-up round, each moving the same bytes between a
Llama-3-8B-shaped layer-major cache (2 MiB blocks of 64 per-layer segments) and the store:

- ``kvpipe``: ``pipe.write`` of the whole cache as requests of ``per_request`` blocks,
  ``concurrency`` in flight, then ``pipe.read`` of them into another cache, ``passes``
  times per round (new keys each pass; the pass's keys deleted after it), checksums on;
- ``hand``: what a user writes by hand for the same job, in ``hand_threads`` worker threads
  (``anyio.to_thread``, halves of the blocks): per chunk of ``slice_block_num`` blocks, a
  numpy gather of each block's segments into a buffer and a copy of each block into a dict
  (memory) or into its own file with ``fdatasync`` (file); then the copy back into the buffer
  and the scatter into the other cache; the stored copies dropped after each pass;
- ``idle``: no offload (the server's and the client's own latency on this machine).

Per phase and round: the server's latency (p50/p99/max) over the requests scheduled during the
phase's passes, and the offload's GB/s (bytes written plus bytes read over the time taken). Summary:
the medians over rounds, and the medians of the per-round ratios kvpipe / hand of p99 and of
GB/s. Each pass of both contenders reloads into a cleared cache, checked against the source
after the pass (clearing and checking fall between the passes' windows).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Final, final

import anyio
import numpy as np
import numpy.typing as npt

from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from .._keys import as_tokens, block_keys
from .._plan import CopySegment, layout_segments
from ..backends.file import FileStore
from ..backends.memory import MemoryStore
from ..pipeline import Pipeline, open_pipeline
from ._asgi import Load, Served, http_parser, serve_app
from ._workload import model_layout, percentiles, random_cache, run_requests, same_bytes, scrub
from .lag import loop_name

__all__ = ("PHASES", "HandOffload", "ServerBenchConfig", "run_server_bench")

#: Phase names, in the order they run each round.
PHASES: Final = ("kvpipe", "hand", "idle")


@final
@dataclass(frozen=True, slots=True)
class ServerBenchConfig:
    """What to run.

    Attributes:
        stores: ``"memory"`` and/or ``"file"`` (one record each).
        cache_bytes: The cache each pass writes whole (and reads back).
        passes: Passes over the cache per phase and round.
        rounds: Recorded rounds (after one warm-up).
        idle_seconds: Length of the idle phase.
        rate: Client requests per second.
        connections: Client keep-alive connections.
        per_request: Blocks per kvpipe request.
        concurrency: kvpipe requests in flight.
        slice_block_num: Blocks per kvpipe slice, and per chunk of the hand-written offload.
        hand_threads: Worker threads of the hand-written offload.
        directory: Where the file stores live.
        file_threads: The file store's ``threads``.
    """

    stores: tuple[str, ...] = ("memory",)
    cache_bytes: int = 256 << 20
    passes: int = 8
    rounds: int = 7
    idle_seconds: float = 1.5
    rate: float = 500.0
    connections: int = 16
    per_request: int = 16
    concurrency: int = 4
    slice_block_num: int = 4
    hand_threads: int = 2
    directory: str = "."
    file_threads: int = 4


@final
class HandOffload:
    """The hand-written offload: gather + copy into a dict or a file per block (write), copy
    back + scatter (read), chunk by chunk, the blocks split over worker threads."""

    def __init__(
        self, src: KVCache, dst: KVCache, chunk: int, threads: int, root: str | None
    ) -> None:
        self.segments: tuple[CopySegment, ...] = layout_segments(src.layout)
        self.src, self.dst = src.byte_rows, dst.byte_rows
        self.n, self.chunk, self.threads, self.root = src.num_blocks, chunk, threads, root
        self.nbytes = src.layout.block_nbytes
        self.store: dict[int, npt.NDArray[np.uint8]] = {}
        self._stages = [np.empty((chunk, self.nbytes), np.uint8) for _ in range(threads)]

    def _write_part(self, part: int) -> None:
        stage = self._stages[part]
        for first in range(*self._range(part), self.chunk):
            count = min(self.chunk, self._range(part)[1] - first)
            for seg in self.segments:
                dst = stage[:count, seg.offset : seg.offset + seg.nbytes]
                dst[...] = self.src[seg.tensor][first : first + count]
            for i in range(count):
                if self.root is None:
                    self.store[first + i] = stage[i].copy()
                else:
                    self._write_file(first + i, stage[i])

    def _read_part(self, part: int) -> None:
        stage = self._stages[part]
        for first in range(*self._range(part), self.chunk):
            count = min(self.chunk, self._range(part)[1] - first)
            for i in range(count):
                if self.root is None:
                    stage[i] = self.store[first + i]
                else:
                    self._read_file(first + i, stage[i])
            for seg in self.segments:
                self.dst[seg.tensor][first : first + count] = stage[
                    :count, seg.offset : seg.offset + seg.nbytes
                ]

    def _range(self, part: int) -> tuple[int, int]:
        per = -(-self.n // self.threads)
        return part * per, min(self.n, (part + 1) * per)

    def _path(self, block: int) -> str:
        assert self.root is not None
        return os.path.join(self.root, f"{block}.blk")

    def _write_file(self, block: int, row: npt.NDArray[np.uint8]) -> None:
        fd = os.open(self._path(block), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = row.data.cast("B")
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read_file(self, block: int, row: npt.NDArray[np.uint8]) -> None:
        with open(self._path(block), "rb", buffering=0) as f:
            if f.readinto(row.data.cast("B")) != self.nbytes:
                raise OSError(f"short read of block {block}")

    def _drop(self) -> None:
        self.store.clear()
        if self.root is not None:
            for block in range(self.n):
                os.unlink(self._path(block))

    async def _parts(self, fn: Callable[[int], None]) -> None:
        async with anyio.create_task_group() as tg:
            for part in range(self.threads):
                tg.start_soon(anyio.to_thread.run_sync, fn, part)

    async def one_pass(self) -> float:
        """Write every block, read it back, drop the copies; the seconds of write + read."""
        started = time.perf_counter()
        await self._parts(self._write_part)
        await self._parts(self._read_part)
        seconds = time.perf_counter() - started
        await anyio.to_thread.run_sync(self._drop)
        return seconds


def _keys(pipe: Pipeline, blocks: int, per: int, tag: int) -> list[str]:
    """The keys :func:`run_requests` writes with ``tag`` (to delete them after a pass)."""
    bs = pipe.cache.layout.block_size
    keys: list[str] = []
    for first in range(0, blocks, per):
        count = min(per, blocks - first)
        tokens = np.arange(first * bs, (first + count) * bs, dtype=np.int64) + tag * 10**10
        keys += block_keys(pipe.scope, as_tokens(tokens), bs, False)
    return keys


async def _bench_store(
    store_name: str, cfg: ServerBenchConfig, tick: Callable[[str], None]
) -> dict[str, Any]:
    layout = model_layout("2MiB")
    nbytes = layout.block_nbytes
    n = max(cfg.per_request, cfg.cache_bytes // nbytes)
    src = random_cache(layout, n)
    dst_kv, dst_hand = create_kv_cache(layout, n), create_kv_cache(layout, n)
    workdir = tempfile.mkdtemp(prefix="kvpipe-bench-server-", dir=cfg.directory)
    hand_root = os.path.join(workdir, "hand") if store_name == "file" else None
    if hand_root is not None:
        os.makedirs(hand_root)
    hand = HandOffload(src, dst_hand, cfg.slice_block_num, cfg.hand_threads, hand_root)
    config = PipelineConfig.from_env(slice_block_num=cfg.slice_block_num, staging_bytes=256 << 20)
    shape: dict[str, Any] = {"per_request": cfg.per_request, "concurrency": cfg.concurrency}
    app = Served()
    # phase, round, (start, end) of each pass, seconds the passes reported
    windows: list[tuple[str, int, list[tuple[float, float]], float]] = []
    tag = [0]
    wrong: list[str] = []
    try:
        async with (
            _open_store(store_name, workdir, cfg) as store,
            open_pipeline(src, store, config=config) as w,
            open_pipeline(dst_kv, store, config=config) as r,
        ):

            async def kvpipe_pass() -> float:
                tag[0] += 1
                a = await run_requests(w, blocks=n, tag=tag[0], write=True, **shape)
                b = await run_requests(r, blocks=n, tag=tag[0], write=False, **shape)
                await store.delete(_keys(w, n, cfg.per_request, tag[0]))
                return a.seconds + b.seconds

            async def idle_pass() -> float:
                await anyio.sleep(cfg.idle_seconds / cfg.passes)
                return 0.0

            contenders: dict[str, Callable[[], Awaitable[float]]] = {
                "kvpipe": kvpipe_pass,
                "hand": hand.one_pass,
                "idle": idle_pass,
            }
            max_seconds = 600.0
            async with (
                serve_app(app) as port,
                Load(port, cfg.rate, cfg.connections, max_seconds) as load,
            ):
                for rnd in range(cfg.rounds + 1):
                    if wrong:
                        break
                    for phase, fn in contenders.items():
                        dst = {"kvpipe": dst_kv, "hand": dst_hand}.get(phase)
                        await anyio.sleep(0.2)  # the previous phase's frees settle (unrecorded)
                        spans: list[tuple[float, float]] = []
                        seconds = 0.0
                        for _ in range(cfg.passes):
                            # each pass reloads into a cleared cache, checked after it; both
                            # outside the pass's window: not in the phase's latencies
                            if dst is not None:
                                await anyio.to_thread.run_sync(scrub, dst)
                            start = time.monotonic()
                            seconds += await fn()
                            spans.append((start, time.monotonic()))
                            if dst is not None and not await anyio.to_thread.run_sync(
                                same_bytes, src, dst
                            ):
                                wrong.append(phase)  # raised once the server has stopped
                                break
                        windows.append((phase, rnd, spans, seconds))
                        if wrong:
                            break
                        tick(f"server {store_name}: round {rnd} {phase}")
                await anyio.sleep(0.2)
    finally:
        await anyio.to_thread.run_sync(shutil.rmtree, workdir, True)
    if wrong:
        raise RuntimeError(f"server bench: {wrong[0]} reloaded different bytes")
    assert load.result is not None
    threads = {"copy": config.copy_threads, "io": config.io_threads}
    return _record(store_name, cfg, (n, nbytes), windows, load, app, threads)


def _open_store(name: str, workdir: str, cfg: ServerBenchConfig) -> Any:
    if name == "memory":
        return MemoryStore()
    return FileStore(os.path.join(workdir, "store"), durability="data", threads=cfg.file_threads)


def _record(
    store_name: str,
    cfg: ServerBenchConfig,
    shape: tuple[int, int],
    windows: list[tuple[str, int, list[tuple[float, float]], float]],
    load: Load,
    app: Served,
    threads: dict[str, int],
) -> dict[str, Any]:
    assert load.result is not None
    blocks, nbytes = shape
    moved = 2 * blocks * nbytes * cfg.passes  # written + read per phase
    rounds: list[dict[str, Any]] = []
    for phase, rnd, spans, seconds in windows:
        if rnd == 0:
            continue
        latencies = [x for start, end in spans for x in load.result.between(start, end).tolist()]
        row: dict[str, Any] = {
            "round": rnd,
            "phase": phase,
            "seconds": round(sum(end - start for start, end in spans), 3),
            "latency_ms": percentiles(latencies, 1e3),
        }
        if phase != "idle":
            row["gbps"] = round(moved / seconds / 1e9, 3)
        rounds.append(row)
    summary: dict[str, Any] = {}
    for phase in PHASES:
        rows = [r for r in rounds if r["phase"] == phase]
        lat = [r["latency_ms"] for r in rows]
        summary[phase] = {
            "p50_ms": round(statistics.median(q["p50"] for q in lat), 3),
            "p99_ms": round(statistics.median(q["p99"] for q in lat), 3),
            "max_ms": round(max(q["max"] for q in lat), 3),
            "requests": sum(q["n"] for q in lat),
        }
        if phase != "idle":
            summary[phase]["gbps"] = round(statistics.median(r["gbps"] for r in rows), 3)
    kv = [r for r in rounds if r["phase"] == "kvpipe"]
    hd = [r for r in rounds if r["phase"] == "hand"]
    pairs = list(zip(kv, hd, strict=True))
    return {
        "store": store_name,
        "loop": loop_name(),
        "http": http_parser(),
        "block_bytes": nbytes,
        "blocks": blocks,
        "bytes_per_phase": moved,
        "config": asdict(cfg) | {"stores": list(cfg.stores)},
        "pipeline_threads": threads,
        "client": load.result.summary,
        "served": app.requests,
        "lifespan": app.lifespan,
        "rounds": rounds,
        "summary": summary,
        "p99_ratio": round(
            statistics.median(
                k["latency_ms"]["p99"] / max(h["latency_ms"]["p99"], 1e-9) for k, h in pairs
            ),
            3,
        ),
        "gbps_ratio": round(statistics.median(k["gbps"] / h["gbps"] for k, h in pairs), 3),
    }


async def run_server_bench(
    cfg: ServerBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run the scenario over every store of ``cfg``; one JSON-ready record each."""
    return [await _bench_store(name, cfg, tick) for name in cfg.stores]
