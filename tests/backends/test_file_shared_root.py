"""Several processes sharing one FileStore root, as an inference server's tensor-parallel
ranks do (one cache-transfer process per rank, each with its own store over one directory).

Each test runs its processes with ``multiprocessing``'s spawn context and coordinates them
with barriers and queues, never sleeps.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
from pathlib import Path

import pytest

from kvpipe.backends.file import FileStore
from kvpipe.backends.file._catalog import Catalog

# Real time: processes started afresh.
pytestmark = pytest.mark.slow

_spawn = multiprocessing.get_context("spawn")

#: Processes opening each new catalog at once, and how many new catalogs they open: two
#: connections turning a new database to WAL together failed about once in 25 tries here,
#: so 300 tries leave no room for luck.
OPENERS = 2
CATALOGS = 300


def _open_new_catalogs(
    base: str, count: int, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue
) -> None:
    """Open (then close) catalogs ``base/0 ... base/count-1`` in step with the other openers;
    put the errors met, as text, on ``out``."""
    errors = []
    for i in range(count):
        start.wait()
        try:
            Catalog(os.path.join(base, f"{i}.sqlite3"), f"opener:{os.getpid()}").close()
        except Exception as exc:
            errors.append(f"catalog {i}: {type(exc).__name__}: {exc}")
    out.put(errors)


def test_processes_opening_a_new_store_at_once_all_open_its_catalog(tmp_path: Path) -> None:
    # The ranks of a server start together on a new root: every one must open the catalog.
    start = _spawn.Barrier(OPENERS)
    out: multiprocessing.Queue = _spawn.Queue()
    procs = [
        _spawn.Process(target=_open_new_catalogs, args=(str(tmp_path), CATALOGS, start, out))
        for _ in range(OPENERS)
    ]
    for p in procs:
        p.start()
    try:
        errors = [e for _ in procs for e in out.get(timeout=60)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert errors == []


def _serve_deletes(
    root: str,
    keys: list[str],
    ready: multiprocessing.Queue,
    orders: multiprocessing.Queue,
) -> None:
    """Open a FileStore at ``root``, put ``keys`` (one chain) and say ``"stored"`` on
    ``ready``; then, for each ``"delete"`` on ``orders``, delete them and say ``"deleted"``,
    until ``"done"``."""
    import anyio

    from kvpipe.backends.file import FileStore
    from tests.backends.test_file_hostile import batches, make_values, put_chain

    async def main() -> None:
        async with batches() as b, FileStore(root) as store:
            statuses = await put_chain(b, store, keys, make_values(len(keys), 1))
            ready.put("stored" if all(s.name == "OK" for s in statuses) else repr(statuses))
            while await anyio.to_thread.run_sync(orders.get, True, 30.0) == "delete":
                await store.delete(keys)
                ready.put("deleted")

    anyio.run(main)


async def test_a_block_another_process_deletes_during_the_open_scan_is_not_a_repair(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A rank (re)opening a store the others are using: a block one of them deletes between
    # the scan's look at the catalog and its walk of the files was deleted properly (file and
    # record): nothing for the scan to forget, nothing to warn about.
    root = tmp_path / "store"
    keys = [f"ns@fp@0-1@k{i}" for i in range(3)]
    ready: multiprocessing.Queue = _spawn.Queue()
    orders: multiprocessing.Queue = _spawn.Queue()
    proc = _spawn.Process(target=_serve_deletes, args=(str(root), keys, ready, orders))
    proc.start()
    records = Catalog.records

    def records_then_delete(self: Catalog) -> dict[str, tuple[bool, float, str | None]]:
        found = records(self)
        orders.put("delete")
        assert ready.get(timeout=30) == "deleted"
        return found

    try:
        assert ready.get(timeout=60) == "stored"
        monkeypatch.setattr(Catalog, "records", records_then_delete)
        async with FileStore(root) as store:
            stats = dict(store.statistics())
            assert _catalog_of(store).known_keys() == set()
    finally:
        orders.put("done")
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
    assert stats.get("forgotten", 0) == 0
    assert "recovered at open" not in caplog.text


def _catalog_of(store: FileStore) -> Catalog:
    assert store._catalog is not None
    return store._catalog
