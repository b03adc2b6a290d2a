"""Actor overhead: the fixed cost per request, per slice and per block of the pipeline's
actor hops (messages between five actors, a task per message, wake-ups, request state),
against the same work done by the same library calls in a plain loop.

**Fixed costs, tiny blocks.** A layout with the 2 MiB layout's structure (32 layers, key
and value: 64 segments per block) but 16 bytes per segment (1 KiB blocks, one token per
block), so copies cost next to nothing and every call runs inline on the event loop (no
worker threads below 256 KiB). Over a :class:`~kvpipe.MemoryStore`, checksums on, one
request at a time, three contenders interleaved per round:

- ``pipeline``: ``pipe.write`` then ``pipe.read`` through the actors;
- ``plain``: the same calls in one task: keys (``block_keys``), the ``exists`` probe, and per
  slice a staging lease, the host engine's gather, sealing, ``put_blocks`` (reads:
  ``get_blocks``, verification, scatter), release;
- ``one_hop``: the plain loop's calls behind the least an actor design on anyio adds (one
  memory-object-stream hop and one deadline cancel scope per slice, an event per request:
  :class:`OneHopLoop`). ``one_hop`` - ``plain`` is that floor.

Three request shapes give per-request ``a``, per-slice ``b`` and per-block ``c`` costs
(``t = a + slices * b + blocks * c``): 64 blocks in 1 slice, 64 blocks in 64 slices, 1
block. The overhead of the actors is pipeline minus plain, per coefficient, median over
rounds.

**Reference.** The copy time of one 2 MiB block (Llama-3-8B layout, 16 tokens): gathering
its 64 segments from a 128 MiB cache into staging, median over rounds; and the round trip
of a worker-thread call (the pipeline makes three per slice larger than 256 KiB on each
path: copy, checksum, store; a plain loop making the same calls makes them too).

Goal (issue 7): actor overhead <= 2 % of a 2 MiB block's copy time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, Final, final

import anyio
import numpy as np
from anyio.to_thread import run_sync

from .._config import PipelineConfig
from .._engine import HostEngine
from .._hostcopy import seal_slots, verify_slots
from .._keys import Scope, block_keys, key_digest
from .._layout import CacheLayout
from .._plan import copy_plan, layout_segments
from .._staging import StagingPool
from .._workers import Lane, ThreadRunner
from ..actors.scheduler import PROBE_CHUNK_MIN
from ..backends._base import GetBatch, KeyBatch, PutBatch
from ..backends.memory import MemoryStore
from ..pipeline import open_pipeline
from ._workload import model_layout, random_cache

__all__ = ("SHAPES", "OneHopLoop", "OverheadBenchConfig", "PlainLoop", "run_overhead_bench")

#: Who runs the same calls: the pipeline, the plain loop, and the plain loop behind one
#: actor hop (:class:`OneHopLoop`).
CONTENDERS: Final = ("pipeline", "plain", "one_hop")
#: (name, blocks per request, blocks per slice).
SHAPES: Final = (("1x64", 64, 64), ("64x1", 64, 1), ("1x1", 1, 1))
#: Slices of a 64-block request at which the overhead per 2 MiB block is reported.
REPORT_SLICES: Final = (1, 4, 16, 64)


@final
@dataclass(frozen=True, slots=True)
class OverheadBenchConfig:
    """What to run.

    Attributes:
        rounds: Recorded rounds (after one warm-up).
        requests: Requests per shape and round: (64 blocks in 1 slice, 64 in 64, 1 in 1).
    """

    rounds: int = 7
    requests: tuple[int, int, int] = (40, 10, 200)


def tiny_layout() -> CacheLayout:
    """64 segments of 16 bytes per block (1 KiB), one token per block."""
    return CacheLayout.gqa(num_layers=32, num_kv_heads=1, head_dim=8, block_size=1)


class PlainLoop:
    """The pipeline's library calls for one request at a time, in one task, no actors."""

    def __init__(self, cache: Any, store: MemoryStore, slice_blocks: int, runner: ThreadRunner):
        self.cache, self.store, self.slice_blocks, self.runner = cache, store, slice_blocks, runner
        layout = cache.layout
        self.block_size = layout.block_size
        self.segments = layout_segments(layout)
        self.payload = layout.block_nbytes
        self.scope = Scope("plain", layout.fingerprint)
        self.pool = StagingPool(self.payload + 48, 2 * slice_blocks)
        self.limiter = Lane(2)
        self.engine = HostEngine(cache, runner, self.limiter)

    async def request(self, tokens: Any, ids: Any, write: bool) -> None:
        """Write (or read) one sequence, slice after slice, as the actors would."""
        keys = await self._probe(tokens, write)
        s = self.slice_blocks
        for lo in range(0, len(keys), s):
            hi = min(lo + s, len(keys))
            lease = await self.pool.acquire(hi - lo)
            try:
                await self._slice(keys, tokens, ids, lo, hi, lease, write)
            finally:
                lease.release()

    async def _probe(self, tokens: Any, write: bool) -> tuple[str, ...]:
        """The request's keys, after the ``exists`` probe the scheduler makes: chunks of
        ``slice_blocks`` keys, at least :data:`~kvpipe.actors.scheduler.PROBE_CHUNK_MIN`."""
        keys = block_keys(self.scope, tokens, self.block_size, False)
        step = max(self.slice_blocks, PROBE_CHUNK_MIN)
        for lo in range(0, len(keys), step):
            flags = await self.store.exists(
                KeyBatch(self.scope, "r", keys[lo : lo + step], lo, tokens)
            )
            if write and not all(flags):
                break
        return keys

    async def _slice(
        self, keys: Any, tokens: Any, ids: Any, lo: int, hi: int, lease: Any, write: bool
    ) -> None:
        """One slice's calls: gather, seal, put (reads: get, verify, scatter)."""
        plan = copy_plan(self.segments, ids[lo:hi], lease.slots)
        digests = [key_digest(k) for k in keys[lo:hi]]
        common = (self.scope, "r", keys[lo:hi], lo, tokens[: hi * self.block_size])
        extra = {"lease": lease, "value_nbytes": self.payload + 48}
        extra |= {"runner": self.runner, "limiter": self.limiter}
        if write:
            await self.engine.gather(plan, lease)
            await self._copy(plan.nbytes, seal_slots, lease, digests)
            await self.store.put_blocks(PutBatch(*common, **extra))
        else:
            await self.store.get_blocks(GetBatch(*common, **extra))
            await self._copy(plan.nbytes, verify_slots, lease, digests)
            await self.engine.scatter(plan, lease)

    async def _copy(self, nbytes: int, fn: Any, lease: Any, digests: list[bytes]) -> None:
        args = (self.pool.buffer, lease.slots, self.payload, digests, True)
        if nbytes <= 256 * 1024:
            await anyio.lowlevel.checkpoint()
            fn(*args)
        else:
            await self.runner.run(fn, *args, hold=lease, lane=self.limiter)


@final
class OneHopLoop(PlainLoop):
    """The plain loop's calls behind the least any actor design on anyio adds: the request's
    task leases each slice's staging and sends it through a memory object stream to one
    long-lived task, which runs the slice's calls in a cancel scope with a deadline and
    releases the staging; the request waits on an event set after its last slice. One hop
    and one deadline scope per slice, nothing else: no ordering, no request state, no
    metrics."""

    def __init__(
        self, cache: Any, store: MemoryStore, slice_blocks: int, runner: ThreadRunner
    ) -> None:
        super().__init__(cache, store, slice_blocks, runner)
        self._send, self._inbox = anyio.create_memory_object_stream[Any](2)

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """The slice task: runs until :meth:`close`."""
        task_status.started()
        async with self._inbox:
            async for keys, tokens, ids, lo, hi, lease, write, done in self._inbox:
                try:
                    with anyio.CancelScope(deadline=anyio.current_time() + 10.0):
                        await self._slice(keys, tokens, ids, lo, hi, lease, write)
                finally:
                    lease.release()
                if hi == len(keys):
                    done.set()

    def close(self) -> None:
        """No more slices: :meth:`serve` returns."""
        self._send.close()

    async def request(self, tokens: Any, ids: Any, write: bool) -> None:
        """Lease and send each slice to the slice task; wait for the last one."""
        keys = await self._probe(tokens, write)
        done = anyio.Event()
        for lo in range(0, len(keys), self.slice_blocks):
            hi = min(lo + self.slice_blocks, len(keys))
            lease = await self.pool.acquire(hi - lo)
            await self._send.send((keys, tokens, ids, lo, hi, lease, write, done))
        await done.wait()


def _fit(t_1x64: float, t_64x1: float, t_1x1: float) -> dict[str, float]:
    """Per-request ``a``, per-slice ``b``, per-block ``c`` (seconds) from the three shapes."""
    b = (t_64x1 - t_1x64) / 63
    c = (t_1x64 - t_1x1) / 63
    return {"request": t_1x1 - b - c, "slice": b, "block": c}


async def _timed(fn: Callable[[], Any], count: int) -> float:
    """Seconds per call of ``count`` sequential calls of ``fn``."""
    started = time.perf_counter()
    for _ in range(count):
        await fn()
    return (time.perf_counter() - started) / count


async def _fixed_costs(cfg: OverheadBenchConfig, tick: Callable[[str], None]) -> dict[str, Any]:
    cache = random_cache(tiny_layout(), 64)
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {}
    store = MemoryStore()
    seq = [0]

    def request(who: str, name: str, blocks: int, write: bool) -> Callable[[], Any]:
        ids = np.arange(blocks, dtype=np.int64)

        async def one() -> None:
            seq[0] += 1
            tokens = np.arange(blocks, dtype=np.int64) + seq[0] * 1000
            if who != "pipeline":
                await loops[who][name].request(tokens, ids, write)
                return
            pipe = pipes[name]
            res = await (pipe.write(tokens, ids) if write else pipe.read(tokens, ids))
            if not res.complete:
                raise RuntimeError(f"overhead bench: incomplete {res}")

        return one

    # The stack closes the one-hop loops (and the pipelines) before the task group waits for
    # their slice tasks to return.
    async with (
        ThreadRunner() as runner,
        anyio.create_task_group() as tg,
        AsyncExitStack() as stack,
    ):
        pipes: dict[str, Any] = {}
        loops: dict[str, dict[str, PlainLoop]] = {"plain": {}, "one_hop": {}}
        for name, _, s in SHAPES:
            config = PipelineConfig(slice_block_num=s, staging_bytes=4 << 20)
            pipes[name] = await stack.enter_async_context(
                open_pipeline(cache, store, config=config)
            )
            loops["plain"][name] = PlainLoop(cache, store, s, runner)
            hop = loops["one_hop"][name] = OneHopLoop(cache, store, s, runner)
            await tg.start(hop.serve)
            stack.callback(hop.close)
        for r in range(cfg.rounds + 1):
            times: dict[tuple[str, str], dict[str, float]] = {}
            for (name, blocks, _), count in zip(SHAPES, cfg.requests, strict=True):
                for who in CONTENDERS:
                    first = seq[0]
                    t_w = await _timed(request(who, name, blocks, True), count)
                    seq[0] = first  # read back the same sequences
                    t_r = await _timed(request(who, name, blocks, False), count)
                    await store.delete(store.keys())
                    times.setdefault((who, "write"), {})[name] = t_w
                    times.setdefault((who, "read"), {})[name] = t_r
                tick(f"overhead: {name} (round {r})")
            if r:
                for key, t in times.items():
                    rounds.setdefault(key, []).append(_fit(t["1x64"], t["64x1"], t["1x1"]) | t)
    out: dict[str, Any] = {}
    for (who, op), fits in rounds.items():
        out.setdefault(who, {})[op] = {
            k: round(statistics.median(f[k] for f in fits) * 1e6, 2) for k in fits[0]
        }
    for label, who in (("actors", "pipeline"), ("one_hop_floor", "one_hop")):
        for op in ("write", "read"):
            pairs = zip(rounds[(who, op)], rounds[("plain", op)], strict=True)
            diffs = [{k: a[k] - b[k] for k in ("request", "slice", "block")} for a, b in pairs]
            out.setdefault(label, {})[op] = {
                k: round(statistics.median(d[k] for d in diffs) * 1e6, 2) for k in diffs[0]
            }
    return out


def _copy_reference(rounds: int) -> dict[str, float]:
    """Microseconds to gather one 2 MiB block (64 segments) from a 128 MiB cache into
    staging, and to ``memcpy`` 2 MiB, medians over rounds of 64 blocks each. Blocking."""
    layout = model_layout("2MiB")
    cache = random_cache(layout, 64, seed=2)
    segments = layout_segments(layout)
    stage = np.empty((64, layout.block_nbytes), np.uint8)
    flat = np.empty((64, layout.block_nbytes), np.uint8)
    contiguous = np.concatenate([np.ascontiguousarray(r) for r in cache.byte_rows], axis=1)
    gather_t, memcpy_t = [], []
    for r in range(rounds + 1):
        started = time.perf_counter()
        for i in range(64):
            for seg in segments:
                stage[i, seg.offset : seg.offset + seg.nbytes] = cache.byte_rows[seg.tensor][i]
        mid = time.perf_counter()
        for i in range(64):
            flat[i] = contiguous[i]
        done = time.perf_counter()
        if r:
            gather_t.append((mid - started) / 64)
            memcpy_t.append((done - mid) / 64)
    return {
        "gather_2mib_us": round(statistics.median(gather_t) * 1e6, 1),
        "memcpy_2mib_us": round(statistics.median(memcpy_t) * 1e6, 1),
    }


async def _thread_hop(count: int = 300) -> float:
    """Microseconds of one ``ThreadRunner.run`` of a no-op (median of ``count``)."""
    samples = []
    async with ThreadRunner() as runner:
        for _ in range(count):
            started = time.perf_counter()
            await runner.run(int)
            samples.append(time.perf_counter() - started)
    return round(statistics.median(samples) * 1e6, 1)


async def run_overhead_bench(
    cfg: OverheadBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Fixed costs, the copy reference and the overhead per 2 MiB block; JSON-ready."""
    fixed = await _fixed_costs(cfg, tick)
    tick("overhead: copy reference")
    ref = await run_sync(_copy_reference, cfg.rounds)
    hop = await _thread_hop()
    copy_us = ref["gather_2mib_us"]
    per_block = []
    for s in REPORT_SLICES:
        row: dict[str, Any] = {"slice_block_num": s, "request_blocks": 64}
        for op in ("write", "read"):
            a = fixed["actors"][op]
            us = a["block"] + a["slice"] / s + a["request"] / 64
            row[f"{op}_us"] = round(us, 2)
            row[f"{op}_pct"] = round(100 * us / copy_us, 2)
            with_hops = us + _HOPS_PER_SLICE * hop / s
            row[f"{op}_with_threads_pct"] = round(100 * with_hops / copy_us, 2)
        per_block.append(row)
    return {
        "fixed_us": fixed,
        "reference": ref | {"thread_hop_us": hop, "thread_hops_per_slice": _HOPS_PER_SLICE},
        "per_2mib_block": per_block,
        "rounds": cfg.rounds,
    }


#: Worker-thread calls per slice larger than 256 KiB, on each path (copy, checksum, store).
_HOPS_PER_SLICE: Final = 3
