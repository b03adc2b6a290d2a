"""The FastDeploy adapter's cost: :class:`~kvpipe.integrations.fastdeploy.KVPipeAttentionStore`
driven from worker threads, as FastDeploy's cache transfer manager drives it, against the
pipeline called directly on its own event loop.

Both contenders move the same bytes between the same per-layer Paddle CPU tensors
(FastDeploy's ``[num_blocks, kv_heads, block_size, head_dim]``, Llama-3-8B's layout, 2 MiB
blocks) and a file store in a fresh directory per round:

- ``adapter``: ``threads`` threads (4), each calling ``write`` for its requests one after the
  other, then ``read`` of the same requests into other block ids; every call hops onto the
  adapter's loop thread and back.
- ``direct``: ``threads`` tasks on the benchmark's own loop doing the same with
  ``Pipeline.write`` / ``Pipeline.read`` over a pipeline on the same tensors and config.

Rounds are interleaved (adapter, direct, adapter, ...) after a warm-up round; the ratio is the
median over rounds of adapter / direct speed. Every round checks its counts and the bytes read
back (outside the timed part).

**Thread hop.** After each adapter round, the same threads each make ``hops`` calls of a
no-op coroutine through the adapter's portal (the path every adapter call takes), all at
once: the time from the caller's call to the loop thread running it and the result back.
Reported as p50 / p99 over every round's calls.
"""

from __future__ import annotations

import importlib
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, final

import anyio
import numpy as np

from .._cache import KVCache
from .._config import PipelineConfig
from .._errors import Unsupported
from ..backends.file import FileStore
from ..integrations.fastdeploy import KVPipeAttentionStore, infer_layout
from ..pipeline import open_pipeline
from ._measure import Measurement

__all__ = ("IntegrationBenchConfig", "run_integration_bench")

#: Llama-3-8B per layer: 8 KV heads of 128; 16 tokens a block make 2 MiB (bf16, K and V).
LAYERS: Final = 32
HEADS: Final = 8
HEAD_DIM: Final = 128
TOKENS: Final = 16


@final
@dataclass(frozen=True, slots=True)
class IntegrationBenchConfig:
    """What to run.

    Attributes:
        total_bytes: Bytes each contender writes (and reads) per round.
        request_blocks: Blocks per request (per ``write`` / ``read`` call).
        threads: Caller threads (adapter) and tasks (direct).
        rounds: Recorded rounds (after one warm-up).
        hops: No-op portal calls per thread per round.
        directory: Where the file store's round directories go.
        layers: Layers of the cache (32: 2 MiB blocks; fewer for smoke runs).
    """

    total_bytes: int = 256 << 20
    request_blocks: int = 16
    threads: int = 4
    rounds: int = 5
    hops: int = 200
    directory: str = "."
    layers: int = LAYERS


def _paddle() -> Any:
    try:
        paddle: Any = importlib.import_module("paddle")
    except ImportError:
        raise Unsupported(
            "the integration scenario drives FastDeploy's adapter with Paddle tensors: "
            "pip install 'kvpipe[paddle]'"
        ) from None
    paddle.set_device("cpu")
    return paddle


@final
class _Bench:
    """The tensors, the requests and the timings of one run."""

    def __init__(self, cfg: IntegrationBenchConfig) -> None:
        self.cfg = cfg
        paddle = _paddle()
        self.block_bytes = cfg.layers * 2 * HEADS * TOKENS * HEAD_DIM * 2
        per_thread = max(1, cfg.total_bytes // self.block_bytes // cfg.threads)
        self.request_blocks = min(cfg.request_blocks, per_thread)
        self.requests = max(1, per_thread // self.request_blocks)  # per thread
        self.blocks = cfg.threads * self.requests * self.request_blocks  # per round
        shape = [2 * self.blocks, HEADS, TOKENS, HEAD_DIM]
        paddle.seed(5)
        self.k = [paddle.randn(shape).astype("bfloat16") for _ in range(cfg.layers)]
        self.v = [paddle.randn(shape).astype("bfloat16") for _ in range(cfg.layers)]
        self.config = PipelineConfig()
        self.layout = infer_layout(self.k, self.v, cfg.layers, TOKENS)
        ordered = [t for pair in zip(self.k, self.v, strict=True) for t in pair]
        self.cache = KVCache.from_tensors(self.layout, ordered)
        self.measured = {op: Measurement(self.blocks * self.block_bytes) for op in ("w", "r")}
        self.hops: list[float] = []
        self.round = 0

    def work(self, worker: int) -> list[tuple[str, list[int], list[int], list[int]]]:
        """This round's requests of ``worker``: (task id, tokens, source ids, target ids)."""
        out = []
        n = self.request_blocks
        for j in range(self.requests):
            first = (worker * self.requests + j) * n
            seq = (self.round * 1_000_000 + first) * TOKENS
            tokens = list(range(seq, seq + n * TOKENS))
            src = list(range(first, first + n))
            out.append((f"r{self.round}w{worker}q{j}", tokens, src, [b + self.blocks for b in src]))
        return out

    def check(self) -> None:
        """The blocks read back equal the blocks written, then zero the targets for the next
        round (outside the timed part; through the cache's views of the same memory)."""
        half = self.blocks
        for rows in self.cache.byte_rows:
            if not np.array_equal(rows[:half], rows[half : 2 * half]):
                raise RuntimeError("integration bench: bytes read back differ")
            rows[half:] = 0

    def directory(self) -> str:
        return tempfile.mkdtemp(prefix="kvpipe-bench-fd-", dir=self.cfg.directory)

    # -- adapter: threads calling KVPipeAttentionStore ----------------------------------------

    def adapter_round(self) -> tuple[float, float]:
        """Blocking: one round through the adapter from ``threads`` threads."""
        where = self.directory()
        try:
            with KVPipeAttentionStore(
                layer_num=self.cfg.layers,
                block_token_size=TOKENS,
                store=FileStore(where),
                config=self.config,
            ) as store:
                threads = self.cfg.threads
                go = [threading.Barrier(threads + 1) for _ in range(4)]

                def worker(w: int) -> None:
                    try:
                        work = self.work(w)
                        go[0].wait()
                        for task, tokens, src, _ in work:
                            if store.write(task, self.k, self.v, tokens, src, 0) != len(src):
                                raise RuntimeError(f"integration bench: write {task} incomplete")
                        go[1].wait()
                        go[2].wait()
                        for task, tokens, _, dst in work:
                            if store.read(task, self.k, self.v, tokens, dst, 0) != len(dst):
                                raise RuntimeError(f"integration bench: read {task} incomplete")
                        go[3].wait()
                        self._hops(store)
                    except BaseException:
                        for barrier in go:  # the others stop waiting for this thread
                            barrier.abort()
                        raise

                with ThreadPoolExecutor(threads) as pool:
                    futures = [pool.submit(worker, w) for w in range(threads)]
                    try:
                        go[0].wait()
                        t0 = time.perf_counter()
                        go[1].wait()
                        t1 = time.perf_counter()
                        go[2].wait()
                        t2 = time.perf_counter()
                        go[3].wait()
                        t3 = time.perf_counter()
                    except threading.BrokenBarrierError:
                        _raise_first(futures)
                        raise
                    for f in futures:
                        f.result()
        finally:
            shutil.rmtree(where, ignore_errors=True)
        return t1 - t0, t3 - t2

    def _hops(self, store: KVPipeAttentionStore) -> None:
        async def noop() -> None:
            return None

        samples = []
        for _ in range(self.cfg.hops):
            started = time.perf_counter()
            store._loop.call(noop, wait=10.0)
            samples.append(time.perf_counter() - started)
        self.hops.extend(samples)  # list.extend is atomic under the GIL

    # -- direct: tasks calling the pipeline on this loop --------------------------------------

    async def direct_round(self) -> tuple[float, float]:
        """One round through a pipeline on this loop, ``threads`` tasks."""
        where = self.directory()
        try:
            async with open_pipeline(self.cache, FileStore(where), config=self.config) as pipe:
                works = [self.work(w) for w in range(self.cfg.threads)]

                async def writes(work: list[Any]) -> None:
                    for task, tokens, src, _ in work:
                        r = await pipe.write(tokens, src, request_id=task)
                        if r.skipped + r.written != len(src):
                            raise RuntimeError(f"integration bench: write {task} incomplete")

                async def reads(work: list[Any]) -> None:
                    for task, tokens, _, dst in work:
                        r = await pipe.read(tokens, dst, request_id=task)
                        if r.loaded != len(dst):
                            raise RuntimeError(f"integration bench: read {task} incomplete")

                t0 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for work in works:
                        tg.start_soon(writes, work)
                t1 = time.perf_counter()
                async with anyio.create_task_group() as tg:
                    for work in works:
                        tg.start_soon(reads, work)
                t2 = time.perf_counter()
        finally:
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(where, ignore_errors=True))
        return t1 - t0, t2 - t1


def _raise_first(futures: list[Future[None]]) -> None:
    """Raise the error of the thread that broke the barriers (the others only saw them
    broken), once every thread has ended."""
    errors = [f.exception() for f in futures]
    for exc in errors:
        if exc is not None and not isinstance(exc, threading.BrokenBarrierError):
            raise exc


def _us(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6, 1)


async def run_integration_bench(
    cfg: IntegrationBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Adapter vs direct pipeline, interleaved rounds; JSON-ready.

    Raises:
        Unsupported: Paddle is not installed.
    """
    bench = await anyio.to_thread.run_sync(_Bench, cfg)
    for r in range(cfg.rounds + 1):
        bench.round = 2 * r
        adapter = await anyio.to_thread.run_sync(bench.adapter_round)
        await anyio.to_thread.run_sync(bench.check)
        bench.round = 2 * r + 1
        direct = await bench.direct_round()
        await anyio.to_thread.run_sync(bench.check)
        if r:
            for i, op in enumerate(("w", "r")):
                bench.measured[op].add("adapter", adapter[i])
                bench.measured[op].add("direct", direct[i])
        else:
            bench.hops.clear()  # the warm-up round's hops are not recorded
        tick(f"integration: round {r}")
    out: dict[str, Any] = {
        "block_size": (
            f"{bench.block_bytes >> 20}MiB"
            if bench.block_bytes % (1 << 20) == 0
            else f"{bench.block_bytes >> 10}KiB"
        ),
        "block_bytes": bench.block_bytes,
        "blocks": bench.blocks,
        "request_blocks": bench.request_blocks,
        "threads": cfg.threads,
        "store": "file",
    }
    for op, name in (("w", "write"), ("r", "read")):
        out[name] = bench.measured[op].summary("adapter", ["direct"])
    out["hop_us"] = {
        "p50": _us(bench.hops, 0.5),
        "p99": _us(bench.hops, 0.99),
        "mean": round(statistics.fmean(bench.hops) * 1e6, 1),
        "calls": len(bench.hops),
    }
    return out
