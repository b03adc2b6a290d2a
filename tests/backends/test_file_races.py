"""Races between a put and another operation on the same key (a second put, a delete, an
eviction, a read that finds a bad file): whatever the order, the catalog records exactly the
block files there are, and a block a put reported ``OK`` goes only by eviction or delete.

Each test holds one operation at the racy step (a patched call in its worker thread) and runs
the other one to its end from there.
"""

from __future__ import annotations

import errno
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

import kvpipe
from kvpipe._results import Residency, ResidencyEntry
from kvpipe.backends import BlockStatus
from kvpipe.backends.file import FileStore
from kvpipe.backends.file import store as store_mod
from kvpipe.backends.file._catalog import Catalog, CatalogFull
from kvpipe.backends.file._reads import check_file
from kvpipe.testing.batches import Batches
from tests.backends.test_file_capacity import (
    STORED,
    _catalog,
    _check_accounting,
    put_cancelled_after_reserving,
)
from tests.backends.test_file_hostile import batches, block_file, get_raw, make_values, put_chain

OK = BlockStatus.OK
CAPACITY = 4 * STORED


def _put_first(
    b: Batches,
    store: FileStore,
    keys: list[str],
    values: list[bytes],
    statuses: list[BlockStatus],
    fn: Callable[..., Any],
) -> Callable[..., Any]:
    """``fn``, called in a store's worker thread, after (the first time only) a put of
    ``values`` from the event loop has run to its end; its statuses go into ``statuses``."""
    token = anyio.lowlevel.current_token()

    def patched(*args: Any) -> Any:
        if not statuses:
            statuses.extend(anyio.from_thread.run(put_chain, b, store, keys, values, token=token))
        return fn(*args)

    return patched


async def test_a_failed_put_of_a_stored_key_keeps_the_stored_blocks_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """A re-put cancelled after reserving: the block stored before stays, and so does its
    record (it dropped it: the block was then neither counted nor ever evicted)."""
    root = tmp_path / "store"
    async with batches() as b, FileStore(root, capacity_bytes=CAPACITY) as store:
        keys, _ = b.keys(1, seed=40)
        old = make_values(1, 40)
        assert await put_chain(b, store, keys, old) == [OK]
        await put_cancelled_after_reserving(b, store, keys, make_values(1, 41), monkeypatch)
        statuses, got = await get_raw(b, store, keys)
        assert statuses == [OK] and got == old
        _check_accounting(store, root, CAPACITY)


@pytest.mark.parametrize("failed_first", [True, False])
async def test_two_puts_of_one_key_one_failing_leave_the_other_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failed_first: bool
) -> None:
    """Two pipelines put the same new key and one put's write fails: whichever settles
    first, the block the other one published stays recorded."""
    root = tmp_path / "store"
    both_reserved = threading.Event()
    first_settled = threading.Event()
    calls: list[str] = []
    real_write = FileStore._write
    real_settle = store_mod.settle

    def write(self: FileStore, *args: Any) -> list[BlockStatus]:
        who = "fail" if not calls else "ok"
        calls.append(who)
        if who == "ok":
            both_reserved.set()
        assert both_reserved.wait(10)
        if (who == "fail") != failed_first:
            assert first_settled.wait(10)
        if who == "fail":
            return [BlockStatus.FAILED] * len(args[2])
        return real_write(self, *args)

    def settle(*args: Any) -> list[str]:
        try:
            return real_settle(*args)
        finally:
            first_settled.set()

    monkeypatch.setattr(FileStore, "_write", write)
    monkeypatch.setattr(store_mod, "settle", settle)
    async with batches() as b, FileStore(root, capacity_bytes=CAPACITY) as store:
        keys, _ = b.keys(1, seed=50)
        value = make_values(1, 50)
        got: dict[str, list[BlockStatus]] = {}

        async def put(name: str) -> None:
            got[name] = await put_chain(b, store, keys, value)

        async with anyio.create_task_group() as tg:
            tg.start_soon(put, "a")
            while not calls:  # noqa: ASYNC110 (a worker thread, no event to wait on)
                await anyio.sleep(0.005)
            tg.start_soon(put, "b")
        monkeypatch.undo()
        assert sorted(s.name for r in got.values() for s in r) == ["FAILED", "OK"]
        statuses, data = await get_raw(b, store, keys)
        assert statuses == [OK] and data == value
        _check_accounting(store, root, CAPACITY)


async def test_a_put_between_a_deletes_removal_and_its_record_stays_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete removed the file; a put then published the key again before the delete
    forgot the record: the put's block is there, so its record must stay."""
    root = tmp_path / "store"
    async with batches() as b, FileStore(root, capacity_bytes=CAPACITY) as store:
        keys, _ = b.keys(1, seed=70)
        assert await put_chain(b, store, keys, make_values(1, 70)) == [OK]
        new = make_values(1, 71)
        catalog = _catalog(store)
        put_status: list[BlockStatus] = []
        reconcile = _put_first(b, store, keys, new, put_status, catalog.reconcile)
        monkeypatch.setattr(catalog, "reconcile", reconcile)
        await store.delete(keys)
        monkeypatch.undo()
        assert put_status == [OK]
        statuses, got = await get_raw(b, store, keys)
        assert statuses == [OK] and got == new
        _check_accounting(store, root, CAPACITY)


async def test_a_put_of_an_evicted_key_before_its_file_goes_is_not_recorded_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put evicts block X (its record first, then its file); another put publishes X
    between the two: the eviction then removes that file, so X must not stay recorded."""
    root = tmp_path / "store"
    async with batches() as b, FileStore(root, capacity_bytes=2 * STORED) as store:
        x, _ = b.keys(1, seed=80)
        y, _ = b.keys(1, seed=81)
        z, _ = b.keys(1, seed=82)
        assert await put_chain(b, store, x, make_values(1, 80)) == [OK]
        assert await put_chain(b, store, y, make_values(1, 81)) == [OK]
        spares = store._spares
        put_status: list[BlockStatus] = []
        x_file = block_file(root, x[0])
        put_then_retire = _put_first(b, store, x, make_values(1, 83), put_status, spares.retire)
        retire = spares.retire

        def retire_x(root_: Any, parts: Any, name: str) -> bool:
            if name == x_file.name:
                return bool(put_then_retire(root_, parts, name))
            return retire(root_, parts, name)

        monkeypatch.setattr(spares, "retire", retire_x)
        assert await put_chain(b, store, z, make_values(1, 82)) == [OK]  # evicts X (oldest)
        monkeypatch.undo()
        assert put_status == [OK]
        _check_accounting(store, root, 2 * STORED)


async def test_a_bad_files_quarantine_spares_a_block_published_after_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """A get finds a tampered file; another put publishes the key again before the get
    moves the bad file aside: the put's block stays, readable and recorded."""
    root = tmp_path / "store"
    async with batches() as b, FileStore(root, capacity_bytes=CAPACITY) as store:
        keys, _ = b.keys(1, seed=60)
        good = make_values(1, 60)
        assert await put_chain(b, store, keys, make_values(1, 61)) == [OK]
        path = block_file(root, keys[0])
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # the read finds the payload's checksum wrong
        path.write_bytes(bytes(raw))
        put_status: list[BlockStatus] = []
        token = anyio.lowlevel.current_token()
        from kvpipe.backends.file import _reads

        def check_then_put(*args: Any) -> str | None:
            why = check_file(*args)
            if why is not None and not put_status:
                put_status.extend(
                    anyio.from_thread.run(put_chain, b, store, keys, good, token=token)
                )
            return why

        monkeypatch.setattr(_reads, "check_file", check_then_put)
        statuses, _ = await get_raw(b, store, keys)
        monkeypatch.undo()
        assert put_status == [OK]
        assert statuses[0] in (BlockStatus.CORRUPT, BlockStatus.MISSING)
        statuses, got = await get_raw(b, store, keys)
        assert statuses == [OK] and got == good
        _check_accounting(store, root, CAPACITY)


async def test_a_full_disk_settle_leaves_the_block_another_put_of_the_key_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_io: str
) -> None:
    """Put A publishes a key, then finds the catalog too full to record it; put B of the
    same key has published it again (and recorded it) just before. Freeing room, A may
    remove only its own file: B's block, reported ``OK``, stays readable and recorded."""
    root = tmp_path / "store"
    real_settle = Catalog.settle
    started = threading.Event()
    raced: list[BlockStatus] = []

    async with batches() as b, FileStore(root) as store:
        keys, _ = b.keys(1, seed=90)
        mine, theirs = make_values(1, 90), make_values(1, 91)
        token = anyio.lowlevel.current_token()

        def settle(catalog: Catalog, *args: Any) -> None:
            if started.is_set():  # B's own settle, and A's after it freed what it could
                return real_settle(catalog, *args)
            started.set()
            raced.extend(anyio.from_thread.run(put_chain, b, store, keys, theirs, token=token))
            raise CatalogFull(errno.ENOSPC, "catalog: database or disk is full")

        monkeypatch.setattr(Catalog, "settle", settle)
        first = await put_chain(b, store, keys, mine)
        monkeypatch.undo()
        assert raced == [OK]
        statuses, got = await get_raw(b, store, keys)
        assert statuses == [OK] and got == theirs
        assert first == [OK]  # A's block was published; B's replaced it, as puts of a key do
        _check_accounting(store, root, 1 << 40)


@pytest.mark.parametrize(
    "error",
    [
        sqlite3.OperationalError("database is locked"),
        sqlite3.DatabaseError("database disk image is malformed"),
    ],
)
async def test_a_put_whose_catalog_cannot_record_it_reports_what_it_published(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: sqlite3.Error,
) -> None:
    """The files are published, then the catalog cannot record it: another process held its
    write lock past SQLite's busy timeout (30 s), or it went bad. The blocks are stored and
    readable (lookups go by the files), so the put reports them ``OK`` and leaves their
    records unsettled, logged, for the next open to settle. The put raised, so the pipeline
    counted none of them while they were there for every reader: stored but not counted."""
    root = tmp_path / "store"

    def settle(catalog: Catalog, *args: Any) -> None:
        raise error

    async with batches() as b, FileStore(root) as store:
        keys, _ = b.keys(3, seed=92)
        monkeypatch.setattr(Catalog, "settle", settle)
        assert await put_chain(b, store, keys, make_values(3, 92)) == [OK] * 3
        monkeypatch.undo()
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 92))
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any("3 record(s) left unsettled" in m for m in errors), errors
    # An open after this process exits, or once the records are stale, settles them.
    async with FileStore(root, stale_temp_after=1e-9) as store:
        await store.open()
        assert store._catalog is not None
        assert store._catalog.known_keys() == set(keys)
        assert store._catalog.stats().pending == 0


async def test_a_put_whose_eviction_the_catalog_cannot_reconcile_still_settles_its_reservation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A put evicts a block to make room; the catalog then cannot reconcile the victim's
    record (another process held its write lock past SQLite's busy timeout). The put's own
    reservation must not be left behind: reservations are never evictable, so one leaked
    here fills the store with nothing until the next open."""
    root = tmp_path / "store"
    real = Catalog.reconcile
    calls: list[int] = []

    def reconcile(catalog: Catalog, *args: Any) -> None:
        calls.append(1)
        if len(calls) == 1:  # the victims', right after they were evicted
            raise sqlite3.OperationalError("database is locked")
        real(catalog, *args)

    async with batches() as b, FileStore(root, capacity_bytes=2 * STORED) as store:
        x, _ = b.keys(1, seed=100)
        y, _ = b.keys(1, seed=101)
        z, _ = b.keys(1, seed=102)
        assert await put_chain(b, store, x, make_values(1, 100)) == [OK]
        assert await put_chain(b, store, y, make_values(1, 101)) == [OK]
        monkeypatch.setattr(Catalog, "reconcile", reconcile)
        try:
            statuses: list[BlockStatus] | None = await put_chain(b, store, z, make_values(1, 102))
        except kvpipe.BackendError:  # the catalog's error, as the store raises it
            statuses = None
        monkeypatch.undo()
        assert calls, "the put evicted nothing"
        assert _catalog(store).stats().pending == 0, "the put left its reservation behind"
        _check_accounting(store, root, 2 * STORED)
        assert statuses == [OK]
        assert await get_raw(b, store, z) == ([OK], make_values(1, 102))
    assert any("database is locked" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_put_does_not_evict_a_block_another_put_is_writing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Put A writes stored block X again (its reservation needs no new room); put B, short of
    room, must not evict X meanwhile: A published X all the same, so X came back without the
    room it takes and the store ended over its capacity (found by test_file_model)."""
    root = tmp_path / "store"
    async with batches() as b, FileStore(root, capacity_bytes=STORED) as store:
        x, _ = b.keys(1, seed=110)
        z, _ = b.keys(1, seed=111)
        assert await put_chain(b, store, x, make_values(1, 110)) == [OK]
        token = anyio.lowlevel.current_token()
        real = store._write
        z_status: list[BlockStatus] = []
        held: list[bool] = []

        def write(*args: Any) -> list[BlockStatus]:
            if not held:  # A, reserved: B runs to its end from the event loop first
                held.append(True)
                z_status.extend(
                    anyio.from_thread.run(put_chain, b, store, z, make_values(1, 111), token=token)
                )
            return real(*args)

        monkeypatch.setattr(store, "_write", write)
        assert await put_chain(b, store, x, make_values(1, 112)) == [OK]
        monkeypatch.undo()
        assert z_status == [BlockStatus.NO_SPACE]
        assert await get_raw(b, store, x) == ([OK], make_values(1, 112))
        _check_accounting(store, root, STORED)


async def test_a_block_recorded_again_after_a_racing_delete_keeps_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete drops the record of a block a put is writing; the put publishes it and
    records it again. The record must name the block's parent as before, or the parent
    passes for a prefix tail and is evicted first, from the middle of its chain, leaving
    a block no read can reach (found by test_file_model)."""
    root = tmp_path / "store"
    async with batches() as b, FileStore(root, capacity_bytes=2 * STORED) as store:
        a, _ = b.keys(2, seed=120)
        z, _ = b.keys(1, seed=121)
        values = make_values(2, 120)
        assert await put_chain(b, store, a[:1], values[:1]) == [OK]
        token = anyio.lowlevel.current_token()
        real = store._write
        held: list[bool] = []

        def write(*args: Any) -> list[BlockStatus]:
            if not held:  # a[1] reserved: the delete runs to its end first
                held.append(True)
                anyio.from_thread.run(store.delete, a[1:], token=token)
            return real(*args)

        monkeypatch.setattr(store, "_write", write)
        assert await put_chain(b, store, a[1:], values[1:], a[0], 1) == [OK]
        monkeypatch.undo()
        assert held
        # Room for z: the tail of a goes, not its head.
        assert await put_chain(b, store, z, make_values(1, 121)) == [OK]
        assert await get_raw(b, store, a[:1]) == ([OK], values[:1])
        assert not block_file(root, a[1]).exists()
        _check_accounting(store, root, 2 * STORED)


async def test_a_cancelled_residency_write_never_lands_over_a_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled ``put_residency`` (a ``flush_index`` that timed out) leaves its worker
    thread running. Held before the catalog took it (behind another thread's write
    transaction, say: the lock is not first come, first served), it must not record its
    entry after a later call of the same node for the same key has recorded that one: it
    used to, and the index kept saying ``GPU`` for a block the node had flushed ``EVICTED``
    since."""
    parked, go, landed = threading.Event(), threading.Event(), threading.Event()
    real = Catalog.put_residency
    calls: list[int] = []

    def put_residency(self: Catalog, *args: Any) -> None:
        calls.append(1)
        if len(calls) > 1:
            return real(self, *args)
        parked.set()
        go.wait(10)
        try:
            return real(self, *args)
        finally:
            landed.set()

    monkeypatch.setattr(Catalog, "put_residency", put_residency)
    async with FileStore(tmp_path / "store") as store:
        old = ResidencyEntry("k-0", "node-a", Residency.GPU, 1.0)
        new = ResidencyEntry("k-0", "node-a", Residency.EVICTED, 2.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.put_residency, [old])
            assert await anyio.to_thread.run_sync(parked.wait, 10)
            tg.cancel_scope.cancel()  # its caller stops waiting; the thread runs on
        await store.put_residency([new])
        go.set()
        assert await anyio.to_thread.run_sync(landed.wait, 10)
        assert list(await store.get_residency(["k-0"])) == [(new,)]
