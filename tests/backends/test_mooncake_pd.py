"""Prefill → decode through a real Mooncake Store, in two processes; then the master dies.

The prefill side is a worker process (``tests/backends/mooncake_worker.py prefill``) with its
own client and segment: it writes requests with a partial last block
(``include_partial=True``) and announces each write's result on its stdout (a local pipe).
The decode side is this test: its client contributes no memory (every block lives in the
prefill's segment, so the prefill is kept alive until the end). For each request announced
complete it reads the whole request, partial block included, with ``require_all=True`` into
its own cache at other block ids, and checks every byte against the content recomputed from
the seed.

Batch 1: 50 requests, all read back byte-exact while the prefill keeps writing.

Batch 2: 4 prefill writers, pausing between requests. Once 4 requests are announced, the test
freezes the prefill process (SIGSTOP), lets what it had sent reach the master, records what
``lookup`` says for every request of the batch, SIGKILLs the master and lets the prefill run
on (SIGCONT). Freezing makes the record exact: nothing can be stored between it and the kill,
so no prefill result may claim more than it says. Then every call on both sides must return
by its deadline with an honest result, and both processes must close within 30 s.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe.backends.mooncake_local import LocalMooncake
from tests.backends.file_worker import prefill_layout
from tests.backends.mooncake_worker import (
    NAMESPACE,
    READ_STOPS,
    SLACK,
    SLOT,
    WRITE_STOPS,
    Done,
    Ids,
    MooncakeWorker,
    bytes_exact,
    pd_request,
    start_mooncake_worker,
    zero,
)

# Real time: prefill and decode processes over a real Mooncake master.
pytestmark = pytest.mark.slow

SEED = 4242
BATCH1 = 50
BATCH2_FIRST = 1000
BATCH2 = 12
WRITERS = 4  # concurrent prefill writers in batch 2
PAUSE = 0.2  # seconds each batch-2 writer pauses before a request ("prefill compute")
KILL_AFTER = 4  # batch-2 requests announced complete before the master is killed
SLICE_TIMEOUT = 1.0
TOTAL_TIMEOUT = 2.0
REGIONS = 16  # decode cache regions of SLOT blocks, one per read in flight
BASE = 64  # decode block ids start here: never the prefill's ids (< 64)


@pytest.fixture
def server() -> Iterator[LocalMooncake]:
    """This test's own metadata server and master (the test kills the master)."""
    with LocalMooncake() as started:
        yield started


@dataclass
class DecodeRead:
    request: int
    started: float
    ended: float
    result: kvpipe.ReadResult
    exact: bool  # every loaded block holds exactly the expected bytes


@dataclass
class Decode:
    """The decode side: its pipeline, cache regions, and everything it observed."""

    pipe: kvpipe.Pipeline
    free: list[int] = field(default_factory=lambda: list(range(REGIONS)))
    reads: list[DecodeRead] = field(default_factory=list)
    lookups: list[tuple[str, float]] = field(default_factory=list)

    def ids(self, request: int, region: int, n: int) -> Ids:
        """Decode block ids for a request: a permutation inside one region, above BASE."""
        perm = np.random.default_rng((SEED, request, 2 * 10**6)).permutation(SLOT)[:n]
        ids: Ids = BASE + region * SLOT + perm
        return ids

    async def read(self, request: int) -> DecodeRead:
        """Read a whole request (partial block included, ``require_all``) and check it."""
        tokens, n = pd_request(SEED, request)
        region = self.free.pop()
        try:
            ids = self.ids(request, region, n)
            zero(self.pipe.cache, ids)
            started = anyio.current_time()
            try:
                result = await self.pipe.read(tokens, ids, include_partial=True, require_all=True)
            except kvpipe.IncompleteRead as exc:
                assert isinstance(exc.result, kvpipe.ReadResult)
                assert exc.failed_blocks == exc.result.failed_blocks
                result = exc.result
            ended = anyio.current_time()
            exact = bytes_exact(self.pipe.cache, ids, SEED, request, result.loaded)
        finally:
            self.free.append(region)
        read = DecodeRead(request, started, ended, result, exact)
        self.reads.append(read)
        return read

    async def lookup_fails(self, request: int) -> None:
        """With the master dead a lookup raises, by its timeout."""
        tokens, _ = pd_request(SEED, request)
        started = anyio.current_time()
        with pytest.raises((kvpipe.BackendError, kvpipe.OperationTimeout)) as raised:
            await self.pipe.lookup(tokens, include_partial=True)
        self.lookups.append((type(raised.value).__name__, anyio.current_time() - started))


@dataclass
class Kill:
    frozen: float = 0.0  # SIGSTOP sent to the prefill
    killed: float = 0.0  # kill_master returned
    stored: dict[int, int] = field(default_factory=dict)  # request -> lookup while frozen


async def batch1(prefill: MooncakeWorker, decode: Decode) -> None:
    """50 requests; each read back complete and byte-exact as soon as it is announced."""
    await prefill.send(f"write 0 {BATCH1} 1 0")
    announced = []
    while (line := await prefill.readline()) != "batch-end 0":
        assert line.startswith("done "), f"prefill said {line!r}:\n{prefill.errors[-3000:]}"
        done = Done.parse(line)
        tokens, n = pd_request(SEED, done.request)
        assert (done.complete, done.claimed, done.requested) == (True, n, n), line
        assert await decode.pipe.lookup(tokens, include_partial=True) == n
        assert await decode.pipe.lookup(tokens) == n - 1  # the partial block has its own key
        read = await decode.read(done.request)
        assert read.result.complete and read.result.loaded == n and read.exact, read
        announced.append(done.request)
    assert announced == list(range(BATCH1))


async def freeze_and_kill(
    prefill: MooncakeWorker, decode: Decode, server: LocalMooncake, kill: Kill
) -> None:
    """SIGSTOP the prefill, record lookups of batch 2, kill the master, SIGCONT."""
    os.kill(prefill.pid, signal.SIGSTOP)
    try:
        kill.frozen = anyio.current_time()
        await anyio.sleep(0.1)  # requests the prefill sent before it stopped reach the master
        for r in range(BATCH2_FIRST, BATCH2_FIRST + BATCH2):
            tokens, _ = pd_request(SEED, r)
            # (a generous timeout: decode reads hanging on the frozen prefill share the client)
            kill.stored[r] = await decode.pipe.lookup(tokens, include_partial=True, timeout=10)
        await anyio.to_thread.run_sync(server.kill_master)
        kill.killed = anyio.current_time()
    finally:
        os.kill(prefill.pid, signal.SIGCONT)


async def after_kill(decode: Decode) -> None:
    """Decode calls against the dead master: re-reads of batch 1, and lookups."""
    async with anyio.create_task_group() as tg:
        for r in range(3):
            tg.start_soon(decode.read, r)
        for r in range(3, 6):
            await decode.lookup_fails(r)


async def batch2(
    prefill: MooncakeWorker, decode: Decode, server: LocalMooncake, kill: Kill
) -> dict[int, Done]:
    """Batch 2 with the master killed mid-way; returns the prefill's results."""
    results: dict[int, Done] = {}
    await prefill.send(f"write {BATCH2_FIRST} {BATCH2} {WRITERS} {PAUSE}")
    async with anyio.create_task_group() as tg:
        while (line := await prefill.readline()) != f"batch-end {BATCH2_FIRST}":
            assert line.startswith("done "), f"prefill said {line!r}:\n{prefill.errors[-3000:]}"
            done = Done.parse(line)
            results[done.request] = done
            if done.complete:
                tg.start_soon(decode.read, done.request)
            if not kill.killed and sum(d.complete for d in results.values()) >= KILL_AFTER:
                await freeze_and_kill(prefill, decode, server, kill)
                tg.start_soon(after_kill, decode)
    return results


async def test_prefill_process_to_decode_through_mooncake_then_the_master_dies(
    server: LocalMooncake,
) -> None:
    layout = prefill_layout()
    cache = kvpipe.create_kv_cache(layout, BASE + REGIONS * SLOT)
    config = kvpipe.PipelineConfig(
        slice_block_num=2,
        staging_bytes=16 << 20,
        slice_timeout=SLICE_TIMEOUT,
        total_timeout=TOTAL_TIMEOUT,
        lookup_timeout=SLICE_TIMEOUT,
    )
    args = ("--master", server.master_address, "--metadata", server.metadata_url)
    timeouts = ("--slice-timeout", str(SLICE_TIMEOUT), "--total-timeout", str(TOTAL_TIMEOUT))
    kill = Kill()
    results: dict[int, Done] = {}
    closing = decode_closed = prefill_closed = 0.0
    tail: list[str] = []
    code: int | None = None
    read_in_batch1 = 0
    with anyio.CancelScope(deadline=anyio.current_time() + 90) as bound:
        async with start_mooncake_worker(
            "prefill", *args, "--seed", str(SEED), "--segment-mib", "256", *timeouts
        ) as prefill:
            assert await prefill.readline() == "open", prefill.errors[-3000:]
            async with (
                kvpipe.MooncakeStore(
                    server.master_address, server.metadata_url, global_segment_size=0
                ) as store,
                kvpipe.open_pipeline(cache, store, config=config, namespace=NAMESPACE) as pipe,
            ):
                decode = Decode(pipe)
                try:
                    await batch1(prefill, decode)
                    read_in_batch1 = len(decode.reads)
                    results = await batch2(prefill, decode, server, kill)
                finally:
                    # both sides close at once, each within 30 s
                    closing = anyio.current_time()
                    bound.deadline = closing + 30
                    with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        await prefill.send("exit")
            decode_closed = anyio.current_time() - closing
            tail = await prefill.rest()
            code = await prefill.process.wait()
            prefill_closed = anyio.current_time() - closing
    assert not bound.cancelled_caught, "the test (90 s) or the shutdown (30 s) overran"
    assert code == 0 and tail and tail[-1].startswith("closed "), (
        code,
        tail,
        prefill.errors[-3000:],
    )

    # the prefill: every write returned by its deadline, claiming nothing not stored
    assert sorted(results) == list(range(BATCH2_FIRST, BATCH2_FIRST + BATCH2))
    for r, done in results.items():
        assert done.elapsed <= TOTAL_TIMEOUT + SLACK, done
        assert done.claimed <= kill.stored[r], (done, kill.stored[r])
        if not done.complete:
            assert done.stop_reason in WRITE_STOPS, done
        else:
            assert kill.stored[r] == done.requested, (done, kill.stored[r])
    completed = [d for d in results.values() if d.complete]
    assert len(completed) >= KILL_AFTER and len(completed) < BATCH2, results

    # the decode: every read by its deadline, never a wrong byte, honest when incomplete
    batch2_reads = decode.reads[read_in_batch1:]
    assert decode.reads[:read_in_batch1] and all(
        rd.result.complete for rd in decode.reads[:read_in_batch1]
    )
    for rd in batch2_reads:
        res = rd.result
        assert rd.ended - rd.started <= TOTAL_TIMEOUT + SLACK, rd
        assert rd.exact, rd
        if res.complete:
            assert res.loaded == res.requested, rd
        else:
            assert res.stop_reason in READ_STOPS, rd
            assert res.loaded < res.requested and res.failed_blocks, rd
            assert res.failed_blocks[0] >= res.loaded, rd
        if rd.started > kill.killed:
            assert res.loaded == 0 and not res.complete, rd
    after = [rd for rd in batch2_reads if rd.started > kill.killed]
    assert len(after) >= 3, "the re-reads after the kill did not run"
    assert len(decode.lookups) == 3
    for kind, elapsed in decode.lookups:
        assert elapsed <= SLICE_TIMEOUT + SLACK, (kind, elapsed)

    worst = max(
        [d.elapsed - TOTAL_TIMEOUT for d in results.values()]
        + [rd.ended - rd.started - TOTAL_TIMEOUT for rd in batch2_reads]
        + [e - SLICE_TIMEOUT for _, e in decode.lookups]
    )
    print(
        f"\nprefill -> decode: {BATCH1} requests read byte-exact; batch 2: "
        f"{len(completed)}/{BATCH2} writes complete, prefill frozen "
        f"{kill.killed - kill.frozen:.3f} s around the kill; stored at the kill "
        f"{[kill.stored[r] for r in sorted(kill.stored)]}; prefill stops "
        f"{sorted({d.stop_reason or 'complete' for d in results.values()})}; decode reads "
        f"{sorted({rd.result.stop_reason or 'complete' for rd in batch2_reads})}; lookups "
        f"{[(k, round(e, 3)) for k, e in decode.lookups]}; worst overrun over a call's timeout "
        f"{worst:.3f} s; decode closed in {decode_closed:.2f} s, prefill exited "
        f"{prefill_closed:.2f} s after the exit command ({tail[-1]})"
    )
