"""Deleted block files kept for later puts (``FileStore(spare_bytes=...)``): reused in place,
bounded, removed at close and when the disk is full, and never written over while a reader
holds one or read as a block once it has been reused."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import pytest
import xxhash

import kvpipe
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus
from kvpipe.backends._base import FetchSink
from kvpipe.backends.file import _native, _writes
from kvpipe.backends.file import store as store_module
from kvpipe.backends.file._format import is_temp_name
from kvpipe.backends.file._fs import Root, still_block
from kvpipe.testing.batches import Batches

from .fault_shim import run_with_faults
from .test_file_direct import LARGE, values
from .test_file_hostile import block_file

fileio = _native.fileio
native = pytest.mark.skipif(fileio is None, reason="the C extension was not built")


@asynccontextmanager
async def batches() -> AsyncIterator[Batches]:
    pool = StagingPool(LARGE, 16)
    async with ThreadRunner() as runner:
        yield Batches(pool, runner)


def with_shards(root: Path) -> Path:
    """``root`` with every shard directory of the test keys' namespace made, as in a store
    that has held a few thousand blocks (a put into a shard not yet there takes the os
    path, which makes it, and a new file)."""
    for i in range(256):
        (root / "blocks" / "conformance" / f"{i:02x}").mkdir(parents=True, exist_ok=True)
    return root


def locked(path: Path, how: int) -> int:
    """A descriptor of ``path`` holding a ``flock`` of kind ``how``."""
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, how)
    return fd


def spares_on_disk(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and is_temp_name(p.name)]


async def put(store: kvpipe.FileStore, b: Batches, n: int, seed: int) -> tuple[str, ...]:
    keys, _ = b.keys(n, seed=seed)
    assert await b.put(store, keys, values(n, b.pool.slot_nbytes, seed)) == [BlockStatus.OK] * n
    return keys


@native
@pytest.mark.parametrize("durability", ["none", "data"])
async def test_a_deleted_block_file_is_written_over_by_the_next_put(
    tmp_path: Path, durability: str
) -> None:
    with_shards(tmp_path)
    async with kvpipe.FileStore(tmp_path, durability=durability) as store, batches() as b:  # type: ignore[arg-type]
        old = await put(store, b, 3, seed=1)
        inodes = {block_file(tmp_path, k).stat().st_ino for k in old}
        await store.delete(old)
        assert store.statistics()["spare_files"] == 3
        assert len(spares_on_disk(tmp_path)) == 3
        assert not any(block_file(tmp_path, k).exists() for k in old)
        assert (await b.get(store, old))[0] == [BlockStatus.MISSING] * 3
        new = await put(store, b, 3, seed=2)
        assert {block_file(tmp_path, k).stat().st_ino for k in new} == inodes  # no new file
        assert store.statistics()["spare_files"] == 0 and spares_on_disk(tmp_path) == []
        statuses, got = await b.get(store, new)
        assert statuses == [BlockStatus.OK] * 3
        assert got == values(3, b.pool.slot_nbytes, 2)


@native
async def test_a_reused_file_longer_than_the_new_block_is_cut_to_length(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (tmp_path / "d").mkdir()
        (tmp_path / "d" / ".old.tmp").write_bytes(b"x" * 10_000)
        assert fileio is not None
        spares = [b"d/.old.tmp"]
        got = fileio.write_files(
            fd, [b"d"], [b".new.tmp"], [b"new"], [[b"fresh"]], 1, False, bytearray(1), spares
        )
    finally:
        os.close(fd)
    assert got == [0]
    assert (tmp_path / "d" / "new").read_bytes() == b"fresh"
    assert os.listdir(tmp_path / "d") == ["new"]


@native
async def test_spares_are_bounded_and_removed_at_close(tmp_path: Path) -> None:
    async with batches() as b:
        async with kvpipe.FileStore(tmp_path / "s", durability="none") as store:
            keys = await put(store, b, 4, seed=1)
            size = block_file(tmp_path / "s", keys[0]).stat().st_size
        async with kvpipe.FileStore(
            tmp_path / "s", durability="none", spare_bytes=size * 5 // 2
        ) as store:
            await store.delete(keys)
            assert store.statistics()["spare_files"] == 2
            assert store.statistics()["spare_bytes"] == 2 * size
            assert len(spares_on_disk(tmp_path / "s")) == 2  # the others removed
        assert spares_on_disk(tmp_path / "s") == []
        async with kvpipe.FileStore(tmp_path / "s", spare_bytes=0) as store:
            keys = await put(store, b, 2, seed=2)
            await store.delete(keys)
            assert store.statistics()["spare_files"] == 0
            assert spares_on_disk(tmp_path / "s") == []


@native
async def test_evicted_block_files_are_reused_by_the_put_that_evicted_them(tmp_path: Path) -> None:
    async with batches() as b, kvpipe.FileStore(tmp_path / "p") as probe:
        size = block_file(tmp_path / "p", (await put(probe, b, 1, seed=9))[0]).stat().st_size
    root = with_shards(tmp_path / "s")
    async with batches() as b, kvpipe.FileStore(root, capacity_bytes=4 * size) as store:
        first = await put(store, b, 4, seed=1)
        inodes = {block_file(root, k).stat().st_ino for k in first}
        new = await put(store, b, 2, seed=2)  # evicts two of the first
        stats = store.statistics()
        assert stats["evictions"] == 2
        assert stats["spare_files"] == 0 and spares_on_disk(root) == []
        assert {block_file(root, k).stat().st_ino for k in new} <= inodes


@native
async def test_spares_taken_by_a_write_that_fails_before_writing_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put takes spare files, then fails before its native call (out of memory for its
    headers): the spares are removed, not left on disk outside the pool."""
    with_shards(tmp_path)
    async with kvpipe.FileStore(tmp_path, durability="none") as store, batches() as b:
        await store.delete(await put(store, b, 2, seed=1))
        assert store.statistics()["spare_files"] == 2 and len(spares_on_disk(tmp_path)) == 2

        def no_memory(*args: object) -> None:
            raise MemoryError("no memory for its headers")

        monkeypatch.setattr(_writes, "_chunks", no_memory)
        keys, _ = b.keys(2, seed=2)
        got = await b.put(store, keys, values(2, b.pool.slot_nbytes, 2))
        monkeypatch.undo()
        assert got == [BlockStatus.FAILED] * 2
        assert store.statistics()["spare_files"] == 0
        assert spares_on_disk(tmp_path) == []
        assert await put(store, b, 2, seed=3)  # and the store writes on


async def test_without_the_native_writer_deleted_files_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native, "fileio", None)  # only the native writer reuses files
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        await store.delete(await put(store, b, 3, seed=1))
        assert store.statistics()["spare_files"] == 0
        assert spares_on_disk(tmp_path) == []


@native
async def test_a_full_disk_lets_the_spares_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with kvpipe.FileStore(tmp_path) as store, batches() as b:
        await store.delete(await put(store, b, 3, seed=1))
        assert store.statistics()["spare_files"] == 3
        monkeypatch.setattr(store_module, "room", lambda root: 0)
        keys, _ = b.keys(2, seed=2)
        got = await b.put(store, keys, values(2, b.pool.slot_nbytes, 2))
        assert got == [BlockStatus.NO_SPACE] * 2
        assert store.statistics()["spare_files"] == 0 and spares_on_disk(tmp_path) == []


@native
async def test_a_spare_a_reader_holds_is_not_written_over(tmp_path: Path) -> None:
    async with kvpipe.FileStore(tmp_path, durability="none") as store, batches() as b:
        with_shards(tmp_path)
        old = await put(store, b, 1, seed=1)
        before = block_file(tmp_path, old[0]).read_bytes()
        reader = locked(block_file(tmp_path, old[0]), fcntl.LOCK_SH)  # a reader mid-read
        try:
            await store.delete(old)
            new = await put(store, b, 1, seed=2)
            assert os.fstat(reader).st_ino != block_file(tmp_path, new[0]).stat().st_ino
            assert os.pread(reader, len(before), 0) == before  # what it opened
        finally:
            os.close(reader)
        assert spares_on_disk(tmp_path) == []  # let go of, not kept
        assert (await b.get(store, new))[0] == [BlockStatus.OK]


@pytest.mark.usefixtures("file_io")
async def test_a_block_file_being_written_over_reads_as_missing(tmp_path: Path) -> None:
    async with kvpipe.FileStore(tmp_path, durability="none") as store, batches() as b:
        keys = await put(store, b, 1, seed=1)
        writer = locked(block_file(tmp_path, keys[0]), fcntl.LOCK_EX)  # a writer reusing it
        try:
            statuses, _ = await b.get(store, keys)
        finally:
            os.close(writer)
        assert statuses == [BlockStatus.MISSING]
        assert store.statistics().get("corrupt", 0) == 0
        assert (await b.get(store, keys))[0] == [BlockStatus.OK]  # the lock gone


def test_a_file_renamed_after_it_was_opened_is_no_longer_the_block(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "f"
    path.write_bytes(b"block")
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        assert still_block(fd, st)
        time.sleep(0.02)  # past the file system's timestamp tick, where ctime is coarse
        os.rename(path, tmp_path / "d" / ".spare.tmp")  # deleted, and
        os.rename(tmp_path / "d" / ".spare.tmp", path)  # published again as another block
        assert not still_block(fd, st)
    finally:
        os.close(fd)
    root = Root(tmp_path)
    try:
        assert root.read_into(("d",), "f", [memoryview(bytearray(8))]) == 5
    finally:
        root.close()


class _CopySink(FetchSink):
    """Takes mapped values: keeps a copy of each that hashes to its checksum."""

    maps = True

    def __init__(self) -> None:
        self.got: dict[int, bytes] = {}

    def fetched(
        self, index: int, checksum: int, value: memoryview | None = None, *, mapped: bool = False
    ) -> bool:
        assert value is not None and mapped
        data = bytes(value)
        if xxhash.xxh3_64_intdigest(data) != checksum:
            return False
        self.got[index] = data
        return True


@pytest.mark.parametrize(
    "mapped", [False, pytest.param(True, marks=native)], ids=["read", "mapped"]
)
async def test_reads_racing_deletes_and_reuse_are_right_or_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mapped: bool
) -> None:
    """Read, or mapped for a read (a mapped file stays locked, so a put reusing deleted
    files never writes over it): what is read is right or missing, never corrupt."""
    if mapped:
        monkeypatch.setattr(store_module, "MAPPED_FROM_NBYTES", 0)
    root = with_shards(tmp_path)
    handed = 0
    async with kvpipe.FileStore(root, durability="none", threads=2) as store, batches() as b:

        async def get(keys: tuple[str, ...]) -> tuple[list[BlockStatus], list[bytes]]:
            nonlocal handed
            sink = _CopySink() if mapped else None
            statuses, got = await b.get(store, keys, sink)
            if sink is not None:
                handed += len(sink.got)
                got = [sink.got.get(i, value) for i, value in enumerate(got)]
            return statuses, got

        for r in range(12):
            keys = await put(store, b, 6, seed=r)
            want = values(6, b.pool.slot_nbytes, r)

            async def read(
                *,
                task_status: anyio.abc.TaskStatus[None],
                keys: tuple[str, ...] = keys,
                want: list[bytes] = want,
            ) -> None:
                assert await get(keys) == ([BlockStatus.OK] * 6, want)  # before the race
                task_status.started()
                for _ in range(3):
                    statuses, got = await get(keys)
                    for status, value, expected in zip(statuses, got, want, strict=True):
                        assert status in (BlockStatus.OK, BlockStatus.MISSING)
                        assert status is not BlockStatus.OK or value == expected

            async def replace(keys: tuple[str, ...] = keys, r: int = r) -> None:
                await store.delete(keys)
                await put(store, b, 6, seed=1000 + r)  # written over the deleted files

            async with anyio.create_task_group() as tg:
                await tg.start(read)
                tg.start_soon(replace)
        assert store.statistics().get("corrupt", 0) == 0
    assert handed > 0 or not mapped


@native
async def test_a_mapped_block_file_is_not_written_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block is deleted and a put that would reuse its file runs while the file is
    mapped for a read: the put writes elsewhere, and the read gets the bytes it mapped."""
    monkeypatch.setattr(store_module, "MAPPED_FROM_NBYTES", 0)
    with_shards(tmp_path)
    async with kvpipe.FileStore(tmp_path, durability="none", threads=2) as store, batches() as b:
        keys = await put(store, b, 1, seed=1)
        want = values(1, b.pool.slot_nbytes, 1)[0]

        async def replace() -> None:
            await store.delete(keys)
            await put(store, b, 1, seed=2)  # would write over the deleted file

        class Racing(_CopySink):
            def fetched(
                self,
                index: int,
                checksum: int,
                value: memoryview | None = None,
                *,
                mapped: bool = False,
            ) -> bool:
                anyio.from_thread.run(replace, token=token)
                return super().fetched(index, checksum, value, mapped=mapped)

        token = anyio.lowlevel.current_token()
        sink = Racing()
        with anyio.fail_after(30):  # a guard against a hang, not a timing
            statuses, _ = await b.get(store, keys, sink)
        assert statuses == [BlockStatus.OK] and sink.got[0] == want
        assert store.statistics().get("corrupt", 0) == 0


def _holds_write_flock(st: os.stat_result, pid: int) -> bool:
    """Whether ``/proc/locks`` shows process ``pid`` holding an exclusive ``flock`` on the
    file of ``st``."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in Path("/proc/locks").read_text().splitlines():
        f = line.split()
        if "->" not in f and f[1:6] == ["FLOCK", "ADVISORY", "WRITE", str(pid), dev]:
            return True
    return False


def _fork_holding(st: os.stat_result) -> tuple[int, int, bool]:
    """Fork a child (no exec) that says whether it inherited a descriptor of the file of
    ``st``, then waits for a byte on its pipe and exits at once. Returns its pid, the pipe's
    write end, and what it said."""
    said_r, said_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but system calls, then _exit
        try:
            held = False
            for name in os.listdir("/proc/self/fd"):
                with contextlib.suppress(OSError):
                    mine = os.fstat(int(name))
                    held |= (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)
            os.write(said_w, b"1" if held else b"0")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(said_w)
    os.close(go_r)
    try:
        said = os.read(said_r, 1)
    finally:
        os.close(said_r)
    return pid, go_w, said == b"1"


def _write_over(root: int, spare: bytes, value: bytes, got: list[list[int]]) -> None:
    """Publish ``value`` as ``d/a`` under ``root`` over the spare file ``spare`` in one
    native call; its result into ``got``."""
    assert fileio is not None
    args = ([b"d"], [b".a.tmp"], [b"a"], [[value]], 0, False, bytearray(1), [spare])
    got.append(fileio.write_files(root, *args))


@native
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_a_spare_is_rewritten_does_not_hide_the_block(
    tmp_path: Path,
) -> None:
    """A process that forks (without exec: multiprocessing's fork, a data loader's
    workers) while the native writer holds the exclusive ``flock`` of a spare it is writing
    over: the child shares the descriptor's open file description, so a lock left to
    ``close`` would stay held by the child after the write, and every reader would read the
    published block as missing until the child exits."""
    assert fileio is not None
    (tmp_path / "d").mkdir()
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    value = b"v" * (64 << 20)  # a write long enough to fork during it
    try:
        for attempt in range(20):  # until the fork lands while the writer holds the file
            spare = tmp_path / "d" / f".spare{attempt}.tmp"
            spare.write_bytes(b"old block")
            st = spare.stat()
            got: list[list[int]] = []
            args = (root, f"d/{spare.name}".encode(), value, got)
            writer = threading.Thread(target=_write_over, args=args)
            writer.start()
            child = None
            try:
                while writer.is_alive() and child is None:
                    if _holds_write_flock(st, os.getpid()):
                        child = _fork_holding(st)
            finally:
                writer.join()
            assert got == [[0]]
            assert os.stat(tmp_path / "d" / "a").st_ino == st.st_ino  # the spare was reused
            if child is None:
                continue
            pid, go, inherited = child
            try:
                fd = os.open(tmp_path / "d" / "a", os.O_RDONLY)
                try:
                    readable = still_block(fd, os.fstat(fd))
                finally:
                    os.close(fd)
            finally:
                os.write(go, b"!")
                os.close(go)
                os.waitpid(pid, 0)
            if inherited:
                assert readable, "the forked child kept the writer's lock: the block read missing"
                return
        pytest.skip("no fork landed while the writer held the spare")
    finally:
        os.close(root)


def _renamed_over(path: Path, fresh: bytes, times: int) -> tuple[object, list[int]]:
    """A ``flock`` that, at each of a reader's first ``times`` shared locks (between its
    open and its check), publishes ``fresh`` over ``path`` as a put does (rename over the
    name), past the file system's time tick; and the calls seen."""
    real = fcntl.flock
    calls: list[int] = []

    def flock(fd: int, how: int) -> None:
        calls.append(how)
        if how & fcntl.LOCK_SH and len(calls) <= times:
            time.sleep(0.02)  # where ctime is coarse: the rename must change it
            new = path.with_name(f".new{len(calls)}.tmp")
            new.write_bytes(fresh)
            os.replace(new, path)
        real(fd, how)

    return flock, calls


def test_a_block_renamed_over_while_opened_is_read_not_missed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put publishing the key again (rename over the name) between a reader's open and its
    check changes the opened file's ctime (it was unlinked): a valid block sat at the name
    all along, so the reader opens it again rather than read a miss."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "f"
    path.write_bytes(b"old block")
    flock, calls = _renamed_over(path, b"new block", times=1)
    monkeypatch.setattr(fcntl, "flock", flock)
    root = Root(tmp_path)
    try:
        buf = bytearray(16)
        assert root.read_into(("d",), "f", [memoryview(buf)]) == 9
        assert bytes(buf[:9]) == b"new block"
    finally:
        root.close()
    assert len(calls) == 2  # opened again once


def test_a_block_renamed_over_at_every_open_is_opened_again_only_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "f"
    path.write_bytes(b"old block")
    flock, calls = _renamed_over(path, b"new block", times=99)
    monkeypatch.setattr(fcntl, "flock", flock)
    root = Root(tmp_path)
    try:
        assert root.read_into(("d",), "f", [memoryview(bytearray(16))]) is None
    finally:
        root.close()
    assert len(calls) == 2


_READ_RENAMED = """
import json, os
from kvpipe.backends.file import _fileio
root = os.open({root!r}, os.O_RDONLY | os.O_DIRECTORY)
buf = bytearray(16)
got = _fileio.{call}(root, [b"d/f"], [[memoryview(buf)]]{extra})
print(json.dumps([got, bytes(buf).decode()]))
"""


@native
@pytest.mark.parametrize(("call", "extra"), [("read_files", ", False"), ("read_cached_files", "")])
def test_the_native_reader_reads_a_block_renamed_over_while_opened(
    tmp_path: Path, call: str, extra: str
) -> None:
    """As :func:`test_a_block_renamed_over_while_opened_is_read_not_missed`, through the C
    extension (the rename is made by the preloaded fault injector, at the reader's lock)."""
    (tmp_path / "d").mkdir()
    path = tmp_path / "d" / "f"
    path.write_bytes(b"old block")
    (tmp_path / "d" / ".new.tmp").write_bytes(b"new block")
    code = _READ_RENAMED.format(root=str(tmp_path), call=call, extra=extra)
    rename = f"{tmp_path / 'd' / '.new.tmp'}\t{path}"
    got, buf = run_with_faults(tmp_path, code, KVPIPE_FAULT_RENAME=rename)
    assert got == [9]
    assert buf.startswith("new block")
