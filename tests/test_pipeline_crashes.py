"""Supervision end to end: a crashed actor fails only its requests; repeated crashes close."""

from __future__ import annotations

import logging
import re

import anyio
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe.actors import writer as writer_module
from tests.fakes import Act, CrashHooks, ScriptedStore
from tests.helpers import fill_random

TOKENS = np.arange(64)  # 4 blocks of 16
IDS = np.arange(4)


def _cache() -> kvpipe.KVCache:
    layout = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=16)
    cache = kvpipe.create_kv_cache(layout, 32)
    fill_random(cache)
    return cache


# The actors a write of a host cache passes through: the scheduler hands it to the writer
# whole, which leases, gathers and seals its slices itself; the slicer and the swapper serve
# only a device cache's.
@pytest.mark.parametrize("actor", ["scheduler", "writer"])
async def test_write_crash_fails_that_request_then_next_one_succeeds(actor: str) -> None:
    hooks = CrashHooks(actor, ["victim"])
    store = kvpipe.MemoryStore()
    config = kvpipe.PipelineConfig(slice_block_num=2)
    async with kvpipe.open_pipeline(_cache(), store, config=config, hooks=hooks) as pipe:
        w = await pipe.write(TOKENS, IDS, request_id="victim")
        assert (w.stop_reason, w.complete) == ("actor_crashed", False)
        assert w.error is not None and actor in w.error
        assert pipe.statistics().restarts == {actor: 1}
        ok = await pipe.write(TOKENS, IDS, request_id="next")
        assert ok.complete and ok.skipped + ok.written == 4
        assert await pipe.lookup(TOKENS) == 4
        stats = pipe.statistics()
        assert stats.open and stats.staging_in_use_bytes == 0 and stats.in_flight == {}


async def test_the_crash_history_keeps_the_latest_crashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline crashing now and then for months kept every crash record (the request ids
    it failed, the error's text): the history grew without bound."""
    from kvpipe.actors import _observe

    monkeypatch.setattr(_observe, "CRASH_HISTORY", 3)
    victims = [f"v{i}" for i in range(5)]
    config = kvpipe.PipelineConfig(slice_block_num=2, max_restarts=10)
    hooks = CrashHooks("writer", list(victims))
    async with kvpipe.open_pipeline(
        _cache(), kvpipe.MemoryStore(), config=config, hooks=hooks
    ) as pipe:
        for rid in victims:
            assert (await pipe.write(TOKENS, IDS, request_id=rid)).stop_reason == "actor_crashed"
        assert [c.request_ids for c in pipe.crashes()] == [("v2",), ("v3",), ("v4",)]
        assert pipe.statistics().restarts == {"writer": 5}


# The actors a read of a host cache passes through: the scheduler hands it to the reader whole,
# which leases each slice and verifies and scatters a sound one itself; the slicer serves only
# device caches, and the swapper scatters reads only for them and after a block failed
# verification.
@pytest.mark.parametrize("actor", ["scheduler", "reader"])
async def test_read_crash_fails_that_request_then_next_one_succeeds(actor: str) -> None:
    store = kvpipe.MemoryStore()
    src = _cache()
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
    dst = kvpipe.create_kv_cache(src.layout, 32)
    hooks = CrashHooks(actor, ["victim"])
    async with kvpipe.open_pipeline(dst, store, hooks=hooks) as pipe:
        r = await pipe.read(TOKENS, np.arange(10, 14), request_id="victim")
        assert (r.stop_reason, r.complete) == ("actor_crashed", False)
        with pytest.raises(kvpipe.IncompleteRead):
            hooks.request_ids.append("victim2")
            await pipe.read(TOKENS, np.arange(10, 14), request_id="victim2", require_all=True)
        r = await pipe.read(TOKENS, np.arange(10, 14), require_all=True)
        assert r.loaded == 4
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[0:4], b[10:14])


async def test_lookup_crash_raises_actor_crashed() -> None:
    hooks = CrashHooks("scheduler", [])
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), hooks=hooks) as pipe:
        original = hooks.on_message

        def crash_any(actor: str, request_id: str) -> None:
            if request_id.startswith("lookup") and not getattr(crash_any, "done", False):
                crash_any.done = True  # type: ignore[attr-defined]
                raise RuntimeError("boom")
            original(actor, request_id)

        hooks.on_message = crash_any  # type: ignore[method-assign]
        with pytest.raises(kvpipe.ActorCrashed) as info:
            await pipe.lookup(TOKENS)
        assert info.value.actor == "scheduler"
        assert re.match(r"lookup lookup-\S+: actor 'scheduler' crashed", str(info.value))
        assert await pipe.lookup(TOKENS) == 0


async def test_repeated_crashes_close_the_pipeline_and_release_every_waiter() -> None:
    """Past max_restarts within the window, every waiting caller gets PipelineClosed."""
    hooks = CrashHooks("writer", ["c1", "c2", "c3"])
    # Another request hangs in the scheduler (its dedup probe never returns) while the writer
    # crashes: it was not held by the writer, yet it must be released when the pipeline closes.
    store = ScriptedStore(exists={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(max_restarts=2, total_timeout=3600, slice_timeout=3600)
    other = np.arange(1000, 1064)
    async with kvpipe.open_pipeline(_cache(), store, config=config, hooks=hooks) as pipe:
        outcomes: dict[str, object] = {}

        async def hang() -> None:
            try:
                outcomes["hang"] = await pipe.write(other, np.arange(20, 24), request_id="hang")
            except kvpipe.PipelineClosed as exc:
                outcomes["hang"] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(hang)
            await store.wait_calls("exists")
            for rid in ("c1", "c2"):
                w = await pipe.write(TOKENS, IDS, request_id=rid)
                assert w.stop_reason == "actor_crashed"
            with pytest.raises(kvpipe.PipelineClosed):
                await pipe.write(TOKENS, IDS, request_id="c3")
        assert isinstance(outcomes["hang"], kvpipe.PipelineClosed)
        assert pipe.closed
        with pytest.raises(kvpipe.PipelineClosed):
            await pipe.write(TOKENS, IDS)
        with pytest.raises(kvpipe.PipelineClosed):
            await pipe.lookup(TOKENS)
        assert pipe.statistics().restarts == {"writer": 2}


async def test_a_writer_crash_while_a_small_last_slice_waits_for_the_put_before_it_leaks_no_staging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host cache's write whose first slice is gathered ahead (large) and whose last one is
    small: the small slice's staging is leased, then the loop waits for the put of the slice
    before it. A writer crash (another request's message) cancels that wait: the small
    slice's staging must still go back to the pool."""
    cache = _cache()
    # 2-block slices are "large" (gathered ahead in a task), a 1-block slice is inline.
    monkeypatch.setattr(writer_module, "INLINE_COPY_BYTES", cache.layout.block_nbytes)
    hooks = CrashHooks("writer", ["crash"])
    store = ScriptedStore(puts={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(slice_block_num=2, copy_threads=2)
    async with kvpipe.open_pipeline(cache, store, config=config, hooks=hooks) as pipe:
        results: dict[str, kvpipe.WriteResult] = {}

        async def victim() -> None:  # 3 blocks: slices of 2 (ahead) and 1 (inline)
            results["victim"] = await pipe.write(TOKENS[:48], IDS[:3], request_id="victim")

        async with anyio.create_task_group() as tg:
            tg.start_soon(victim)
            await store.wait_calls("put")  # slice 0's put hangs; slice 1 holds its staging
            w = await pipe.write(np.arange(500, 516), np.arange(8, 9), request_id="crash")
            assert w.stop_reason == "actor_crashed"
        assert results["victim"].stop_reason == "actor_crashed"
        assert pipe.statistics().restarts == {"writer": 1}
        assert pipe.statistics().staging_in_use_bytes == 0


async def test_read_crash_before_a_missing_tail_is_reported_as_the_crash() -> None:
    """Blocks 0-3 stored, 4-5 not: a read of all six stops at block 4 at the latest, but a
    reader that crashed before loading any block stopped it at block 0, and the result must
    say so (the crash and its description), not ``not_stored``."""
    store = kvpipe.MemoryStore()
    src = _cache()
    async with kvpipe.open_pipeline(src, store) as pipe:
        assert (await pipe.write(TOKENS, IDS)).complete
    hooks = CrashHooks("reader", ["victim"])
    dst = kvpipe.create_kv_cache(src.layout, 32)
    async with kvpipe.open_pipeline(dst, store, hooks=hooks) as pipe:
        r = await pipe.read(np.arange(96), np.arange(10, 16), request_id="victim")
        assert (r.loaded, r.stop_reason) == (0, "actor_crashed")
        assert r.error is not None and "reader" in r.error
        assert r.failed_blocks[0] == 0


class _Raise(kvpipe.PipelineHooks):
    """Raise ``exc`` (a BaseException that is no Exception) in ``actor`` for ``victim``."""

    def __init__(self, actor: str, exc: BaseException) -> None:
        self.actor, self.exc = actor, exc

    def on_message(self, actor: str, request_id: str) -> None:
        if actor == self.actor and request_id == "victim":
            raise self.exc


async def _interrupted_by(actor: str, exc: BaseException) -> dict[str, object]:
    """Serve from tasks outside the pipeline's block (a server's handlers): one request hangs
    in the scheduler's dedup probe, then ``victim`` makes ``actor`` raise ``exc``. What each
    caller and the block got, and when (virtual time)."""
    store = ScriptedStore(exists={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(total_timeout=50, close_timeout=20)
    out: dict[str, object] = {}
    opened = anyio.Event()
    pipes: list[kvpipe.Pipeline] = []
    start = anyio.current_time()

    async def serve() -> None:
        try:
            async with kvpipe.open_pipeline(
                _cache(), store, config=config, hooks=_Raise(actor, exc)
            ) as pipe:
                pipes.append(pipe)
                opened.set()
                await anyio.sleep_forever()
        except BaseException as raised:  # what leaves the block is the subject
            out["block"] = (raised, anyio.current_time() - start)

    async def call(rid: str, tokens: np.ndarray, ids: np.ndarray) -> None:
        try:
            await pipes[0].write(tokens, ids, request_id=rid)
        except kvpipe.KVPipeError as error:
            out[rid] = (error, anyio.current_time() - start)

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        await opened.wait()
        tg.start_soon(call, "other", np.arange(1000, 1064), np.arange(20, 24))
        await store.wait_calls("exists")
        tg.start_soon(call, "victim", TOKENS, IDS)
    return out


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})]
)
@pytest.mark.parametrize("actor", ["scheduler", "writer"])
@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit], ids=["interrupt", "exit"])
async def test_a_base_exception_in_an_actor_fails_the_calls_at_once_and_closes_at_once(
    actor: str, exc: type[BaseException]
) -> None:
    """A KeyboardInterrupt or SystemExit raised in an actor (a hook, an observer; trio's
    Ctrl-C) is no crash: it is not restarted, it stops the actors. Nothing serves requests
    any more, yet the calls in flight were left waiting, and the close waited for them, for
    the whole close_timeout: the interrupt took 20 s to leave, and the close's log blamed
    the timeout. Now they fail at once with PipelineClosed, naming the interrupt."""
    out = await _interrupted_by(actor, exc())
    for rid in ("other", "victim"):
        error, when = out[rid]  # type: ignore[misc]
        assert isinstance(error, kvpipe.PipelineClosed) and exc.__name__ in str(error)
        assert when == 0
    _raised, when = out["block"]  # type: ignore[misc]
    assert when == 0


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})]
)
@pytest.mark.parametrize("actor", ["scheduler", "writer"])
async def test_a_base_exception_in_an_actor_leaves_the_block_as_itself(actor: str) -> None:
    """A SystemExit(3) raised in an actor left ``open_pipeline`` wrapped in two exception
    groups (the actor's task group's and the supervisor's): ``except SystemExit`` or
    ``except KeyboardInterrupt`` around the block missed it, and the process exited with
    status 1 and a group's traceback instead of the status asked for."""
    out = await _interrupted_by(actor, SystemExit(3))
    raised, _when = out["block"]  # type: ignore[misc]
    assert isinstance(raised, SystemExit) and raised.code == 3


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})]
)
@pytest.mark.parametrize("crashed_before", [False, True], ids=["restart", "escalate"])
async def test_a_crash_after_the_close_failed_the_requests_is_not_restarted(
    caplog: pytest.LogCaptureFixture, crashed_before: bool
) -> None:
    """The close fails the requests still in flight at its deadline; the writer then takes
    the message of one that waited in its inbox, and crashes. It was restarted all the same
    (``restarts`` and ``crashes()`` counted a restart, logged "restarting ... failed 1
    request(s)" for a request the close had failed), and with no restart left (one crash
    before, ``max_restarts=1``) the crash "escalated": an ERROR "closing the pipeline"
    during the close, and later calls told the pipeline closed for the crashes. Now an
    actor that crashes once the requests are failed is not restarted (nothing needs it),
    escalates nothing, and what waits in its inbox is let go of; each request failed once,
    with ``PipelineClosed``, by the close deadline."""
    hooks = CrashHooks("writer", ["early", "queued"] if crashed_before else ["queued"])
    store = ScriptedStore(puts={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(queue_depth=1, close_timeout=5, total_timeout=50, max_restarts=1)
    out: dict[str, object] = {}
    start = anyio.current_time()

    async def call(pipe: kvpipe.Pipeline, rid: str, tokens: np.ndarray, ids: np.ndarray) -> None:
        try:
            await pipe.write(tokens, ids, request_id=rid)
        except kvpipe.PipelineClosed as error:
            out[rid] = (error, anyio.current_time() - start)

    async with anyio.create_task_group() as tg:
        async with kvpipe.open_pipeline(_cache(), store, config=config, hooks=hooks) as pipe:
            if crashed_before:
                early = await pipe.write(np.arange(500, 516), IDS[:1], request_id="early")
                assert early.stop_reason == "actor_crashed"
            tg.start_soon(call, pipe, "hang", TOKENS, IDS)  # its put hangs in the writer
            await store.wait_calls("put")
            tg.start_soon(call, pipe, "queued", np.arange(1000, 1064), np.arange(20, 24))
            await anyio.sleep(1)
            assert pipe.statistics().queue_depths["writer"] == 1  # waits behind "hang"
        closed_after = anyio.current_time() - start
    assert closed_after == 6  # the close began at 1 s: its deadline
    for rid in ("hang", "queued"):
        error, when = out[rid]  # type: ignore[misc]
        assert "pipeline closed" in str(error) and "crash" not in str(error) and when == 6
    stats = pipe.statistics()
    assert stats.restarts == ({"writer": 1} if crashed_before else {})
    assert stats.staging_in_use_bytes == 0
    assert [(c.request_ids, c.restarted) for c in pipe.crashes()][-1] == (("queued",), False)
    logged = [r.getMessage() for r in caplog.records if r.name == "kvpipe.supervisor"]
    assert "restarting" not in logged[-1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    with pytest.raises(kvpipe.PipelineClosed, match=r"\(closed\)"):
        await pipe.lookup(TOKENS)
