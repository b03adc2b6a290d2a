"""The pipeline's lifecycle at its edges: escalation, close and crashes at awkward moments,
on asyncio and on trio (in virtual time there: a hang shows as a deadline reached, not as a
slow test)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe import _runtime as runtime_module
from kvpipe._runtime import Runtime
from kvpipe.actors import scheduler as scheduler_module
from tests.fakes import Act, ScriptedStore
from tests.helpers import fill_random, until

TOKENS = np.arange(64)  # 4 blocks of 16
IDS = np.arange(4)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    if request.param == "trio":
        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})
    return "asyncio"


def _hang_guard(backend: object) -> contextlib.AbstractContextManager[object]:
    """On asyncio a hang fails the test after 20 s; on trio's MockClock a hang shows as
    virtual time passing (a guard there would fire while the loop waits for a real thread)."""
    return anyio.fail_after(20) if backend == "asyncio" else contextlib.nullcontext()


def _cache() -> kvpipe.KVCache:
    layout = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=16)
    cache = kvpipe.create_kv_cache(layout, 32)
    fill_random(cache)
    return cache


async def _until_in_flight(pipe: kvpipe.Pipeline, n: int) -> None:
    await until(lambda: sum(pipe.statistics().in_flight.values()) == n)


async def test_an_escalating_scheduler_releases_callers_waiting_for_room_in_its_inbox(
    monkeypatch: pytest.MonkeyPatch, anyio_backend: object
) -> None:
    """The scheduler (one handler, an inbox of one) works on a request, a second waits in
    its inbox and a third caller waits for room there when the scheduler crashes past its
    restart intensity. The pipeline closes and every caller gets ``PipelineClosed`` at once,
    the third one too, though its request never entered the inbox: it waited for its whole
    deadline (an hour here) where closing the inbox wakes no sender (anyio before 4.16)."""
    go = anyio.Event()
    probe_leading = scheduler_module.probe_leading

    async def crashing_probe(ctx: Any, request_id: str, *args: Any, **kw: Any) -> int:
        if request_id.startswith("crash"):
            if request_id == "crash":
                await go.wait()
            raise RuntimeError("injected scheduler bug")
        return await probe_leading(ctx, request_id, *args, **kw)

    monkeypatch.setattr(scheduler_module, "probe_leading", crashing_probe)
    config = kvpipe.PipelineConfig(
        queue_depth=1, max_restarts=1, total_timeout=3600, slice_timeout=3600
    )
    outcomes: dict[str, object] = {}
    with _hang_guard(anyio_backend):
        async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), config=config) as pipe:

            async def write(rid: str) -> None:
                try:
                    outcomes[rid] = await pipe.write(TOKENS, IDS, request_id=rid)
                except kvpipe.PipelineClosed as exc:
                    outcomes[rid] = exc

            first = await pipe.write(TOKENS, IDS, request_id="crash-first")
            assert first.stop_reason == "actor_crashed"  # restarted; the next crash escalates
            async with anyio.create_task_group() as tg:
                for n, rid in enumerate(("crash", "queued", "blocked"), 1):
                    tg.start_soon(write, rid)
                    await _until_in_flight(pipe, n)
                await until(lambda: pipe.statistics().queue_depths["scheduler"] == 1)
                start = anyio.current_time()
                go.set()
            assert anyio.current_time() - start < 1
            assert pipe.closed
            assert sorted(outcomes) == ["blocked", "crash", "queued"]
            for rid, outcome in outcomes.items():
                assert isinstance(outcome, kvpipe.PipelineClosed), (rid, outcome)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_close_that_used_its_deadline_still_unregisters_and_frees_the_staging(
    anyio_backend: str,
) -> None:
    """A put hangs through the whole ``close_timeout``: the close fails it at the deadline,
    and then no call uses the staging any more. Unregistering it (a vendor call in a thread,
    as Mooncake's) gets the grace past the deadline, so the staging is unregistered and
    freed; it was kept allocated, registered, for the life of the process."""
    from kvpipe.backends import _registration

    class ThreadedRegistration(ScriptedStore):
        def __init__(self) -> None:
            super().__init__(puts={0: Act(hang=True)})
            self.unregistered = 0

        async def register_staging(self, buffer: memoryview) -> None:
            await anyio.to_thread.run_sync(lambda: None)

        async def unregister_staging(self, buffer: memoryview) -> None:
            await anyio.to_thread.run_sync(lambda: None)
            self.unregistered += 1

    store = ThreadedRegistration()
    kept = len(_registration.KEPT)
    config = kvpipe.PipelineConfig(close_timeout=0.2, staging_bytes=1 << 20)
    with anyio.fail_after(10):
        async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
            staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]

            async def write(pipe: kvpipe.Pipeline) -> None:
                with pytest.raises(kvpipe.PipelineClosed):
                    await pipe.write(TOKENS, IDS)

            async with anyio.create_task_group() as tg:
                tg.start_soon(write, pipe)
                await store.wait_calls("put")
                await pipe.aclose()
            del pipe
    assert store.unregistered == 1
    assert len(_registration.KEPT) == kept
    assert staging() is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # real threads: no virtual time
async def test_open_pipeline_opens_the_store_before_it_serves(tmp_path: Any) -> None:
    """A file store handed over unopened was opened by the first request, its recovery scan
    inside that request's timeout (a lookup of 5 s waited for the whole scan, a hung disk
    forever); the pipeline now opens it before serving."""
    store = kvpipe.FileStore(tmp_path / "store")
    opened: list[str] = []
    real = store._open_sync

    def open_sync() -> None:
        opened.append("open")
        real()

    store._open_sync = open_sync  # type: ignore[method-assign]
    try:
        async with kvpipe.open_pipeline(_cache(), store) as pipe:
            assert opened == ["open"]  # before any request
            assert await pipe.lookup(TOKENS) == 0
        assert opened == ["open"]
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "error", [OSError("no such volume"), kvpipe.BackendError("s", "open", "x")]
)
async def test_a_store_that_cannot_open_fails_the_pipeline_s_open(error: Exception) -> None:
    class Unopenable(kvpipe.MemoryStore):
        async def open(self) -> None:
            raise error

    with pytest.raises(kvpipe.BackendError) as caught:
        async with kvpipe.open_pipeline(_cache(), Unopenable()):
            pytest.fail("served without a store")
    if isinstance(error, OSError):
        assert caught.value.operation == "open" and caught.value.__cause__ is error
    else:
        assert caught.value is error


async def test_entering_a_store_opens_it_and_a_faulty_store_opens_its_inner_one() -> None:
    """``async with`` a backend that has its own ``open`` but not its own ``__aenter__``
    left it unopened (the base class's entering did nothing); a ``FaultyStore`` opened by
    a pipeline left its inner store to open on its first call."""
    from kvpipe.testing.faults import FaultPlan, FaultyStore

    class Counting(kvpipe.MemoryStore):
        opened = 0

        async def open(self) -> None:
            self.opened += 1

    async with Counting() as store:
        assert store.opened == 1
    inner = Counting()
    async with FaultyStore(inner, FaultPlan()) as faulty:
        async with kvpipe.open_pipeline(_cache(), faulty):
            assert inner.opened == 1


async def _close_during_two_writes(close_timeout: float) -> kvpipe.Pipeline:
    """Close a pipeline while two writes ("raises", "cancelled") are in its scheduler; both
    callers get ``PipelineClosed``, and one scheduler crash is recorded, not restarted."""
    config = kvpipe.PipelineConfig(close_timeout=close_timeout)
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), config=config) as pipe:

        async def write(rid: str) -> None:
            with pytest.raises(kvpipe.PipelineClosed):
                await pipe.write(TOKENS, IDS, request_id=rid)

        async with anyio.create_task_group() as tg:
            for rid in ("raises", "cancelled"):
                tg.start_soon(write, rid)
            await _until_in_flight(pipe, 2)
            await pipe.aclose()
    assert [(c.actor, c.error, c.restarted) for c in pipe.crashes()] == [
        ("scheduler", "RuntimeError('injected scheduler bug')", False)
    ]
    return pipe


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})]
)
async def test_an_actor_crashing_as_the_close_deadline_cancels_it_is_a_crash_not_a_raw_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two scheduler handlers in waits their requests' end does not reach (shielded, as a
    copy thread's) at the close deadline: the actors are cancelled, one handler then hits a
    checkpoint (cancelled) and the other raises. The actor's task group ends in a group of
    the cancellation and the error, which the supervisor's ``except Exception`` let through:
    a raw ``ExceptionGroup(RuntimeError)`` left ``open_pipeline``, and no crash was
    recorded or logged. It is a crash like any other now, and the close is clean."""

    async def stuck(ctx: Any, request_id: str, *args: Any, **kw: Any) -> int:
        with anyio.CancelScope(shield=True):  # past the cancellation, at 0.5 s past the deadline
            await anyio.sleep(0.7 if request_id == "raises" else 0.65)
        if request_id == "raises":
            raise RuntimeError("injected scheduler bug")
        return 0

    monkeypatch.setattr(scheduler_module, "probe_leading", stuck)
    await _close_during_two_writes(0.1)
    assert "actor scheduler crashed (RuntimeError('injected scheduler bug'))" in caplog.text


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True}), ("trio", {})]
)
async def test_an_actor_crashing_as_it_is_cancelled_at_close_is_not_restarted_on_any_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As above, on every loop, with the handlers let go of by the actors' cancellation
    itself (no clock). On asyncio anyio's task group leaves a task that ended cancelled out
    of the group it raises: the supervisor saw a plain crash and recorded, counted and
    logged a restart ("restarting (1 of 3 allowed ...)", ``restarted=True``) of an actor
    that was being cancelled at the close deadline, where trio's said ``restarted=False``."""
    cancelled = anyio.Event()
    cancel_actors = Runtime.cancel_actors

    def cancel_and_tell(self: Runtime) -> None:
        cancel_actors(self)
        cancelled.set()

    async def stuck(ctx: Any, request_id: str, *args: Any, **kw: Any) -> int:
        with anyio.CancelScope(shield=True):  # past the deadline, as a copy thread's wait
            await cancelled.wait()
        if request_id == "raises":
            raise RuntimeError("injected scheduler bug")
        await anyio.lowlevel.checkpoint()  # the other one ends cancelled
        return 0

    monkeypatch.setattr(Runtime, "cancel_actors", cancel_and_tell)
    monkeypatch.setattr(runtime_module, "UNWIND_GRACE", 0.02)
    monkeypatch.setattr(scheduler_module, "probe_leading", stuck)
    pipe = await _close_during_two_writes(0.01)
    assert pipe.statistics().restarts.get("scheduler", 0) == 0
    assert "restarting" not in caplog.text
    assert "as it was cancelled at the close deadline; not restarted" in caplog.text
