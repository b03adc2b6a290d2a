"""MooncakeStore over a fake vendor client (a TCP listener stands in for the master's port):
a closed store stays closed, and a failed unregister_buffer is not taken for success."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.abc
import numpy as np
import pytest

import kvpipe
from kvpipe._keys import Scope, as_tokens
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, GetBatch, KeyBatch, PutBatch
from kvpipe.backends import mooncake as mc
from kvpipe.backends._values import VALUES_FINGERPRINT, ValueClient
from tests.helpers import checkpoints, until


class FakeClient:
    def __init__(self) -> None:
        self.closed = 0

    def setup(self, *args: object) -> int:
        return 0

    def close(self) -> int:
        self.closed += 1
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return -1  # still registered: the caller must not free the memory


@pytest.fixture
async def master() -> AsyncIterator[str]:
    """An address whose port answers (the store probes it before ``setup``)."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    try:
        yield f"127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
    finally:
        await listener.aclose()


@pytest.mark.parametrize("opened", [True, False])
async def test_a_call_after_aclose_does_not_set_up_a_new_client(
    master: str, monkeypatch: pytest.MonkeyPatch, opened: bool
) -> None:
    """A closed store (opened before, or closed before its first call) refuses later calls
    without setting up a vendor client: it would mount a segment that nothing closes."""
    clients: list[FakeClient] = []

    def load() -> FakeClient:
        clients.append(FakeClient())
        return clients[-1]

    monkeypatch.setattr(mc, "_load_client", load)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    if opened:
        await store.open()
    await store.aclose()
    assert store.closed
    assert [c.closed for c in clients] == ([1] if opened else [])
    scope = Scope("ns", VALUES_FINGERPRINT)
    batch = KeyBatch(scope, "r", ["k1"], 0, as_tokens(np.zeros(0, np.int64)))
    with pytest.raises(kvpipe.BackendError):
        await store.exists(batch)
    assert len(clients) == int(opened)


async def test_a_failed_unregister_is_a_backend_error(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mc, "_load_client", FakeClient)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)
        await store.register_staging(staging.data)
        with pytest.raises(kvpipe.BackendError, match="unregister_buffer"):
            await store.unregister_staging(staging.data)


class SlowRegisterClient(FakeClient):
    """register_buffer completes only when ``go`` is set; records what stays registered."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.started = threading.Event()
        self.done = threading.Event()
        self.registered: set[int] = set()

    def register_buffer(self, ptr: int, size: int) -> int:
        self.started.set()
        self.go.wait(10)
        self.registered.add(ptr)
        self.done.set()
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        if ptr not in self.registered:
            return -1
        self.registered.discard(ptr)
        return 0


async def test_a_cancelled_register_is_unregistered_or_refused(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration whose call was cancelled counts as made (the vendor call may complete,
    and the pipeline then unregisters it at close): unregister_staging must unregister it, or
    fail so the caller keeps the memory, never answer success with the buffer registered."""
    client = SlowRegisterClient()
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.register_staging, staging.data)
            await anyio.to_thread.run_sync(client.started.wait, 10)
            tg.cancel_scope.cancel()  # the pipeline's open gave up midway
        client.go.set()  # the abandoned vendor call completes: the buffer is registered
        await anyio.to_thread.run_sync(client.done.wait, 10)
        assert client.registered == {staging.ctypes.data}
        try:
            await store.unregister_staging(staging.data)
        except kvpipe.BackendError:
            pass  # refused: the caller keeps the memory
        else:
            assert client.registered == set(), "reported unregistered, still registered"


async def test_a_registration_cancelled_before_its_call_started_registers_nothing(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration cancelled before the vendor call started registers nothing: closing
    does not fail on it (which would keep the staging allocated for good)."""
    client = SlowRegisterClient()
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.register_staging(staging.data)
        await store.unregister_staging(staging.data)  # nothing to undo: no error
        assert not client.started.is_set() and client.registered == set()


class FailingSlowRegisterClient(SlowRegisterClient):
    """register_buffer fails (registering nothing) once ``go`` is set."""

    def register_buffer(self, ptr: int, size: int) -> int:
        self.started.set()
        self.go.wait(10)
        self.done.set()
        return -1


@pytest.mark.parametrize("fails", [True, False], ids=["first call fails", "first call works"])
async def test_a_second_registration_of_a_buffer_waits_for_the_first_ones_outcome(
    master: str, monkeypatch: pytest.MonkeyPatch, fails: bool
) -> None:
    """A second register_staging of a buffer whose first registration's vendor call was
    still running returned success at once, as soon as it was counted: before the buffer
    was registered, and even when that call then failed (the second owner then believed it
    registered, its unregister failed, and its staging was kept allocated for good). It
    waits for the first call and shares its outcome."""
    client = FailingSlowRegisterClient() if fails else SlowRegisterClient()
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)
        outcomes: dict[str, str] = {}

        async def register(owner: str) -> None:
            try:
                await store.register_staging(staging.data)
            except kvpipe.BackendError:
                outcomes[owner] = "failed"
            else:
                outcomes[owner] = "registered"

        async with anyio.create_task_group() as tg:
            tg.start_soon(register, "first")
            await anyio.to_thread.run_sync(client.started.wait, 10)
            tg.start_soon(register, "second")
            try:
                await checkpoints()
                assert outcomes == {}, "answered before the vendor call ended"
            finally:
                client.go.set()
        expected = "failed" if fails else "registered"
        assert outcomes == {"first": expected, "second": expected}
        if fails:
            assert not store._registered and client.registered == set()
        else:
            await store.unregister_staging(staging.data)
            assert client.registered == {staging.ctypes.data}  # the first owner's still
            await store.unregister_staging(staging.data)
            assert client.registered == set()


async def test_a_registration_cancelled_while_it_waits_for_a_failing_one_unregisters_quietly(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second register_staging cancelled while the first one's vendor call runs counts as
    registered, as a cancelled call does; where that call fails nothing is registered, and
    the owner's unregister at close must not fail (which keeps its staging allocated for
    good)."""
    client = FailingSlowRegisterClient()
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)

        async def first() -> None:
            with pytest.raises(kvpipe.BackendError, match="register_buffer"):
                await store.register_staging(staging.data)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.to_thread.run_sync(client.started.wait, 10)
            try:
                with anyio.CancelScope() as second:

                    async def cancel_it() -> None:
                        await checkpoints()  # once it waits for the first one's call
                        second.cancel()

                    tg.start_soon(cancel_it)
                    await store.register_staging(staging.data)
                assert second.cancelled_caught
            finally:
                client.go.set()
        assert not store._vendor and client.registered == set()
        await store.unregister_staging(staging.data)  # the second owner's, at its close
        assert not store._registered


class DuplicateGetClient(FakeClient):
    """Answers batch_get_into as the vendor does for a key asked twice in one call: one
    transfer per distinct key, into the last of its buffers, and every one reported filled."""

    def __init__(self, stored: dict[str, bytes]) -> None:
        super().__init__()
        self.stored = stored

    def batch_get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        target = dict(zip(keys, addresses, strict=True))  # the vendor's map: last one wins
        for key, address in target.items():
            value = self.stored[key]
            ctypes.memmove(address, value, len(value))
        return [len(self.stored[k]) for k in keys]


async def test_a_key_asked_twice_in_one_get_fills_both_buffers(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get reports OK only for a buffer that holds the value: a key asked twice in one
    batch (ValueClient takes caller-named keys) must not leave one buffer stale."""
    nbytes = 4096
    value = bytes(range(256)) * (nbytes // 256)
    client = DuplicateGetClient({"k1": value})
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    pool = StagingPool(nbytes, 2)
    async with (
        kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store,
        ThreadRunner() as runner,
    ):
        lease = pool.try_acquire(2)
        assert lease is not None
        try:
            for slot in lease.slots:
                pool.slot(slot)[:] = 0xEE  # stale staging: whatever a slot held before
            batch = GetBatch(
                Scope("ns", VALUES_FINGERPRINT),
                "r",
                ["k1", "k1"],
                0,
                as_tokens(np.zeros(0, np.int64)),
                lease=lease,
                value_nbytes=nbytes,
                runner=runner,
                limiter=None,
            )
            statuses = list(await store.get_blocks(batch))
            for status, buf in zip(statuses, batch.buffers, strict=True):
                if status is BlockStatus.OK:
                    assert bytes(buf) == value, "reported OK, the buffer was never written"
        finally:
            lease.release()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("global_segment_size", -1),
        ("global_segment_size", 1.5),
        ("global_segment_size", True),
        ("local_buffer_size", -(64 << 20)),
        ("local_buffer_size", "64MiB"),
        ("setup_timeout", 0),
        ("setup_timeout", -1.0),
        ("setup_timeout", float("nan")),
        ("setup_timeout", float("inf")),
    ],
)
def test_a_bad_size_or_timeout_is_refused_at_construction(field: str, value: object) -> None:
    """A negative or non-int size got past the constructor and surfaced at the first call
    as the vendor's raw ``TypeError`` (``setup(): incompatible function arguments``); a
    timeout of 0 as "master unreachable". Refused up front, naming the argument."""
    with pytest.raises(kvpipe.ConfigError) as info:
        mc.MooncakeStore(
            "127.0.0.1:1", "http://127.0.0.1:1/metadata", client=FakeClient(), **{field: value}
        )  # type: ignore[arg-type]
    assert info.value.field == field


def test_a_client_that_contributes_no_segment_is_accepted() -> None:
    """``global_segment_size=0`` (and a local buffer of 0) are valid Mooncake settings: a
    client that only moves values to and from other clients' segments."""
    mc.MooncakeStore(
        "127.0.0.1:1",
        "http://127.0.0.1:1/metadata",
        global_segment_size=0,
        local_buffer_size=0,
        client=FakeClient(),
    )


@pytest.mark.parametrize(
    "bad", ["127.0.0.1", "127.0.0.1:", ":50051", "host:port", "h:0", "h:70000"]
)
def test_a_master_without_host_and_port_is_refused_at_construction(bad: str) -> None:
    """A master address without a port raised a raw ``ValueError`` (``int('')``) at the
    first call."""
    with pytest.raises(kvpipe.ConfigError) as info:
        mc.MooncakeStore(bad, "http://127.0.0.1:1/metadata", client=FakeClient())
    assert info.value.field == "master"


class ShortAnswerClient(FakeClient):
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1] * (len(keys) - 1)


async def test_an_exists_answer_of_the_wrong_length_is_a_backend_error(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One code short: a ``BackendError`` naming the call, not ``zip``'s raw ``ValueError``."""
    monkeypatch.setattr(mc, "_load_client", ShortAnswerClient)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        scope = Scope("ns", VALUES_FINGERPRINT)
        batch = KeyBatch(scope, "r", ["k1", "k2"], 0, as_tokens(np.zeros(0, np.int64)))
        with pytest.raises(kvpipe.BackendError, match="batch_is_exist"):
            await store.exists(batch)


class OddAnswerClient(FakeClient):
    """``batch_is_exist`` answers with something other than a list of int codes."""

    def __init__(self, answer: object) -> None:
        super().__init__()
        self.answer = answer

    def batch_is_exist(self, keys: list[str]) -> object:
        return self.answer


@pytest.mark.parametrize("answer", [None, [1, None], ["yes", 1]])
async def test_an_exists_answer_of_the_wrong_type_is_a_backend_error(
    master: str, monkeypatch: pytest.MonkeyPatch, answer: object
) -> None:
    """Not ``int()``'s or ``len()``'s raw ``TypeError`` / ``ValueError``, which callers
    (the FastDeploy adapter) take for their own mistake and raise on."""
    monkeypatch.setattr(mc, "_load_client", lambda: OddAnswerClient(answer))
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        scope = Scope("ns", VALUES_FINGERPRINT)
        batch = KeyBatch(scope, "r", ["k1", "k2"], 0, as_tokens(np.zeros(0, np.int64)))
        with pytest.raises(kvpipe.BackendError, match="batch_is_exist"):
            await store.exists(batch)


class ShortRemoveClient(FakeClient):
    """``batch_remove`` answers for the first key only (the others' fate unknown)."""

    def batch_remove(self, keys: list[str], force: bool) -> list[int]:
        return [0]


async def test_a_delete_answer_of_the_wrong_length_is_a_backend_error(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete whose vendor call did not answer for every key is not reported done: a
    block that failed verification may still be stored."""
    monkeypatch.setattr(mc, "_load_client", ShortRemoveClient)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        with pytest.raises(kvpipe.BackendError, match="batch_remove"):
            await store.delete(["k1", "k2"])


class StoredValuesClient(FakeClient):
    """Holds values; ``batch_get_into`` copies them into registered memory."""

    def __init__(self, values: dict[str, bytes]) -> None:
        super().__init__()
        self.values = values
        self.registered: list[int] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append(size)
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        out = []
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            value = self.values.get(key)
            if value is None:
                out.append(mc.NOT_FOUND)
                continue
            ctypes.memmove(ptr, value, min(size, len(value)))
            out.append(len(value))
        return out


def test_a_put_compares_stored_values_in_bounded_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A put of keys already stored reads them back to compare, into scratch registered with
    the transfer engine (pinned under RDMA): in pieces of at most ``SCRATCH_MAX`` bytes, not
    one buffer the size of the whole slice (1 GiB for 500 blocks of 2 MiB)."""
    size = 4096
    monkeypatch.setattr(mc, "SCRATCH_MAX", 3 * size)
    values = {f"k{i}": bytes([i]) * size for i in range(8)}
    client = StoredValuesClient(values)
    mine = [bytes([i if i != 5 else 99]) * size for i in range(8)]
    views = [memoryview(v) for v in mine]
    lines = mc._Lines(mc.LogLimiter(mc.log), "10.0.0.1:50051")
    got = mc._read_and_compare(lines, client, [f"k{i}" for i in range(8)], [*range(8)], size, views)
    assert got == [(i, mc._DIFFERENT if i == 5 else 0) for i in range(8)]
    assert client.registered == [3 * size, 3 * size, 2 * size]


class HeldReadClient(StoredValuesClient):
    """Stores values too; while :attr:`hold` is set, ``batch_get_into`` waits for
    :attr:`release`, then answers :attr:`fail` for every key (a segment owner gone)."""

    def __init__(self) -> None:
        super().__init__({})
        self.hold = False
        self.fail = -800
        self.entered = threading.Event()
        self.release = threading.Event()

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(k in self.values) for k in keys]

    def _store(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self.values[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)

    batch_put_from = batch_upsert_from = _store

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if not self.hold:
            return super().batch_get_into(keys, ptrs, sizes)
        self.entered.set()
        self.release.wait(10)
        return [self.fail] * len(keys)


def _idle(store: kvpipe.MooncakeStore) -> bool:
    """Wait (blocking) until no vendor call of ``store`` runs."""
    calls = store._inflight._cond
    with calls:
        return calls.wait_for(lambda: store._inflight.running == 0, 10)


async def test_a_key_put_anew_while_a_read_given_up_on_runs_on_stays_trusted(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read given up on (its segment owner hangs) leaves its keys untrusted while its call
    runs on, and a put of them stores them anew (they are replaced) and makes them trusted.
    The old read failing afterwards says nothing about the value stored since: the keys
    stay trusted (they were distrusted again, so lookups stopped before fresh blocks until
    someone put them once more)."""
    client = HeldReadClient()
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    keys, values = ["held-a", "held-b"], [b"\x01" * 4096, b"\x02" * 4096]
    async with (
        kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store,
        ValueClient(store) as vc,
    ):
        assert await vc.put(keys, values) == [BlockStatus.OK] * 2
        client.hold = True
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(vc.get, keys, [4096, 4096])
                await anyio.to_thread.run_sync(client.entered.wait, 10)
                scope.cancel()  # the slice deadline: the vendor call runs on
        assert await vc.exists(keys) == [False, False]
        assert await vc.put(keys, values) == [BlockStatus.OK] * 2  # stored anew
        assert await vc.exists(keys) == [True, True]
        client.release.set()  # the old read now fails
        assert await anyio.to_thread.run_sync(_idle, store)
        assert await vc.exists(keys) == [True, True]
        assert store.statistics()["distrusted_keys"] == 0


class HungSetupClient(FakeClient):
    """``setup`` blocks until :attr:`go` is set (a metadata server that does not answer:
    the vendor's setup then takes about 90 s), then succeeds."""

    go = threading.Event()

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.closed_now = threading.Event()

    def setup(self, *args: object) -> int:
        self.started.set()
        self.go.wait(10)
        return 0

    def close(self) -> int:
        self.closed_now.set()
        return super().close()


@pytest.fixture
def hung_setups(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[HungSetupClient]]:
    """The vendor clients the stores create (each one's ``setup`` hangs until ``go``)."""
    clients: list[HungSetupClient] = []

    def load() -> HungSetupClient:
        clients.append(HungSetupClient())
        return clients[-1]

    HungSetupClient.go = threading.Event()
    monkeypatch.setattr(mc, "_load_client", load)
    yield clients
    HungSetupClient.go.set()


async def _give_up_on_a_call(store: kvpipe.MooncakeStore, ready: Callable[[], bool]) -> None:
    """Call ``exists`` and cancel it (the caller's deadline) once ``ready()``; the store
    opens on first use."""
    batch = KeyBatch(Scope("ns", VALUES_FINGERPRINT), "r", ["k1"], 0, as_tokens(np.zeros(0)))
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.exists, batch)
            await until(ready)
            await checkpoints(500)  # time to open (probe the master, set up a client)
            scope.cancel()


async def test_calls_given_up_on_during_a_hung_setup_start_no_more_setups(
    master: str, hung_setups: list[HungSetupClient]
) -> None:
    """A call given up on while the store opens leaves the vendor's setup running; the next
    calls wait for that one rather than each set up one more client (a thread, a client
    and, once it answers, a mounted segment for each call that gave up)."""
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    for _ in range(3):
        await _give_up_on_a_call(
            store, lambda: bool(hung_setups) and hung_setups[0].started.is_set()
        )
    assert len(hung_setups) == 1
    HungSetupClient.go.set()
    await store.open()  # the one setup answered: its client is the store's
    assert len(hung_setups) == 1
    await store.aclose()
    assert hung_setups[0].closed == 1


async def test_a_client_whose_setup_ends_after_close_is_closed(
    master: str, hung_setups: list[HungSetupClient]
) -> None:
    """A setup given up on that ends after ``aclose`` leaves no client open (its mounted
    segment would stay with the master for the process's lifetime)."""
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    await _give_up_on_a_call(store, lambda: bool(hung_setups) and hung_setups[0].started.is_set())
    await store.aclose()
    HungSetupClient.go.set()
    assert await anyio.to_thread.run_sync(hung_setups[0].closed_now.wait, 10)


class RaisingUnregisterClient(FakeClient):
    def __init__(self) -> None:
        super().__init__()
        self.unregistered: list[int] = []

    def unregister_buffer(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        if len(self.unregistered) == 1:
            raise RuntimeError("transfer engine: no such region")
        return -1


async def test_aclose_unregisters_every_buffer_and_closes_whatever_one_unregister_does(
    master: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vendor ``unregister_buffer`` that raised escaped ``aclose``: the other buffers
    stayed registered and the client (with its mounted segment) was never closed; one that
    returned an error code passed unnoticed."""
    clients: list[RaisingUnregisterClient] = []

    def load() -> RaisingUnregisterClient:
        clients.append(RaisingUnregisterClient())
        return clients[-1]

    monkeypatch.setattr(mc, "_load_client", load)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    first, second = np.zeros(4096, np.uint8), np.zeros(8192, np.uint8)
    await store.register_staging(first.data)
    await store.register_staging(second.data)
    with caplog.at_level("ERROR", logger="kvpipe.mooncake"):
        await store.aclose()
    (client,) = clients
    assert len(client.unregistered) == 2 and client.closed == 1
    assert "no such region" in caplog.text and "returned -1" in caplog.text


class RaisingScratchUnregisterClient(StoredValuesClient):
    """Stores values; its ``unregister_buffer`` raises (the region may still be registered)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        super().__init__(values)
        self.addresses: list[int] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        self.addresses.append(ptr)
        return super().register_buffer(ptr, size)

    def unregister_buffer(self, ptr: int) -> int:
        raise RuntimeError("transfer engine: region busy")


def test_put_scratch_whose_unregister_raised_is_never_freed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The scratch a put reads stored values into is kept alive where the vendor's
    ``unregister_buffer`` raised, as where it returned an error code: the region may still be
    registered with the transfer engine. It was freed as the exception unwound (and the put
    failed with that exception, though every stored value had been read and compared)."""
    kept: list[np.ndarray] = []
    monkeypatch.setattr(mc, "_KEPT", kept)
    size = 4096
    client = RaisingScratchUnregisterClient({"k0": b"\x00" * size, "k1": b"\x01" * size})
    views = [memoryview(b"\x00" * size), memoryview(b"\x07" * size)]
    with caplog.at_level("ERROR", logger="kvpipe.mooncake"):
        lines = mc._Lines(mc.LogLimiter(mc.log), "10.0.0.1:50051")
        got = mc._read_and_compare(lines, client, ["k0", "k1"], [0, 1], size, views)
    assert got == [(0, 0), (1, mc._DIFFERENT)]
    assert [int(a.ctypes.data) for a in kept] == client.addresses
    assert "region busy" in caplog.text


class FailingCloseClient(FakeClient):
    """``close`` answers an error code."""

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def close(self) -> int:
        super().close()
        return -1


async def test_a_close_that_returns_an_error_code_is_a_backend_error(
    master: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The vendor ``close`` answers an int; an error code (the segment may still be mounted
    with the master) passed as success, while one that raised was a ``BackendError``."""
    clients: list[FailingCloseClient] = []

    def load() -> FailingCloseClient:
        clients.append(FailingCloseClient())
        return clients[-1]

    monkeypatch.setattr(mc, "_load_client", load)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    await store.open()
    with pytest.raises(kvpipe.BackendError, match=r"close: returned -1"):
        await store.aclose()
    assert [c.closed for c in clients] == [1] and store.closed


class RaisingCloseAfterHungSetup(HungSetupClient):
    def close(self) -> int:
        super().close()
        raise RuntimeError("master gone")


async def test_closing_a_client_set_up_but_never_taken_raises_backend_errors(
    master: str, monkeypatch: pytest.MonkeyPatch, hung_setups: list[HungSetupClient]
) -> None:
    """``aclose`` closes a client whose setup succeeded after its caller gave up (never taken
    by an ``open``); the vendor ``close`` raising there escaped as the vendor's own
    exception, not a ``BackendError``."""
    clients: list[HungSetupClient] = []

    def load() -> HungSetupClient:
        clients.append(RaisingCloseAfterHungSetup())
        return clients[-1]

    monkeypatch.setattr(mc, "_load_client", load)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    await _give_up_on_a_call(store, lambda: bool(clients) and clients[0].started.is_set())
    HungSetupClient.go.set()
    setup = store._setup
    assert setup is not None
    await until(lambda: setup.result == 0)
    with pytest.raises(kvpipe.BackendError, match="master gone"):
        await store.aclose()
    assert clients[0].closed == 1


def test_a_read_answer_of_a_value_s_size_is_counted_under_one_name() -> None:
    """A read answered with a value's byte count (a value of another size than asked) was
    counted as get_code_<bytes>: one statistic, and so one Prometheus label value, per size
    met. Error codes keep their own names (a short, fixed set)."""
    from kvpipe.backends.mooncake import _code_name

    assert _code_name("get", 4096) == _code_name("get", 123) == "get_other_size"
    assert _code_name("get", -704) == "get_code_-704"
    assert _code_name("put_read", 64) == "put_read_other_size"


class MasterGoingDownClient(StoredValuesClient):
    """A master that goes down mid-put, every put: the lookup after the put raises
    (``"visible"``), or the upsert after ``batch_put_from`` published values
    (``"upsert"``)."""

    def __init__(self, fails: str) -> None:
        super().__init__({"stored": b"\x01" * 64})
        self.fails = fails
        self.lookups = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.lookups += 1
        if self.lookups % 2:  # a put's first lookup: nothing of this put published yet
            self.published: set[str] = set()
        elif self.fails == "visible":
            raise RuntimeError("master unreachable")
        return [1 if k in self.values or k in self.published else 0 for k in keys]

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        self.published.update(keys)
        return [0] * len(keys)

    def batch_upsert_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if self.fails == "upsert":
            raise RuntimeError("master unreachable")
        return [0] * len(keys)


@pytest.mark.parametrize("fails", ["visible", "upsert"])
def test_a_master_going_down_on_every_put_logs_a_bounded_number_of_errors(
    fails: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A master that fails every put after values were published ('batch_upsert_from
    raised after values were published', 'batch_is_exist after a put raised') logged one
    ERROR per put call, i.e. per slice of every write. The first of each kind shows, the
    rest at DEBUG until the interval passes; each call still answers honestly."""
    client = MasterGoingDownClient(fails)
    value = np.zeros(64, np.uint8)
    views = [memoryview(value), memoryview(value)]
    addresses = [int(value.ctypes.data)] * 2
    n = 20
    lines = mc._Lines(mc.LogLimiter(mc.log), "10.0.0.1:50051")  # one store's
    with caplog.at_level("DEBUG", logger="kvpipe.mooncake"):
        for _ in range(n):
            got = mc._put_from_staging(
                lines, client, frozenset(), ["fresh", "stored"], addresses, 64, views
            )
            assert got[0] == (0, "put")
    loud = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(loud) == 1 and "master unreachable" in loud[0], loud
    assert sum("master unreachable" in r.getMessage() for r in caplog.records) == n


async def test_one_masters_errors_do_not_hide_another_masters_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two stores over two masters in one process, both going down on every put: the
    stores shared one log limiter, so the first's repeated ERRORs hid the second's first at
    DEBUG, and a line did not say which store it was about. Each store's lines are bounded
    on their own and name its master."""
    stores = [
        kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata", client=client)
        for master, client in (
            ("10.0.0.1:50051", MasterGoingDownClient("visible")),
            ("10.0.0.2:50051", MasterGoingDownClient("visible")),
        )
    ]
    pool = StagingPool(64, 2)
    lease = pool.try_acquire(2)
    assert lease is not None

    async def put(store: kvpipe.MooncakeStore, runner: ThreadRunner) -> None:
        batch = PutBatch(
            Scope("ns", VALUES_FINGERPRINT),
            "r",
            ["fresh", "stored"],
            0,
            as_tokens(np.zeros(0, np.int64)),
            lease=lease,
            value_nbytes=64,
            runner=runner,
            limiter=None,
        )
        assert (await store.put_blocks(batch))[0] is BlockStatus.OK

    try:
        async with ThreadRunner() as runner:
            with caplog.at_level("DEBUG", logger="kvpipe.mooncake"):
                for _ in range(5):
                    await put(stores[0], runner)
                await put(stores[1], runner)
                await put(stores[0], runner)
    finally:
        lease.release()
        for store in stores:
            await store.aclose()
    loud = [r.getMessage() for r in caplog.records if r.levelno >= 30]
    assert len(loud) == 2, loud  # each store's first
    assert "10.0.0.1:50051" in loud[0] and "10.0.0.2:50051" in loud[1], loud
    assert all("master unreachable" in m for m in loud), loud


@pytest.mark.parametrize("own", [True, False])
async def test_staging_aclose_could_not_unregister_is_kept_by_its_owner(
    master: str, monkeypatch: pytest.MonkeyPatch, own: bool
) -> None:
    """A store closed before the owner of its staging (a pipeline, a ``ValueClient``) whose
    ``unregister_buffer`` at close failed left the buffer registered, yet answered the owner's
    later ``unregister_staging`` with success (it had forgotten the buffer): the owner freed
    memory the transfer engine may still write into (a client passed in is not closed)."""
    from kvpipe.backends._registration import KEPT, Registrations

    client = FakeClient()  # unregister_buffer answers -1: still registered
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    store = kvpipe.MooncakeStore(
        master, "http://127.0.0.1:1/metadata", client=None if own else client
    )
    owner = Registrations(store)
    staging = np.zeros(4096, np.uint8)
    await owner.add(staging.data)
    await store.aclose()
    kept = len(KEPT)
    try:
        await owner.aclose(anyio.current_time() + 10)
        assert owner.kept and len(KEPT) == kept + 1, "freed while still registered"
    finally:
        del KEPT[kept:]


class FailingCloseAfterHungSetup(HungSetupClient):
    def close(self) -> int:
        super().close()
        return -1


async def test_a_late_setup_s_close_that_answers_an_error_code_is_logged(
    master: str,
    monkeypatch: pytest.MonkeyPatch,
    hung_setups: list[HungSetupClient],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client whose setup ends after ``aclose`` is closed in the setup's thread; a vendor
    ``close`` that raised there was logged, one that answered an error code (its segment
    may still be mounted with the master) passed without a word."""
    clients: list[HungSetupClient] = []

    def load() -> HungSetupClient:
        clients.append(FailingCloseAfterHungSetup())
        return clients[-1]

    monkeypatch.setattr(mc, "_load_client", load)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    await _give_up_on_a_call(store, lambda: bool(clients) and clients[0].started.is_set())
    setup = store._setup
    assert setup is not None
    await store.aclose()
    with caplog.at_level("ERROR", logger="kvpipe.mooncake"):
        HungSetupClient.go.set()
        with anyio.fail_after(10):
            await setup.done.wait()  # set once the thread has closed the client
    assert clients[0].closed == 1
    assert "returned -1" in caplog.text


class SlowUnregisterClient(SlowRegisterClient):
    """register_buffer registers at once; unregister_buffer completes only when ``go`` is set,
    the first one answering ``first_answer`` (``-1``: still registered)."""

    def __init__(self, first_answer: int) -> None:
        super().__init__()
        self.first_answer = first_answer
        self.unregistering = threading.Event()

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.add(ptr)
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self.unregistering.set()
        self.go.wait(10)
        answer, self.first_answer = self.first_answer, 0
        return answer if answer != 0 else super().unregister_buffer(ptr)


@pytest.mark.parametrize("answer", [0, -1], ids=["unregister works", "unregister fails"])
async def test_a_registration_waits_for_an_unregister_of_its_buffer_still_running(
    master: str, monkeypatch: pytest.MonkeyPatch, answer: int
) -> None:
    """A register_staging of a buffer whose last owner's unregister_staging was still running
    started its own vendor call beside that one: the buffer could end unregistered under the
    new owner (the unregister taking effect last), or, where that unregister failed, counted
    twice, so the new owner's unregister answered success with the buffer still registered.
    It waits for the unregister, and registers anew only where that took effect."""
    client = SlowUnregisterClient(answer)
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    async with kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata") as store:
        staging = np.zeros(4096, np.uint8)
        ptr = staging.ctypes.data
        running: list[str] = []  # vendor calls for the buffer the store awaits now
        overlaps: list[list[str]] = []
        call = store._call

        async def tracked(fn: Callable[..., object], *args: object) -> object:
            mine = args[:1] == (ptr,)
            if mine:
                if running:
                    overlaps.append([*running, fn.__name__])
                running.append(fn.__name__)
            try:
                return await call(fn, *args)
            finally:
                if mine:
                    running.remove(fn.__name__)

        monkeypatch.setattr(store, "_call", tracked)
        await store.register_staging(staging.data)  # the first owner's

        async def unregister_first() -> None:
            if answer == 0:
                await store.unregister_staging(staging.data)
            else:
                with pytest.raises(kvpipe.BackendError, match="unregister_buffer"):
                    await store.unregister_staging(staging.data)

        async with anyio.create_task_group() as tg:
            tg.start_soon(unregister_first)
            await anyio.to_thread.run_sync(client.unregistering.wait, 10)
            tg.start_soon(store.register_staging, staging.data)  # the second owner's
            try:
                await checkpoints()
                assert overlaps == [], "vendor calls for one buffer ran at once"
            finally:
                client.go.set()
        assert client.registered == {ptr}, "the second owner's buffer is not registered"
        await store.unregister_staging(staging.data)  # the second owner's, at its close
        assert client.registered == set(), "answered success, still registered"


@pytest.mark.parametrize("where", ["before the store opened", "before its vendor call began"])
async def test_a_cancelled_registration_is_an_owner_until_its_caller_unregisters_it(
    master: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A register_staging cancelled before the store opened, or before its vendor call began,
    was not counted; yet its caller counts it registered (the call may have completed) and
    unregisters it at close: that took another owner's count, and the buffer was
    unregistered under the owner still using it."""
    from kvpipe.backends._registration import Registrations

    client = SlowRegisterClient()
    client.go.set()  # registrations complete at once
    monkeypatch.setattr(mc, "_load_client", lambda: client)
    store = kvpipe.MooncakeStore(master, "http://127.0.0.1:1/metadata")
    if where == "before its vendor call began":
        await store.open()
    try:
        staging = np.zeros(4096, np.uint8)
        first, second = Registrations(store), Registrations(store)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await first.add(staging.data)
        assert scope.cancelled_caught and not client.started.is_set()
        await second.add(staging.data)
        assert client.registered == {staging.ctypes.data}
        await first.aclose(anyio.current_time() + 10)
        assert not first.kept
        assert client.registered == {staging.ctypes.data}, "unregistered under its owner"
        await second.aclose(anyio.current_time() + 10)
        assert not second.kept and client.registered == set()
    finally:
        await store.aclose()
