"""MooncakeStore when the real Mooncake fails: master killed, master restarted, a client holding
a segment gone, store full — measured and checked against a real master on loopback.

Every test that kills or restarts the master has its own metadata server and master
(``local_mooncake``), so the tests stay independent. What the vendor does (measured on this
machine, see ``/work/shared/reference/mooncake-local.md``):

- master killed: the first call of a client fails at once with ``-900``; later calls block
  about 4.4 s, then ``-900``. Closing a client that contributes a segment then takes 7–18 s.
- master restarted: every key is lost; ``batch_is_exist`` answers ``-900`` for ~0.2 s,
  then 0; puts answer ``-200`` for ~0.5–1 s until the client has mounted its segment again.
- a client holding a segment killed: ``batch_is_exist`` says 1 for its keys until the
  master's ``--client_ttl`` passes; gets of them answer ``-800``, at once or after ~1 s.
- store full: puts answer ``-200``, and (default settings) the failed allocation makes the
  master evict ~5 % of the objects at random, often blocks the same write had just counted.
- closing a client while one of its calls still runs in another thread crashes the process
  (SIGSEGV).

Timing assertions are bounds (a call returns by its timeout plus 1 s), never speed targets.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import pytest

import kvpipe
from kvpipe._keys import as_tokens, block_keys
from kvpipe.backends import BlockStatus
from kvpipe.backends._values import ValueClient
from kvpipe.backends.mooncake_local import LocalMooncake
from tests.backends.file_worker import fill_request, prefill_layout, request_tokens
from tests.backends.mooncake_fixtures import make_client
from tests.backends.mooncake_worker import (
    NAMESPACE,
    READ_STOPS,
    SLACK,
    WRITE_STOPS,
    Done,
    Ids,
    bytes_exact,
    pd_request,
    start_mooncake_worker,
    zero,
)

# Real time: a real Mooncake master and workers killed, frozen and restarted.
pytestmark = pytest.mark.slow

SEED = 8080
LAYOUT = prefill_layout()  # 128 KiB blocks
BS = LAYOUT.block_size
BLOCKS = 8  # full blocks per request of the in-process tests: 4 slices of 2


@pytest.fixture
def local_mooncake() -> Iterator[Callable[..., LocalMooncake]]:
    """Start a fresh metadata server and master (``start(*master_args)``); all stopped after."""
    started: list[LocalMooncake] = []

    def start(*master_args: str) -> LocalMooncake:
        server = LocalMooncake(master_args=master_args)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


async def start_server(factory: Callable[..., LocalMooncake], *master_args: str) -> LocalMooncake:
    """Start a server off the event loop (it waits for real processes to listen)."""
    return await anyio.to_thread.run_sync(lambda: factory(*master_args))


def config(**changes: Any) -> kvpipe.PipelineConfig:
    """Short timeouts, slices of 2 blocks."""
    base: dict[str, Any] = {
        "slice_block_num": 2,
        "staging_bytes": 32 << 20,
        "slice_timeout": 1.0,
        "total_timeout": 2.5,
        "lookup_timeout": 1.0,
    }
    return kvpipe.PipelineConfig(**{**base, **changes})


def tokens_of(request: int, blocks: int = BLOCKS) -> npt.NDArray[np.int64]:
    """Token ids of an in-process test request of ``blocks`` full blocks."""
    return request_tokens(SEED, request, blocks * BS)


def leading(codes: Sequence[int]) -> int:
    """Length of the leading run of 1 in ``batch_is_exist`` codes."""
    n = 0
    for c in codes:
        if c != 1:
            break
        n += 1
    return n


# -- master killed ---------------------------------------------------------------------------


@dataclass
class WriteCall:
    request: int
    started: float
    ended: float
    result: kvpipe.WriteResult
    #: ``batch_is_exist`` of the claimed keys by a second client right after the result
    #: (``None``: not checked, the master was being killed).
    confirmed: list[int] | None


@dataclass
class ReadCall:
    request: int
    started: float
    ended: float
    result: kvpipe.ReadResult
    exact: bool


@dataclass
class Kill:
    started: float = 0.0  # just before the snapshot
    done: float = 0.0  # kill_master returned
    snapshot: dict[int, int] = field(default_factory=dict)  # request -> leading stored blocks


@dataclass
class LoopStalls:
    """When the event loop stood still, as a task sleeping ``tick`` at a time sees it: each
    of its sleeps that ended late is a stall, from when it was due until it woke.

    A call's deadline is a timer of the loop: while the loop stands still (a loaded machine:
    other processes on the cores, other threads holding the GIL) no call returns, however
    correct. The deadline bounds below allow the stalls after the deadline; a call kept
    past its deadline by kvpipe, with the loop free, still overruns them.
    """

    tick: float = 0.005
    seen: list[tuple[float, float]] = field(default_factory=list)  # (due, woken)

    async def watch(self) -> None:
        """Sleep ``tick`` at a time, recording each sleep's due and wake-up times."""
        while True:
            due = anyio.current_time() + self.tick
            await anyio.sleep_until(due)
            self.seen.append((due, anyio.current_time()))

    def within(self, start: float, end: float) -> float:
        """Seconds the loop stood still between ``start`` and ``end``."""
        return sum(max(0.0, min(woken, end) - max(due, start)) for due, woken in self.seen)


@dataclass
class Traffic:
    """A writer task and a reader task on one pipeline, the master killed while they run."""

    pipe: kvpipe.Pipeline
    observer: Any  # a second vendor client: sees what is stored
    writes: list[WriteCall] = field(default_factory=list)
    reads: list[ReadCall] = field(default_factory=list)
    lookups: list[tuple[str, float, float]] = field(default_factory=list)  # kind, started, ended
    kill: Kill = field(default_factory=Kill)
    stalls: LoopStalls = field(default_factory=LoopStalls)
    writing: int = 100
    stop: anyio.Event = field(default_factory=anyio.Event)
    warm: anyio.Event = field(default_factory=anyio.Event)  # 3 writes and 3 reads done
    write_ids: Ids = field(default_factory=lambda: np.arange(0, BLOCKS))
    read_ids: Ids = field(default_factory=lambda: np.arange(16, 16 + BLOCKS))

    def keys(self, r: int) -> tuple[str, ...]:
        return block_keys(self.pipe.scope, as_tokens(tokens_of(r)), BS, False)

    async def writer(self) -> None:
        """Write requests 100, 101, ... one after the other; a second client checks each
        result's claimed blocks right after it (until the kill begins)."""
        cache, r = self.pipe.cache, 100
        while not self.stop.is_set():
            self.writing = r
            fill_request(cache, self.write_ids, SEED, r)
            started = anyio.current_time()
            result = await self.pipe.write(tokens_of(r), self.write_ids)
            ended = anyio.current_time()
            claimed = list(self.keys(r)[: result.skipped + result.written])
            confirmed = None
            if claimed and not self.kill.started:
                codes = await anyio.to_thread.run_sync(self.observer.batch_is_exist, claimed)
                if all(c >= 0 for c in codes):
                    confirmed = list(codes)
            self.writes.append(WriteCall(r, started, ended, result, confirmed))
            self._progress()
            r += 1

    async def reader(self) -> None:
        """Read requests 0-3 round and round, checking the bytes of what each read loaded."""
        cache, i = self.pipe.cache, 0
        while not self.stop.is_set():
            r = i % 4
            zero(cache, self.read_ids)
            started = anyio.current_time()
            try:
                result = await self.pipe.read(tokens_of(r), self.read_ids, require_all=True)
            except kvpipe.IncompleteRead as exc:
                assert isinstance(exc.result, kvpipe.ReadResult)
                result = exc.result
            ended = anyio.current_time()
            exact = bytes_exact(cache, self.read_ids, SEED, r, result.loaded)
            self.reads.append(ReadCall(r, started, ended, result, exact))
            self._progress()
            i += 1

    def _progress(self) -> None:
        if len(self.writes) >= 3 and len(self.reads) >= 3:
            self.warm.set()

    async def run(self, server: LocalMooncake) -> None:
        for r in range(4):  # what the reader reads
            fill_request(self.pipe.cache, self.write_ids, SEED, r)
            assert (await self.pipe.write(tokens_of(r), self.write_ids)).complete
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.writer)
            tg.start_soon(self.reader)
            await self.warm.wait()
            kill = self.kill
            kill.started = anyio.current_time()
            watched = range(100, self.writing + 4)
            codes = await anyio.to_thread.run_sync(
                self.observer.batch_is_exist, [k for r in watched for k in self.keys(r)]
            )
            kill.snapshot = {
                r: leading(codes[j * BLOCKS : (j + 1) * BLOCKS]) for j, r in enumerate(watched)
            }
            await anyio.to_thread.run_sync(server.kill_master)
            kill.done = anyio.current_time()
            for r in range(3):
                tg.start_soon(self.lookup_fails, r)
            # traffic against the dead master: later vendor calls block ~4.4 s each
            await anyio.sleep(3.5)
            self.stop.set()

    async def lookup_fails(self, request: int) -> None:
        """A lookup against the dead master raises, by its timeout."""
        await anyio.sleep(0.5)
        started = anyio.current_time()
        with pytest.raises((kvpipe.BackendError, kvpipe.OperationTimeout)) as raised:
            await self.pipe.lookup(tokens_of(request))
        self.lookups.append((type(raised.value).__name__, started, anyio.current_time()))


async def test_master_killed_mid_traffic_every_call_returns_honestly_by_its_deadline(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """One task writes 4-slice requests, another reads stored ones, when the master is
    SIGKILLed. Every call returns by its timeout + 1 s (and the event loop's stalls past its
    deadline: no call returns while the loop stands still); write results claim only blocks
    a second client saw stored (right after each result while the master lived, or in a
    snapshot taken just before the kill); writes started after the kill claim nothing; reads
    never load wrong bytes; lookups raise; the pipeline and store close within 30 s."""
    server = await start_server(local_mooncake)
    observer = await anyio.to_thread.run_sync(make_client, server, 0)
    cfg = config()
    cache = kvpipe.create_kv_cache(LAYOUT, 32)
    closing = closed_in = 0.0
    observer_closing = False
    with anyio.CancelScope(deadline=anyio.current_time() + 60) as bound:
        async with anyio.create_task_group() as closers:
            try:
                async with (
                    kvpipe.MooncakeStore(
                        server.master_address, server.metadata_url, global_segment_size=256 << 20
                    ) as store,
                    kvpipe.open_pipeline(cache, store, config=cfg, namespace="killed") as pipe,
                ):
                    traffic = Traffic(pipe, observer)
                    try:
                        async with anyio.create_task_group() as watching:
                            watching.start_soon(traffic.stalls.watch)
                            await traffic.run(server)
                            watching.cancel_scope.cancel()
                        stats = pipe.statistics()
                    finally:
                        # leaving the pipeline and the store must take at most 30 s
                        closing = anyio.current_time()
                        bound.deadline = closing + 30
                        closers.start_soon(anyio.to_thread.run_sync, observer.close)
                        observer_closing = True
                closed_in = anyio.current_time() - closing
            finally:
                if not observer_closing:
                    closers.start_soon(anyio.to_thread.run_sync, observer.close)
    assert not bound.cancelled_caught, "traffic (60 s) or shutdown (30 s) overran its bound"
    writes, reads, lookups, kill = traffic.writes, traffic.reads, traffic.lookups, traffic.kill

    # every call returned by its deadline (and the loop's stalls past it)
    def late(started: float, ended: float, timeout: float) -> float:
        """Seconds past ``timeout + SLACK`` less the loop's stalls past the deadline."""
        due = started + timeout
        return ended - due - SLACK - traffic.stalls.within(due, ended)

    for w in writes:
        assert late(w.started, w.ended, cfg.total_timeout) <= 0, w
    for rd in reads:
        assert late(rd.started, rd.ended, cfg.total_timeout) <= 0, rd
    assert len(lookups) == 3, lookups
    for kind, started, ended in lookups:
        assert late(started, ended, cfg.lookup_timeout) <= 0, (kind, ended - started)
    # writes: honest results
    before = [w for w in writes if w.ended < kill.started]
    after = [w for w in writes if w.started > kill.done]
    across = [w for w in writes if w not in before and w not in after]
    assert len(before) >= 3 and after, (len(before), len(across), len(after))
    for w in writes:
        claimed = w.result.skipped + w.result.written
        if w.confirmed is not None:
            assert w.confirmed == [1] * claimed, w  # a second client sees every claimed block
        else:
            # Not checked right after the result: then the snapshot taken just before the
            # kill must hold it. Slices of a write go one at a time, so at most the one in
            # flight may have been stored between the snapshot and the kill.
            window = cfg.slice_block_num if w.ended >= kill.started else 0
            assert claimed <= kill.snapshot.get(w.request, 0) + window, (w, kill.snapshot)
        if not w.result.complete:
            assert w.result.stop_reason in WRITE_STOPS, w.result
    for w in before:
        assert w.result.complete, w
    for w in after:
        assert (w.result.skipped, w.result.written, w.result.complete) == (0, 0, False), w
    # reads: never wrong bytes; after the kill nothing loads
    assert all(rd.exact for rd in reads), [rd for rd in reads if not rd.exact]
    for rd in reads:
        if rd.ended < kill.started:
            assert rd.result.complete, rd
        elif not rd.result.complete:
            assert rd.result.stop_reason in READ_STOPS and rd.result.failed_blocks, rd
        if rd.started > kill.done:
            assert rd.result.loaded == 0 and not rd.result.complete, rd
    assert [rd for rd in reads if rd.started > kill.done], "no read ran against the dead master"

    overrun = max(
        [w.ended - w.started - cfg.total_timeout for w in writes]
        + [rd.ended - rd.started - cfg.total_timeout for rd in reads]
        + [e - s - cfg.lookup_timeout for _, s, e in lookups]
    )
    first_after = min(after, key=lambda w: w.started)
    print(
        f"\nmaster killed: {len(before)} writes before, {len(across)} across, {len(after)} "
        f"after; first write after the kill: {first_after.result.stop_reason} in "
        f"{first_after.ended - first_after.started:.3f} s ({first_after.result.error}); "
        f"write stops after: {sorted({w.result.stop_reason or '' for w in after})}; read stops "
        f"after: {sorted({rd.result.stop_reason or '' for rd in reads if rd.started > kill.done})}"
        f"; lookups: {[(k, round(e - s, 3)) for k, s, e in lookups]}; max overrun over the call's "
        f"timeout {overrun:.3f} s; deadline guard fired "
        f"{stats.counters.get('deadline_guard_expired', 0)} times; backend {dict(stats.backend)}"
        f"; pipeline + store closed in {closed_in:.2f} s; the loop stood still "
        f"{traffic.stalls.within(-math.inf, math.inf):.2f} s in all"
    )


# -- master restarted ------------------------------------------------------------------------


async def test_master_restarted_every_key_is_lost_and_clients_reconnect(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """After a restart lookups fall to 0 (no stale hit), an old request reads as not stored,
    and within 10 s a new write → read round trip works again (the time is reported)."""
    server = await start_server(local_mooncake)
    cfg = config()
    cache = kvpipe.create_kv_cache(LAYOUT, 32)
    ids = np.arange(BLOCKS)
    dst = np.arange(16, 16 + BLOCKS)
    with anyio.fail_after(60):
        async with (
            kvpipe.MooncakeStore(
                server.master_address, server.metadata_url, global_segment_size=256 << 20
            ) as store,
            kvpipe.open_pipeline(cache, store, config=cfg, namespace="restarted") as pipe,
        ):
            for r in range(3):
                fill_request(cache, ids, SEED, r)
                assert (await pipe.write(tokens_of(r), ids)).complete
                assert await pipe.lookup(tokens_of(r)) == BLOCKS
            await anyio.to_thread.run_sync(server.kill_master)
            await anyio.to_thread.run_sync(server.start_master)
            restarted = anyio.current_time()

            answers: dict[int, int] = {}
            errors: list[str] = []
            for r in range(3):
                while r not in answers:
                    try:
                        answers[r] = await pipe.lookup(tokens_of(r))
                    except (kvpipe.BackendError, kvpipe.OperationTimeout) as exc:
                        errors.append(type(exc).__name__)
                        assert anyio.current_time() - restarted < 10, errors
                        await anyio.sleep(0.1)
            first_answer = anyio.current_time() - restarted
            assert answers == {0: 0, 1: 0, 2: 0}, f"stale hits after the restart: {answers}"

            zero(cache, dst)
            with pytest.raises(kvpipe.IncompleteRead) as raised:
                await pipe.read(tokens_of(0), dst, require_all=True)
            old = raised.value.result
            assert isinstance(old, kvpipe.ReadResult)
            assert (old.loaded, old.stop_reason, old.failed_blocks) == (0, "not_stored", (0,))

            attempts: list[kvpipe.WriteResult] = []
            while True:
                fill_request(cache, ids, SEED, 10)
                w = await pipe.write(tokens_of(10), ids)
                attempts.append(w)
                if w.complete:
                    break
                assert anyio.current_time() - restarted < 10, attempts
                await anyio.sleep(0.1)
            reconnected = anyio.current_time() - restarted
            zero(cache, dst)
            got = await pipe.read(tokens_of(10), dst, require_all=True)
            assert got.loaded == BLOCKS and bytes_exact(cache, dst, SEED, 10, BLOCKS)
            assert await pipe.lookup(tokens_of(10)) == BLOCKS
            backend = dict(pipe.statistics().backend)
    print(
        f"\nmaster restarted: first lookup answered after {first_answer:.3f} s "
        f"(errors before: {errors}); write -> read round trip worked after {reconnected:.3f} s "
        f"and {len(attempts)} attempt(s) (earlier stops: "
        f"{[(a.written, a.stop_reason, a.error) for a in attempts[:-1]][:3]}); backend {backend}"
    )


# -- a client holding a segment is gone -----------------------------------------------------

CLIENT_TTL = 3  # seconds the master keeps a silent client's segment (its default is 10)


@asynccontextmanager
async def dead_owner(
    server: LocalMooncake, cfg: kvpipe.PipelineConfig, sig: signal.Signals = signal.SIGKILL
) -> AsyncIterator[tuple[kvpipe.Pipeline, float]]:
    """A worker process stores requests 0-3 in its own segment; this process (whose client
    contributes no memory) reads request 0 back byte-exact; then the worker gets ``sig``
    (SIGKILL: gone; SIGSTOP: unreachable, killed at the end). Yields this process's pipeline
    and the time of the signal."""
    cache = kvpipe.create_kv_cache(LAYOUT, 8)
    dst = np.arange(8)
    args = ("--master", server.master_address, "--metadata", server.metadata_url)
    async with start_mooncake_worker(
        "prefill", *args, "--seed", str(SEED), "--segment-mib", "64"
    ) as worker:
        assert await worker.readline() == "open", worker.errors[-3000:]
        async with (
            kvpipe.MooncakeStore(
                server.master_address, server.metadata_url, global_segment_size=0
            ) as store,
            kvpipe.open_pipeline(cache, store, config=cfg, namespace=NAMESPACE) as pipe,
        ):
            await worker.send("write 0 4 1 0")
            done = [await worker.readline() for _ in range(5)]
            assert done[-1] == "batch-end 0", (done, worker.errors[-3000:])
            assert all(Done.parse(line).complete for line in done[:-1]), done
            tokens0, n0 = pd_request(SEED, 0)
            zero(cache, dst)
            got = await pipe.read(tokens0, dst[:n0], include_partial=True, require_all=True)
            assert got.loaded == n0 and bytes_exact(cache, dst, SEED, 0, n0)
            os.kill(worker.pid, sig)
            if sig == signal.SIGKILL:
                await worker.process.wait()
            try:
                yield pipe, anyio.current_time()
            finally:
                if sig != signal.SIGKILL:
                    # Gets hanging on the frozen owner must end before this client closes
                    # (closing a vendor client under a running call crashes the process).
                    os.kill(worker.pid, signal.SIGKILL)
                    await worker.process.wait()


async def read_failing(
    pipe: kvpipe.Pipeline, request: int
) -> tuple[kvpipe.ReadResult, float, bool]:
    """Read a request whose blocks cannot be fetched: ``(result, elapsed, bytes exact)``."""
    tokens, n = pd_request(SEED, request)
    dst = np.arange(n)
    zero(pipe.cache, dst)
    started = anyio.current_time()
    with pytest.raises(kvpipe.IncompleteRead) as raised:
        await pipe.read(tokens, dst, include_partial=True, require_all=True)
    elapsed = anyio.current_time() - started
    res = raised.value.result
    assert isinstance(res, kvpipe.ReadResult)
    assert raised.value.failed_blocks == res.failed_blocks
    assert res.loaded < res.requested == n and res.failed_blocks, res
    assert res.failed_blocks[0] == res.loaded, res
    return res, elapsed, bytes_exact(pipe.cache, dst, SEED, request, res.loaded)


async def test_dead_segment_owner_reads_report_failed_blocks_and_are_not_trusted(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """While the master still lists a killed client's keys (until ``--client_ttl``), a
    lookup says they are there, but a read reports the failed blocks (no wrong byte) and the
    next lookup stops before them. After the TTL every key of the dead client is gone.

    Gets of the dead client's keys answer ``-800``: the first at once, later ones after
    ~1 s (the vendor's connect timeout), so the slice timeout here is 3 s: every get answers
    within it. (When it does not, see the next test.)"""
    server = await start_server(local_mooncake, f"--client_ttl={CLIENT_TTL}")
    cfg = config(slice_timeout=3.0, total_timeout=5.0)
    with anyio.fail_after(60):
        async with dead_owner(server, cfg) as (pipe, killed):
            tokens1, n1 = pd_request(SEED, 1)
            stale = await pipe.lookup(tokens1, include_partial=True)
            assert stale == n1, "the master should still list the dead client's keys"
            res, read_elapsed, exact = await read_failing(pipe, 1)
            assert res.stop_reason == "failed_block" and exact, res
            assert read_elapsed <= cfg.total_timeout + SLACK
            after = await pipe.lookup(tokens1, include_partial=True)
            assert after <= res.failed_blocks[0], (after, res.failed_blocks)
            backend = dict(pipe.statistics().backend)
            assert backend.get("distrusted_keys", 0) >= 1, backend

            tokens2, n2 = pd_request(SEED, 2)
            listed = await pipe.lookup(tokens2, include_partial=True)
            while (left := await pipe.lookup(tokens2, include_partial=True)) > 0:
                assert anyio.current_time() - killed < CLIENT_TTL + 15, left
                await anyio.sleep(0.25)
            dropped = anyio.current_time() - killed
    assert left == 0
    print(
        f"\ndead segment owner: lookup right after the kill {stale}/{n1} (stale), read failed in "
        f"{read_elapsed:.3f} s with failed_blocks {res.failed_blocks}, lookup after the failed "
        f"read {after}; an unread request was listed ({listed}/{n2}) until {dropped:.2f} s after "
        f"the kill (client_ttl={CLIENT_TTL}); backend {backend}"
    )


async def test_unreachable_segment_owner_read_that_timed_out_is_not_trusted_either(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """The worker holding the data is frozen (SIGSTOP: a hung process, a partitioned host).
    The master still lists its keys (until its client TTL: 10 s by default); a read's gets
    hang and the read honestly reports the blocks as failed (``slice_timeout``) without the
    store ever seeing a code for them. The store distrusts keys whose read timed out, so the
    next lookup does not count the blocks that just failed (it did, until the store learned
    to distrust them, and every read of them cost a slice timeout again). A SIGKILLed owner
    whose vendor ``-800`` comes later than the slice timeout takes the same path."""
    server = await start_server(local_mooncake)  # default client_ttl: 10 s
    cfg = config(slice_timeout=0.5, total_timeout=1.5)
    with anyio.fail_after(60):
        async with dead_owner(server, cfg, signal.SIGSTOP) as (pipe, _):
            tokens1, n1 = pd_request(SEED, 1)
            assert await pipe.lookup(tokens1, include_partial=True) == n1  # listed
            res, elapsed, exact = await read_failing(pipe, 1)
            assert res.stop_reason in READ_STOPS and exact, res
            assert elapsed <= cfg.total_timeout + SLACK
            after = await pipe.lookup(tokens1, include_partial=True)
            again, again_elapsed, _ = await read_failing(pipe, 1)
            backend = dict(pipe.statistics().backend)
    print(
        f"\nsegment owner frozen: read {res.stop_reason} in {elapsed:.3f} s, failed_blocks "
        f"{res.failed_blocks}; lookup after it {after}/{n1}; the same read again: "
        f"{again.stop_reason} in {again_elapsed:.3f} s; backend {backend}"
    )
    assert after <= res.failed_blocks[0], (
        f"lookup counts {after} blocks of a request whose block {res.failed_blocks[0]} just "
        "failed to read"
    )


# -- store full ------------------------------------------------------------------------------

FULL_BLOCKS = 400  # 50 MiB of 128 KiB blocks into a 32 MiB segment


@dataclass
class Overfill:
    write: kvpipe.WriteResult
    stored: int  # lookup right after the write
    read: kvpipe.ReadResult
    exact: bool
    again: kvpipe.WriteResult  # a further write into the full store


async def overfill(server: LocalMooncake) -> Overfill:
    """Write one request larger than the store, then look it up and read it back."""
    cfg = config(slice_block_num=16, staging_bytes=16 << 20, slice_timeout=5.0, total_timeout=20.0)
    cache = kvpipe.create_kv_cache(LAYOUT, FULL_BLOCKS)
    ids = np.arange(FULL_BLOCKS)
    tokens = tokens_of(500, FULL_BLOCKS)
    with anyio.fail_after(60):
        async with (
            kvpipe.MooncakeStore(
                server.master_address, server.metadata_url, global_segment_size=32 << 20
            ) as store,
            kvpipe.open_pipeline(cache, store, config=cfg, namespace="full") as pipe,
        ):
            fill_request(cache, ids, SEED, 500)
            write = await pipe.write(tokens, ids)
            stored = await pipe.lookup(tokens)
            zero(cache, ids)
            read = await pipe.read(tokens, ids)
            exact = bytes_exact(cache, ids, SEED, 500, read.loaded)
            fill_request(cache, ids[:16], SEED, 501)
            again = await pipe.write(tokens_of(501, 16), ids[:16])
    return Overfill(write, stored, read, exact, again)


def check_clean_incomplete(o: Overfill) -> None:
    w = o.write
    assert w.stop_reason == "incomplete_slice" and "no_space" in (w.error or ""), w
    assert 0 < w.written < w.requested == FULL_BLOCKS and w.skipped == 0, w
    assert o.stored == w.written, f"the write counted {w.written} blocks, lookup finds {o.stored}"
    assert o.read.loaded == w.written and o.exact, (o.read, o.exact)
    assert o.read.stop_reason == "not_stored" and o.read.failed_blocks == (w.written,), o.read


async def test_full_store_without_eviction_is_a_clean_incomplete_write(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """A master that never evicts (``--eviction_ratio=0``): the write stops at the first
    ``-200``, counts exactly what fits, lookup agrees, the blocks read back byte-exact, and a
    further write stores nothing."""
    o = await overfill(await start_server(local_mooncake, "--eviction_ratio=0"))
    check_clean_incomplete(o)
    assert (o.again.written, o.again.stop_reason) == (0, "incomplete_slice"), o.again
    print(f"\nfull store, no eviction: wrote {o.write.written}/{FULL_BLOCKS}, lookup {o.stored}")


async def test_full_store_default_master_result_is_honest_though_it_may_evict(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """The same with the master's default settings (what ``LocalMooncake`` and most
    deployments run). The write stops the same way, but its ``-200`` makes the master evict
    objects at random (``eviction_ratio`` 5 %) — in most runs including blocks this write
    had just counted, so lookups right after find a shorter prefix (the first hole). Nothing
    is ever claimed that was not stored: lookup never exceeds what the write counted, and a
    read loads only what is still there, byte-exact."""
    o = await overfill(await start_server(local_mooncake))
    w = o.write
    print(
        f"\nfull store, default master: wrote {w.written}/{FULL_BLOCKS} ({w.stop_reason}), "
        f"lookup right after {o.stored}, read loaded {o.read.loaded}; "
        f"{w.written - o.stored} counted blocks now unreachable past the first hole"
    )
    assert w.stop_reason == "incomplete_slice" and "no_space" in (w.error or ""), w
    assert 0 < w.written < w.requested == FULL_BLOCKS and w.skipped == 0, w
    assert o.stored <= w.written, (o.stored, w.written)
    assert o.read.loaded <= o.stored and o.exact, (o.read, o.stored)
    assert not o.read.complete and o.read.failed_blocks[0] == o.read.loaded, o.read


async def test_a_put_of_another_size_in_a_full_store_leaves_the_stored_value(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """A ``ValueClient`` may store a key again with a value of another size. The vendor's
    upsert of it drops the stored value first, and in a full store that does not evict it
    then fails (``-200``) with the key gone. Such a put fails instead, touching nothing: the
    key stays visible and reads back as it was. A value of the same size is replaced in
    place (the vendor reuses its space, full store or not), and after a delete a value of
    another size is stored as a new one. (``--eviction_ratio=0`` alone still lets the master
    evict objects above its high watermark, 0.9 by default.)"""
    server = await start_server(
        local_mooncake, "--eviction_ratio=0", "--eviction_high_watermark_ratio=1.0"
    )
    size = 1 << 20
    old, new = bytes(range(256)) * (size // 256), b"\x05" * size
    with anyio.fail_after(60):
        async with (
            kvpipe.MooncakeStore(
                server.master_address, server.metadata_url, global_segment_size=16 << 20
            ) as store,
            ValueClient(store, slots=2) as values,
        ):
            assert await values.put(["kept"], [old]) == [BlockStatus.OK]
            for i in range(64):
                (status,) = await values.put([f"fill-{i}"], [b"\x07" * size])
                if status is not BlockStatus.OK:
                    break
            assert status is BlockStatus.NO_SPACE, "the store never filled up"
            for other in (size // 2, 2 * size):
                assert await values.put(["kept"], [b"\x09" * other]) == [BlockStatus.FAILED]
                assert await values.exists(["kept"]) == [True]
                assert await values.get(["kept"], [size]) == [(BlockStatus.OK, old)]
            assert store.statistics()["put_other_size"] == 2
            assert await values.put(["kept"], [new]) == [BlockStatus.OK]
            assert await values.get(["kept"], [size]) == [(BlockStatus.OK, new)]
            await values.delete(["kept"])
            half = b"\x09" * (size // 2)
            assert await values.put(["kept"], [half]) == [BlockStatus.OK]
            assert await values.get(["kept"], [size // 2]) == [(BlockStatus.OK, half)]


# -- closing while a vendor call still runs --------------------------------------------------


async def test_store_close_while_an_abandoned_vendor_call_runs_does_not_crash(
    local_mooncake: Callable[..., LocalMooncake],
) -> None:
    """With the master dead a put blocks ~4.4 s in the vendor; the slice timeout abandons it
    and the pipeline (``close_timeout=1``) gives up on the thread. ``MooncakeStore.aclose``
    used to close the vendor client under the running call, and the process died of SIGSEGV;
    it now waits for the call (``InFlight.drain``) and the process exits normally."""
    server = await start_server(local_mooncake)
    args = ("--master", server.master_address, "--metadata", server.metadata_url)
    with anyio.fail_after(60):
        async with start_mooncake_worker("closerace", *args, "--seed", str(SEED)) as worker:
            assert await worker.readline() == "written 1", worker.errors[-3000:]
            await anyio.to_thread.run_sync(server.kill_master)
            await worker.send("go")
            lines = await worker.rest()
            code = await worker.process.wait()
    assert lines and lines[0].startswith("done 1 0 "), lines
    assert any(line.endswith(" 0 slice_timeout") for line in lines), lines  # a put abandoned
    assert code == 0 and lines[-1] == "closed", (
        f"worker exited with {code} after printing {lines}; stderr tail:\n{worker.errors[-2000:]}"
    )
