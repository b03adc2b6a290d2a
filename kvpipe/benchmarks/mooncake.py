"""Mooncake Store throughput: the pipeline over :class:`kvpipe.MooncakeStore` versus the
direct Mooncake client, on the same client, the same value sizes, in the same run.

Per block size and placement, interleaved rounds (after one warm-up) of four contenders:

- ``pipeline``: ``pipe.write`` of N blocks from a layer-major cache (dedup probe, gather into
  registered staging, checksum trailer, ``batch_is_exist`` and ``batch_put_from`` per slice),
  then ``pipe.read`` into another cache (probe, ``batch_get_into`` per slice, verify, scatter).
- ``put_from``: one ``batch_put_from`` of N values (``block_nbytes + 48`` bytes each, the size
  the pipeline stores) from a contiguous buffer registered with the same client, then one
  ``batch_get_into`` of them into another registered buffer.
- ``upsert_from``: the same with ``batch_upsert_from`` (the call the backend replaces a stored
  value with).
- ``loop``: the least a gathered offload must do, by hand (:mod:`._mooncake_baselines`):
  per slice of the pipeline's size, gather, XXH3 and ``batch_upsert_from``; then
  ``batch_get_into``, verify and scatter, in one thread. The write and read ratios are
  against the direct client; ``ratio_vs_loop`` says what the pipeline's machinery costs over
  this loop.

Every contender's keys are removed after its round (untimed), so the store never fills up.
One call of all N values from one thread is the direct client's best shape measured here:
splitting it into slices, or into 2-8 concurrent calls, was as fast with the data in this
process and slower with it in another process (concurrent transfers over loopback TCP
compete for the two cores).

Placements (Mooncake puts an object in a segment the master picks; the default
``random`` strategy picks among the segments mounted when the put starts):

- ``local``: the benchmark's client is the only one and contributes the segment: every
  object lands in this process's memory (Mooncake copies with ``memcpy``).
- ``remote``: a helper process (:mod:`._segment_holder`) contributes the only segment, and
  the benchmark's client contributes none (``global_segment_size=0``): every object moves
  over loopback TCP into, and back from, the other process. The replica's owner is checked
  with ``get_replica_desc`` and recorded.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Final, final

import anyio
import numpy as np
from anyio.to_thread import run_sync

from .._blockformat import TRAILER_NBYTES
from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from .._errors import Unsupported
from .._layout import CacheLayout
from ..backends.mooncake import MooncakeStore
from ..backends.mooncake_local import LocalMooncake
from ..pipeline import Pipeline, open_pipeline
from ._measure import THROUGHPUT_COPY_THREADS, Measurement, Timer, interleave
from ._mooncake_baselines import direct_put_get, hand_loop, holder_of
from ._segment_holder import start_holder, stop_holder
from ._workload import same_bytes, scrub
from .filestore import LAYOUTS

__all__ = ("PLACEMENTS", "MooncakeBenchConfig", "run_mooncake_bench")

#: ``local``: the data lands in this process's segment; ``remote``: in another process's.
PLACEMENTS: Final = ("local", "remote")


@final
@dataclass(frozen=True, slots=True)
class MooncakeBenchConfig:
    """What to run.

    Attributes:
        sizes: Keys of :data:`~kvpipe.benchmarks.filestore.LAYOUTS`.
        placements: Items of :data:`PLACEMENTS`.
        total_bytes: Bytes one round writes (and reads) per contender.
        rounds: Recorded rounds (after one warm-up).
        slice_bytes: Bytes of one pipeline slice (one vendor call); blocks per slice are
            ``max(1, slice_bytes // value bytes)``.
        request_slices: Slices per pipeline request.
        concurrency: Pipeline requests in flight at once.
        io_threads: The pipeline's worker threads for vendor calls.
        verify_checksums: The pipeline's checksums (on by default, as in production).
    """

    sizes: tuple[str, ...] = ("256KiB", "2MiB", "8MiB")
    placements: tuple[str, ...] = PLACEMENTS
    total_bytes: int = 256 << 20
    rounds: int = 9
    slice_bytes: int = 32 << 20
    request_slices: int = 4
    concurrency: int = 2
    io_threads: int = 2
    verify_checksums: bool = True

    def slice_blocks(self, layout: CacheLayout) -> int:
        """Blocks per pipeline slice for ``layout``."""
        return max(1, self.slice_bytes // (layout.block_nbytes + TRAILER_NBYTES))

    def request_blocks(self, layout: CacheLayout) -> int:
        """Blocks per pipeline request for ``layout``."""
        return self.slice_blocks(layout) * self.request_slices

    def blocks(self, layout: CacheLayout) -> int:
        """Blocks one round moves for ``layout``."""
        return max(self.request_blocks(layout), self.total_bytes // layout.block_nbytes)

    def segment_bytes(self) -> int:
        """The segment that holds one contender's round of the largest size, twice over."""
        most = 0
        for name in self.sizes:
            layout = CacheLayout.gqa(**LAYOUTS[name])  # type: ignore[arg-type]
            most = max(most, self.blocks(layout) * (layout.block_nbytes + TRAILER_NBYTES))
        return 2 * most + (64 << 20)


@final
@dataclass(frozen=True, slots=True)
class _Placement:
    """The vendor client the benchmark uses, and whose segment holds the data."""

    name: str
    client: Any
    server: LocalMooncake
    segment_host: str
    segment_pid: int


def _client(server: LocalMooncake, segment_bytes: int) -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise Unsupported(f"the Mooncake benchmark needs the Mooncake client ({exc})") from exc

    client = MooncakeDistributedStore()
    rc = client.setup(
        "127.0.0.1", server.metadata_url, segment_bytes, 64 << 20, "tcp", "", server.master_address
    )
    if rc != 0:
        raise RuntimeError(f"mooncake setup returned {rc}")
    return client


@asynccontextmanager
async def _placement(name: str, cfg: MooncakeBenchConfig) -> AsyncIterator[_Placement]:
    """A fresh Mooncake (master, metadata server, and for ``remote`` a segment holder)."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    server = LocalMooncake()
    holder: subprocess.Popen[bytes] | None = None
    client: Any = None
    try:
        await run_sync(server.start)
        segment = cfg.segment_bytes()
        if name == "remote":
            holder, host = await run_sync(
                start_holder, server.master_address, server.metadata_url, segment
            )
            client = await run_sync(_client, server, 0)
        else:
            client = await run_sync(_client, server, segment)
            host = str(client.get_hostname())
        owner = holder.pid if holder is not None else os.getpid()
        yield _Placement(name, client, server, host, owner)
    finally:
        with anyio.CancelScope(shield=True):
            if client is not None:
                await run_sync(client.close)
            if holder is not None:
                await run_sync(stop_holder, holder)
            await run_sync(server.stop)


async def _move(
    pipe: Pipeline, cfg: MooncakeBenchConfig, n: int, round_no: int, *, write: bool
) -> float:
    """Write or read all ``n`` blocks, ``cfg.concurrency`` requests at a time; seconds."""
    bs = pipe.cache.layout.block_size
    per = cfg.request_blocks(pipe.cache.layout)
    limit = anyio.Semaphore(cfg.concurrency)
    failures: list[Any] = []

    async def one(first: int) -> None:
        async with limit:
            count = min(per, n - first)
            tokens = np.arange(first * bs, (first + count) * bs, dtype=np.int64)
            tokens += round_no * 10**9
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


def _random_cache(layout: CacheLayout, n: int) -> KVCache:
    cache = create_kv_cache(layout, n)
    rng = np.random.default_rng(0)
    for rows in cache.byte_rows:
        rows[:] = np.frombuffer(rng.bytes(rows.size), np.uint8).reshape(rows.shape)
    return cache


async def _bench_size(
    name: str, place: _Placement, cfg: MooncakeBenchConfig, tick: Callable[[str], None]
) -> dict[str, Any]:
    layout = CacheLayout.gqa(**LAYOUTS[name])  # type: ignore[arg-type]
    nbytes, n = layout.block_nbytes, cfg.blocks(layout)
    vsize = nbytes + TRAILER_NBYTES
    client, label = place.client, f"{name} {place.name}"
    src, dst = _random_cache(layout, n), create_kv_cache(layout, n)
    values = np.frombuffer(np.random.default_rng(1).bytes(n * vsize), np.uint8).copy()
    readback = np.zeros_like(values)
    # the hand loop's own staging and read cache: it must not fill the pipeline's ``dst``,
    # whose bytes are checked at the end
    loop_staging, loop_dst = np.zeros((n, vsize), np.uint8), create_kv_cache(layout, n)
    src_ptrs = [values.ctypes.data + i * vsize for i in range(n)]
    dst_ptrs = [readback.ctypes.data + i * vsize for i in range(n)]
    for buf in (values, readback, loop_staging):
        if await run_sync(client.register_buffer, buf.ctypes.data, buf.nbytes) != 0:
            raise RuntimeError("register_buffer failed")
    write_m, read_m = Measurement(n * nbytes), Measurement(n * nbytes)
    state = {"round": 0, "recording": False}
    holders: set[str] = set()
    config = PipelineConfig(
        slice_block_num=cfg.slice_blocks(layout),
        copy_threads=THROUGHPUT_COPY_THREADS,
        io_threads=cfg.io_threads,
        verify_checksums=cfg.verify_checksums,
        staging_bytes=max(256 << 20, 4 * cfg.concurrency * cfg.slice_blocks(layout) * vsize),
    )
    store = MooncakeStore(
        place.server.master_address,
        place.server.metadata_url,
        client=client,
    )

    def record(m: Measurement, contender: str, seconds: float) -> None:
        if state["recording"]:
            m.add(contender, seconds)

    async def clear(expected: int) -> None:
        removed = await run_sync(client.remove_all, True)
        if removed < expected:
            raise RuntimeError(f"remove_all removed {removed} of {expected} objects")

    try:
        async with (
            store,
            open_pipeline(src, store, config=config, namespace="bench") as wpipe,
            open_pipeline(dst, store, config=config, namespace="bench") as rpipe,
        ):

            async def checked(who: str, same: Awaitable[bool]) -> None:
                """Each round's read, into a cleared buffer, checked right after (untimed)."""
                if not await same:
                    raise RuntimeError(f"mooncake bench: {who} read back different bytes")

            async def pipeline_round() -> float:
                state["round"] += 1
                w = await _move(wpipe, cfg, n, state["round"], write=True)
                await run_sync(scrub, dst)  # what the read leaves there is what it moved
                r = await _move(rpipe, cfg, n, state["round"], write=False)
                await checked("pipeline", run_sync(same_bytes, src, dst))
                await clear(n)
                record(write_m, "pipeline", w)
                record(read_m, "pipeline", r)
                tick(f"{label}: pipeline")
                return w

            def direct_round(contender: str) -> Callable[[], Any]:
                put = getattr(client, f"batch_{contender}")

                async def go() -> float:
                    state["round"] += 1
                    keys = [f"direct-{state['round']}-{i}" for i in range(n)]
                    await run_sync(readback.fill, 0)
                    w, r = await run_sync(
                        direct_put_get, client, put, keys, src_ptrs, dst_ptrs, vsize
                    )
                    await checked(contender, run_sync(np.array_equal, values, readback))
                    for key in (keys[0], keys[-1]):
                        holders.add(await run_sync(holder_of, client, key))
                    await clear(n)
                    record(write_m, contender, w)
                    record(read_m, f"get_into@{contender}", r)
                    tick(f"{label}: {contender}")
                    return w

                return go

            async def loop_round() -> float:
                state["round"] += 1
                keys = [f"loop-{state['round']}-{i}" for i in range(n)]
                await run_sync(scrub, loop_dst)
                w, r = await run_sync(
                    lambda: hand_loop(
                        client,
                        src,
                        loop_dst,
                        loop_staging,
                        keys,
                        cfg.slice_blocks(layout),
                        checksums=cfg.verify_checksums,
                    )
                )
                await checked("hand loop", run_sync(same_bytes, src, loop_dst))
                await clear(n)
                record(write_m, "loop", w)
                record(read_m, "loop", r)
                tick(f"{label}: hand loop")
                return w

            def warmed(r: int) -> None:
                state["recording"] = True

            contenders = {
                "pipeline": pipeline_round,
                "put_from": direct_round("put_from"),
                "upsert_from": direct_round("upsert_from"),
                "loop": loop_round,
            }
            await interleave(contenders, cfg.rounds, warmed)
    finally:
        with anyio.CancelScope(shield=True):
            for buf in (values, readback, loop_staging):
                await run_sync(client.unregister_buffer, buf.ctypes.data)
    if holders != {place.segment_host}:
        raise RuntimeError(f"data landed in {sorted(holders)}, not in {place.segment_host}")
    # the read baseline of a round: the faster of its two get_into runs
    after_put, after_upsert = (read_m.seconds[f"get_into@{c}"] for c in ("put_from", "upsert_from"))
    read_m.seconds["get_into"] = [min(p) for p in zip(after_put, after_upsert, strict=True)]
    write = write_m.summary("pipeline", ["put_from", "upsert_from"])
    write["ratio_vs_put_from"] = round(write_m.ratio("pipeline", ["put_from"]), 3)
    write["ratio_vs_upsert_from"] = round(write_m.ratio("pipeline", ["upsert_from"]), 3)
    read = read_m.summary("pipeline", ["get_into"])
    for summary, m, direct in (
        (write, write_m, ["put_from", "upsert_from"]),
        (read, read_m, ["get_into"]),
    ):
        summary["loop_gbps_median"] = round(m.gbps("loop")[0], 3)
        summary["ratio_vs_loop"] = round(m.ratio("pipeline", ["loop"]), 3)
        summary["loop_vs_direct"] = round(m.ratio("loop", direct), 3)
    return {
        "block_size": name,
        "block_bytes": nbytes,
        "value_bytes": vsize,
        "blocks": n,
        "placement": place.name,
        "segment_host": place.segment_host,
        "segment_pid": place.segment_pid,
        "pipeline": {
            "request_blocks": cfg.request_blocks(layout),
            "concurrency": cfg.concurrency,
            "slice_block_num": config.slice_block_num,
            "io_threads": config.io_threads,
            "verify_checksums": config.verify_checksums,
            "staging_bytes": config.staging_bytes,
        },
        "write": write,
        "read": read,
    }


async def run_mooncake_bench(
    cfg: MooncakeBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> list[dict[str, Any]]:
    """Run every placement and block size on a Mooncake started for it; a record each.

    Raises:
        kvpipe.Unsupported: The Mooncake client is not installed.
        RuntimeError: A transfer failed or the data was not where the placement says.
    """
    out = []
    for placement in cfg.placements:
        tick(f"starting Mooncake ({placement})")
        async with _placement(placement, cfg) as place:
            for name in cfg.sizes:
                out.append(await _bench_size(name, place, cfg, tick))
    return out
