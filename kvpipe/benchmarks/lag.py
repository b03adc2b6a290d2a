"""Event-loop lag: how late a 1 ms ticker on the pipeline's own event loop wakes up while
kvpipe writes and reads at full speed.

A ticker task sleeps 1 ms at a time (``anyio.sleep(0.001)``) on the loop that runs the
pipeline and records how much later than 1 ms it woke up; the samples are tagged with the
phase running at that moment. Phases, interleaved per round after a warm-up round:

- ``idle``: nothing else runs (the loop's and the machine's own timer jitter);
- ``plain copies``: the memory scenario's plain-numpy baseline moves the same bytes in two
  worker threads (what saturating both cores with GIL-free copies does to the loop);
- ``raw file writes``: the file scenario's raw baseline writes the file store's share of
  bytes, one file per block with ``fdatasync``, from four threads (what the disk path alone
  does to the loop);
- ``<store> write`` / ``<store> read``: ``pipe.write`` / ``pipe.read`` of N blocks of 2 MiB,
  requests of 16 blocks in slices of 4, 4 in flight, over the memory store and the file store
  (``durability="data"``), checksums on.

Goal (issue 7): p99 <= 2 ms and max <= 10 ms during full-speed writes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, final

import anyio
from anyio.to_thread import run_sync

from .._config import PipelineConfig
from ..backends.file import FileStore
from ..backends.memory import MemoryStore
from ..pipeline import Pipeline, open_pipeline
from ._file_baselines import raw_write
from ._workload import (
    model_layout,
    percentiles,
    random_cache,
    run_requests,
    same_bytes,
    scrub,
)
from .memory import PlainCopies

__all__ = ("LagBenchConfig", "Ticker", "run_lag_bench")


@final
@dataclass(frozen=True, slots=True)
class LagBenchConfig:
    """What to run.

    Attributes:
        stores: ``"memory"`` and/or ``"file"``.
        memory_bytes: Bytes one round writes (and reads) over the memory store.
        file_bytes: Bytes one round writes (and reads) over the file store.
        idle_seconds: Length of the idle phase of a round.
        rounds: Recorded rounds (after one warm-up).
        directory: Where the file store lives.
        interval: The ticker's period, seconds.
        copy_threads: The pipelines' ``copy_threads`` (default: the pipeline's default).
        io_threads: The pipelines' ``io_threads`` (default: the pipeline's default).
        store_threads: The file store's ``threads`` (default: the store's default).
    """

    stores: tuple[str, ...] = ("memory", "file")
    memory_bytes: int = 512 << 20
    file_bytes: int = 256 << 20
    idle_seconds: float = 0.5
    rounds: int = 3
    directory: str = "."
    interval: float = 0.001
    copy_threads: int | None = None
    io_threads: int | None = None
    store_threads: int | None = None


@final
class Ticker:
    """Wakes every ``interval`` seconds and records its lateness under the current phase."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.phase: str | None = None
        self.samples: dict[str, list[float]] = {}
        self._stop = False

    async def run(self) -> None:
        """Tick until :meth:`stop`."""
        clock = time.perf_counter
        while not self._stop:
            phase = self.phase
            started = clock()
            await anyio.sleep(self.interval)
            late = clock() - started - self.interval
            if phase is not None and phase == self.phase:
                self.samples.setdefault(phase, []).append(max(0.0, late))

    def stop(self) -> None:
        """End :meth:`run` at its next tick."""
        self._stop = True


def loop_name() -> str:
    """``uvloop`` or ``asyncio`` (or the running loop's class name)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return "trio"
    module = type(loop).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


async def run_lag_bench(
    cfg: LagBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run every phase ``cfg.rounds`` times (plus a warm-up); one record per phase."""
    layout = model_layout("2MiB")
    nbytes = layout.block_nbytes
    n_mem = max(16, cfg.memory_bytes // nbytes)
    n_file = max(16, cfg.file_bytes // nbytes)
    n = max(n_mem, n_file) if "file" in cfg.stores else n_mem
    src = random_cache(layout, n)
    dst = random_cache(layout, n, seed=1)
    plain = PlainCopies(src, dst, 4)
    threads = {"copy_threads": cfg.copy_threads, "io_threads": cfg.io_threads}
    config = PipelineConfig(slice_block_num=4, staging_bytes=256 << 20).replace(
        **{k: v for k, v in threads.items() if v is not None}
    )
    shape: dict[str, Any] = {"per_request": 16, "concurrency": 4}
    ticker = Ticker(cfg.interval)
    workdir = tempfile.mkdtemp(prefix="kvpipe-bench-lag-", dir=cfg.directory)
    moved: dict[str, float] = {}
    tag = [0]

    async def phase(name: str, recording: bool, fn: Callable[[], Any]) -> None:
        ticker.phase = name if recording else None
        started = time.perf_counter()
        await fn()
        if recording:
            moved[name] = moved.get(name, 0.0) + time.perf_counter() - started
        ticker.phase = None
        tick(f"lag: {name}")

    async def pipeline_phases(store: str, w: Pipeline, r: Pipeline, blocks: int, rec: bool) -> None:
        tag[0] += 1
        await phase(
            f"{store} write",
            rec,
            lambda: run_requests(w, blocks=blocks, tag=tag[0], write=True, **shape),
        )
        # the plain copies scatter into ``dst`` too: clear it, so that the check below sees
        # what this read moved (both untimed)
        await run_sync(scrub, dst, blocks)
        await phase(
            f"{store} read",
            rec,
            lambda: run_requests(r, blocks=blocks, tag=tag[0], write=False, **shape),
        )
        if not await run_sync(same_bytes, src, dst, blocks):
            raise RuntimeError(f"lag bench: {store} read back different bytes")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            mem = MemoryStore()
            async with (
                FileStore(
                    os.path.join(workdir, "store"),
                    durability="data",
                    threads=cfg.store_threads or 4,
                ) as fstore,
                open_pipeline(src, mem, config=config) as mw,
                open_pipeline(dst, mem, config=config) as mr,
                open_pipeline(src, fstore, config=config) as fw,
                open_pipeline(dst, fstore, config=config) as fr,
            ):
                for r in range(cfg.rounds + 1):
                    rec = r > 0
                    await anyio.sleep(0.2)  # let the previous round's frees settle (untimed)
                    await phase("idle", rec, lambda: anyio.sleep(cfg.idle_seconds))

                    async def copies() -> None:
                        await run_sync(plain.run, plain.write, n_mem, 2)
                        await run_sync(plain.run, plain.read, n_mem, 2)
                        plain.store.clear()

                    await phase("plain copies", rec, copies)
                    if "file" in cfg.stores:
                        raw = os.path.join(workdir, f"raw-{r}")
                        os.makedirs(raw)
                        flat = plain.flat(n_file)

                        async def raw_writes(root: str = raw, buf: Any = flat) -> None:
                            await run_sync(raw_write, root, buf, 4, "data")

                        await phase("raw file writes", rec, raw_writes)
                        await run_sync(shutil.rmtree, raw)
                    if "memory" in cfg.stores:
                        await pipeline_phases("memory", mw, mr, n_mem, rec)
                        await mem.delete(mem.keys())
                    if "file" in cfg.stores:
                        await pipeline_phases("file", fw, fr, n_file, rec)
            ticker.stop()
    finally:
        await run_sync(shutil.rmtree, workdir, True)
    loop = loop_name()
    out = []
    for name, samples in ticker.samples.items():
        store, _, op = name.partition(" ")
        blocks = {"memory": n_mem, "file": n_file}.get(store, n_mem)
        row: dict[str, Any] = {
            "phase": name,
            "loop": loop,
            "threads": {
                "copy": config.copy_threads,
                "io": config.io_threads,
                "file_store": cfg.store_threads or 4,
            },
            "seconds": round(moved.get(name, 0.0), 3),
            "lag_ms": percentiles(samples, 1e3),
        }
        if name == "raw file writes":
            row["gbps"] = round(cfg.rounds * n_file * nbytes / moved[name] / 1e9, 3)
        if op in ("write", "read") and store in ("memory", "file"):
            row["gbps"] = round(cfg.rounds * blocks * nbytes / moved[name] / 1e9, 3)
        out.append(row)
    return out
