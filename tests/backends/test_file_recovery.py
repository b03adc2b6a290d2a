"""FileStore recovery at open (temporary files, catalog drift, bad files) and read-only
inspection (``inspect_store``)."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

import kvpipe
from kvpipe._keys import Scope, as_tokens, block_keys
from kvpipe.backends import BlockStatus
from kvpipe.backends.file import FileStore, StoreReport, _inspect, inspect_store
from kvpipe.backends.file import store as store_module
from kvpipe.backends.file._catalog import Catalog
from kvpipe.backends.file._format import HEADER_NBYTES, block_location, temp_name
from kvpipe.backends.file._fs import HOST, Root
from kvpipe.testing.batches import Batches
from tests.backends.test_file_hostile import (
    SCOPE,
    VALUE,
    batches,
    block_file,
    call_unblocking_fifo,
    exists,
    get_raw,
    make_values,
    put_chain,
    quarantined,
    tree,
)

#: Bytes one block counts against a store's capacity: its value and the file header.
STORED = VALUE + HEADER_NBYTES

OK = BlockStatus.OK
STALE = 600.0


@pytest.fixture
async def b() -> AsyncIterator[Batches]:
    async with batches() as bb:
        yield bb


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of another process of this host that stays alive during the test."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield child.pid
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process of this host that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _catalog(store: FileStore) -> Catalog:
    assert store._catalog is not None
    return store._catalog


def _other_keys(n: int, namespace: str = "other") -> tuple[str, ...]:
    """Keys in another namespace (same layout fingerprint as the Batches scope)."""
    scope = Scope(namespace, SCOPE.fingerprint)
    return block_keys(scope, as_tokens(np.arange(500, 500 + n * 4)), 4, False)


def _temp_file(root: Path, key: str, host: str, pid: int, age: float = 0.0) -> Path:
    """A temporary file next to ``key``'s block, as a writer ``host``/``pid`` names it."""
    parts, final = block_location(key)
    shard = root.joinpath(*parts)
    shard.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = shard / temp_name(final, host, pid, "0a1b2c3d")
    tmp.write_bytes(b"half a block" * 100)
    if age:
        then = time.time() - age
        os.utime(tmp, (then, then))
    return tmp


async def _populated(root: Path, b: Batches, stale: float = STALE) -> tuple[str, ...]:
    """A store holding a 3-block chain; returns its keys."""
    keys, _ = b.keys(3, seed=1)
    async with FileStore(root, stale_temp_after=stale) as store:
        assert await put_chain(b, store, keys, make_values(3, 1)) == [OK] * 3
    return keys


def _drop_catalog(root: Path) -> None:
    for suffix in ("", "-wal", "-shm", "-journal"):
        (root / f"catalog.sqlite3{suffix}").unlink(missing_ok=True)


# -- (a) stale temporary files -----------------------------------------------------------------


async def test_temp_files_of_dead_writers_on_this_host_are_removed(
    tmp_path: Path, b: Batches, dead_pid: int
) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    fresh, _ = b.keys(1, seed=2)
    temps = [
        _temp_file(root, keys[1], HOST, dead_pid),  # next to a stored block
        _temp_file(root, fresh[0], HOST, dead_pid),  # in a shard of its own
    ]
    async with FileStore(root, stale_temp_after=STALE) as store:
        await store.open()
        assert [t.exists() for t in temps] == [False, False]
        assert store.statistics()["temp_files_removed"] == 2
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))
    assert inspect_store(str(root)).temp_files == 0


async def test_temp_files_of_live_writers_are_kept(
    tmp_path: Path, b: Batches, live_pid: int
) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    temps = [
        _temp_file(root, keys[0], HOST, live_pid, age=5.0),  # another live process
        _temp_file(root, keys[1], HOST, os.getpid(), age=5.0),  # this process
        _temp_file(root, keys[2], "some-other-host", 1, age=5.0),  # recent, foreign
    ]
    contents = [t.read_bytes() for t in temps]
    async with FileStore(root, stale_temp_after=STALE) as store:
        await store.open()
        assert store.statistics().get("temp_files_removed", 0) == 0
        assert [t.read_bytes() for t in temps] == contents
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


async def test_a_full_disk_removes_the_temp_files_of_writers_that_died_since_the_open(
    tmp_path: Path, b: Batches, dead_pid: int, live_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process sharing the root that is killed leaves its temporary files (a put's
    unpublished files, and up to ``spare_bytes`` of deleted files it held for reuse). Only an
    open removed them: stores that share a root and are never reopened (ranks of a long-lived
    server) kept a dead peer's files for good, and a put that found the disk full let only
    its own spares go, refusing blocks the dead peer's bytes would have held. A put that
    finds the disk full now removes them too, as an open would (a live writer's stay)."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    fresh, _ = b.keys(2, seed=2)
    async with FileStore(root, stale_temp_after=STALE) as store:
        await store.open()
        dead = [
            _temp_file(root, keys[1], HOST, dead_pid),
            _temp_file(root, fresh[0], HOST, dead_pid),
        ]
        live = _temp_file(root, keys[2], HOST, live_pid)
        monkeypatch.setattr(store_module, "room", lambda root: 0)
        assert await put_chain(b, store, fresh, make_values(2, 2)) == [BlockStatus.NO_SPACE] * 2
        monkeypatch.undo()
        assert [t.exists() for t in dead] == [False, False]
        assert live.exists()
        assert store.statistics()["temp_files_removed"] == 2
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


#: A writer in a PID namespace of its own (``unshare``), with the pid ``argv[2]`` there: it
#: writes ``argv[3]/argv[4]`` under the store ``argv[1]`` and waits, its temporary file
#: written, until told "go" on its input, then publishes it.
_NAMESPACED_WRITER = """
import os, sys
root, want, shard, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
try:
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(want - 1))
except OSError as exc:  # the namespace's pids cannot be chosen here: nothing to test
    print(f"no pid to choose: {exc}", flush=True)
    sys.exit(0)
child = os.fork()
if child:
    os._exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
assert os.getpid() == want, os.getpid()
from kvpipe.backends.file._fs import Root

def abandoned():
    print("written", flush=True)
    return sys.stdin.readline().strip() != "go"

ok = Root(root).write_atomic(shard.split("/"), name, [b"x" * 5000], "none", abandoned, False)
print("published" if ok else "abandoned", flush=True)
"""


def _free_pid() -> int:
    """A pid no process of this PID namespace has."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text())
    return next(p for p in range(top - 1, 300, -1) if not Path(f"/proc/{p}").exists())


async def test_a_live_writer_in_another_pid_namespace_keeps_its_temp_file(
    tmp_path: Path, b: Batches
) -> None:
    """Containers sharing the store's volume (one host name, PID namespaces of their own):
    a writer mid-write whose pid, in its namespace, no process of this one has is not taken
    for dead; its temporary file survives this process's recovery and it publishes."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a PID namespace of its own needs root and unshare")
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    if (await anyio.run_process(probe, check=False)).returncode != 0:
        pytest.skip("this container may not make PID namespaces (unshare refused)")
    root = tmp_path / "store"
    keys = await _populated(root, b)
    parts, final = block_location(keys[0])
    shard = root.joinpath(*parts)
    pid = _free_pid()
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c"]
    argv += [_NAMESPACED_WRITER, str(root), str(pid), "/".join(parts), final]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with anyio.fail_after(30):  # a guard against a hang, not a timing
        async with await anyio.open_process(argv, env=env) as writer:
            assert writer.stdin is not None and writer.stdout is not None
            lines = BufferedByteReceiveStream(writer.stdout)
            said = await lines.receive_until(b"\n", 1024)  # the writer's crash fails here
            if said.startswith(b"no pid to choose"):
                pytest.skip(f"cannot run a writer at a chosen pid: {said!r}")
            assert said == b"written"
            temps = [p for p in shard.iterdir() if p.name.startswith(f".{final}.tmp.")]
            assert len(temps) == 1 and f".{pid}." in temps[0].name
            async with FileStore(root, stale_temp_after=STALE) as store:
                await store.open()  # recovery
                assert temps[0].exists(), "a live writer's temporary file was removed"
            await writer.stdin.send(b"go\n")
            said = await lines.receive_until(b"\n", 1024)
            assert said == b"published", await writer.stderr.receive() if writer.stderr else ""
        assert writer.returncode == 0
    assert block_file(root, keys[0]).read_bytes() == b"x" * 5000


async def test_old_temp_files_are_removed_whoever_wrote_them(
    tmp_path: Path, b: Batches, live_pid: int
) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    temps = [
        _temp_file(root, keys[0], "some-other-host", 4242, age=2 * STALE),
        _temp_file(root, keys[1], HOST, live_pid, age=2 * STALE),
    ]
    kept = _temp_file(root, keys[2], "some-other-host", 4242, age=STALE / 2)
    async with FileStore(root, stale_temp_after=STALE) as store:
        await store.open()
        assert [t.exists() for t in temps] == [False, False]
        assert kept.exists()
        assert store.statistics()["temp_files_removed"] == 2
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


async def test_a_reopened_store_has_no_temp_files_left_after_a_killed_writer(
    tmp_path: Path, b: Batches
) -> None:
    """A writer killed mid-write (its temp file is all that is left) is cleaned at open."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    parts, final = block_location(keys[0])
    code = (
        "import os, signal\n"
        f"os.chdir({str(root.joinpath(*parts))!r})\n"
        f"from kvpipe.backends.file._format import temp_name\n"
        f"name = temp_name({final!r}, {HOST!r}, os.getpid(), 'deadbeef')\n"
        "fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)\n"
        "os.write(fd, b'x' * 5000)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = await anyio.run_process([sys.executable, "-c", code], check=False)
    assert done.returncode == -signal.SIGKILL
    assert any(p.name.startswith(".") for p in root.joinpath(*parts).iterdir())
    async with FileStore(root) as store:
        await store.open()
        assert not any(p.name.startswith(".") for p in root.joinpath(*parts).iterdir())
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


# -- (b) files the catalog lost are adopted, (c) records whose file is gone are forgotten --------


async def test_block_files_without_a_catalog_are_adopted(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    keys, _ = b.keys(3, seed=3)
    others = _other_keys(2)
    async with FileStore(root) as store:
        assert await put_chain(b, store, keys, make_values(3, 3)) == [OK] * 3
        assert await put_chain(b, store, others, make_values(2, 4)) == [OK] * 2
    _drop_catalog(root)
    async with FileStore(root) as store:
        await store.open()
        assert store.statistics()["adopted"] == 5
        stats = _catalog(store).stats()
        assert (stats.blocks, stats.bytes, stats.pending) == (5, 5 * STORED, 0)
        assert stats.namespaces == {"conformance": 3, "other": 2}
        assert _catalog(store).known_keys() == {*keys, *others}
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 3))
        assert await get_raw(b, store, others) == ([OK] * 2, make_values(2, 4))
    async with FileStore(root) as store:  # adopting is once: the next open finds nothing new
        await store.open()
        assert store.statistics().get("adopted", 0) == 0
        assert _catalog(store).stats().blocks == 5


async def test_adopted_blocks_count_towards_capacity(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    keys, _ = b.keys(3, seed=5)
    fresh, _ = b.keys(2, seed=6)
    async with FileStore(root) as store:
        assert await put_chain(b, store, keys, make_values(3, 5)) == [OK] * 3
    _drop_catalog(root)
    async with FileStore(root, capacity_bytes=4 * STORED) as store:
        assert await put_chain(b, store, fresh, make_values(2, 6)) == [OK] * 2
        assert _catalog(store).stats().bytes <= 4 * STORED
        assert store.statistics()["evictions"] == 1
        flags = [await exists(b, store, k) for k in (*keys, *fresh)]
        assert flags.count(True) == 4 and flags[3:] == [True, True]


async def test_records_whose_file_is_gone_are_forgotten(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    block_file(root, keys[1]).unlink()
    block_file(root, keys[2]).unlink()
    async with FileStore(root) as store:
        await store.open()
        assert store.statistics()["forgotten"] == 2
        assert _catalog(store).known_keys() == {keys[0]}
        stats = _catalog(store).stats()
        assert (stats.blocks, stats.bytes) == (1, STORED)
        statuses, _ = await get_raw(b, store, keys)
        assert statuses == [OK, BlockStatus.MISSING, BlockStatus.MISSING]


# -- (d) bad files found at open ---------------------------------------------------------------


def _unknown_key(i: int) -> str:
    return f"{SCOPE.prefix}unknown{i}"


async def test_bad_files_found_at_open_are_quarantined(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    keys, _ = b.keys(6, seed=7)
    values = make_values(6, 7)
    async with FileStore(root) as store:
        assert await put_chain(b, store, keys, values) == [OK] * 6
    files = [block_file(root, k) for k in keys]
    _drop_catalog(root)  # so every file is unknown and its header is read
    os.truncate(files[0], HEADER_NBYTES + 10)  # truncated
    raw = bytearray(files[1].read_bytes())
    raw[40] ^= 0xFF
    files[1].write_bytes(bytes(raw))  # flipped header byte
    files[2].write_bytes(b"")  # zero length
    # a valid block of keys[3] copied to where another key's block would be: misplaced
    misplaced = block_file(root, _unknown_key(0))
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(files[3], misplaced)
    # a valid block moved into another namespace's directory: misplaced too
    wrong_ns = root / "blocks" / "other" / files[4].relative_to(root / "blocks" / "conformance")
    wrong_ns.parent.mkdir(parents=True)
    files[4].rename(wrong_ns)
    # garbage under a block name
    garbage = block_file(root, _unknown_key(1))
    garbage.parent.mkdir(parents=True, exist_ok=True)
    garbage.write_bytes(os.urandom(HEADER_NBYTES + VALUE))
    # a link at a block name to a valid block outside the root
    target = outside / "block.kvb"
    shutil.copyfile(files[5], target)
    files[5].unlink()
    files[5].symlink_to(target)
    outside_before = tree(outside)
    bad = 7

    async with FileStore(root) as store:
        await store.open()
        stats = store.statistics()
        assert stats["quarantined"] == bad
        assert stats.get("adopted", 0) == 1  # only keys[3]'s own file is sound
        assert len(quarantined(root)) == bad
        assert _catalog(store).known_keys() == {keys[3]}
        for path in (*files[:3], misplaced, wrong_ns, garbage, files[5]):
            assert not path.exists() and not path.is_symlink(), path
        statuses, got = await get_raw(b, store, keys)
        assert statuses[3] is OK and got[3] == values[3]
        assert [s for i, s in enumerate(statuses) if i != 3] == [BlockStatus.MISSING] * 5
    assert tree(outside) == outside_before


async def test_unknown_bad_files_are_quarantined_with_the_catalog_intact(
    tmp_path: Path, b: Batches
) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    stray = block_file(root, _unknown_key(2))
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"\x80\x04 not a block")
    other = root / "blocks" / "conformance" / "README"  # not a block name: left alone
    other.write_text("notes")
    async with FileStore(root) as store:
        await store.open()
        assert store.statistics()["quarantined"] == 1
        assert not stray.exists() and other.exists()
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


async def test_a_block_published_again_during_the_scan_is_not_quarantined(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process shares the root: it publishes a key after the scan read the catalog,
    deletes it while the scan reads its file (which fails: it is gone) and publishes it
    again before the scan moves that file aside. Its block stays (only eviction or a delete
    may remove a published block), as a read finding a bad file leaves it."""
    root = tmp_path / "store"
    keys, _ = b.keys(1, seed=90)
    value = make_values(1, 90)
    name = block_location(keys[0])[1]
    token = anyio.lowlevel.current_token()
    put_status: list[BlockStatus] = []
    async with FileStore(root) as other:

        def run(fn: Any, *args: Any) -> Any:
            return anyio.from_thread.run(fn, *args, token=token)

        records = Catalog.records
        checked_header = _inspect._checked_header
        quarantine = Root.quarantine

        def records_then_put(self: Catalog) -> Any:
            got = records(self)
            put_status.extend(run(put_chain, b, other, keys, value))  # after the snapshot
            return got

        def delete_then_check(path: str, parts: Any, file: str) -> Any:
            if file == name:
                run(other.delete, keys)
            return checked_header(path, parts, file)

        def put_then_quarantine(self: Root, parts: Any, file: str, *args: Any) -> bool:
            if file == name:
                put_status.extend(run(put_chain, b, other, keys, value))
            return quarantine(self, parts, file, *args)

        monkeypatch.setattr(Catalog, "records", records_then_put)
        monkeypatch.setattr(_inspect, "_checked_header", delete_then_check)
        monkeypatch.setattr(Root, "quarantine", put_then_quarantine)
        async with FileStore(root, stale_temp_after=STALE) as scanning:
            await scanning.open()
        monkeypatch.undo()
        assert put_status == [OK, OK]
        assert await get_raw(b, other, keys) == ([OK], value)
        assert quarantined(root) == []


async def test_a_block_deleted_while_the_scan_adopts_it_is_not_recorded(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process shares the root: it publishes a key after the scan read the catalog,
    and deletes it after the scan checked the file but before it adopted it: the catalog
    must not record a block whose file is gone (it stayed counted until the next open)."""
    root = tmp_path / "store"
    keys, _ = b.keys(1, seed=91)
    token = anyio.lowlevel.current_token()
    put_status: list[BlockStatus] = []
    async with FileStore(root, capacity_bytes=4 * STORED) as other:

        def run(fn: Any, *args: Any) -> Any:
            return anyio.from_thread.run(fn, *args, token=token)

        records = Catalog.records
        adopt = Catalog.adopt

        def records_then_put(self: Catalog) -> Any:
            got = records(self)
            put_status.extend(run(put_chain, b, other, keys, make_values(1, 91)))
            return got

        def delete_then_adopt(self: Catalog, key: str, *args: Any) -> bool:
            if key == keys[0]:
                run(other.delete, keys)
            return adopt(self, key, *args)

        monkeypatch.setattr(Catalog, "records", records_then_put)
        monkeypatch.setattr(Catalog, "adopt", delete_then_adopt)
        async with FileStore(root, stale_temp_after=STALE) as scanning:
            await scanning.open()
        monkeypatch.undo()
        assert put_status == [OK]
        assert not block_file(root, keys[0]).exists()
        assert keys[0] not in _catalog(other).known_keys()
        stats = _catalog(other).stats()
        assert (stats.blocks, stats.bytes, stats.pending) == (0, 0, 0)


async def test_a_namespace_symlink_out_of_the_root_is_not_walked_at_open(
    tmp_path: Path, b: Batches
) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    keys = await _populated(root, b)
    _drop_catalog(root)
    # The whole namespace moves outside and a link to it takes its place.
    shutil.move(root / "blocks" / "conformance", outside)
    (root / "blocks" / "conformance").symlink_to(outside, target_is_directory=True)
    before = tree(outside)
    async with FileStore(root) as store:
        await store.open()
        assert store.statistics().get("adopted", 0) == 0
        assert _catalog(store).known_keys() == set()
        statuses, got = await get_raw(b, store, keys)
        assert OK not in statuses
        assert all(make_values(3, 1)[i][:256] not in got[i] for i in range(3))
    assert tree(outside) == before


async def test_a_directory_at_a_block_name_is_cleared_at_open(tmp_path: Path, b: Batches) -> None:
    """A directory where a block file belongs is not a shard to descend into: left there,
    it makes the key unwritable for good (a rename cannot replace a directory)."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    victim = block_file(root, keys[2])
    victim.unlink()
    victim.mkdir()
    (victim / "x.kvb").write_bytes(b"not a block")
    async with FileStore(root) as store:
        await store.open()
        assert not victim.exists(), "the directory was left in place of the block file"
        assert await put_chain(b, store, keys[2:], make_values(3, 1)[2:], keys[1], 2) == [OK]
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


async def test_a_namespace_named_like_a_block_file_is_walked_not_judged(
    tmp_path: Path, b: Batches, dead_pid: int
) -> None:
    """A namespace ending in ``.kvb`` (a valid one) is a directory of shards, not a
    directory at a block's name: reopening kept its blocks (it moved the whole namespace to
    ``quarantine/``), inspection did not call it corrupt, and its temporary files of dead
    writers were swept."""
    root = tmp_path / "store"
    keys = _other_keys(3, namespace="model.kvb")
    assert block_location(keys[0])[0][1] == "model.kvb"
    values = make_values(3, 12)
    async with FileStore(root) as store:
        assert await put_chain(b, store, keys, values) == [OK] * 3
    tmp = _temp_file(root, keys[0], HOST, dead_pid)
    report = inspect_store(str(root))
    assert (report.blocks, report.corrupt, report.temp_files) == (3, [], 1)
    async with FileStore(root) as store:
        await store.open()
        assert quarantined(root) == []
        assert not tmp.exists(), "a dead writer's temporary file was left"
        assert store.statistics().get("forgotten", 0) == 0
        assert await get_raw(b, store, keys) == ([OK] * 3, values)
        assert _catalog(store).stats().blocks == 3


async def test_a_fifo_at_a_block_name_does_not_hang_open(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    fifo = block_file(root, _unknown_key(3))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo, 0o600)
    store = FileStore(root)

    async def open_store() -> None:
        await store.open()

    try:
        _, hung = await call_unblocking_fifo(fifo, open_store)
        assert not hung, "opening the store blocked forever on a FIFO in the block tree"
        assert not fifo.exists()
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))
    finally:
        await store.aclose()


async def test_a_payload_corrupt_adopted_file_is_caught_on_read(tmp_path: Path, b: Batches) -> None:
    """Open reads headers only; a bad payload in an adopted file is caught by the read."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    _drop_catalog(root)
    raw = bytearray(block_file(root, keys[2]).read_bytes())
    raw[HEADER_NBYTES + 99] ^= 0x10
    block_file(root, keys[2]).write_bytes(bytes(raw))
    async with FileStore(root) as store:
        statuses, got = await get_raw(b, store, keys)
        assert statuses == [OK, OK, BlockStatus.CORRUPT]
        assert got[:2] == make_values(3, 1)[:2]
        assert not await exists(b, store, keys[2])
        assert _catalog(store).stats().blocks == 2


# -- (e) inspection --------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, tuple[object, ...]]:
    """Entries with kind, size, content digest and modification time."""
    out: dict[str, tuple[object, ...]] = {}
    for rel, entry in tree(root).items():
        out[rel] = (*entry, (root / rel).lstat().st_mtime_ns)
    return out


@pytest.mark.parametrize("verify", [True, False])
async def test_inspect_store_reports_without_changing_anything(
    tmp_path: Path, b: Batches, verify: bool, live_pid: int
) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    keys, _ = b.keys(4, seed=8)
    others = _other_keys(3)
    started = time.time()
    async with FileStore(root) as store:
        assert await put_chain(b, store, keys, make_values(4, 8)) == [OK] * 4
        assert await put_chain(b, store, others, make_values(3, 9)) == [OK] * 3
        # one block corrupt in its header, read once so it is quarantined
        raw = bytearray(block_file(root, keys[3]).read_bytes())
        raw[8] ^= 1
        block_file(root, keys[3]).write_bytes(bytes(raw))
        assert (await get_raw(b, store, keys[3:]))[0] == [BlockStatus.CORRUPT]
    finished = time.time()
    # a payload flip (only a verifying inspection sees it)
    raw = bytearray(block_file(root, others[2]).read_bytes())
    raw[-5] ^= 1
    block_file(root, others[2]).write_bytes(bytes(raw))
    # a header flip nobody has read yet
    raw = bytearray(block_file(root, keys[2]).read_bytes())
    raw[100] ^= 1
    block_file(root, keys[2]).write_bytes(bytes(raw))
    # a link out of the root at a block name, to a valid block
    target = outside / "stolen.kvb"
    shutil.copyfile(block_file(root, keys[1]), target)
    block_file(root, keys[1]).unlink()
    block_file(root, keys[1]).symlink_to(target)
    # temporary files: one of a live writer, one abandoned long ago
    _temp_file(root, keys[0], HOST, live_pid)
    _temp_file(root, _unknown_key(4), "some-other-host", 7, age=2 * 3600)
    before, outside_before = _snapshot(root), _snapshot(outside)

    report = inspect_store(str(root), verify=verify)

    assert _snapshot(root) == before, "inspection changed the store"
    assert _snapshot(outside) == outside_before
    assert report.verified is verify
    good = 3 if verify else 4  # keys[0], others[0], others[1] (+ others[2] unverified)
    assert report.blocks == good
    assert report.payload_bytes == good * VALUE
    assert report.disk_bytes == good * (VALUE + HEADER_NBYTES)
    assert report.namespaces == Counter({"conformance": 1, "other": good - 1})
    assert len(report.corrupt) == (3 if verify else 2), report.corrupt
    assert any(str(block_location(keys[1])[1]) in line for line in report.corrupt)
    assert any(str(block_location(keys[2])[1]) in line for line in report.corrupt)
    assert (report.temp_files, report.stale_temp_files) == (2, 1)
    assert report.quarantined == 1
    assert report.catalog_blocks == 6 and report.catalog_bytes == 6 * STORED
    assert report.untracked == 0
    assert report.oldest is not None and report.newest is not None
    assert started <= report.oldest <= report.newest <= finished


async def test_inspect_store_finds_untracked_files(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    async with FileStore(root) as store:
        await store.open()
        _catalog(store).reconcile([keys[0]], lambda keys: [None])  # forget it
    before = _snapshot(root)
    report = inspect_store(str(root), verify=True)
    assert _snapshot(root) == before
    assert (report.blocks, report.catalog_blocks, report.untracked) == (3, 2, 1)
    assert report.corrupt == []


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("when", ["before the header", "after the header"])
async def test_inspect_store_skips_a_block_deleted_while_it_looks(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch, verify: bool, when: str
) -> None:
    """Inspecting a store in use: a block deleted (or evicted) after the walk listed it is
    gone, not corrupt. It was reported corrupt ("unreadable: No such file or directory",
    exit code 1) when removed before its header was read, and with ``verify`` it ended the
    whole inspection with a FileNotFoundError when removed between its header and its
    payload."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    victim = block_file(root, keys[1])
    real_open = os.open

    def open_then_delete(path: Any, *args: Any, **kwargs: Any) -> int:
        if str(path) != str(victim) or not victim.exists():
            return real_open(path, *args, **kwargs)
        if when == "before the header":
            victim.unlink()
            return real_open(path, *args, **kwargs)
        fd = real_open(path, *args, **kwargs)
        victim.unlink()  # the store deletes it once this reader has it open
        return fd

    monkeypatch.setattr(os, "open", open_then_delete)
    report = inspect_store(str(root), verify=verify)
    monkeypatch.undo()
    assert report.corrupt == []
    assert report.blocks in (2, 3)  # read before it went, or skipped
    assert not victim.exists()


async def test_inspect_store_does_not_hang_on_a_fifo(tmp_path: Path, b: Batches) -> None:
    root = tmp_path / "store"
    await _populated(root, b)
    fifo = block_file(root, _unknown_key(5))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo, 0o600)

    async def inspect() -> StoreReport:
        return await anyio.to_thread.run_sync(inspect_store, str(root), True)

    report, hung = await call_unblocking_fifo(fifo, inspect)
    assert not hung, "inspect_store blocked forever on a FIFO in the block tree"
    assert report.blocks == 3 and len(report.corrupt) == 1


# -- (e) a damaged catalog ---------------------------------------------------------------------


def _set_aside(root: Path) -> list[Path]:
    return sorted(root.glob("catalog.sqlite3.damaged-*"))


async def test_a_catalog_that_is_not_a_database_is_replaced_and_the_blocks_adopted(
    tmp_path: Path, b: Batches, caplog: pytest.LogCaptureFixture
) -> None:
    """Overwritten (a disk error, a stray copy): the store opens all the same, with the
    block files adopted into a new catalog; the damaged one and its WAL are kept aside."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    junk = b"not a database" * 1000
    (root / "catalog.sqlite3").write_bytes(junk)
    (root / "catalog.sqlite3-wal").write_bytes(b"stale wal" * 100)
    async with FileStore(root) as store:
        await store.open()
        assert store.statistics()["catalog_replaced"] == 1
        assert store.statistics()["adopted"] == 3
        assert _catalog(store).known_keys() == set(keys)
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))
        assert await put_chain(b, store, _other_keys(1), make_values(1, 9)) == [OK]
    aside = _set_aside(root)
    assert aside[0].name.endswith(f"-{os.getpid()}") and aside[0].read_bytes() == junk
    assert aside[0].with_name(f"{aside[0].name}-wal").read_bytes() == b"stale wal" * 100
    wal = root / "catalog.sqlite3-wal"
    assert not wal.exists() or b"stale wal" not in wal.read_bytes()
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "damaged" in errors[0].getMessage()
    async with FileStore(root) as store:  # sound now: nothing replaced again
        await store.open()
        assert "catalog_replaced" not in store.statistics()
        assert _catalog(store).stats().blocks == 4


async def test_a_catalog_malformed_past_its_first_page_is_replaced(
    tmp_path: Path, b: Batches
) -> None:
    """The header and schema read fine, the tables do not: found by the scan at open."""
    root = tmp_path / "store"
    keys = await _populated(root, b)
    path = root / "catalog.sqlite3"
    data = bytearray(path.read_bytes())
    assert (
        not (root / "catalog.sqlite3-wal").exists()
        or not (root / "catalog.sqlite3-wal").stat().st_size
    )  # checkpointed at close: the pages are in the file
    page = int.from_bytes(data[16:18], "big")
    data[page:] = b"\xa5" * (len(data) - page)
    path.write_bytes(bytes(data))
    async with FileStore(root) as store:
        await store.open()
        assert store.statistics()["catalog_replaced"] == 1
        assert _catalog(store).known_keys() == set(keys)
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))
    assert len(_set_aside(root)) == 1


async def test_a_damaged_catalog_is_rebuilt_even_without_the_scan_at_open(
    tmp_path: Path, b: Batches
) -> None:
    root = tmp_path / "store"
    keys = await _populated(root, b)
    (root / "catalog.sqlite3").write_bytes(b"\0" * 8192)
    async with FileStore(root, scan_on_open=False) as store:
        await store.open()
        assert store.statistics()["adopted"] == 3
        assert _catalog(store).stats().blocks == 3
        assert await get_raw(b, store, keys) == ([OK] * 3, make_values(3, 1))


def test_a_catalog_replaced_by_another_process_meanwhile_is_not_replaced_again(
    tmp_path: Path,
) -> None:
    """Two processes find the catalog damaged at once: the second waits for the first's
    lock, then opens the first's new catalog rather than setting that one aside."""
    import fcntl
    import threading

    from kvpipe.backends.file._catalog import open_or_replace

    root = tmp_path
    path = str(root / "catalog.sqlite3")
    (root / "catalog.sqlite3").write_bytes(b"not a database" * 100)
    lock = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # "the first process", replacing it
    scans: list[bool] = []
    got: list[Any] = []
    second = threading.Thread(
        target=lambda: got.append(open_or_replace(path, "", lambda c, r: scans.append(r)))
    )
    second.start()
    deadline = time.monotonic() + 10
    while not _waits_for_a_flock(os.getpid()):  # its first try failed; it waits for the lock
        assert time.monotonic() < deadline and second.is_alive()
        time.sleep(0.01)
    os.unlink(path)
    Catalog(path).close()  # the first process's new catalog
    fcntl.flock(lock, fcntl.LOCK_UN)
    os.close(lock)
    second.join(10)
    assert not second.is_alive()
    catalog, _, aside = got[0]
    catalog.close()
    assert (aside, scans) == (None, [False])
    assert not _set_aside(root)


def _waits_for_a_flock(pid: int) -> bool:
    """Whether a thread of ``pid`` is blocked waiting for a ``flock`` (``/proc/locks``)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in ln and "FLOCK" in ln and f" {pid} " in ln for ln in lines)


async def test_a_catalog_that_cannot_be_opened_is_not_taken_for_damaged(tmp_path: Path) -> None:
    """A directory at the catalog's name is an error SQLite reports as such (cannot open),
    not damage: the open fails, nothing is moved."""
    root = tmp_path / "store"
    async with FileStore(root) as store:
        await store.open()
    _drop_catalog(root)
    (root / "catalog.sqlite3").mkdir()
    with pytest.raises(kvpipe.BackendError):
        await FileStore(root).open()
    assert (root / "catalog.sqlite3").is_dir()
    assert not _set_aside(root)


# -- (f) reservations of writers that died while the store stays open --------------------------

#: A writer of another container sharing the volume (its own PID namespace: pids this
#: process cannot judge), as its catalog owner token says.
_OTHER_NAMESPACE = "other-container.0123456789abcdef:4242"


def _reserve_as(
    root: Path, owner: str, keys: Sequence[str], parent: str | None, age: float
) -> None:
    """Reserve room for ``keys`` (a chain after ``parent``) as the writer ``owner`` does at
    the start of a put, made ``age`` seconds ago (0: now, a record there already keeping
    its creation time); the writer then dies (never settles), or is still writing."""
    catalog = Catalog(str(root / "catalog.sqlite3"), owner)
    try:
        res = catalog.reserve(keys, parent, SCOPE.namespace, STORED, None, 1 << 40)
        assert res.admitted == [True] * len(keys)
        if not age:
            return
        then = time.time() - age
        with sqlite3.connect(root / "catalog.sqlite3") as db:
            db.executemany(
                "UPDATE blocks SET created=?, last_access=? WHERE key=?",
                [(then, then, k) for k in keys],
            )
    finally:
        catalog.close()


async def test_an_open_store_settles_a_dead_writers_old_reservations_when_it_needs_room(
    tmp_path: Path, b: Batches, caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks in containers (a PID namespace each) sharing a store: a rank killed mid-put
    leaves its reservations unsettled, and the long-lived ranks never reopen the store. Once
    older than ``stale_temp_after`` they must not keep taking capacity, nor pin the chain
    they continue against eviction: a put that needs room settles them."""
    root = tmp_path / "store"
    a, _ = b.keys(4, seed=1)
    d, _ = b.keys(2, seed=2)
    async with FileStore(root, capacity_bytes=4 * STORED, stale_temp_after=STALE) as store:
        assert await put_chain(b, store, a[:2], make_values(2, 1)) == [OK] * 2
        _reserve_as(root, _OTHER_NAMESPACE, a[2:], a[1], age=2 * STALE)
        assert _catalog(store).stats().pending == 2
        assert await put_chain(b, store, d, make_values(2, 2)) == [OK] * 2
        stats = _catalog(store).stats()
        assert (stats.pending, stats.blocks, stats.bytes) == (0, 4, 4 * STORED)
        settled = [r for r in caplog.records if "settled 2 reservation(s)" in r.message]
        assert [r.levelname for r in settled] == ["WARNING"]  # an operator sees it
        assert await get_raw(b, store, [*a[:2], *d]) == (
            [OK] * 4,
            make_values(2, 1) + make_values(2, 2),
        )


async def test_an_open_store_settles_reservations_of_dead_writers_of_its_pid_namespace(
    tmp_path: Path, b: Batches, dead_pid: int
) -> None:
    """A rank of this host (same PID namespace) killed mid-put: its pid says it is dead, so
    a put that needs room settles its reservations at once, however recent."""
    root = tmp_path / "store"
    a, _ = b.keys(4, seed=1)
    d, _ = b.keys(2, seed=2)
    async with FileStore(root, capacity_bytes=4 * STORED, stale_temp_after=STALE) as store:
        assert await put_chain(b, store, a[:2], make_values(2, 1)) == [OK] * 2
        _reserve_as(root, f"{HOST}:{dead_pid}", a[2:], a[1], age=1.0)
        assert await put_chain(b, store, d, make_values(2, 2)) == [OK] * 2
        assert _catalog(store).stats().pending == 0


@pytest.mark.parametrize(
    "owner", [_OTHER_NAMESPACE, "live"], ids=["other-pid-namespace", "live-pid"]
)
async def test_an_open_store_never_settles_a_recent_reservation_it_cannot_judge_dead(
    tmp_path: Path, b: Batches, live_pid: int, owner: str
) -> None:
    """A writer that may be alive (its pid runs, or it is of another PID namespace) and
    reserved less than ``stale_temp_after`` ago is writing: its reservation stays, and the
    chain it continues is not evicted under it."""
    root = tmp_path / "store"
    owner = f"{HOST}:{live_pid}" if owner == "live" else owner
    a, _ = b.keys(4, seed=1)
    d, _ = b.keys(2, seed=2)
    async with FileStore(root, capacity_bytes=4 * STORED, stale_temp_after=STALE) as store:
        assert await put_chain(b, store, a[:2], make_values(2, 1)) == [OK] * 2
        _reserve_as(root, owner, a[2:], a[1], age=STALE / 2)
        assert await put_chain(b, store, d, make_values(2, 2)) == [BlockStatus.NO_SPACE] * 2
        assert _catalog(store).records()[a[2]] == (
            False,
            pytest.approx(time.time() - STALE / 2, abs=60),
            owner,
        )
        assert _catalog(store).stats().pending == 2
        assert await get_raw(b, store, a[:2]) == ([OK] * 2, make_values(2, 1))


async def test_an_open_never_settles_a_recent_reservation_of_an_old_block(
    tmp_path: Path, b: Batches
) -> None:
    """A writer of another PID namespace puts again a block stored long ago: its
    reservation is recent, though the block's record was created more than
    ``stale_temp_after`` ago. A store opened meanwhile must not take it for abandoned, and
    so must not evict the block being written."""
    root = tmp_path / "store"
    a, _ = b.keys(1, seed=1)
    async with FileStore(root, stale_temp_after=STALE) as store:
        assert await put_chain(b, store, a, make_values(1, 1)) == [OK]
    with sqlite3.connect(root / "catalog.sqlite3") as db:
        then = time.time() - 2 * STALE
        db.execute("UPDATE blocks SET created=?, last_access=?", (then, then))
    _reserve_as(root, _OTHER_NAMESPACE, a, None, age=0.0)  # put again just now
    d, _ = b.keys(1, seed=2)
    async with FileStore(root, capacity_bytes=STORED, stale_temp_after=STALE) as store:
        assert _catalog(store).records()[a[0]][0] is False, "a live writer's reservation settled"
        assert await put_chain(b, store, d, make_values(1, 2)) == [BlockStatus.NO_SPACE]
        assert block_file(root, a[0]).exists()


async def test_reads_of_a_block_do_not_keep_a_dead_writers_reservation_of_it_fresh(
    tmp_path: Path, b: Batches
) -> None:
    """A writer of another PID namespace died putting again a block stored before; the old
    block is still read (it is there until replaced). Those reads do not make the dead
    writer's reservation recent: once it is older than ``stale_temp_after``, a put that
    needs room settles it (and may then evict the block)."""
    root = tmp_path / "store"
    a, _ = b.keys(1, seed=1)
    d, _ = b.keys(2, seed=2)
    async with FileStore(root, capacity_bytes=2 * STORED, stale_temp_after=STALE) as store:
        assert await put_chain(b, store, a, make_values(1, 1)) == [OK]
        _reserve_as(root, _OTHER_NAMESPACE, a, None, age=2 * STALE)
        assert await get_raw(b, store, a) == ([OK], make_values(1, 1))
        assert await put_chain(b, store, d, make_values(2, 2)) == [OK] * 2
        assert _catalog(store).stats().pending == 0


#: Another writer of another container, alive and putting now.
_LIVE_OTHER_NAMESPACE = "live-container.fedcba9876543210:777"


@pytest.mark.parametrize("stored", [True, False], ids=["old-block", "new-block"])
async def test_an_open_never_settles_a_reservation_made_again_during_its_scan(
    tmp_path: Path, b: Batches, monkeypatch: pytest.MonkeyPatch, stored: bool
) -> None:
    """A writer of another PID namespace died long ago putting a block (stored before, or
    new), leaving its reservation unsettled. While an open scans the tree (after it read
    the catalog's records), a live writer of another container puts that block again and
    reserves it anew. The open judges the record as it is when it settles it: the live
    writer's fresh reservation stays unsettled (so the block is not evicted under it, and
    its bytes stay reserved), not taken for the dead writer's stale one."""
    root = tmp_path / "store"
    a, _ = b.keys(1, seed=1)
    async with FileStore(root, stale_temp_after=STALE) as store:
        if stored:
            assert await put_chain(b, store, a, make_values(1, 1)) == [OK]
    _reserve_as(root, _OTHER_NAMESPACE, a, None, age=2 * STALE)  # died long ago
    records = Catalog.records

    def then_a_live_writer_reserves(catalog: Catalog) -> dict[str, Any]:
        seen = records(catalog)
        _reserve_as(root, _LIVE_OTHER_NAMESPACE, a, None, age=0.0)  # during the walk
        return seen

    monkeypatch.setattr(Catalog, "records", then_a_live_writer_reserves)
    d, _ = b.keys(1, seed=2)
    async with FileStore(root, capacity_bytes=STORED, stale_temp_after=STALE) as store:
        monkeypatch.setattr(Catalog, "records", records)
        ready, _, owner = _catalog(store).records()[a[0]]
        assert (ready, owner) == (False, _LIVE_OTHER_NAMESPACE), "a live reservation settled"
        assert await put_chain(b, store, d, make_values(1, 2)) == [BlockStatus.NO_SPACE]
        assert block_file(root, a[0]).exists() is stored
