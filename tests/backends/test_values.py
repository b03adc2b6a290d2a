"""ValueClient's staging is never freed while the store may still use it."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

import kvpipe
from kvpipe.backends import BlockStatus, _registration
from kvpipe.backends._values import ValueClient
from tests.fakes import StuckInThreadStore


async def test_staging_a_call_abandoned_at_exit_may_use_stays_registered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = StuckInThreadStore("put")
    kept = len(_registration.KEPT)
    try:
        with anyio.fail_after(10):
            async with ValueClient(store, close_timeout=0.2) as client:
                # the caller gives up once the put is stuck in its thread (not at a set time:
                # on a loaded machine the thread may not have started by then)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.put, ["k0"], [b"x" * 64])
                    await anyio.to_thread.run_sync(store.running.wait, 10)
                    tg.cancel_scope.cancel()
                assert store.running.is_set()
        assert store.running.is_set()  # still running after the exit
        assert store.unregistered == []
        assert len(_registration.KEPT) == kept + 1
        assert any("stays registered" in r.getMessage() for r in caplog.records)
    finally:
        store.go_on.set()


class RefusingStore(kvpipe.MemoryStore):
    async def unregister_staging(self, buffer: memoryview) -> None:
        raise kvpipe.BackendError("refusing", "unregister_staging", "refused")


async def test_staging_the_store_would_not_unregister_is_kept_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kept = len(_registration.KEPT)
    async with ValueClient(RefusingStore()) as client:
        assert await client.put(["k0"], [b"x" * 64]) == [BlockStatus.OK]
    assert len(_registration.KEPT) == kept + 1
    assert any("refused" in r.getMessage() for r in caplog.records)


class SlowRegisterStore(kvpipe.MemoryStore):
    """Registration is a vendor call that goes on (and registers) when its caller stops
    waiting."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[memoryview] = []
        self.registering = anyio.Event()

    async def register_staging(self, buffer: memoryview) -> None:
        self.registered.append(buffer)
        self.registering.set()
        await anyio.sleep_forever()

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.registered = [b for b in self.registered if b is not buffer]


async def test_a_registration_cancelled_midway_is_unregistered_at_exit() -> None:
    store = SlowRegisterStore()
    async with ValueClient(store) as client:
        # cancelled once registering began (not at a set time, which a loaded machine's
        # scheduling delay could reach first)
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.put, ["k0"], [b"x" * 64])
            with anyio.fail_after(30):  # a hang guard only
                await store.registering.wait()
            tg.cancel_scope.cancel()
        assert len(store.registered) == 1
    assert store.registered == []


class SlowRegistrationStore(kvpipe.MemoryStore):
    """Registering staging yields to the loop (as Mooncake's, a call in a worker thread);
    counts registrations and unregistrations."""

    def __init__(self) -> None:
        super().__init__()
        self.registered = 0
        self.unregistered = 0

    async def register_staging(self, buffer: memoryview) -> None:
        self.registered += 1
        for _ in range(3):
            await anyio.lowlevel.checkpoint()

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.unregistered += 1


async def test_concurrent_first_calls_of_one_size_share_one_staging_pool() -> None:
    """FastDeploy's manager threads call at once; the first calls of one value size must
    not each allocate and register a pool (all but one orphaned, registered, until exit)."""
    store = SlowRegistrationStore()
    async with ValueClient(store, slots=4) as client:
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(client.put, [f"k{i}"], [bytes([i]) * 64])
        assert store.registered == 1
        assert len(client._pools) == 1
        got = await client.get(["k0", "k1", "k2"], [64, 64, 64])
        assert [v for _, v in got] == [bytes([i]) * 64 for i in range(3)]
    assert store.unregistered == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_large_copies_leave_the_event_loop_small_ones_stay(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of large values is copied into and out of staging in a worker thread: a
    server's event loop keeps answering while 32 values of 2 MiB (64 MiB) are copied. A
    batch of small values is copied on the loop (a thread hop costs more than the copy)."""
    from kvpipe._workers import INLINE_COPY_BYTES
    from kvpipe.backends import _values

    loop_thread = threading.get_ident()
    seen: list[tuple[str, int, bool]] = []

    def recorded(name: str, fn: Any) -> Any:
        def call(pool: Any, slots: Any, *args: Any) -> Any:
            seen.append((name, len(slots), threading.get_ident() == loop_thread))
            return fn(pool, slots, *args)

        return call

    monkeypatch.setattr(_values, "fill_slots", recorded("fill", _values.fill_slots))
    monkeypatch.setattr(_values, "read_slots", recorded("read", _values.read_slots))
    big = [bytes([i]) * (2 << 20) for i in range(32)]
    small = [bytes([i]) * 64 for i in range(4)]
    assert 64 * 4 <= INLINE_COPY_BYTES < 2 << 20
    async with ValueClient(kvpipe.MemoryStore()) as client:
        keys = [f"b{i}" for i in range(32)]
        assert await client.put(keys, big) == [BlockStatus.OK] * 32
        got = await client.get([*keys, "absent"], [2 << 20] * 33)
        assert [v for _, v in got] == [*big, b""]
        assert all(type(v) is bytearray for _, v in got)  # copied by numpy, GIL let go
        assert got[-1][0] is BlockStatus.MISSING
        assert await client.put(["s0", "s1", "s2", "s3"], small) == [BlockStatus.OK] * 4
        got = await client.get(["s0", "s1", "s2", "s3"], [64] * 4)
        assert [v for _, v in got] == small
    # in a thread: the 32 large values each way; the miss (a second batch: 32 slots) is not
    # copied; on the loop: the small ones
    assert seen == [
        ("fill", 32, False),
        ("read", 32, False),
        ("read", 0, True),
        ("fill", 4, True),
        ("read", 4, True),
    ]


async def test_an_empty_value_is_refused_before_any_value_is_stored() -> None:
    """A put whose values include an empty one raises ``ValueError`` (no staging slot holds
    zero bytes), as a bad key does: before it stores anything. It stored the values of the
    sizes met before the empty one first, then raised, so the caller took the whole call for
    failed while some of its keys were stored."""
    async with kvpipe.MemoryStore() as store, ValueClient(store) as client:
        with pytest.raises(ValueError, match="empty value"):
            await client.put(["full", "empty"], [b"x" * 64, b""])
        assert await client.exists(["full", "empty"]) == [False, False]


class FailingProbeStore(kvpipe.MemoryStore):
    """Answers the first ``exists`` (every key missing, so the keys after the first miss are
    probed again one by one), then fails every probe as a store that cannot look would."""

    exists_answers_every_key = False  # as a store whose exists stops at the first miss

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def exists(self, batch: Any) -> list[bool]:
        self.calls += 1
        if self.calls == 1:
            return [False] * len(batch.keys)
        raise kvpipe.BackendError("probe", "exists", "cannot look at the block")


async def test_a_failing_probe_raises_its_backend_error_not_an_exception_group() -> None:
    """ValueClient.exists probes the keys after the first miss again in a task group: a
    store's BackendError from one probe came out wrapped in an ExceptionGroup, which callers
    catching BackendError (the store's documented error) let through."""
    async with FailingProbeStore() as store, ValueClient(store) as client:
        with pytest.raises(kvpipe.BackendError, match="cannot look"):
            await client.exists(["k0", "k1", "k2", "k3"])


class CountingExistsStore(kvpipe.MemoryStore):
    def __init__(self, every_key: bool) -> None:
        super().__init__()
        self.exists_answers_every_key = every_key
        self.exists_calls = 0

    async def exists(self, batch: Any) -> list[bool]:
        self.exists_calls += 1
        return list(await super().exists(batch))


@pytest.mark.parametrize("every_key", [True, False])
async def test_keys_after_a_miss_are_probed_again_only_where_exists_may_stop(
    every_key: bool,
) -> None:
    """A store whose exists answers every key (MemoryStore, MooncakeStore) is asked once
    for all keys; one that may stop at the first miss has each key after it that it
    answered missing probed again.
    Before, every store's keys after a miss were probed one call each (32 master calls for
    a FastDeploy batch_set of 32 new keys on Mooncake)."""
    async with CountingExistsStore(every_key) as store, ValueClient(store) as client:
        await client.put(["k1", "k3"], [b"x" * 64, b"y" * 64])
        store.exists_calls = 0
        assert await client.exists(["k0", "k1", "k2", "k3"]) == [False, True, False, True]
        assert store.exists_calls == (1 if every_key else 2)  # k2 probed again


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"store": object()}, "store"),
        ({"slots": 0}, "slots"),
        ({"slots": 2.5}, "slots"),
        ({"close_timeout": -1}, "close_timeout"),
        ({"close_timeout": float("nan")}, "close_timeout"),
        ({"close_timeout": "10"}, "close_timeout"),
    ],
)
def test_bad_arguments_are_a_config_error_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    """A ValueClient over something that is no store raised a bare TypeError (a Pipeline
    raises ConfigError("store")), and close_timeout was not checked at all: a negative or
    NaN one surfaced only at exit, a string as a TypeError there."""
    args: dict[str, Any] = {"store": kvpipe.MemoryStore(), **kwargs}
    with pytest.raises(kvpipe.ConfigError) as caught:
        ValueClient(args.pop("store"), **args)
    assert caught.value.field == field


def test_a_numpy_integer_slots_is_taken_as_its_int() -> None:
    """The argument check of 4676199 took only a Python int, refusing slots=np.int64(4),
    which was accepted before."""
    import numpy as np

    assert ValueClient(kvpipe.MemoryStore(), slots=np.int64(4)).slots == 4


@pytest.mark.parametrize("size", [2.7, None, "3", True], ids=repr)
async def test_a_size_that_is_no_int_is_a_request_error(size: Any) -> None:
    """``get`` took each size as ``int(n)``: 2.7 was cut to 2 (a 3-byte value then read as
    ``CORRUPT``, a 2-byte one returned for a 2.7-byte ask), "3" was read as 3, ``True`` as 1,
    and ``None`` raised a bare ``TypeError`` instead of the documented ``RequestError``."""
    async with kvpipe.MemoryStore() as store, ValueClient(store) as client:
        await client.put(["k"], [b"xyz"])
        with pytest.raises(kvpipe.RequestError, match="one positive size per key"):
            await client.get(["k"], [size])


async def test_a_numpy_integer_size_is_taken_as_its_int() -> None:
    import numpy as np

    async with kvpipe.MemoryStore() as store, ValueClient(store) as client:
        await client.put(["k"], [b"xyz"])
        assert await client.get(["k"], [np.int64(3)]) == [(BlockStatus.OK, bytearray(b"xyz"))]
