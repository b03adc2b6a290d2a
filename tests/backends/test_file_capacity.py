"""FileStore capacity: prefix tails go first, least recently used first; what cannot be made
to fit is refused, and every later block of its batch with it."""

from __future__ import annotations

import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import numpy as np
import pytest

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe.backends import BlockStatus
from kvpipe.backends.file import FileStore, _space
from kvpipe.backends.file._catalog import Catalog, SizeOf
from kvpipe.backends.file._format import HEADER_NBYTES
from kvpipe.backends.file._fs import Root
from kvpipe.testing.batches import Batches
from tests.backends.test_file_hostile import (
    VALUE,
    _flip,
    batches,
    block_file,
    exists,
    get_raw,
    make_values,
    put_chain,
)
from tests.backends.test_file_native import no_free_fds

OK, NO_SPACE = BlockStatus.OK, BlockStatus.NO_SPACE
#: Bytes one block counts against a store's capacity: its value and the file header.
STORED = VALUE + HEADER_NBYTES


@pytest.fixture
async def b() -> AsyncIterator[Batches]:
    async with batches() as bb:
        yield bb


def _catalog(store: FileStore) -> Catalog:
    assert store._catalog is not None
    return store._catalog


async def _stored(b: Batches, store: FileStore, keys: Sequence[str]) -> list[bool]:
    """Per key, asked one at a time: is it stored?"""
    return [await exists(b, store, k) for k in keys]


def _block_files(root: Path) -> list[Path]:
    blocks = root / "blocks"
    return [p for p in blocks.rglob("*.kvb") if p.is_file()] if blocks.exists() else []


def _check_accounting(store: FileStore, root: Path, capacity: int, value: int = STORED) -> None:
    stats = _catalog(store).stats()
    files = _block_files(root)
    assert stats.bytes <= capacity
    assert stats.pending == 0
    assert stats.blocks == len(files)
    assert stats.bytes == len(files) * value


async def put_cancelled_after_reserving(
    b: Batches,
    store: FileStore,
    keys: Sequence[str],
    values: Sequence[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Put ``values``, its deadline landing just after the store reserved room for them;
    return once the store's thread has finished on its own."""
    catalog = _catalog(store)
    reserve = catalog.reserve
    with anyio.CancelScope() as scope:

        def reserve_then_cancel(*args: Any) -> Any:
            admitted = reserve(*args)
            anyio.from_thread.run_sync(scope.cancel)  # the deadline hits just now
            return admitted

        monkeypatch.setattr(catalog, "reserve", reserve_then_cancel)
        try:
            await put_chain(b, store, keys, values)
        finally:
            monkeypatch.setattr(catalog, "reserve", reserve)
    assert scope.cancelled_caught
    with anyio.fail_after(10):  # the store's thread finishes on its own; wait for it
        while b.pool.in_use:  # noqa: ASYNC110 (a worker thread, no event to wait on)
            await anyio.sleep(0.01)


async def test_tails_of_the_least_recently_used_chain_go_first(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(4, seed=1)
    c, _ = b.keys(4, seed=2)
    async with FileStore(root, capacity_bytes=6 * STORED) as store:
        assert await put_chain(b, store, a, make_values(4, 1)) == [OK] * 4
        assert await put_chain(b, store, c, make_values(4, 2)) == [OK] * 4
        # A's tail went, then its new tail: A stays a prefix.
        assert await _stored(b, store, a) == [True, True, False, False]
        assert await _stored(b, store, c) == [True] * 4
        assert not block_file(root, a[2]).exists() and not block_file(root, a[3]).exists()
        stats = store.statistics()
        assert stats["evictions"] == 2 and stats["evicted_bytes"] == 2 * STORED
        assert _catalog(store).stats().bytes == 6 * STORED
        _check_accounting(store, root, 6 * STORED)
        statuses, got = await get_raw(b, store, [*a[:2], *c])
        assert statuses == [OK] * 6
        assert got == [*make_values(4, 1)[:2], *make_values(4, 2)]


@pytest.mark.parametrize("read_first", [True, False])
async def test_a_read_refreshes_a_chain(tmp_path: Path, b: Batches, read_first: bool) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(4, seed=3)
    c, _ = b.keys(4, seed=4)
    d, _ = b.keys(2, seed=5)
    async with FileStore(root, capacity_bytes=8 * STORED) as store:
        assert await put_chain(b, store, a, make_values(4, 3)) == [OK] * 4
        assert await put_chain(b, store, c, make_values(4, 4)) == [OK] * 4
        if read_first:
            assert (await get_raw(b, store, a))[0] == [OK] * 4
        assert await put_chain(b, store, d, make_values(2, 5)) == [OK] * 2
        older, newer = (c, a) if read_first else (a, c)
        assert await _stored(b, store, newer) == [True] * 4
        assert await _stored(b, store, older) == [True, True, False, False]
        assert await _stored(b, store, d) == [True, True]
        _check_accounting(store, root, 8 * STORED)


async def test_the_parent_of_the_batch_is_never_evicted(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(3, seed=6)
    c, _ = b.keys(2, seed=7)
    async with FileStore(root, capacity_bytes=4 * STORED) as store:
        assert await put_chain(b, store, a[:2], make_values(2, 6)) == [OK] * 2
        assert await put_chain(b, store, c, make_values(2, 7)) == [OK] * 2
        # a[1] is the least recently used tail, but it is the parent of what is written.
        assert await put_chain(b, store, a[2:], make_values(3, 6)[2:], a[1], 2) == [OK]
        assert await _stored(b, store, a) == [True] * 3
        assert await _stored(b, store, c) == [True, False]
        assert store.statistics()["evictions"] == 1
        _check_accounting(store, root, 4 * STORED)


async def test_a_chain_cannot_evict_its_own_prefix(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(6, seed=8)
    values = make_values(6, 8)
    async with FileStore(root, capacity_bytes=4 * STORED) as store:
        assert await put_chain(b, store, a[:2], values[:2]) == [OK] * 2
        assert await put_chain(b, store, a[2:4], values[2:4], a[1], 2) == [OK] * 2
        assert await put_chain(b, store, a[4:], values[4:], a[3], 4) == [NO_SPACE] * 2
        assert await _stored(b, store, a) == [True] * 4 + [False] * 2
        assert (await get_raw(b, store, a[:4])) == ([OK] * 4, values[:4])
        stats = store.statistics()
        assert stats.get("evictions", 0) == 0 and stats["no_space"] == 2
        _check_accounting(store, root, 4 * STORED)


async def test_a_batch_larger_than_the_store_is_cut_and_the_rest_refused(
    tmp_path: Path, b: Batches
) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(5, seed=9)
    async with FileStore(root, capacity_bytes=3 * STORED + STORED // 2) as store:
        assert await put_chain(b, store, a, make_values(5, 9)) == [OK] * 3 + [NO_SPACE] * 2
        assert await _stored(b, store, a) == [True] * 3 + [False] * 2
        assert store.statistics()["no_space"] == 2
        _check_accounting(store, root, 3 * STORED + STORED // 2)


async def test_once_refused_every_later_block_of_the_batch_is_refused(
    tmp_path: Path, b: Batches
) -> None:
    """The second block would fit (it is stored already, it needs no new room), but it could
    never be reached once the first was refused."""
    root = tmp_path / "store"
    k, _ = b.keys(2, seed=10)
    z, _ = b.keys(1, seed=11)
    async with FileStore(root, capacity_bytes=2 * STORED) as store:
        assert await put_chain(b, store, k[1:], make_values(1, 10)) == [OK]
        assert await put_chain(b, store, z, make_values(1, 11)) == [OK]
        # Nothing may be evicted: k[1] is in the batch, z is its parent.
        assert await put_chain(b, store, k, make_values(2, 12), z[0], 1) == [NO_SPACE] * 2
        assert await _stored(b, store, [*k, *z]) == [False, True, True]
        # The refused rewrite left the old value alone.
        assert await get_raw(b, store, k[1:]) == ([OK], make_values(1, 10))
        _check_accounting(store, root, 2 * STORED)


async def test_a_block_larger_than_the_capacity_is_refused(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(3, seed=13)
    c, _ = b.keys(1, seed=14)
    async with FileStore(root, capacity_bytes=STORED - 1) as store:
        assert await put_chain(b, store, a, make_values(3, 13)) == [NO_SPACE] * 3
        assert await put_chain(b, store, c, make_values(1, 14)) == [NO_SPACE]
        assert _block_files(root) == []
        _check_accounting(store, root, STORED - 1)


async def test_deleting_and_quarantining_release_capacity(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    a, _ = b.keys(3, seed=15)
    c, _ = b.keys(3, seed=16)
    async with FileStore(root, capacity_bytes=3 * STORED) as store:
        assert await put_chain(b, store, a, make_values(3, 15)) == [OK] * 3
        await store.delete([a[2]])
        raw = bytearray(block_file(root, a[1]).read_bytes())
        raw[-1] ^= 1
        block_file(root, a[1]).write_bytes(bytes(raw))
        assert (await get_raw(b, store, a[:2]))[0] == [OK, BlockStatus.CORRUPT]
        assert _catalog(store).stats().bytes == STORED
        # Two blocks fit without evicting a[0]; the third evicts it.
        assert await put_chain(b, store, c[:2], make_values(3, 16)[:2]) == [OK] * 2
        assert await _stored(b, store, a[:1]) == [True]
        assert store.statistics().get("evictions", 0) == 0
        assert await put_chain(b, store, c[2:], make_values(3, 16)[2:], c[1], 2) == [OK]
        assert await _stored(b, store, [a[0], *c]) == [False, True, True, True]
        _check_accounting(store, root, 3 * STORED)


async def test_a_batch_holding_the_64_oldest_tails_still_evicts_another_block(
    tmp_path: Path,
) -> None:
    """Eviction looked at the 64 least recently used tails only and gave up when all of them
    were blocks of the batch (never evicted): after the catalog was rebuilt, every adopted
    block is a tail, oldest file first, so rewriting a chain whose head went refused the
    whole batch while another block could have gone."""
    root = tmp_path / "store"
    async with batches(80) as b:
        chain, _ = b.keys(65, seed=40)
        other, _ = b.keys(1, seed=41)
        values = make_values(65, 40)
        async with FileStore(root) as store:
            assert await put_chain(b, store, chain, values) == [OK] * 65
        for suffix in ("", "-wal", "-shm"):  # lost: the blocks are adopted at the next open
            (root / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)
        async with FileStore(root, capacity_bytes=65 * STORED) as store:
            await store.delete(chain[:1])
            assert await put_chain(b, store, other, make_values(1, 41)) == [OK]  # full now
            assert await put_chain(b, store, chain, values) == [OK] * 65
            assert await _stored(b, store, other) == [False]
            assert await get_raw(b, store, chain) == ([OK] * 65, values)
            _check_accounting(store, root, 65 * STORED)


@pytest.mark.usefixtures("file_io")
async def test_a_delete_that_fails_on_one_key_forgets_the_files_it_removed(
    tmp_path: Path, b: Batches
) -> None:
    """A delete removes a block file, then cannot remove the next key's (a directory at its
    name here; a disk error alike): the record of the file it removed goes too (it stayed,
    counted against the capacity, until the next open)."""
    root = tmp_path / "store"
    keys, _ = b.keys(2, seed=17)
    async with FileStore(root, capacity_bytes=3 * STORED) as store:
        assert await put_chain(b, store, keys, make_values(2, 17)) == [OK] * 2
        block_file(root, keys[1]).unlink()
        block_file(root, keys[1]).mkdir()
        with pytest.raises(kvpipe.BackendError, match="delete"):
            await store.delete(keys)
        assert not block_file(root, keys[0]).exists()
        assert keys[0] not in _catalog(store).known_keys()
        _check_accounting(store, root, 3 * STORED)


async def test_random_workload_keeps_prefixes_and_accounting(tmp_path: Path, b: Batches) -> None:
    """Random continuations and reads over several chains: the byte total never passes the
    capacity, the catalog matches the files, every chain's stored blocks are a prefix, a put
    never stores a block after a refused one, and everything stored reads back exactly."""
    root = tmp_path / "store"
    capacity = 10 * STORED
    rng = np.random.default_rng(17)
    chains = [b.keys(7, seed=20 + c)[0] for c in range(5)]
    values = [make_values(7, 20 + c) for c in range(5)]
    evictions_seen = 0
    async with FileStore(root, capacity_bytes=capacity, threads=2) as store:
        for _ in range(50):
            c = int(rng.integers(len(chains)))
            keys = chains[c]
            stored = await _stored(b, store, keys)
            p = stored.index(False) if False in stored else len(keys)
            assert stored == [True] * p + [False] * (len(keys) - p), "not a prefix"
            if p == len(keys) or rng.random() < 0.3:
                if p:
                    statuses, got = await get_raw(b, store, keys[:p])
                    assert statuses == [OK] * p and got == values[c][:p]
                continue
            n = int(rng.integers(1, 4))
            part = keys[p : p + n]
            statuses = await put_chain(
                b, store, part, values[c][p : p + n], keys[p - 1] if p else None, p
            )
            ok = statuses.count(OK)
            assert statuses == [OK] * ok + [NO_SPACE] * (len(part) - ok)
            _check_accounting(store, root, capacity)
            for chain in chains:
                flags = await _stored(b, store, chain)
                assert flags == sorted(flags, reverse=True), "a gap in a stored prefix"
        evictions_seen = int(store.statistics().get("evictions", 0))
    assert evictions_seen > 0


async def test_a_put_cancelled_after_reserving_releases_its_reservation(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put cancelled between reserving room and writing (a slice timeout can land there)
    must give the room back: reservations are never evictable, so leaked ones fill the
    store with nothing until the next open an hour later."""
    root = tmp_path / "store"
    keys, _ = b.keys(4, seed=30)
    other, _ = b.keys(4, seed=31)
    async with FileStore(root, capacity_bytes=4 * STORED) as store:
        await store.open()
        await put_cancelled_after_reserving(b, store, keys, make_values(4, 30), monkeypatch)
        assert _catalog(store).stats().pending == 0, "the cancelled put kept its reservation"
        _check_accounting(store, root, 4 * STORED)
        assert await put_chain(b, store, other, make_values(4, 31)) == [OK] * 4


# -- the pipeline over a small file store ------------------------------------------------------

LAYOUT = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=16)
BLOCK_VALUE = value_nbytes(LAYOUT.block_nbytes) + HEADER_NBYTES


@pytest.mark.parametrize("fits", [5, 4])
async def test_pipeline_over_a_full_store(tmp_path: Path, fits: int) -> None:
    """``fits`` = 4 ends on a slice boundary: the third slice is refused as a whole."""
    root = tmp_path / "store"
    src = kvpipe.create_kv_cache(LAYOUT, 32)
    rng = np.random.default_rng(18)
    for rows in src.byte_rows:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    first, second = np.arange(8 * 16), np.arange(10_000, 10_000 + 3 * 16)
    config = kvpipe.PipelineConfig(slice_block_num=2)
    capacity = fits * BLOCK_VALUE
    async with FileStore(root, capacity_bytes=capacity) as store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="cap") as pipe:
            w = await pipe.write(first, np.arange(8))
            assert (w.stop_reason, w.error) == ("incomplete_slice", f"block {fits}: no_space")
            assert (w.written, w.skipped, w.complete) == (fits, 0, False)
            assert [s.written for s in w.slices] == [2, 2, fits - 4]
            assert await pipe.lookup(first) == fits
            assert _catalog(store).stats().bytes <= capacity

            w2 = await pipe.write(second, np.arange(8, 11))
            assert w2.complete and w2.written == 3
            assert await pipe.lookup(second) == 3
            assert _catalog(store).stats().bytes <= capacity
            left = await pipe.lookup(first)
            assert left == fits - 3  # the first sequence's tails made room
            assert store.statistics()["evictions"] == 3

            dst = kvpipe.create_kv_cache(LAYOUT, 32)
            async with kvpipe.open_pipeline(dst, store, config=config, namespace="cap") as rp:
                r1 = await rp.read(first, np.arange(20, 28))
                r2 = await rp.read(second, np.arange(28, 31), require_all=True)
            assert r1.loaded == left and r1.stop_reason == "not_stored"
            assert r2.loaded == 3
            for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
                assert np.array_equal(a[:left], c[20 : 20 + left])
                assert np.array_equal(a[8:11], c[28:31])
        _check_accounting(store, root, capacity, BLOCK_VALUE)


@pytest.mark.parametrize("corrupt", [False, True])
async def test_a_read_whose_bookkeeping_the_catalog_refuses_still_returns_its_blocks(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch, corrupt: bool
) -> None:
    """Recording a read for LRU (``touch``), or forgetting a corrupt block, in a catalog
    locked past SQLite's busy timeout (or damaged) failed the whole get: blocks read and
    verified came back as an error, the cache rows they were placed in uncounted."""
    import sqlite3

    root = tmp_path / "store"
    a, _ = b.keys(3, seed=9)
    async with FileStore(root, capacity_bytes=8 * STORED) as store:
        assert await put_chain(b, store, a, make_values(3, 9)) == [OK] * 3
        if corrupt:
            _flip(HEADER_NBYTES + 5)(block_file(root, a[2]), root)

        def locked(*_: object) -> None:
            raise sqlite3.OperationalError("database is locked")

        monkeypatch.setattr(_catalog(store), "touch", locked)
        monkeypatch.setattr(_catalog(store), "reconcile", locked)
        statuses, got = await get_raw(b, store, a)
        want = [OK, OK, BlockStatus.CORRUPT] if corrupt else [OK] * 3
        assert statuses == want
        assert got[:2] == make_values(3, 9)[:2]


@pytest.mark.usefixtures("file_io")
async def test_a_put_that_cannot_look_at_its_file_keeps_its_record(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settling a put whose block file cannot be looked at just then (every descriptor in
    use, ``EMFILE``; ``EACCES``, ``EIO`` alike): the native lookup read the file as missing
    and the catalog dropped its record, with the file still stored. The store then grew past
    its capacity for good, and eviction never removed the file. The record stays as it was
    (a reservation, settled as one a put left unsettled); the os path failed the whole put,
    its block published."""
    root = tmp_path / "store"
    a, _ = b.keys(1, seed=50)
    c, _ = b.keys(1, seed=51)
    real = _space.sizes

    def starved(root: Root) -> SizeOf:
        inner = real(root)

        def size_of(keys: Sequence[str]) -> list[int | None]:
            with no_free_fds():
                return inner(keys)

        return size_of

    async with FileStore(root, capacity_bytes=STORED) as store:
        monkeypatch.setattr(_space, "sizes", starved)  # the put's settling only
        assert await put_chain(b, store, a, make_values(1, 50)) == [OK]
        monkeypatch.setattr(_space, "sizes", real)
        assert block_file(root, a[0]).is_file()
        assert a[0] in _catalog(store).known_keys()
        assert _catalog(store).stats().bytes == STORED
        await put_chain(b, store, c, make_values(1, 51))
        assert len(_block_files(root)) * STORED <= STORED  # never past the capacity
    # Settled as any reservation left unsettled: at an open once it is stale.
    async with FileStore(root, capacity_bytes=STORED, stale_temp_after=1e-6) as store:
        _check_accounting(store, root, STORED)
        assert await _stored(b, store, a) == [True]


async def test_a_kept_record_of_a_failed_temp_sweep_keeps_no_store_or_staging(
    tmp_path: Path,
    no_cyclic_gc: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A put refused for room sweeps stale temporary files; when the tree cannot be walked
    its WARNING held the ``OSError`` itself as an argument, so a handler that keeps records
    (pytest's capture, a MemoryHandler) kept its traceback's frames, and through them and
    their callers the store and the put's batch, with the staging it leases from, after
    close. The record holds the error's text."""
    from kvpipe.backends.file import store as store_module

    def unwalkable(root: Root, stale_after: float) -> int:
        raise PermissionError(13, "injected: cannot walk", str(root.path))

    monkeypatch.setattr(store_module, "remove_stale_temps", unwalkable)
    with caplog.at_level("WARNING", logger="kvpipe"):
        async with batches() as bb:
            a, _ = bb.keys(1, seed=40)
            async with FileStore(tmp_path / "store", capacity_bytes=STORED - 1) as store:
                assert await put_chain(bb, store, a, make_values(1, 40)) == [NO_SPACE]
            refs = (weakref.ref(store), weakref.ref(bb.pool))
            del store, bb
    assert "cannot look for stale temporary files" in caplog.text
    assert "injected: cannot walk" in caplog.text
    store_ref, pool_ref = refs
    for thread in threading.enumerate():
        if thread.name == "kvpipe-close":
            thread.join(30)  # the store's closing thread lets go of it as it ends
    assert store_ref() is None, "a kept log record holds the closed store"
    assert pool_ref() is None, "a kept log record holds the staging"
