"""The FastDeploy adapters and their loop thread when a call races ``close()``: a call made
after it, or cut off by it, gets FastDeploy's "nothing" (counts 0, no record) with one
WARNING, never a stray ``RuntimeError`` or ``CancelledError``; what an ``enter`` racing it
entered is exited."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

import kvpipe
from kvpipe import _lograte
from kvpipe.integrations._portal import LoopThread
from kvpipe.integrations.fastdeploy import KVPipeAttentionStore, KVPipeStorage


def _outcome_of(
    call: Callable[[], object],
) -> tuple[list[BaseException | None], Callable[[], None]]:
    """A list, and a function for a thread that runs ``call`` and appends to the list what
    it raised (``None`` when it returned)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    return outcome, run


LAYERS, BLOCKS, BS = 2, 8, 4


def test_attention_store_calls_after_close_answer_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After ``close()``, ``write`` / ``read`` / ``query`` / ``flush_token_index`` raised
    ``RuntimeError('... is closed')`` (or 'This portal is not running' when the call had to
    open a pipeline) into FastDeploy's manager thread."""
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    k = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    v = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    other = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    tokens = list(range(2 * BS))
    store = KVPipeAttentionStore(layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore())
    assert store.write("t", k, v, tokens, [0, 1], 0) == 2
    store.close()
    calls: list[tuple[str, Callable[[], Any], Any]] = [
        ("write", lambda: store.write("t", k, v, tokens, [0, 1], 0), 0),
        ("read", lambda: store.read("t", k, v, tokens, [2, 3], 0), 0),
        ("query", lambda: store.query("t", tokens, 0), 0),
        ("flush_token_index", lambda: store.flush_token_index("t", tokens, 0, True), None),
        ("write", lambda: store.write("t", other, v, tokens, [0, 1], 0), 0),  # opens one
    ]
    for what, call, nothing in calls:
        caplog.clear()
        _lograte.reset_all()  # each call's own line (repeats are bounded: the next test)
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            assert call() == nothing, what
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "closed" in warnings[0].getMessage(), (what, warnings)


def test_attention_store_calls_after_close_log_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FastDeploy calls a closed store for every request: each call logged one WARNING
    (thousands a second). The first of each operation shows, the rest at DEBUG."""
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    k = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    v = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    tokens = list(range(2 * BS))
    store = KVPipeAttentionStore(layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore())
    assert store.write("t", k, v, tokens, [0, 1], 0) == 2
    store.close()
    n = 20
    with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
        for i in range(n):
            assert store.write(f"w{i}", k, v, tokens, [0, 1], 0) == 0
            assert store.read(f"r{i}", k, v, tokens, [2, 3], 0) == 0
            assert store.query(f"q{i}", tokens, 0) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 3, warnings  # write, read, query: once each
    assert all("closed" in w for w in warnings), warnings
    assert {w.split()[1] for w in warnings} == {"write", "read", "query"}


def test_one_stores_repeated_warnings_do_not_hide_anothers_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two adapters in one process shared one log limiter: the first's failures (here: it
    was closed) hid the second's first failure of the same kind at DEBUG. Each adapter's
    repeats are bounded on their own."""
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    tokens = list(range(2 * BS))
    first, second = (
        KVPipeAttentionStore(
            namespace=ns, layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore()
        )
        for ns in ("first", "second")
    )
    first.close()
    second.close()
    with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
        for i in range(10):
            assert first.query(f"a{i}", tokens, 0) == 0
        assert second.query("b0", tokens, 0) == 0
        assert first.query("a10", tokens, 0) == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w.split()[2] for w in warnings] == ["a0:", "b0:"], warnings


def test_a_call_cut_off_by_close_is_pipeline_closed() -> None:
    """A call still running when the loop stops (its closers done or timed out) came back
    as ``concurrent.futures.CancelledError``, which the adapters do not take for a store
    failure; it is ``PipelineClosed`` now."""
    loop = LoopThread("test-cut-off", close_timeout=1.0)
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await anyio.Event().wait()

    outcome, caller = _outcome_of(lambda: loop.call(forever, wait=60.0))
    thread = threading.Thread(target=caller)
    thread.start()
    assert started.wait(30)
    loop.close()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], kvpipe.PipelineClosed), outcome


class _Recorded:
    """An async context manager that records being entered and exited; its ``__aenter__``
    waits for ``may_enter``, its ``__aexit__`` runs ``on_exit``."""

    def __init__(self) -> None:
        self.may_enter: anyio.Event | None = None
        self.started = threading.Event()
        self.exited = anyio.Event()
        self.entered = False
        self.on_exit: Callable[[], Any] | None = None

    async def __aenter__(self) -> _Recorded:
        self.started.set()
        if self.may_enter is not None:
            await self.may_enter.wait()
        self.entered = True
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.exited.set()
        if self.on_exit is not None:
            await self.on_exit()


def test_an_enter_that_completes_while_close_runs_is_exited_and_refused() -> None:
    """``close()`` takes the closers registered so far; an ``enter`` that finished after
    that used to register a closer nobody ran and return as if all was well, so its
    resource (a pipeline and its staging) was left to the loop's cancellation."""
    loop = LoopThread("test-enter-race", close_timeout=5.0)
    late = _Recorded()

    async def make_event() -> anyio.Event:
        return anyio.Event()

    late.may_enter = loop.call(make_event, wait=10.0)
    first = _Recorded()

    async def let_late_enter_then_wait_for_its_exit() -> None:
        assert late.may_enter is not None
        late.may_enter.set()  # close() already holds its closers: this one is first's
        await late.exited.wait()

    first.on_exit = let_late_enter_then_wait_for_its_exit
    loop.enter(first)
    outcome, enter_late = _outcome_of(lambda: loop.enter(late, wait=30.0))
    thread = threading.Thread(target=enter_late)
    thread.start()
    assert late.started.wait(30)  # entering, held until close() runs first's exit
    loop.close()  # runs first's exit, which lets late enter and waits for late's exit
    thread.join(30)
    assert late.entered and late.exited.is_set()
    assert len(outcome) == 1 and isinstance(outcome[0], kvpipe.PipelineClosed), outcome


Caches = tuple[list[Any], list[Any]]


def _caches(paddle: Any) -> Caches:
    def one() -> Any:
        return paddle.randn([BLOCKS, 2, BS, 8]).astype("bfloat16")

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


@contextlib.contextmanager
def _written_from_old_caches() -> Iterator[tuple[KVPipeAttentionStore, Caches, Caches, list[int]]]:
    """An adapter that wrote two blocks from one set of caches, and another set of caches
    (the ones FastDeploy replaces them with)."""
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    old, new = _caches(paddle), _caches(paddle)
    tokens = list(range(2 * BS))
    with KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore()
    ) as store:
        assert store.write("t1", *old, tokens, [0, 1], 0) == 2
        yield store, old, new, tokens


def _exits_started(store: KVPipeAttentionStore) -> None:
    """Wait for the pipeline exits the store started in its loop (no sleeping)."""
    for leaving in list(store._loop._leaving):
        leaving.result(timeout=30)


def test_replaced_caches_close_their_pipeline() -> None:
    """FastDeploy replaces its caches when the model's weights are cleared and updated.
    Every set of tensors the adapter ever saw kept its pipeline open (its staging, and a
    reference to the old tensors, so their memory) until the adapter closed. Now a call
    with new caches closes the pipeline over the old ones; the store is shared, so what was
    written is still there."""
    with _written_from_old_caches() as (store, (old_k, old_v), (new_k, new_v), tokens):
        (old,) = store._pipes.values()
        assert store.read("t2", new_k, new_v, tokens, [4, 5], 0) == 2  # the new caches
        _exits_started(store)
        assert old.pipe.closed and old.retired
        assert [e.pipe.closed for e in store._pipes.values()] == [False]
        assert store.query("t3", tokens, 0) == 2
        assert [t.numpy().tobytes() for t in new_k] != [t.numpy().tobytes() for t in old_k]
        for n, o in zip(new_k + new_v, old_k + old_v, strict=True):
            assert n[4].numpy().tobytes() == o[0].numpy().tobytes()


def test_a_replaced_pipeline_in_use_closes_when_its_call_ends() -> None:
    """A call still using the old caches' pipeline finishes on it; the pipeline closes
    after, not under it."""
    with _written_from_old_caches() as (store, _, (new_k, new_v), tokens):
        ident = next(iter(store._pipes))
        held = store._take(ident)  # as a call on the old caches does, until it returns
        assert held is not None
        assert store.write("t2", new_k, new_v, tokens, [0, 1], 0) == 2
        _exits_started(store)
        assert held.retired and not held.pipe.closed
        store._put_back(held)  # that call ends
        _exits_started(store)
        assert held.pipe.closed


def test_close_closes_every_pipeline_and_lets_go_of_the_caches() -> None:
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    tokens = list(range(BS))
    store = KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore(), cache_sets=2
    )
    sets = [_caches(paddle), _caches(paddle)]
    for i, (k, v) in enumerate(sets):
        assert store.write(f"t{i}", k, v, tokens, [0], 0) == 1
    entries = list(store._pipes.values())
    assert len(entries) == 2
    store.close()
    assert all(e.pipe.closed for e in entries)
    assert not store._pipes


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_cache_sets_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(kvpipe.ConfigError, match="cache_sets"):
        KVPipeAttentionStore(cache_sets=bad, store=kvpipe.MemoryStore())  # type: ignore[arg-type]


def test_storage_remembers_a_bounded_number_of_keys(caplog: pytest.LogCaptureFixture) -> None:
    """``KVPipeStorage`` kept every key it ever stored or saw stored (for ``clear``) for the
    server's lifetime: a set that only grew, blocks evicted long ago included. It now keeps
    the ``remember_keys`` most recent, with one WARNING when it first forgets; ``clear``
    removes those, the forgotten ones stay in the store."""
    import ctypes

    payload = ctypes.create_string_buffer(b"v" * 64, 64)
    ptr = ctypes.addressof(payload)
    keys = [f"k{i}" for i in range(10)]
    with (
        caplog.at_level(logging.WARNING, "kvpipe.integrations"),
        KVPipeStorage(store=kvpipe.MemoryStore(), remember_keys=4) as fs,
    ):
        for key in keys:
            assert fs.batch_set([key], [ptr], [64]) == [0]
        assert len(fs._own) == 4
        assert fs.exists(keys[:2]) == {"k0": True, "k1": True}  # seen stored: remembered
        assert len(fs._own) == 4
        warnings = [r for r in caplog.records if "remember_keys" in r.getMessage()]
        assert len(warnings) == 1
        assert fs.clear() is True
        assert not fs._own
        stored = fs.exists(keys)
        assert [k for k, ok in stored.items() if not ok] == ["k0", "k1", "k8", "k9"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_remember_keys_must_be_a_count(bad: object) -> None:
    with pytest.raises(kvpipe.ConfigError, match="remember_keys"):
        KVPipeStorage(store=kvpipe.MemoryStore(), remember_keys=bad)  # type: ignore[arg-type]


def test_a_pipeline_opened_while_close_runs_is_not_kept_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write opens the pipeline over its caches; ``close()`` runs (another thread) between
    the pipeline being entered and its being recorded. The pipeline is closed with the
    rest, and the write answers 0 with one WARNING: it was recorded after ``close()`` had
    cleared the record, so the closed pipeline, and through it the caches, stayed alive."""
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    store = KVPipeAttentionStore(layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore())
    enter = store._loop.enter

    def enter_then_close(*args: Any, **kw: Any) -> Any:
        entered = enter(*args, **kw)
        store.close()  # as another thread's close() would, just then
        return entered

    store._loop.enter = enter_then_close  # type: ignore[method-assign]
    k, v = _caches(paddle)
    with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
        assert store.write("t", k, v, list(range(BS)), [0], 0) == 0
    assert not store._pipes
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "closed" in warnings[0], warnings


class _HungReadClient:
    """A Mooncake vendor-client stand-in whose ``batch_get_into`` hangs until :attr:`release`
    (a segment owner that stopped answering)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.closed = threading.Event()

    def setup(self, *args: object) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.entered.set()
        self.release.wait(60)
        return [-800] * len(keys)

    def close(self) -> int:
        self.closed.set()
        return 0


def test_close_returns_by_its_timeout_while_the_mooncake_store_drains_a_hung_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVPipeStorage.close`` over a Mooncake store with a vendor read still hanging (its
    caller gave up at its timeout): the store's shielded ``aclose`` waits up to its
    ``setup_timeout`` (60 s here) for that call before closing the client, and ``close``
    joined the loop thread without a bound, holding FastDeploy's thread that long past
    ``close_timeout``. It returns by ``close_timeout`` plus the slack, the read still hung;
    the store finishes closing in the loop thread once the call returns.

    No real deadline is raced: the read is asked for again until one's vendor call has
    begun by the time its 0.2 s run out (on a loaded machine the first may give up before
    its worker thread started it, and a read given up on so never begins), and close is
    given 30 s, far less than the drain it must not wait for (the read is held until the
    test releases it)."""
    import socket
    import time

    from kvpipe.backends import mooncake as mc

    fake = _HungReadClient()
    monkeypatch.setattr(mc, "_load_client", lambda: fake)
    with socket.socket() as listener:  # the master's port: the store probes it
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        master = f"127.0.0.1:{listener.getsockname()[1]}"
        store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata", setup_timeout=60.0)
        storage = KVPipeStorage(store=store, timeout=0.2, close_timeout=0.2)
        try:
            out = bytearray(64)
            ptr = ctypes.addressof((ctypes.c_char * 64).from_buffer(out))
            guard = time.monotonic() + 30
            while not fake.entered.is_set():  # a read that hangs, its caller gone
                assert storage.batch_get(["k"], [ptr], [64]) == [-1]
                assert time.monotonic() < guard, "no read reached the vendor in 30 s"
            closer = threading.Thread(target=storage.close)
            closer.start()
            closer.join(30)
            assert not closer.is_alive(), "close still waits for the store's drain"
            assert not fake.release.is_set() and not fake.closed.is_set()  # the read hangs on
        finally:
            fake.release.set()
        assert fake.closed.wait(30)  # the store closed its client once the read returned
        closer.join(30)


@dataclass
class _LateCopy:
    """An adapter whose read's copy into the caches outlasts ``close_timeout``."""

    store: KVPipeAttentionStore
    release: threading.Event  # lets the copy end
    reading: threading.Thread  # the read's caller
    outcome: list[BaseException | None]  # what the read raised (None: it returned)


@contextlib.contextmanager
def _copy_outlasting_close(monkeypatch: pytest.MonkeyPatch) -> Iterator[_LateCopy]:
    """A read's copy into the caches held (in its worker thread, shielded from
    cancellation) until ``release`` is set, running once entered; ``close_timeout`` 0.2 s,
    :data:`HOP_SLACK` 0.05 s."""
    from kvpipe import _engine
    from kvpipe.actors import reader
    from kvpipe.integrations import _portal

    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    monkeypatch.setattr(_portal, "HOP_SLACK", 0.05)  # close's own bound: 0.2 s + 2 x 0.05 s
    monkeypatch.setattr(_engine, "INLINE_COPY_BYTES", 0)  # every copy in a worker thread
    monkeypatch.setattr(reader, "INLINE_COPY_BYTES", 0)
    copying, release = threading.Event(), threading.Event()
    scatter = reader.check_and_scatter

    def slow_scatter(*args: Any) -> Any:  # a copy into the caches that takes its time
        copying.set()
        release.wait(60)
        return scatter(*args)

    monkeypatch.setattr(reader, "check_and_scatter", slow_scatter)
    k, v = _caches(paddle)
    tokens = list(range(2 * BS))
    store = KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore(), close_timeout=0.2
    )
    assert store.write("t", k, v, tokens, [0, 1], 0) == 2
    outcome, read = _outcome_of(lambda: store.read("r", k, v, tokens, [2, 3], 0, timeout=60.0))
    reading = threading.Thread(target=read)
    reading.start()
    try:
        assert copying.wait(30)
        yield _LateCopy(store, release, reading, outcome)
    finally:
        release.set()
        reading.join(30)


def test_a_close_that_returns_while_a_copy_into_the_caches_runs_says_so_and_keeps_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read's copy into the caches runs in a worker thread, shielded from cancellation,
    and outlasts ``close_timeout``: ``close()`` returned by its bound (as it must), having
    let go of the pipelines over the caches and logged only that "the loop thread still
    runs a task that ignores cancellation", so FastDeploy went on to free or reuse caches
    that kvpipe was still writing into. It now says, at ERROR, that the caches may still
    be read or written and must not be freed or reused, keeps the pipelines over them
    until the loop thread has ended, and logs when it has."""
    with _copy_outlasting_close(monkeypatch) as late:
        store = late.store
        with caplog.at_level(logging.INFO, "kvpipe.integrations"):
            store.close()  # returns by its bound, the copy into blocks 2 and 3 still running
            assert not late.release.is_set()
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("do not free or reuse" in e and "caches" in e for e in errors), errors
            assert store._pipes, "the pipeline over caches still in use was let go"
            caplog.clear()
            late.release.set()  # the copy ends, the read with it, then the loop thread
            late.reading.join(30)
            assert late.outcome == [None]
            assert store._loop._joiner is not None
            store._loop._joiner.join(30)
        assert not store._pipes
        ended = [r.getMessage() for r in caplog.records if "has ended" in r.getMessage()]
        assert len(ended) == 1 and "caches" in ended[0], ended


def test_a_late_end_of_the_loop_logs_no_close_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``close()`` returned by its bound, a copy into the caches still running; when it
    ended, and the loop thread with it, each closer the loop's stop had cut off (the
    pipeline's exit, the store's) logged "error while closing" at ERROR with a
    ``concurrent.futures.CancelledError`` traceback: the portal's own cancelling, not an
    error in closing, and at 3 a.m. it reads as one. The late end logs what it means to:
    that nothing uses the caches any more."""
    with _copy_outlasting_close(monkeypatch) as late:
        loop = late.store._loop
        with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
            assert loop.close() is False  # the copy into blocks 2 and 3 still running
            # close's helper: it still runs the closers that the loop's stop cut off
            helpers = [t for t in threading.enumerate() if t.name == f"{loop.name}-close"]
            assert helpers
            caplog.clear()
            late.release.set()  # the copy ends, the read with it, then the loop thread
            late.reading.join(30)
            assert loop._joiner is not None
            loop._joiner.join(30)
            for helper in helpers:
                helper.join(30)  # every closer's outcome logged
        ours = [r for r in caplog.records if r.name == "kvpipe.integrations"]
        loud = [(r.levelname, r.getMessage()) for r in ours if r.levelno >= logging.WARNING]
        assert loud == [
            (
                "WARNING",
                f"{loop.name}: the loop thread has ended: nothing uses "
                "FastDeploy's caches any more",
            )
        ], loud


class _ExitsLate:
    """An async context manager whose exit runs, shielded from cancellation (as a store's
    own bounded close, a copy into the caller's caches), until :attr:`release` is set; it
    then raises :attr:`error` when given, else passes a checkpoint (where the loop's stop
    cancels it). Its entering waits for :attr:`may_enter` when given."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.release = threading.Event()
        self.may_enter: anyio.Event | None = None
        self.exiting: anyio.Event | None = None

    async def __aenter__(self) -> _ExitsLate:
        self.exiting = anyio.Event()
        if self.may_enter is not None:
            await self.may_enter.wait()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.exiting is not None
        self.exiting.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.release.wait, 60)
        if self.error is not None:
            raise self.error
        await anyio.lowlevel.checkpoint()


def _close_helpers(loop: LoopThread) -> list[threading.Thread]:
    """The threads in which ``loop``'s close runs its closers."""
    return [t for t in threading.enumerate() if t.name == f"{loop.name}-close"]


def _loud(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, str | None]]:
    """The LoopThread's records at WARNING or above: level, message (its first line), and
    the error its traceback ends with, if any (a closer's error is logged as its text)."""
    loud: list[tuple[str, str, str | None]] = []
    for r in caplog.records:
        if r.name == "kvpipe.integrations" and r.levelno >= logging.WARNING:
            first, *rest = r.getMessage().splitlines()
            loud.append((r.levelname, first, rest[-1].split(":")[0] if rest else None))
    return loud


BACKEND_ERROR = f"{kvpipe.BackendError.__module__}.{kvpipe.BackendError.__qualname__}"


@pytest.mark.parametrize("error", [None, kvpipe.BackendError("memory", "close", "injected")])
def test_an_exit_ending_after_close_returned_logs_only_its_own_error(
    error: Exception | None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An exit that ignores cancellation outlasts ``close_timeout``; ``close()`` returns by
    its bound. When the exit ends, the loop thread with it, an exit that ended cancelled
    (by the loop's stop) logged "error while closing" at ERROR with a
    ``concurrent.futures.CancelledError``; an exit that raised its own error is still
    logged so, with that error."""
    from kvpipe.integrations import _portal

    monkeypatch.setattr(_portal, "HOP_SLACK", 0.05)
    loop = LoopThread("test-late-exit", close_timeout=0.1)
    cm = _ExitsLate(error)
    try:
        loop.enter(cm, wait=30.0)
        with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
            assert loop.close() is False
            helpers = _close_helpers(loop)
            caplog.clear()
            cm.release.set()  # the exit ends, then the loop thread
            assert loop._joiner is not None
            loop._joiner.join(30)
            for helper in helpers:
                helper.join(30)  # every closer's outcome logged
    finally:
        cm.release.set()
    ended = ("WARNING", "test-late-exit: the loop thread has ended", None)
    expected = [ended]
    if error is not None:
        expected.append(("ERROR", "test-late-exit: error while closing", BACKEND_ERROR))
    assert sorted(_loud(caplog), key=str) == sorted(expected, key=str)


def test_an_enter_racing_close_logs_no_close_error_for_its_exit_cut_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``enter`` that finished after ``close()`` took its closers exits what it entered
    itself; that exit ignores cancellation and outlasts ``close_timeout``, so the loop's
    stop cuts it off. It then logged "error while closing" at ERROR with a
    ``concurrent.futures.CancelledError``, as did the closer that close's stop cut off:
    the portal's cancelling, not an error in closing. ``enter`` raises ``PipelineClosed``,
    and the only ERRORs are close's own."""
    from kvpipe.integrations import _portal

    monkeypatch.setattr(_portal, "HOP_SLACK", 0.05)
    loop = LoopThread("test-enter-race-late", close_timeout=0.5)
    late = _ExitsLate()

    async def make_event() -> anyio.Event:
        return anyio.Event()

    late.may_enter = loop.call(make_event, wait=10.0)
    first = _Recorded()

    async def let_late_enter_and_exit_then_hang() -> None:
        assert late.may_enter is not None
        late.may_enter.set()  # close() already holds its closers: this one is first's
        assert late.exiting is not None
        await late.exiting.wait()
        await anyio.sleep_forever()  # until the loop's stop cancels it

    first.on_exit = let_late_enter_and_exit_then_hang
    loop.enter(first)
    outcome, enter_late = _outcome_of(lambda: loop.enter(late, wait=30.0))
    thread = threading.Thread(target=enter_late)
    thread.start()
    try:
        assert first.started.wait(30)
        with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
            assert loop.close() is False  # late's exit still runs
            helpers = _close_helpers(loop)
            late.release.set()  # late's exit ends, cancelled, then the loop thread
            thread.join(30)
            assert loop._joiner is not None
            loop._joiner.join(30)
            for helper in helpers:
                helper.join(30)
    finally:
        late.release.set()
        thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], kvpipe.PipelineClosed), outcome
    errors = [m for level, m, _ in _loud(caplog) if level == "ERROR"]
    assert errors == [
        "test-enter-race-late: close did not finish within 0.5 s",
        "test-enter-race-late: the loop thread still runs a task that ignores cancellation; "
        "left to finish on its own",
    ], errors


class _FailsToExit:
    """An async context manager whose exit raises (as a pipeline's does when an actor's
    error surfaces at its close), once :attr:`may_end` is set."""

    def __init__(self) -> None:
        self.exiting = threading.Event()
        self.may_end: anyio.Event | None = None

    async def __aenter__(self) -> _FailsToExit:
        self.may_end = anyio.Event()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self.may_end is not None
        self.exiting.set()
        await self.may_end.wait()
        raise kvpipe.BackendError("memory", "close", "injected")


@pytest.mark.parametrize("at_close", [False, True], ids=["before-close", "at-close"])
def test_an_exit_started_early_that_raised_is_logged_once(
    at_close: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """An exit started early (the function ``enter`` returns beside its value; the adapter
    retires the pipeline over replaced caches so) that raised: nobody read its outcome
    once it had ended, so the error vanished, where ``close()`` logs an exit's error at
    ERROR. It is logged at ERROR, once, whether it ended before ``close()`` or during it."""
    loop = LoopThread("test-leave-soon-error")
    cm = _FailsToExit()
    other = _Recorded()  # exited by close(), before it waits for the exit started early

    async def let_it_end() -> None:
        assert cm.may_end is not None
        cm.may_end.set()

    async def noop() -> None:
        pass

    with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
        try:
            _, leave_soon = loop.enter(cm, wait=30.0)
            loop.enter(other, wait=30.0)
            leave_soon()
            assert cm.exiting.wait(30)
            if at_close:
                other.on_exit = let_it_end
            else:
                loop.call(let_it_end, wait=30.0)
                loop.call(noop, wait=30.0)  # after the exit's step: it has ended
                assert not loop._leaving
        finally:
            assert loop.close() is True
    errors = [(m, error) for level, m, error in _loud(caplog) if level == "ERROR"]
    assert errors == [("test-leave-soon-error: error while closing", BACKEND_ERROR)]


class _EntersOnCloseExitsLate:
    """An async context manager entered once :attr:`may_enter` is set (from a thread);
    its exit, shielded from cancellation (a store's unregister that hangs), runs until
    :attr:`release` is set."""

    def __init__(self) -> None:
        self.entering = threading.Event()
        self.may_enter = threading.Event()
        self.exiting = threading.Event()
        self.release = threading.Event()

    async def __aenter__(self) -> _EntersOnCloseExitsLate:
        self.entering.set()
        await anyio.to_thread.run_sync(self.may_enter.wait, 60)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.exiting.set()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.release.wait, 60)


def test_an_enter_racing_close_returns_by_its_wait_while_its_exit_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ``enter`` that finished after ``close()`` took its closers exits what it entered
    itself, and waited for that exit without a bound: with an exit that takes its time (a
    store's unregister that hangs) its caller (FastDeploy's thread opening a pipeline)
    waited past its ``wait`` plus :data:`HOP_SLACK`, the most the loop thread may hold a
    caller. It raises ``PipelineClosed`` by then; the exit goes on in the loop, its
    outcome logged when it ends."""
    from kvpipe.integrations import _portal

    monkeypatch.setattr(_portal, "HOP_SLACK", 0.05)
    loop = LoopThread("test-enter-race-slow-exit", close_timeout=30.0)
    late = _EntersOnCloseExitsLate()
    first = _Recorded()

    async def let_late_enter() -> None:  # close() already holds its closers: this is first's
        late.may_enter.set()
        await anyio.to_thread.run_sync(late.exiting.wait, 60)

    first.on_exit = let_late_enter
    loop.enter(first)
    outcome, enter_late = _outcome_of(lambda: loop.enter(late, wait=1.0))
    entering = threading.Thread(target=enter_late)
    closing = threading.Thread(target=loop.close)
    try:
        entering.start()
        assert late.entering.wait(30)
        closing.start()
        assert late.exiting.wait(30)  # entered, and exiting: until released
        entering.join(1.0 + 10.0)  # its wait, and 10 s for a busy machine
        assert not entering.is_alive(), "enter still waits for the exit of what it entered"
        assert len(outcome) == 1 and isinstance(outcome[0], kvpipe.PipelineClosed), outcome
    finally:
        late.release.set()
        entering.join(30)
        closing.join(60)


class _Payload:
    """Something the owner of a loop thread refers to (its pipelines, the caller's caches)."""


class _LetsGoBadly:
    """An owner whose ``ended_late`` callback raises."""

    def __init__(self) -> None:
        self.payload = _Payload()

    def let_go(self) -> None:
        raise RuntimeError("injected: letting go failed")


def test_a_kept_record_of_an_error_after_the_loop_ended_keeps_nothing_alive(
    no_cyclic_gc: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``close(ended_late)`` returned before the loop thread ended; once it had, the
    callback raised: the "error after the loop thread ended" record held the error itself
    (``exc_info``), so a handler that keeps records (pytest's capture, a ``MemoryHandler``)
    kept its traceback's frames, and through them the callback's owner (an adapter, its
    pipelines, FastDeploy's caches). The record holds the error's text, traceback included."""
    from kvpipe.integrations import _portal

    monkeypatch.setattr(_portal, "HOP_SLACK", 0.05)
    loop = LoopThread("test-let-go-record", close_timeout=0.1)
    cm = _ExitsLate()
    owner = _LetsGoBadly()
    ref = weakref.ref(owner.payload)
    try:
        loop.enter(cm, wait=30.0)
        with caplog.at_level(logging.ERROR, "kvpipe.integrations"):
            assert loop.close(owner.let_go) is False
            cm.release.set()  # the exit ends, then the loop thread
            assert loop._joiner is not None
            loop._joiner.join(30)
            assert not loop._joiner.is_alive()
    finally:
        cm.release.set()
    (record,) = [r for r in caplog.records if "error after the loop thread ended" in r.getMessage()]
    assert "RuntimeError: injected: letting go failed" in caplog.text
    assert "let_go" in caplog.text  # where it was raised
    del owner, record
    assert ref() is None, "a kept log record holds the owner of the loop thread"
