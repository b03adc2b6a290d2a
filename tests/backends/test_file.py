"""FileStore: the shared conformance suite, durability settings, capacity and eviction."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
import stat
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import kvpipe
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, StorageBackend
from kvpipe.backends.file import store as store_mod
from kvpipe.backends.file._catalog import Catalog
from kvpipe.testing import BackendConformance
from kvpipe.testing.batches import Batches, random_values
from tests.backends.test_file_capacity import _check_accounting
from tests.backends.test_file_hostile import (
    VALUE,
    batches,
    block_file,
    get_raw,
    make_values,
    put_chain,
)
from tests.backends.test_file_native import no_free_fds
from tests.helpers import ends_with_host_threads_busy

pytestmark = pytest.mark.usefixtures("file_io")


class TestFileStoreConformance(BackendConformance):
    @pytest.fixture(params=["none", "data", "full"])
    async def backend(
        self, tmp_path: Path, request: pytest.FixtureRequest
    ) -> AsyncIterator[StorageBackend]:
        async with kvpipe.FileStore(tmp_path / "store", durability=request.param) as store:
            yield store


async def test_a_batch_ends_only_once_every_store_thread_has_let_go_of_its_staging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch is shared among the store's threads; where one share fails, the batch still
    returns (with that share's error) only once the others are done with the staging."""
    pool = StagingPool(4096 + 64, 4)
    finished = threading.Event()
    async with ThreadRunner() as runner, kvpipe.FileStore(tmp_path / "store", threads=2) as store:
        b = Batches(pool, runner)
        keys, _ = b.keys(4)
        assert (
            await b.put(store, keys, random_values(4, pool.slot_nbytes, 1)) == [BlockStatus.OK] * 4
        )

        def read(
            hooks: object, root: object, keys: object, bufs: object, fp: object, part: list[int]
        ) -> list[BlockStatus]:
            if 0 in part:
                raise MemoryError("the first share fails at once")
            finished.wait(0.2)  # the second is still reading into its staging meanwhile
            finished.set()
            return [BlockStatus.OK] * len(part)

        monkeypatch.setattr(store, "_read", read)
        monkeypatch.setattr(store, "_read_to_sink", read)
        with pytest.raises(MemoryError):
            await b.get(store, keys)
        assert finished.is_set(), "the batch returned while a share was still reading"


async def test_a_share_whose_thread_cannot_be_started_is_done_within_its_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's thread for a share of a batch cannot be started (the system's thread
    limit): the share must still be done, or not at all, before the call ends. The thread
    pool had queued it before the start failed; it ran at the next call that got a thread,
    writing the first put's block from staging that the second put had refilled: the first
    key published (and read back ``OK``) with another key's bytes."""
    root = tmp_path / "store"
    pool = StagingPool(VALUE, 2)  # the second put gets the slots of the first
    start = threading.Thread.start

    def no_first_thread(thread: threading.Thread) -> None:
        if thread.name == "kvpipe-file_0":
            raise RuntimeError("can't start new thread")
        start(thread)

    async with ThreadRunner() as runner:
        b = Batches(pool, runner)
        first, _ = b.keys(2, seed=1)
        second, _ = b.keys(2, seed=2)
        async with kvpipe.FileStore(root, threads=2) as store:
            monkeypatch.setattr(threading.Thread, "start", no_first_thread)
            try:
                put = await b.put(store, first, make_values(2, 1))
            except RuntimeError:  # nothing published then, ever
                put = [BlockStatus.FAILED] * 2
            monkeypatch.undo()
            assert await b.put(store, second, make_values(2, 2)) == [BlockStatus.OK] * 2
        async with kvpipe.FileStore(root) as store:  # what the disk holds once all is done
            statuses, got = await b.get(store, first)
    for i in range(2):
        if statuses[i] is BlockStatus.OK:
            assert got[i] == make_values(2, 1)[i], f"block {i} holds another key's bytes"
        assert statuses[i] is (BlockStatus.OK if put[i] is BlockStatus.OK else BlockStatus.MISSING)


async def test_a_put_whose_share_fails_reports_what_the_other_shares_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, file_io: str
) -> None:
    """A batch split over two store threads, one of whose shares raises (out of memory for
    its headers, say) after the other share published its blocks: the put returns statuses,
    not the error. ``OK`` for each block published (visible, recorded), ``FAILED`` for the
    rest, none of which is visible; the error is counted and logged."""
    root = tmp_path / "store"
    real_one, real_batch = store_mod.write_one, store_mod.write_batch
    async with batches() as b, kvpipe.FileStore(root, threads=2) as store:
        keys, _ = b.keys(4, seed=5)

        def one(hooks: Any, root_: Any, key: str, *args: Any) -> BlockStatus:
            if key == keys[3]:  # the os path: the second share's second block
                raise MemoryError("no memory for its header")
            return real_one(hooks, root_, key, *args)

        def batch(hooks: Any, root_: Any, ks: list[str], *args: Any) -> list[BlockStatus]:
            if keys[3] in ks:  # the native path: the second share, before it writes
                raise MemoryError("no memory for its headers")
            return real_batch(hooks, root_, ks, *args)

        monkeypatch.setattr(store_mod, "write_one", one)
        monkeypatch.setattr(store_mod, "write_batch", batch)
        statuses = await put_chain(b, store, keys, make_values(4, 5))
        monkeypatch.undo()
        published = 3 if file_io == "os" else 2
        assert statuses == [BlockStatus.OK] * published + [BlockStatus.FAILED] * (4 - published)
        assert [block_file(root, k).exists() for k in keys] == [i < published for i in range(4)]
        _check_accounting(store, root, 1 << 40)
        assert store.statistics()["io_errors"] == 4 - published
        assert "MemoryError: no memory for its header" in caplog.text


async def test_close_takes_none_of_the_event_loop_librarys_shared_threads(tmp_path: Path) -> None:
    """A server may have every shared worker thread busy (blocking endpoints): closing the
    store still ends."""
    store = kvpipe.FileStore(tmp_path / "store")
    await store.open()
    ended = await ends_with_host_threads_busy(store.aclose)
    assert ended, "closing waited for one of the host's threads"


async def test_a_catalog_that_fails_to_close_still_lets_go_of_the_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error closing the catalog escaped aclose raw and left the root's descriptor open
    (and the store half closed); it is logged, and everything is closed all the same."""
    store = kvpipe.FileStore(tmp_path / "store")
    await store.open()
    root_fd = store._root.fd  # type: ignore[union-attr]

    def failing_close(self: Catalog) -> None:
        raise sqlite3.OperationalError("unable to close due to unfinalized statements")

    monkeypatch.setattr(Catalog, "close", failing_close)
    await store.aclose()
    assert "closing: unable to close" in caplog.text
    link = anyio.Path(f"/proc/self/fd/{root_fd}")  # closed (or its number reused since)
    assert not await link.is_symlink() or await link.readlink() != (tmp_path / "store").resolve()


async def test_close_does_not_wait_past_its_timeout_for_an_open_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An open stuck in its thread (a hung disk at the recovery scan, say): closing gives up
    after its timeout, leaves the store as it is and says so."""
    store = kvpipe.FileStore(tmp_path / "store")
    go_on = threading.Event()
    opening = store._open_sync

    def stuck() -> None:
        go_on.wait(30)
        opening()

    monkeypatch.setattr(store, "_open_sync", stuck)
    async with anyio.create_task_group() as tg:
        tg.start_soon(store.open)
        await anyio.wait_all_tasks_blocked()
        try:
            with anyio.fail_after(10), caplog.at_level("ERROR", logger="kvpipe"):
                await store.aclose(timeout=0.1)
        finally:
            go_on.set()
    assert any("still opening" in r.getMessage() for r in caplog.records)
    await store.aclose()


@pytest.mark.parametrize("cut", ["draining", "closing"])
async def test_a_close_cancelled_by_asyncio_still_closes_the_store_then_is_cancelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """anyio's shield does not keep out asyncio's own cancellation (``Task.cancel``: a
    timeout around the close, a shutdown): a close waiting for a worker call given up on
    (or for its closing thread) returned at once, the store refusing calls but its catalog,
    root descriptor and threads left open for good. It waits on, closes, then is cancelled."""
    store = kvpipe.FileStore(tmp_path / "store")
    await store.open()
    gate, started = threading.Event(), threading.Event()

    def busy() -> None:
        started.set()
        gate.wait(30)

    if cut == "draining":  # a call whose caller gave up, still running in its thread
        threading.Thread(target=store._inflight.track(busy), daemon=True).start()
    else:
        real = store._spares.drain
        monkeypatch.setattr(store._spares, "drain", lambda root: (busy(), real(root)))
    task = asyncio.ensure_future(store.aclose())
    try:
        await anyio.to_thread.run_sync(started.wait, 10)
        await anyio.sleep(0.01)  # closing is waiting for it
        task.cancel("shutting down")
        await anyio.sleep(0.01)
        assert not task.done()  # still waiting for it
    finally:
        gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()  # the cancellation is not swallowed
    assert store.closed
    assert store._root is None and store._catalog is None and store._executor is None


async def test_a_call_after_close_is_refused_without_opening_the_store_again(
    tmp_path: Path,
) -> None:
    """A call after :meth:`aclose` (of an open store or of one never opened) is refused, and
    leaves the store closed: it opened the root, the catalog and the thread pool again (and
    ran the recovery scan), and nothing ever closed them."""
    b = Batches(StagingPool(4096 + 64, 1), ThreadRunner())
    keys, _ = b.keys(1)
    for opened in (True, False):
        store = kvpipe.FileStore(tmp_path / "store")
        if opened:
            await store.open()
        await store.aclose()
        assert store.closed
        with pytest.raises(kvpipe.BackendError):
            await store.exists(b.key_batch(keys))
        with pytest.raises(kvpipe.BackendError, match="closed"):
            await store.open()
        assert store._root is None and store._catalog is None and store._executor is None


async def test_calls_are_refused_not_given_threads_when_the_file_system_stops_answering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each probe a caller gives up on runs on in its thread; once as many as the store's
    threads are stuck so, more calls fail at once instead of each leaving a thread behind."""
    from kvpipe.backends.file import store as file_store

    go_on, entered = threading.Event(), threading.Semaphore(0)

    def hung(*_: object) -> list[bool]:
        entered.release()
        go_on.wait(30)
        return [False]

    monkeypatch.setattr(file_store, "regular_files", hung)
    b = Batches(StagingPool(4096 + 64, 1), ThreadRunner())
    keys, _ = b.keys(1)
    async with kvpipe.FileStore(tmp_path / "store", threads=1) as store:
        try:
            for _ in range(2):  # one stuck in the store's thread, one more past it
                with anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(store.exists, b.key_batch(keys))
                        await anyio.to_thread.run_sync(entered.acquire)  # in the probe
                        scope.cancel()
            with anyio.fail_after(5), pytest.raises(kvpipe.BackendError, match="not answering"):
                await store.exists(b.key_batch(keys))
        finally:
            go_on.set()


@pytest.mark.parametrize("file_io", ["os"], indirect=True)
async def test_a_block_published_before_its_directory_sync_failed_is_reported_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """``durability="full"``: the block's rename succeeded, then syncing its directory
    failed. The block is visible (and recorded), so it must be reported ``OK`` (a put
    reported ``FAILED`` never made its block visible); the failure is counted and logged."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "directory sync failed")
        real(fd)

    for i in range(256):  # a directory made now is synced into its parent first
        (tmp_path / "store" / "blocks" / "conformance" / f"{i:02x}").mkdir(parents=True)
    monkeypatch.setattr(os, "fsync", fsync)
    pool = StagingPool(4096 + 64, 1)
    async with (
        ThreadRunner() as runner,
        kvpipe.FileStore(tmp_path / "store", durability="full") as store,
    ):
        b = Batches(pool, runner)
        keys, _ = b.keys(1)
        value = random_values(1, pool.slot_nbytes, 5)
        statuses = await b.put(store, keys, value)
        visible = list(await store.exists(b.key_batch(keys)))
        assert visible == [True]
        assert statuses == [BlockStatus.OK], "reported failed, yet published"
        assert store.statistics()["io_errors"] == 1


async def test_full_durability_syncs_the_directories_a_put_makes_into_their_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """``durability="full"``: the first put into a store makes its block's directories
    (``blocks/``, the namespace's, the shard's); each is synced into its parent before the
    block is reported ``OK``, else a crash could lose the directory and the block in it."""
    real = os.fsync
    synced: list[str] = []

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    root = tmp_path / "store"
    pool = StagingPool(4096 + 64, 1)
    async with ThreadRunner() as runner, kvpipe.FileStore(root, durability="full") as store:
        b = Batches(pool, runner)
        keys, _ = b.keys(1)
        monkeypatch.setattr(os, "fsync", fsync)
        assert await b.put(store, keys, random_values(1, pool.slot_nbytes, 6)) == [BlockStatus.OK]
        monkeypatch.undo()
    made = [root, root / "blocks", root / "blocks" / "conformance"]  # each got a new entry
    assert {str(p.resolve()) for p in made} <= set(synced), synced


def test_a_share_that_raised_leaves_no_reference_cycle() -> None:
    """A share's error, kept by the share object that its traceback's frames hold, made a
    cycle keeping every frame it passed (the batch's keys and staging) until the collector
    ran."""
    import gc
    import weakref
    from concurrent.futures import ThreadPoolExecutor

    from kvpipe.backends.file._shares import in_shares

    class Item:
        pass

    def fail(items: list[Item]) -> list[int]:
        raise OSError("injected")

    enabled = gc.isenabled()
    gc.disable()
    try:
        with ThreadPoolExecutor(2) as pool:
            items = [Item(), Item()]
            refs = [weakref.ref(i) for i in items]
            with pytest.raises(OSError, match="injected"):
                in_shares(pool, 2, fail, items, "store")
            del items
            assert all(r() is None for r in refs), "the shares' items are held in a cycle"
    finally:
        if enabled:
            gc.enable()


def _locked(*_: object) -> Any:
    raise sqlite3.OperationalError("database is locked")


def _eio(*_: object) -> Any:
    raise OSError(errno.EIO, "Input/output error")


#: (operation, what fails in the worker thread: (where, name, how)).
_FAILING: list[tuple[str, list[tuple[Any, str, Any]]]] = [
    ("put_residency", [(Catalog, "put_residency", _locked)]),
    ("get_residency", [(Catalog, "get_residency", _locked)]),
    ("delete", [(Catalog, "reconcile", _locked)]),
    ("put_blocks", [(Catalog, "reserve", _locked)]),
    ("exists", [(store_mod, "regular_files", _eio)]),
    ("get_blocks", [(store_mod, "read_batch", _eio)]),
]


@pytest.mark.parametrize(("op", "failing"), _FAILING, ids=[f[0] for f in _FAILING])
async def test_a_failing_catalog_or_disk_is_a_backend_error_not_a_vendor_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str, failing: list[tuple[Any, str, Any]]
) -> None:
    """SQLite's and the OS's errors from a call's worker thread (the catalog locked past its
    busy timeout, a read-only catalog's ``CatalogFull``, an I/O error under a probe) escaped
    the store's methods as they were: ``sqlite3.OperationalError`` or ``OSError``, outside
    kvpipe's one hierarchy (open already translated them). Now a ``BackendError`` naming the
    method, chained to the vendor's error."""
    async with batches() as b, kvpipe.FileStore(tmp_path / "store") as store:
        keys, _ = b.keys(2, seed=3)
        entry = kvpipe.ResidencyEntry(keys[0], "node", kvpipe.Residency.GPU, 0.0)
        calls = {
            "put_residency": lambda: store.put_residency([entry]),
            "get_residency": lambda: store.get_residency(keys),
            "delete": lambda: store.delete(keys),
            "put_blocks": lambda: put_chain(b, store, keys, make_values(2, 3)),
            "exists": lambda: store.exists(b.key_batch(keys)),
            "get_blocks": lambda: get_raw(b, store, keys),
        }
        assert await put_chain(b, store, keys, make_values(2, 3)) == [BlockStatus.OK] * 2
        for where, name, how in failing:
            monkeypatch.setattr(where, name, how)
        with pytest.raises(kvpipe.BackendError) as info:
            await calls[op]()
        monkeypatch.undo()
        assert info.value.backend == "file" and info.value.operation == op, str(info.value)
        assert isinstance(info.value.__cause__, OSError | sqlite3.Error)
        assert str(info.value.__cause__) in str(info.value)
        assert len(await store.exists(b.key_batch(keys))) == 2  # the store still answers


async def test_exists_that_cannot_look_at_a_block_file_is_a_backend_error_not_a_miss(
    tmp_path: Path,
) -> None:
    """``exists`` with every descriptor of the process in use (``EMFILE``, as in a busy
    server; ``EACCES`` and ``EIO`` alike): the native probe read a block file it could not
    open as missing and answered ``False`` for blocks on disk, a silent miss (a read
    recomputed them, a write rewrote them), where the ``os`` path raised. Both raise a
    ``BackendError`` now, naming the error."""
    async with batches() as b, kvpipe.FileStore(tmp_path / "store") as store:
        keys, _ = b.keys(3, seed=3)
        assert await put_chain(b, store, keys, make_values(3, 3)) == [BlockStatus.OK] * 3
        with no_free_fds(), pytest.raises(kvpipe.BackendError) as info:
            await store.exists(b.key_batch(keys))
        assert info.value.operation == "exists"
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.EMFILE, str(info.value)
        assert list(await store.exists(b.key_batch(keys))) == [True] * 3


@pytest.mark.parametrize("asked", [32, 96, 4096 * 3])
async def test_a_value_read_at_another_size_is_refused_and_kept(
    tmp_path: Path, asked: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A ValueClient read with a size other than the stored value's (a caller's mistake, or
    another deployment's value of one key: FastDeploy's KVPipeStorage with MTP on one side)
    got CORRUPT and the store moved the sound value into quarantine, so the right-size read
    after it found nothing. It is refused (CORRUPT, as MemoryStore does) and kept."""
    from kvpipe.backends._values import ValueClient

    value = bytes(range(64))
    async with kvpipe.FileStore(tmp_path) as store, ValueClient(store) as client:
        assert await client.put(["k"], [value]) == [BlockStatus.OK]
        ((status, _),) = await client.get(["k"], [asked])
        assert status is BlockStatus.CORRUPT
        assert store.statistics().get("quarantined", 0) == 0
        ((status, got),) = await client.get(["k"], [64])
        assert status is BlockStatus.OK and bytes(got) == value
    assert any("a value of" in r.getMessage() for r in caplog.records)


async def test_an_empty_value_file_is_quarantined_not_judged_by_a_stale_header(
    tmp_path: Path,
) -> None:
    """A value file shorter than a header (empty: a crash before its data reached the disk)
    leaves the thread's header scratch page as the last read left it. When that read was of
    the same key at another size, the refusal took that stale header for the file's own and
    kept the damaged file as another deployment's value (never quarantined by a read at the
    other size). A file too short to hold a header is judged on its own bytes only."""
    from kvpipe.backends._values import ValueClient

    value = bytes(range(64))
    async with kvpipe.FileStore(tmp_path, threads=1) as store, ValueClient(store) as client:
        assert await client.put(["k"], [value]) == [BlockStatus.OK]
        ((status, _),) = await client.get(["k"], [64])
        assert status is BlockStatus.OK  # the header page now holds k's header (64 B)
        block_file(tmp_path, "k").write_bytes(b"")
        ((status, _),) = await client.get(["k"], [128])
        assert status is BlockStatus.CORRUPT
        assert store.statistics().get("quarantined", 0) == 1
        assert not block_file(tmp_path, "k").exists()
