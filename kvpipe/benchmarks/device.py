"""The CUDA device path end to end: the pipeline offloading a GPU cache to the memory store
and reloading it, against a hand-written loop doing the same data movement, in the same run.

The cache is Llama-3-8B's layout (bf16, 32 layers, K and V: 64 tensors of
``[num_blocks, 16, 8, 128]``, 2 MiB blocks by default) in device memory that kvpipe's own
driver allocates (no framework needed), filled with random bytes. Each round writes
``blocks`` blocks from the first half of the cache and reads them back into the second half,
in interleaved rounds after one warm-up round:

- ``pipeline``: ``pipe.write`` over a :class:`~kvpipe.MemoryStore` (dedup probe, the gather
  kernel into pinned staging, XXH3 trailer, the store's copy of each value into memory of
  its own), then ``pipe.read`` (probe, the store's copy into staging, verify, the scatter
  kernel reading mapped staging). Requests of ``request_bytes`` in ``slice_bytes`` slices,
  ``concurrency`` in flight, ordered after a producer stream (``stream=``).
- ``plain`` (the baseline): ``threads`` threads over disjoint slices of the same size, each
  with its own stream and pinned buffer (kept across passes): **write** = one
  ``cuMemcpyDtoHAsync`` per tensor of the slice's consecutive blocks into a layer-major
  pinned buffer, wait, then each block's 64 segments copied by one strided numpy copy into a
  fresh array held in a dict; **read** = each stored value copied back by one strided copy,
  one ``cuMemcpyHtoDAsync`` per tensor, wait. No keys, checksums, trailer, actors or event
  loop. The store is emptied after each round, for both.
- ``link`` (the ceiling of the PCIe link, not a contender): one ``cuMemcpyAsync`` per
  direction of ``slice_bytes`` at a time between one device buffer and pinned memory, no
  host copy at all.
- ``host`` (the host's side alone, not a contender): ``threads`` threads copying the plain
  loop's stored values into pinned memory a slice at a time (``copy``: what a read's store
  does into staging), and the same copies each followed by XXH3 of what landed
  (``copy_hash``: what a verified read's host passes read and write), no device at all.

Ratios are medians over rounds of pipeline / plain speed. Every round of both contenders
checks the blocks read back against the blocks written (outside the timed part).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeVar, final

import anyio
import numpy as np
import xxhash
from anyio.to_thread import run_sync

from .. import _blockformat
from .._cache import KVCache
from .._config import PipelineConfig
from .._layout import CacheLayout, numpy_dtype
from ..backends.memory import MemoryStore
from ..cuda._driver import CudaDriver, Driver
from ..cuda._pinned import PinnedBuffer
from ..pipeline import open_pipeline
from ._measure import Measurement
from ._workload import MODEL_BLOCK_TOKENS, model_layout, run_requests

__all__ = ("DeviceBenchConfig", "run_device_bench")

T = TypeVar("T")


@final
@dataclass(frozen=True, slots=True)
class DeviceBenchConfig:
    """What to run.

    Attributes:
        size: Block size, a key of :data:`~kvpipe.benchmarks._workload.MODEL_BLOCK_TOKENS`.
        total_bytes: Bytes one round writes (and reads back) per contender.
        rounds: Recorded rounds (after one warm-up).
        request_bytes: Bytes per pipeline request.
        slice_bytes: Bytes per slice, and the plain loop's and the link's chunk.
        concurrency: Pipeline requests in flight.
        threads: The pipeline's ``copy_threads`` and the plain loop's threads.
        verify_checksums: The pipeline's :attr:`~kvpipe.PipelineConfig.verify_checksums`.
        staging_bytes: The pipeline's :attr:`~kvpipe.PipelineConfig.staging_bytes` (pinned).
        ordinal: The CUDA device.
    """

    size: str = "2MiB"
    total_bytes: int = 2 << 30
    rounds: int = 5
    request_bytes: int = 256 << 20
    slice_bytes: int = 64 << 20
    concurrency: int = 4
    threads: int = 4
    verify_checksums: bool = True
    staging_bytes: int = 1 << 30
    ordinal: int = 0


@final
class _DeviceArray:
    """Device memory from kvpipe's driver, shaped as a CUDA tensor (``data_ptr``,
    ``device``), which :meth:`KVCache.from_tensors` takes as it takes a framework's."""

    def __init__(self, drv: Driver, shape: tuple[int, ...], dtype: str, ordinal: int) -> None:
        self.shape, self.dtype = shape, dtype
        self.nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
        self.device = SimpleNamespace(type="cuda", index=ordinal)
        self.ptr = drv.mem_alloc(self.nbytes)

    def data_ptr(self) -> int:
        return self.ptr

    def is_contiguous(self) -> bool:
        return True


async def _on_device(drv: Driver, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread with the driver's context current there, and what
    was current there before again after it: the thread is the event loop library's, shared
    with the caller's other work (:meth:`Driver.current`)."""

    def call() -> T:
        with drv.current():
            return fn(*args)

    return await run_sync(call)


def _wait(drv: Driver, stream: int, event: int) -> None:
    """Block this (worker) thread until ``stream``'s queued work is done."""
    drv.event_record(event, stream)
    while not drv.event_query(event):
        time.sleep(20e-6)


@final
class _Bench:
    """The cache, the device-side buffers and the plain loop's state, for one run."""

    def __init__(self, cfg: DeviceBenchConfig, drv: Driver, layout: CacheLayout) -> None:
        self.cfg, self.drv, self.layout = cfg, drv, layout
        nbytes = layout.block_nbytes
        self.blocks = max(1, cfg.total_bytes // nbytes)
        self.per_request = max(1, cfg.request_bytes // nbytes)
        self.per_slice = max(1, cfg.slice_bytes // nbytes)
        specs = [layout.role(role) for role, _l in layout.tensor_order()]
        if len({s.block_nbytes for s in specs}) != 1:
            raise ValueError("the device scenario's layout has tensors of one block size")
        self.seg_nbytes = specs[0].block_nbytes
        # what :meth:`close` releases, newest first; a setup that fails part way releases
        # what it had (the caller's driver may stay open: nothing is left behind on it)
        self._release = ExitStack()
        try:
            self._set_up(specs)
        except BaseException:
            self._release.close()
            raise

    def _set_up(self, specs: list[Any]) -> None:
        cfg, drv, layout, keep = self.cfg, self.drv, self.layout, self._release.callback
        self.tensors: list[_DeviceArray] = []
        for s in specs:
            t = _DeviceArray(drv, (2 * self.blocks, *s.block_shape), s.dtype, cfg.ordinal)
            keep(drv.mem_free, t.ptr)
            self.tensors.append(t)
        self.cache = KVCache.from_tensors(layout, self.tensors)
        self.producer = drv.stream_create()
        keep(drv.stream_destroy, self.producer)
        self.plain_store: dict[int, np.ndarray[Any, Any]] = {}
        # the plain loop's own: a stream, an event and a pinned buffer per thread, kept
        # across passes as a hand-written offload would keep them
        self._pool = ThreadPoolExecutor(cfg.threads)
        keep(self._pool.shutdown)
        self._streams: list[int] = []
        self._events: list[int] = []
        self._hosts: list[PinnedBuffer] = []
        chunk = self.per_slice * layout.block_nbytes
        for _ in range(cfg.threads):
            self._streams.append(drv.stream_create())
            keep(drv.stream_destroy, self._streams[-1])
            self._events.append(drv.event_create())
            keep(drv.event_destroy, self._events[-1])
            self._hosts.append(PinnedBuffer(drv, chunk, mapped=False))
            keep(self._hosts[-1].free)
        # the bench's own, for filling, poisoning, checking and the link: one tensor's bytes
        self._host = PinnedBuffer(drv, max(self.tensors[0].nbytes, chunk), mapped=False)
        keep(self._host.free)
        self._stream = drv.stream_create()
        keep(drv.stream_destroy, self._stream)
        self._event = drv.event_create()
        keep(drv.event_destroy, self._event)
        self._fill_random()

    def _fill_random(self) -> None:
        rng, host = np.random.default_rng(0), self._host.array()
        for t in self.tensors:
            host[: t.nbytes] = np.frombuffer(rng.bytes(t.nbytes), np.uint8)
            self.drv.memcpy_htod_async(t.ptr, self._host.host_ptr, t.nbytes, self._stream)
            _wait(self.drv, self._stream, self._event)

    def halves_equal(self) -> bool:
        """Whether every tensor's second half (read back) equals its first (written)."""
        host = self._host.array()
        for t in self.tensors:
            n = t.nbytes // 2
            self.drv.memcpy_dtoh_async(self._host.host_ptr, t.ptr, 2 * n, self._stream)
            _wait(self.drv, self._stream, self._event)
            if not np.array_equal(host[:n], host[n : 2 * n]):
                return False
        return True

    def clear_second_half(self) -> None:
        """Poison the blocks a round reads into, so a read that moved nothing fails."""
        self._host.array()[:] = 0xA5
        for t in self.tensors:
            n = t.nbytes // 2
            self.drv.memcpy_htod_async(t.ptr + n, self._host.host_ptr, n, self._stream)
        _wait(self.drv, self._stream, self._event)

    # ------------------------------------------------------------------ the plain loop

    def _plain_slice(self, k: int, first: int, write: bool) -> None:
        """Thread ``k``'s share: one slice of consecutive blocks from ``first``."""
        drv, stream, event = self.drv, self._streams[k], self._events[k]
        n, seg = min(self.per_slice, self.blocks - first), self.seg_nbytes
        host = self._hosts[k]
        # layer-major: tensor j's n blocks, as one DMA moves them; block i is host[:, i]
        rows = host.array()[: len(self.tensors) * n * seg].reshape(len(self.tensors), n, seg)
        if write:
            for j, t in enumerate(self.tensors):
                dst = host.host_ptr + j * n * seg
                drv.memcpy_dtoh_async(dst, t.ptr + first * seg, n * seg, stream)
            _wait(drv, stream, event)
            for i in range(n):
                self.plain_store[first + i] = rows[:, i].copy()  # its own copy, as the store
            return
        for i in range(n):
            rows[:, i] = self.plain_store[first + i]
        target = first + self.blocks
        for j, t in enumerate(self.tensors):
            src = host.host_ptr + j * n * seg
            drv.memcpy_htod_async(t.ptr + target * seg, src, n * seg, stream)
        _wait(drv, stream, event)

    def plain(self, write: bool) -> float:
        """One plain pass (all blocks, ``threads`` threads); its seconds."""
        firsts = list(range(0, self.blocks, self.per_slice))
        threads = self.cfg.threads
        if write:
            self.plain_store.clear()

        def worker(k: int) -> None:
            self.drv.make_current()
            for first in firsts[k::threads]:
                self._plain_slice(k, first, write)

        started = time.perf_counter()
        list(self._pool.map(worker, range(threads)))
        return time.perf_counter() - started

    def link(self) -> dict[str, float]:
        """GB/s of one contiguous ``cuMemcpyAsync`` per slice, each direction (best of 3)."""
        chunk = self.per_slice * self.layout.block_nbytes
        total = chunk * max(1, self.blocks // self.per_slice)
        dev, host, stream = self.drv.mem_alloc(chunk), self._host.host_ptr, self._stream
        out = {}
        try:
            for name, copy, args in (
                ("d2h", self.drv.memcpy_dtoh_async, (host, dev, chunk)),
                ("h2d", self.drv.memcpy_htod_async, (dev, host, chunk)),
            ):
                best = math.inf
                for _ in range(3):
                    started = time.perf_counter()
                    for _ in range(total // chunk):
                        copy(*args, stream)
                    _wait(self.drv, stream, self._event)
                    best = min(best, time.perf_counter() - started)
                out[name] = round(total / best / 1e9, 2)
        finally:
            self.drv.mem_free(dev)
        return out

    def host(self) -> dict[str, float]:
        """GB/s of the host's passes alone (see the module docstring), best of 3 each."""
        values = [v.reshape(-1) for _, v in sorted(self.plain_store.items())]
        nbytes, per, threads = self.layout.block_nbytes, self.per_slice, self.cfg.threads
        native = _blockformat.native

        def work(k: int, digest: bool) -> None:
            slots = self._hosts[k].array()[: per * nbytes].reshape(per, nbytes)
            mine = values[k::threads]
            for first in range(0, len(mine), per):
                batch = mine[first : first + per]
                for slot, value in zip(slots, batch, strict=False):
                    slot[:] = value
                if digest and native is not None:
                    native.payload_digests(list(slots[: len(batch)]), nbytes)
                elif digest:
                    for slot in slots[: len(batch)]:
                        xxhash.xxh3_64_intdigest(slot.data)

        out = {}
        for name, digest in (("copy", False), ("copy_hash", True)):
            best = math.inf
            for _ in range(3):
                started = time.perf_counter()
                list(self._pool.map(work, range(threads), [digest] * threads))
                best = min(best, time.perf_counter() - started)
            out[name] = round(len(values) * nbytes / best / 1e9, 2)
        return out

    def close(self) -> None:
        """Release everything :meth:`__init__` set up (newest first)."""
        self._release.close()


async def run_device_bench(
    cfg: DeviceBenchConfig,
    tick: Callable[[str], None] | None = None,
    *,
    driver: Driver | None = None,
) -> dict[str, Any]:
    """Run the scenario on CUDA device ``cfg.ordinal``; a JSON-ready record.

    ``driver`` replaces the CUDA driver (the tests' double) for the benchmark and the
    pipeline alike.

    Raises:
        Unsupported: No usable CUDA driver or device, or no NVRTC.
        RuntimeError: A request did not complete, or blocks read back differ.
    """
    if cfg.size not in MODEL_BLOCK_TOKENS:
        raise ValueError(f"unknown size {cfg.size!r}; one of {sorted(MODEL_BLOCK_TOKENS)}")
    drv = driver if driver is not None else CudaDriver()
    info = await run_sync(drv.open, cfg.ordinal)
    try:
        bench = await _on_device(drv, _Bench, cfg, drv, model_layout(cfg.size))
        try:
            return await _measure(cfg, bench, info, tick, driver)
        finally:
            # shielded: cancelled, an unshielded run_sync raises before it runs anything
            with anyio.CancelScope(shield=True):
                await _on_device(drv, bench.close)
    finally:
        drv.close()


async def _measure(
    cfg: DeviceBenchConfig,
    bench: _Bench,
    info: Any,
    tick: Callable[[str], None] | None,
    driver: Driver | None,
) -> dict[str, Any]:
    writes = Measurement(bench.blocks * bench.layout.block_nbytes)
    reads = Measurement(writes.nbytes)
    config = PipelineConfig(
        slice_block_num=bench.per_slice,
        copy_threads=cfg.threads,
        verify_checksums=cfg.verify_checksums,
        staging_bytes=cfg.staging_bytes,
    )
    store = MemoryStore()
    async with open_pipeline(bench.cache, store, config=config, device_driver=driver) as pipe:
        for r in range(cfg.rounds + 1):  # round 0 warms up and is not recorded
            await _on_device(bench.drv, bench.clear_second_half)
            common = dict(blocks=bench.blocks, per_request=bench.per_request)
            w = await run_requests(
                pipe, **common, concurrency=cfg.concurrency, tag=r, write=True,
                stream=bench.producer,
            )  # fmt: skip
            rd = await run_requests(
                pipe, **common, concurrency=cfg.concurrency, tag=r, write=False,
                stream=bench.producer, offset=bench.blocks,
            )  # fmt: skip
            await _check(bench, "pipeline")
            await store.delete(store.keys())  # as the plain loop drops its values
            await _on_device(bench.drv, bench.clear_second_half)
            plain_w = await _on_device(bench.drv, bench.plain, True)
            plain_r = await _on_device(bench.drv, bench.plain, False)
            await _check(bench, "plain")
            if r:
                writes.add("pipeline", w.seconds)
                reads.add("pipeline", rd.seconds)
                writes.add("plain", plain_w)
                reads.add("plain", plain_r)
            if tick is not None:
                tick(f"device: round {r}/{cfg.rounds}")
        path = pipe.statistics().device_path
    link = await _on_device(bench.drv, bench.link)
    host = await run_sync(bench.host)
    return {
        "device": f"{info.name} (sm_{info.capability[0]}{info.capability[1]})",
        "device_path": path,
        "block_size": cfg.size,
        "block_bytes": bench.layout.block_nbytes,
        "blocks": bench.blocks,
        "request_blocks": bench.per_request,
        "slice_blocks": bench.per_slice,
        "concurrency": cfg.concurrency,
        "threads": cfg.threads,
        "verify_checksums": cfg.verify_checksums,
        "staging_bytes": cfg.staging_bytes,
        "link_gbps": link,
        "host_gbps": host,
        "write": writes.summary("pipeline", ["plain"]),
        "read": reads.summary("pipeline", ["plain"]),
    }


async def _check(bench: _Bench, who: str) -> None:
    if not await _on_device(bench.drv, bench.halves_equal):
        raise RuntimeError(f"device bench: the blocks {who} read back differ from those written")
