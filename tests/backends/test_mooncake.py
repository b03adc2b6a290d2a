"""MooncakeStore against a real Mooncake master on loopback: the shared conformance suite."""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe.backends import BlockStatus, StorageBackend
from kvpipe.backends._values import ValueClient
from kvpipe.backends.mooncake_local import LocalMooncake
from kvpipe.testing import BackendConformance
from tests.backends.mooncake_fixtures import (  # noqa: F401
    make_client,
    mooncake,
    mooncake_client,
    remove_every_key,
)
from tests.cuda.devcache import device_rows, fake_device_cache, fill_device, free_device_cache
from tests.cuda.fake_driver import FakeDriver
from tests.helpers import LAYOUTS, ends_with_host_threads_busy


class TestMooncakeConformance(BackendConformance):
    """The whole suite."""

    @pytest.fixture
    async def backend(
        self,
        mooncake: LocalMooncake,  # noqa: F811
        mooncake_client: Any,  # noqa: F811
    ) -> AsyncIterator[StorageBackend]:
        remove_every_key(mooncake_client)
        async with kvpipe.MooncakeStore(
            mooncake.master_address,
            mooncake.metadata_url,
            client=mooncake_client,
        ) as store:
            yield store


class Recording:
    """A vendor client whose calls are named in :attr:`calls` as they are made."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.client, name)
        if not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return attr(*args)

        call.__name__ = name
        return call


@asynccontextmanager
async def _values(
    server: LocalMooncake, client: Any
) -> AsyncIterator[tuple[kvpipe.MooncakeStore, ValueClient]]:
    """A store over ``client`` (a vendor client, or a wrapper of one) and a value client on it."""
    async with (
        kvpipe.MooncakeStore(server.master_address, server.metadata_url, client=client) as store,
        ValueClient(store) as vc,
    ):
        yield store, vc


async def test_a_re_put_of_the_stored_bytes_leaves_the_value_alone(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """The vendor's upsert of a stored key hides it while it runs and may remove it when it
    fails, so a put of the bytes a key already holds (every re-put of a content-derived key)
    writes nothing; only a different value is written over the stored one."""
    remove_every_key(mooncake_client)
    client = Recording(mooncake_client)
    keys, values = ["mc-same-a", "mc-same-b"], [b"\x01" * 4096, b"\x02" * 4096]
    async with _values(mooncake, client) as (store, vc):
        assert await vc.put(keys, values) == [BlockStatus.OK] * 2
        client.calls.clear()
        assert await vc.put(keys, values) == [BlockStatus.OK] * 2
        assert not {"batch_upsert_from", "batch_put_from"} & set(client.calls), client.calls
        assert store.statistics()["blocks_unchanged"] == 2
        client.calls.clear()
        assert await vc.put(keys[:1], [b"\x03" * 4096]) == [BlockStatus.OK]
        assert client.calls.count("batch_upsert_from") == 1
        assert store.statistics()["blocks_replaced"] == 1
        got = await vc.get(keys, [4096, 4096])
        assert got == [(BlockStatus.OK, b"\x03" * 4096), (BlockStatus.OK, values[1])]


async def test_a_key_that_failed_to_read_is_replaced_by_a_put_of_any_size(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """A put of a stored key with a value of another size is refused (the vendor's upsert
    could drop the stored value), but not for a key this store distrusts: it failed to read,
    is not trusted by ``exists``, and a put must be able to store it anew."""
    remove_every_key(mooncake_client)
    async with _values(mooncake, mooncake_client) as (_, vc):
        assert await vc.put(["odd"], [b"\x01" * 8192]) == [BlockStatus.OK]
        assert await vc.put(["odd"], [b"\x02" * 4096]) == [BlockStatus.FAILED]
        ((status, _),) = await vc.get(["odd"], [4096])  # a read of the wrong size fails
        assert status is BlockStatus.FAILED
        assert await vc.exists(["odd"]) == [False]
        assert await vc.put(["odd"], [b"\x02" * 4096]) == [BlockStatus.OK]
        assert await vc.exists(["odd"]) == [True]
        assert await vc.get(["odd"], [4096]) == [(BlockStatus.OK, b"\x02" * 4096)]


class RacingWriter:
    """A vendor client whose ``batch_put_from`` of ``raced`` first has another node
    (``other``, a client of its own) begin a put of it that stays unfinished until the test
    ends it (:meth:`end`): ``batch_put_session_start``, the first step of the vendor's put
    (the master reserves the object) without its transfer and last step. The master holds
    the object as while another node's put is midway: a read answers ``-703`` (not ready).
    (A real put of a large value raced here before, and ended first on a loaded machine.)
    """

    def __init__(self, client: Any, other: Any, raced: str, size: int) -> None:
        self.client = client
        self.other = other
        self.raced = raced
        self.size = size
        self.begun = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def batch_put_from(self, keys: list[str], *args: Any) -> Any:
        if self.raced in keys and not self.begun:
            started = self.other.batch_put_session_start([self.raced], [self.size])
            assert list(started) == [0], started
            self.begun = True
            probe = np.zeros(1, np.uint8)
            got = self.client.batch_get_into([self.raced], [probe.ctypes.data], [1])
            assert got == [-703], got  # REPLICA_IS_NOT_READY: begun, not ended
        return self.client.batch_put_from(keys, *args)

    def end(self) -> None:
        """The other node's put ends (blocking)."""
        if self.begun:
            ended = self.other.batch_put_session_end([self.raced])
            assert list(ended) == [0], ended


async def test_a_key_another_node_is_still_putting_is_not_reported_stored(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """Two nodes write the same prefix at once (content-derived keys). The vendor's put of a
    key whose put by another node has begun but not ended answers 0 (its "already exists"
    counts as success), though the key can be neither found nor read until that put ends,
    and never if it fails. Such a block is not reported ``OK``; the others of the batch are;
    and the other node's put, once ended, stores the key."""
    remove_every_key(mooncake_client)
    other = await anyio.to_thread.run_sync(make_client, mooncake, 0)
    client = RacingWriter(mooncake_client, other, "raced", 4096)
    try:
        async with _values(mooncake, client) as (store, vc):
            got = await vc.put(["alone", "raced"], [b"\x01" * 4096, b"\x02" * 4096])
            assert client.begun, "the store put no batch with the raced key"
            found = mooncake_client.batch_is_exist(["alone", "raced"])
            assert found == [1, 0], found
            assert got == [BlockStatus.OK, BlockStatus.FAILED], got
            assert store.statistics()["put_not_visible"] == 1
    finally:
        try:
            await anyio.to_thread.run_sync(client.end)
        finally:
            await anyio.to_thread.run_sync(other.close)
    assert mooncake_client.batch_is_exist(["raced"]) == [1]  # the other node's, once ended


class HeldReads:
    """A vendor client whose ``batch_get_into`` waits for :attr:`release` before it reads,
    and then answers :attr:`fail` for every key instead where set."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()
        self.fail: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def batch_get_into(self, *args: Any) -> Any:
        self.entered.set()
        self.release.wait(30)
        try:
            return [self.fail] * len(args[0]) if self.fail else self.client.batch_get_into(*args)
        finally:
            self.returned.set()


async def test_a_read_given_up_on_whose_call_then_reads_the_blocks_leaves_them_trusted(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """A read is given up on for many reasons besides a segment owner that hangs: the caller
    cancels, or an earlier slice of the read stopped short and the later ones are cancelled.
    Its keys are not trusted by ``exists`` while its vendor call runs on; once that call has
    read them, they are trusted again (they stayed distrusted until this store put them
    anew, so a node that only reads lost those prefix hits for good)."""
    remove_every_key(mooncake_client)
    client = HeldReads(mooncake_client)
    keys, values = ["held-a", "held-b"], [b"\x01" * 4096, b"\x02" * 4096]
    async with _values(mooncake, client) as (store, vc):
        assert await vc.put(keys, values) == [BlockStatus.OK] * 2

        async def give_up_on_a_read() -> None:
            for event in (client.entered, client.release, client.returned):
                event.clear()
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(vc.get, keys, [4096, 4096])
                    await anyio.to_thread.run_sync(client.entered.wait, 10)
                    scope.cancel()
            assert await vc.exists(keys) == [False, False]  # its call runs on: not trusted
            client.release.set()

            def idle() -> bool:  # no vendor call of the store runs
                calls = store._inflight._cond
                with calls:
                    return calls.wait_for(lambda: store._inflight.running == 0, 10)

            assert await anyio.to_thread.run_sync(idle) and client.returned.is_set()

        await give_up_on_a_read()
        assert await vc.exists(keys) == [True, True]
        assert store.statistics()["distrusted_keys"] == 0
        assert await vc.get(keys, [4096, 4096]) == [(BlockStatus.OK, v) for v in values]
        client.fail = -800  # the call then fails (a segment owner gone): they stay distrusted
        await give_up_on_a_read()
        assert await vc.exists(keys) == [False, False]
        assert store.statistics()["distrusted_keys"] == 2


async def test_unreachable_master_is_a_backend_error() -> None:
    from kvpipe.backends.mooncake_local import free_port

    port = free_port()
    store = kvpipe.MooncakeStore(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata")
    with pytest.raises(kvpipe.BackendError, match="unreachable"):
        await store.open()


async def test_node_registry_repairs_itself_at_the_next_flush(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """Mooncake has no compare-and-set: the node list can be overwritten by another node that
    read it before this one registered, and a restarted master loses it. Each flush reads it
    and puts its node back, so such a loss lasts until that node's next flush, no longer."""
    from kvpipe.backends._mooncake_index import NODES_KEY

    remove_every_key(mooncake_client)
    now = 1.0
    async with kvpipe.MooncakeStore(
        mooncake.master_address, mooncake.metadata_url, client=mooncake_client
    ) as store:

        async def nodes_of(key: str) -> set[str]:
            (records,) = await store.get_residency([key])
            return {e.node_id for e in records}

        for node in ("node-a", "node-b"):
            entry = kvpipe.ResidencyEntry("blk-1", node, kvpipe.Residency.CPU, now)
            await store.put_residency([entry])
        assert await nodes_of("blk-1") == {"node-a", "node-b"}
        # node-b's stale read-modify-write lands after node-a registered: node-a is lost.
        assert mooncake_client.upsert(NODES_KEY, b"node-b") == 0
        assert await nodes_of("blk-1") == {"node-b"}
        entry = kvpipe.ResidencyEntry("blk-2", "node-a", kvpipe.Residency.GPU, now)
        await store.put_residency([entry])
        assert await nodes_of("blk-1") == {"node-a", "node-b"}
        assert await nodes_of("blk-2") == {"node-a"}
        # A restarted master has no list at all (every key is lost with it; here only the
        # list): the next flush of each node brings it back.
        assert mooncake_client.remove(NODES_KEY, True) == 0
        assert await nodes_of("blk-1") == set()
        entry = kvpipe.ResidencyEntry("blk-3", "node-b", kvpipe.Residency.EVICTED, now)
        await store.put_residency([entry])
        assert await nodes_of("blk-1") == {"node-b"}
        assert await nodes_of("blk-3") == {"node-b"}


async def test_a_key_asked_twice_in_one_locate_reads_its_records(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """The vendor's ``get_batch`` of a name asked twice fills only its last answer; the
    others hold whatever its transfer buffer held before (here: not JSON, a BackendError;
    a stale record of the same length would be returned as current)."""
    remove_every_key(mooncake_client)
    async with kvpipe.MooncakeStore(
        mooncake.master_address, mooncake.metadata_url, client=mooncake_client
    ) as store:
        await store.put_residency([kvpipe.ResidencyEntry("blk", "a", kvpipe.Residency.CPU, 1.0)])
        assert len((await store.get_residency(["blk"]))[0]) == 1
        await store.put_residency([kvpipe.ResidencyEntry("blk", "a", kvpipe.Residency.CPU, 2.0)])
        got = await store.get_residency(["blk", "other", "blk"])
        want = (kvpipe.ResidencyEntry("blk", "a", kvpipe.Residency.CPU, 2.0),)
        assert list(got) == [want, (), want]


async def test_a_record_given_twice_in_one_flush_keeps_the_last(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """``put_residency`` replaces a node's record for a key, in order, as the other stores
    do; the vendor's ``upsert_batch`` of a name given twice keeps the first value."""
    remove_every_key(mooncake_client)
    async with kvpipe.MooncakeStore(
        mooncake.master_address, mooncake.metadata_url, client=mooncake_client
    ) as store:
        first = kvpipe.ResidencyEntry("blk", "a", kvpipe.Residency.GPU, 1.0)
        last = kvpipe.ResidencyEntry("blk", "a", kvpipe.Residency.EVICTED, 2.0)
        await store.put_residency([first, last])
        assert list(await store.get_residency(["blk"])) == [(last,)]


class HeldRecordWrites:
    """A vendor client whose ``upsert_batch`` of residency records stops midway, in the
    master state the vendor's own upsert of a stored key is in until it ends: the names
    stored but not readable (``batch_is_exist`` 0, ``get_batch`` ``b""``). It drops them and
    reserves them anew (``batch_put_session_start``, as an upsert of another size does),
    hands the test an event in :attr:`held` and waits for it, then revokes the reservation
    and makes the real call. Other calls pass through."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.held: queue.Queue[threading.Event | None] = queue.Queue()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def upsert_batch(self, keys: list[str], values: list[bytes]) -> int:
        from kvpipe.backends._mooncake_index import NODES_KEY

        if NODES_KEY not in keys:
            self.client.batch_remove(keys, True)
            assert list(self.client.batch_put_session_start(keys, [len(v) for v in values])) == [
                0
            ] * len(keys)
            release = threading.Event()
            self.held.put(release)
            assert release.wait(30), "the test never released the held write"
            self.client.batch_put_session_revoke(keys)
        rc: int = self.client.upsert_batch(keys, values)
        return rc


async def test_a_record_being_rewritten_is_still_located(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """A flush rewrites its node's records with the vendor's upsert, which leaves a stored
    name unreadable until it ends: a ``locate`` meanwhile found no record of the block (and
    stopped there), though the node held it before the flush and after. Every moment of a
    flush shows the record, the old or the new one."""
    remove_every_key(mooncake_client)
    held = HeldRecordWrites(mooncake_client)
    old = kvpipe.ResidencyEntry("blk-rewritten", "node-a", kvpipe.Residency.GPU, 1.0)
    new = kvpipe.ResidencyEntry("blk-rewritten", "node-a", kvpipe.Residency.EVICTED, 2.0)
    address = (mooncake.master_address, mooncake.metadata_url)
    async with (
        kvpipe.MooncakeStore(*address, client=mooncake_client) as reader,
        kvpipe.MooncakeStore(*address, client=held) as writer,
    ):
        await reader.put_residency([old])
        seen: list[Any] = []

        async def flush() -> None:
            try:
                await writer.put_residency([new])
            finally:
                held.held.put(None)

        async with anyio.create_task_group() as tg:
            tg.start_soon(flush)
            while (release := await anyio.to_thread.run_sync(held.held.get, True, 30)) is not None:
                seen.append(tuple((await reader.get_residency(["blk-rewritten"]))[0]))
                release.set()
        assert seen, "no record write was held"
        assert all(got in ((old,), (new,)) for got in seen), seen
        assert list(await reader.get_residency(["blk-rewritten"])) == [(new,)]


async def test_two_nodes_flushing_one_block_at_once_keep_both_records(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """Each node's record of a block has names of its own, never a list the nodes share: a
    node flushing a block while another node's flush of it is midway loses neither record
    (a read-modify-write of one shared record would drop one of them)."""
    remove_every_key(mooncake_client)
    held = HeldRecordWrites(mooncake_client)
    a = kvpipe.ResidencyEntry("blk-both", "node-a", kvpipe.Residency.GPU, 1.0)
    b = kvpipe.ResidencyEntry("blk-both", "node-b", kvpipe.Residency.CPU, 1.0)
    address = (mooncake.master_address, mooncake.metadata_url)
    async with (
        kvpipe.MooncakeStore(*address, client=mooncake_client) as node_b,
        kvpipe.MooncakeStore(*address, client=held) as node_a,
    ):
        await node_b.put_residency([dataclasses.replace(e, updated_at=0.5) for e in (a, b)])

        async def flush() -> None:
            try:
                await node_a.put_residency([a])
            finally:
                held.held.put(None)

        async with anyio.create_task_group() as tg:
            tg.start_soon(flush)
            while (release := await anyio.to_thread.run_sync(held.held.get, True, 30)) is not None:
                await node_b.put_residency([b])
                release.set()
        assert list(await node_b.get_residency(["blk-both"])) == [(a, b)]


class StuckCloseClient:
    """A vendor-client stand-in whose ``close`` does not return until released (as the real
    one can wait on a master that is gone)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.closing = threading.Event()
        self.closed = threading.Event()  # close returned
        self.unregistered: list[int] = []

    def setup(self, *args: object) -> int:
        return 0

    def register_buffer(self, ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def close(self) -> int:
        self.closing.set()
        self.release.wait(30)
        self.closed.set()
        return 0  # the vendor's close answers an int


async def test_close_is_bounded_when_the_vendor_close_hangs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``aclose`` is shielded, so an unbounded vendor ``close`` would hang the caller for good;
    it gives up after ``setup_timeout`` seconds, says so, and leaves the close to its thread.

    No real deadline is raced but the one checked: the store opens under a 30 s
    ``setup_timeout`` (0.3 s also bounded the probe of the master and the setup thread, which
    a loaded machine need not run in time) and closes under 0.3 s; the vendor close is held
    until the test releases it, so ``aclose`` returning with it still held is the bound (not
    a measured time)."""
    import anyio
    import numpy as np

    from kvpipe.backends import mooncake as mc

    fake = StuckCloseClient()
    monkeypatch.setattr(mc, "_load_client", lambda: fake)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    try:
        store = kvpipe.MooncakeStore(
            f"127.0.0.1:{port}", "http://127.0.0.1:1/metadata", setup_timeout=30.0
        )
        await store.open()
        staging = np.zeros(4096, np.uint8)
        await store.register_staging(staging.data)
        store.setup_timeout = 0.3  # aclose's waits
        with caplog.at_level("ERROR", logger="kvpipe.mooncake"):
            await store.aclose()
        assert not fake.closed.is_set(), "aclose waited for the stuck vendor close"
        assert any("left to finish" in r.getMessage() for r in caplog.records)
        # its thread may start only now, on a loaded machine: unregistering, then closing
        assert await anyio.to_thread.run_sync(fake.closing.wait, 30)
        assert fake.unregistered == [staging.ctypes.data]
        await store.aclose()  # idempotent: nothing left to close
    finally:
        fake.release.set()
        await listener.aclose()


async def test_a_close_cancelled_by_asyncio_still_closes_the_client_then_is_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """anyio's shield does not keep out asyncio's own cancellation (``Task.cancel``: a
    timeout around the close, a shutdown): a close waiting for a vendor call given up on
    returned at once, the store refusing calls but its staging never unregistered and its
    client never closed (not by a later close either). It waits on, unregisters and closes,
    then is cancelled."""
    import asyncio

    import numpy as np

    from kvpipe.backends import mooncake as mc

    fake = StuckCloseClient()
    fake.release.set()
    monkeypatch.setattr(mc, "_load_client", lambda: fake)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    gate, started = threading.Event(), threading.Event()

    def busy() -> None:
        started.set()
        gate.wait(30)

    try:
        store = kvpipe.MooncakeStore(f"127.0.0.1:{port}", "http://127.0.0.1:1/metadata")
        await store.open()
        staging = np.zeros(4096, np.uint8)
        await store.register_staging(staging.data)
        # a vendor call whose caller gave up, still running in its thread
        threading.Thread(target=store._inflight.track(busy), daemon=True).start()
        await anyio.to_thread.run_sync(started.wait, 10)
        task = asyncio.ensure_future(store.aclose())
        try:
            await anyio.sleep(0.01)  # closing is waiting for it
            task.cancel("shutting down")
            await anyio.sleep(0.01)
            assert not task.done()  # still waiting for the vendor call
        finally:
            gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()  # the cancellation is not swallowed
        assert store.closed
        assert fake.unregistered == [staging.ctypes.data] and fake.closing.is_set()
    finally:
        gate.set()
        await listener.aclose()


async def test_close_takes_none_of_the_event_loop_librarys_shared_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server may have every shared worker thread busy (blocking endpoints): closing the
    store still ends."""
    import anyio

    from kvpipe.backends import mooncake as mc

    fake = StuckCloseClient()
    fake.release.set()
    monkeypatch.setattr(mc, "_load_client", lambda: fake)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    store = kvpipe.MooncakeStore(f"127.0.0.1:{port}", "http://127.0.0.1:1/metadata")
    try:
        await store.open()
        ended = await ends_with_host_threads_busy(store.aclose)
        assert ended and fake.closing.is_set(), "closing waited for one of the host's threads"
    finally:
        await listener.aclose()


async def test_a_device_cache_round_trips_through_mooncake(
    mooncake: LocalMooncake,  # noqa: F811
    mooncake_client: Any,  # noqa: F811
) -> None:
    """A device cache (the CUDA driver's test double, whose pinned staging is real host
    memory) written to a real Mooncake Store and read back into other blocks: the store
    registers the engine's pinned staging and moves values from and into it, the partial
    last block included; both pipelines unregister it at close."""

    remove_every_key(mooncake_client)
    fake = FakeDriver()
    fake.open(0)
    fake.make_current()
    producer = fake.stream_create()
    layout = LAYOUTS["gqa"]()
    src = fake_device_cache(fake, layout, 8)
    rows = fill_device(fake, src, seed=21)
    tokens = np.arange(7 * layout.block_size + 3)  # 7 full blocks and a partial one
    config = kvpipe.PipelineConfig(slice_block_num=3, staging_bytes=1 << 20)
    async with kvpipe.MooncakeStore(
        mooncake.master_address, mooncake.metadata_url, client=mooncake_client
    ) as store:
        async with kvpipe.open_pipeline(src, store, config=config, device_driver=fake) as pipe:
            w = await pipe.write(tokens, range(8), include_partial=True, stream=producer)
            assert w.complete and w.written == 8
            assert store._registered  # the engine's pinned staging
        async with kvpipe.open_pipeline(src, store, config=config, device_driver=fake) as pipe:
            assert await pipe.lookup(tokens, include_partial=True) == 8
            order = [7, 6, 5, 4, 3, 2, 1, 0]
            fill_device(fake, src, seed=22)  # overwritten: only the read can restore it
            r = await pipe.read(
                tokens, order, include_partial=True, require_all=True, stream=producer
            )
            assert r.complete and r.loaded == 8
        assert not store._registered  # both pipelines unregistered their staging
    for want, have in zip(rows, device_rows(fake, src), strict=True):
        assert (have[order] == want).all()
    fake.run_until_idle()
    free_device_cache(fake, src)
    fake.stream_destroy(producer)
    fake.close()
    assert fake.violations == []
