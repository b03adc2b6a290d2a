"""The scheduler alone: keys, dedup, planning, and the index calls."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe._keys import as_tokens
from kvpipe.actors import Scheduler
from kvpipe.actors import scheduler as scheduler_module
from kvpipe.actors._state import CallState
from tests.actors.harness import BLOCK, harness
from tests.fakes import Act, ScriptedStore

TOKENS = np.arange(10 * BLOCK)


async def _store_first(store: kvpipe.MemoryStore, h_keys: tuple[str, ...], n: int) -> None:
    store._data.update({k: b"x" for k in h_keys[:n]})


@pytest.fixture(params=["host", "cuda"])
def engine(request: pytest.FixtureRequest) -> str:
    """The cache's engine: a host cache's requests go on to the writer or the reader whole,
    a device cache's to the slicer."""
    return str(request.param)


async def test_write_skips_the_stored_leading_blocks_and_plans_the_rest(engine: str) -> None:
    store = kvpipe.MemoryStore()
    async with harness(store, slice_blocks=4) as h:
        h.ctx.engine.name = engine
        state = h.write_state(TOKENS, np.arange(10))
        state.keys = None
        sched = Scheduler(h.ctx, h.inboxes["scheduler"])
        probe = h.write_state(TOKENS, np.arange(10))
        assert probe.keys is not None
        await _store_first(store, probe.keys, 3)
        store._data[probe.keys[5]] = b"x"  # a non-leading hit does not count
        await sched.handle(state)
        assert state.machine.skipped == 3
        assert [(s.first_block, s.count) for s in state.slices] == [(3, 4), (7, 3)]
        assert h.sent("writer" if engine == "host" else "slicer") == [state]
        assert not state.done


async def test_write_of_an_entirely_stored_prefix_finishes_without_slices() -> None:
    store = kvpipe.MemoryStore()
    async with harness(store) as h:
        state = h.write_state(TOKENS, np.arange(10))
        assert state.keys is not None
        await _store_first(store, state.keys, 10)
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert state.done and state.result is not None
        assert (state.result.skipped, state.result.written, state.result.complete) == (10, 0, True)
        assert h.sent("slicer") == h.sent("writer") == []


@pytest.mark.parametrize(
    ("chunk_min", "calls"),
    [
        # chunks of 2: [0,1] all there, [2,3] has a miss → stop; 3 probes would be wasteful
        (1, [(0, 2), (2, 2)]),
        # the default minimum: one call for all ten keys, not five
        (scheduler_module.PROBE_CHUNK_MIN, [(0, 10)]),
    ],
)
async def test_dedup_probe_asks_in_chunks_and_stops_at_the_first_chunk_with_a_miss(
    monkeypatch: pytest.MonkeyPatch, chunk_min: int, calls: list[tuple[int, int]]
) -> None:
    monkeypatch.setattr(scheduler_module, "PROBE_CHUNK_MIN", chunk_min)
    store = ScriptedStore()
    async with harness(store, slice_blocks=2) as h:
        state = h.write_state(TOKENS, np.arange(10))
        assert state.keys is not None
        store.inner._data.update({k: b"x" for k in state.keys[:3]})
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert [(c.first_block, len(c.keys)) for c in store.calls_of("exists")] == calls
        assert state.machine.skipped == 3


async def test_failed_dedup_probe_writes_everything() -> None:
    store = ScriptedStore(exists={0: Act(error=OSError("down"))})
    async with harness(store) as h:
        state = h.write_state(TOKENS, np.arange(10))
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert state.machine.skipped == 0 and len(state.slices) == 3
        assert h.ctx.metrics.counters["probe_errors"] == 1


async def test_a_dedup_probe_failing_on_a_later_chunk_keeps_what_the_earlier_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks of 2: [0,1] stored, the call on [2,3] fails: blocks 0-1 are known stored and
    are not written again (before: every block was)."""
    monkeypatch.setattr(scheduler_module, "PROBE_CHUNK_MIN", 1)
    store = ScriptedStore(exists={1: Act(error=OSError("down"))})
    async with harness(store, slice_blocks=2) as h:
        state = h.write_state(TOKENS, np.arange(10))
        assert state.keys is not None
        store.inner._data.update({k: b"x" for k in state.keys[:3]})
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert [(c.first_block, len(c.keys)) for c in store.calls_of("exists")] == [(0, 2), (2, 2)]
        assert state.machine.skipped == 2
        assert [(s.first_block, s.count) for s in state.slices] == [(2, 2), (4, 2), (6, 2), (8, 2)]
        assert h.ctx.metrics.counters["probe_errors"] == 1


async def test_read_stops_at_the_first_block_not_stored(engine: str) -> None:
    store = kvpipe.MemoryStore()
    async with harness(store) as h:
        h.ctx.engine.name = engine
        state = h.read_state(TOKENS, np.arange(10))
        assert state.keys is not None
        store._data.update({k: b"x" for k in state.keys[:6]})
        store._data[state.keys[7]] = b"x"
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert [(s.first_block, s.count) for s in state.slices] == [(0, 4), (4, 2)]
        assert state.machine.stop_block == 6 and state.machine.stop_reason == "not_stored"
        assert h.sent("reader" if engine == "host" else "slicer") == [state]


async def test_read_with_nothing_stored_ends_at_once() -> None:
    async with harness(kvpipe.MemoryStore()) as h:
        state = h.read_state(TOKENS, np.arange(10))
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert state.done and state.result is not None
        assert (state.result.loaded, state.result.stop_reason) == (0, "not_stored")
        assert state.result.failed_blocks == (0,)
        assert h.sent("slicer") == h.sent("reader") == []


async def test_flush_and_locate_record_this_node() -> None:
    store = kvpipe.MemoryStore()
    config = kvpipe.PipelineConfig(node_id="node-a", slice_block_num=4)
    async with harness(store, config=config) as h:
        sched = Scheduler(h.ctx, h.inboxes["scheduler"])
        now = anyio.current_time()
        flush = CallState(
            "f",
            now + 5,
            now,
            "flush",
            as_tokens(TOKENS),
            False,
            start_block=2,
            residency=kvpipe.Residency.CPU,
        )
        await sched.handle(flush)
        assert flush.value == 8
        locate = CallState("l", now + 5, now, "locate", as_tokens(TOKENS), False)
        await sched.handle(locate)
        assert locate.value == []  # block 0 has no record: nothing leads
        flush0 = CallState(
            "f0",
            now + 5,
            now,
            "flush",
            as_tokens(TOKENS),
            False,
            start_block=0,
            residency=kvpipe.Residency.GPU,
        )
        await sched.handle(flush0)
        locate = CallState("l2", now + 5, now, "locate", as_tokens(TOKENS), False)
        await sched.handle(locate)
        assert [loc.block for loc in locate.value] == list(range(10))
        assert all(loc.held_by("node-a") is kvpipe.Residency.GPU for loc in locate.value)
        assert locate.value[3].held_by("node-b") is None


@pytest.mark.parametrize("op", ["lookup", "locate"])
async def test_backend_errors_reach_index_callers(op: str) -> None:
    class Broken(ScriptedStore):
        async def get_residency(self, keys):  # type: ignore[no-untyped-def]
            raise OSError("no index")

    store = Broken(exists={0: Act(error=OSError("no index"))})
    async with harness(store) as h:
        now = anyio.current_time()
        params = {"start_block": 0} if op == "lookup" else {}
        state = CallState("c", now + 5, now, op, as_tokens(TOKENS), False, **params)  # type: ignore[arg-type]
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert isinstance(state.error, kvpipe.BackendError)
        assert "no index" in str(state.error)


async def test_a_locate_answered_for_other_keys_is_a_backend_error() -> None:
    """A store that answers ``get_residency`` out of order (a third-party one) gave each
    block the holders of another; now its answer is refused."""

    class Shuffled(kvpipe.MemoryStore):
        async def get_residency(self, keys):  # type: ignore[no-untyped-def]
            return await super().get_residency(list(reversed(keys)))  # answers out of order

    store = Shuffled()
    async with harness(store) as h:
        now = anyio.current_time()
        state = CallState(
            "c",
            now + 5,
            now,
            "flush",
            as_tokens(TOKENS),
            False,
            residency=kvpipe.Residency.CPU,
            start_block=0,
        )  # type: ignore[arg-type]
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert state.error is None
        state = CallState("c", now + 5, now, "locate", as_tokens(TOKENS), False)  # type: ignore[arg-type]
        await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
        assert isinstance(state.error, kvpipe.BackendError)
        assert "another key" in str(state.error)


@pytest.mark.parametrize("bad", ["tuple", "str_residency"])
async def test_a_locate_answered_with_malformed_records_is_a_backend_error(bad: str) -> None:
    """A store whose ``get_residency`` answers something else than ``ResidencyEntry``
    records of a ``Residency`` (rows as plain tuples, or the residency as its text: a
    third-party store's slip) is a ``BackendError`` for that call, as a wrong count of
    answers is. It used to crash the scheduler (``AttributeError``, an actor restart; a
    few such calls closed the pipeline), or hand the caller holders whose residency was
    a string, which ``held_by(...) is Residency.GPU`` never matches."""

    class Malformed(kvpipe.MemoryStore):
        async def get_residency(self, keys):  # type: ignore[no-untyped-def]
            records = await super().get_residency(keys)
            if bad == "tuple":
                return [
                    [(e.key, e.node_id, e.residency.value, e.updated_at) for e in r]
                    for r in records
                ]
            return [
                [
                    kvpipe.ResidencyEntry(e.key, e.node_id, e.residency.value, e.updated_at)
                    for e in r
                ]  # type: ignore[arg-type]
                for r in records
            ]

    await _flushed_then_located_is_a_get_residency_error(Malformed())


@pytest.mark.parametrize("answer", ["none", "number"])
@pytest.mark.parametrize("op", ["lookup", "write"])
async def test_an_exists_answer_that_is_not_a_sequence_is_a_backend_error(
    op: str, answer: str
) -> None:
    """A store whose ``exists`` answers something that is not one flag per key (``None``,
    a count: a third-party store's slip) is a ``BackendError`` of that call, as a wrong
    number of answers is: ``lookup`` raises it, a write goes on without skipping
    (``probe_errors``). It used to crash the scheduler (``TypeError`` from ``len``): the
    request ended ``actor_crashed`` and the actor restarted."""

    class Malformed(kvpipe.MemoryStore):
        async def exists(self, batch):  # type: ignore[no-untyped-def]
            return None if answer == "none" else len(batch.keys)

    async with harness(Malformed()) as h:
        sched = Scheduler(h.ctx, h.inboxes["scheduler"])
        if op == "write":
            write = h.write_state(TOKENS, np.arange(10))
            write.keys = None
            await sched.handle(write)
            assert write.machine.skipped == 0 and len(write.slices) == 3
            assert h.ctx.metrics.counters["probe_errors"] == 1
            return
        now = anyio.current_time()
        state = CallState("c", now + 5, now, "lookup", as_tokens(TOKENS), False, start_block=0)
        await sched.handle(state)
        assert isinstance(state.error, kvpipe.BackendError), state.value
        assert "exists" in str(state.error)


async def test_blocks_skipped_counts_only_what_the_result_reports_skipped() -> None:
    """A write that ends (its caller cancelled) while a store's ``exists`` runs on, not
    cancellable (a thread it waits for), settles with nothing skipped; the probe's answer
    arrives after. ``blocks_skipped`` used to count that answer all the same, so the
    metric no longer matched the sum of the results' ``skipped``."""
    answered = anyio.Event()

    class Uncancellable(kvpipe.MemoryStore):
        async def exists(self, batch):  # type: ignore[no-untyped-def]
            with anyio.CancelScope(shield=True):
                await answered.wait()
            return [k in self._data for k in batch.keys]

    store = Uncancellable()
    async with harness(store) as h:
        state = h.write_state(TOKENS, np.arange(10))
        assert state.keys is not None
        await _store_first(store, state.keys, 3)
        async with anyio.create_task_group() as tg:
            tg.start_soon(Scheduler(h.ctx, h.inboxes["scheduler"]).handle, state)
            await anyio.wait_all_tasks_blocked()
            state.end("cancelled", "the caller was cancelled")
            answered.set()
        assert state.result is not None and state.result.stop_reason == "cancelled"
        assert h.ctx.metrics.counters["blocks_skipped"] == state.result.skipped == 0
        assert h.sent("writer") == h.sent("slicer") == []


class TestVirtualTime:
    @pytest.fixture
    def anyio_backend(self) -> tuple[str, dict[str, object]]:
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})

    @pytest.mark.parametrize("kind", ["write", "read"])
    async def test_handing_on_to_a_full_inbox_is_bounded_by_the_deadline(
        self, engine: str, kind: str
    ) -> None:
        store = kvpipe.MemoryStore()
        async with harness(store, slice_blocks=4) as h:
            h.ctx.engine.name = engine
            to = "slicer" if engine == "cuda" else ("writer" if kind == "write" else "reader")
            while True:  # fill the next actor's inbox
                try:
                    h.sends[to].send_nowait(None)
                except anyio.WouldBlock:
                    break
            make = h.write_state if kind == "write" else h.read_state
            state = make(TOKENS, np.arange(10), timeout=7)
            assert state.keys is not None
            if kind == "read":  # stored: the read has slices to hand on
                await _store_first(store, state.keys, 10)
            start = anyio.current_time()
            await Scheduler(h.ctx, h.inboxes["scheduler"]).handle(state)
            assert anyio.current_time() - start == pytest.approx(7.0)
            assert state.result is not None and state.result.stop_reason == "total_timeout"
            assert state not in h.sent(to)


@pytest.mark.parametrize("answer", ["none", "count", "number_per_block", "entry_per_block"])
async def test_a_locate_answer_that_is_not_records_per_block_is_a_backend_error(
    answer: str,
) -> None:
    """A store whose ``get_residency`` answers something that is not a sequence of records
    per key (``None``, a count, a number or a bare record for a block: a third-party
    store's slip) is a ``BackendError`` of that ``locate``, as a wrong count of answers is.
    It crashed the scheduler (``TypeError`` from ``len`` or iterating the block's answer):
    the call ended ``ActorCrashed`` and the actor restarted (a few such calls closed the
    pipeline)."""

    class Malformed(kvpipe.MemoryStore):
        async def get_residency(self, keys):  # type: ignore[no-untyped-def]
            records = await super().get_residency(keys)
            if answer == "none":
                return None
            if answer == "count":
                return len(keys)
            if answer == "number_per_block":
                return [1 for _ in keys]
            return [r[0] if r else r for r in records]  # a record, not a sequence of them

    await _flushed_then_located_is_a_get_residency_error(Malformed())


async def _flushed_then_located_is_a_get_residency_error(store: kvpipe.MemoryStore) -> None:
    """Flush TOKENS' blocks into ``store`` (its records kept as they are), then locate them:
    the locate ends with a ``BackendError`` naming ``get_residency``."""
    async with harness(store) as h:
        sched = Scheduler(h.ctx, h.inboxes["scheduler"])
        now = anyio.current_time()
        flush = CallState(
            "f",
            now + 5,
            now,
            "flush",
            as_tokens(TOKENS),
            False,
            start_block=0,
            residency=kvpipe.Residency.GPU,
        )
        await sched.handle(flush)
        assert flush.error is None
        state = CallState("l", now + 5, now, "locate", as_tokens(TOKENS), False)
        await sched.handle(state)
        assert isinstance(state.error, kvpipe.BackendError), state.value
        assert "get_residency" in str(state.error)
