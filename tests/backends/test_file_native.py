"""The file store's C extension on its own: confined batch reads, probes and atomic batch
writes, and what each answers for missing files, links, FIFOs, wrong sizes and abandonment."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpipe.backends.file import _native

from .fault_shim import run_with_faults

fileio = _native.fileio
pytestmark = pytest.mark.skipif(fileio is None, reason="the C extension was not built")


@pytest.fixture
def root(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    (tmp_path / "d").mkdir()
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield tmp_path, fd
    finally:
        os.close(fd)


def test_read_files_fills_views_in_order_and_counts(root: tuple[Path, int]) -> None:
    path, fd = root
    (path / "d" / "a").write_bytes(b"0123456789")
    (path / "d" / "b").write_bytes(b"xy")
    head, body, extra = bytearray(4), bytearray(4), bytearray(8)
    head2 = bytearray(4)
    got = fileio.read_files(
        fd,
        [b"d/a", b"d/b"],
        [[memoryview(head), memoryview(body), memoryview(extra)], [memoryview(head2)]],
        False,
    )
    assert got == [10, 2]
    assert (bytes(head), bytes(body), bytes(extra[:2])) == (b"0123", b"4567", b"89")
    assert bytes(head2[:2]) == b"xy"


def test_read_files_reports_what_it_cannot_read(root: tuple[Path, int]) -> None:
    path, fd = root
    (path / "d" / "ok").write_bytes(b"data")
    os.mkfifo(path / "d" / "fifo")
    (path / "d" / "dir").mkdir()
    (path.parent / "secret").write_bytes(b"secret")
    os.symlink(path.parent / "secret", path / "d" / "link")
    names = [b"d/missing", b"d/fifo", b"d/dir", b"d/link", b"../secret", b"/etc/hostname"]
    bufs = [bytearray(16) for _ in names]
    got = fileio.read_files(fd, names, [[memoryview(b)] for b in bufs], False)
    assert got[0] == -errno.ENOENT
    assert got[1] == fileio.NOT_REGULAR and got[2] == fileio.NOT_REGULAR
    assert got[3] == -errno.ELOOP  # a link is never followed
    assert got[4] == -errno.EXDEV and got[5] == -errno.EXDEV  # nothing outside the root
    assert all(b == bytearray(16) for b in bufs)  # nothing was read into any buffer


def test_read_files_rejects_read_only_buffers_and_bad_arguments(root: tuple[Path, int]) -> None:
    _, fd = root
    with pytest.raises(BufferError):
        fileio.read_files(fd, [b"d/x"], [[memoryview(b"readonly")]], False)
    with pytest.raises(TypeError):
        fileio.read_files(fd, ["d/x"], [[memoryview(bytearray(1))]], False)
    with pytest.raises(ValueError):
        fileio.read_files(fd, [b"d/x"], [], False)
    with pytest.raises(ValueError):
        fileio.read_files(fd, [b"d/x"], [[memoryview(bytearray(1))] * 17], False)


def test_file_sizes_stops_at_the_first_miss(root: tuple[Path, int]) -> None:
    path, fd = root
    for name, size in (("a", 1), ("b", 0), ("d", 3)):
        (path / "d" / name).write_bytes(b"x" * size)
    os.symlink(path / "d" / "a", path / "d" / "link")
    paths = [b"d/a", b"d/b", b"d/c", b"d/d"]
    assert fileio.file_sizes(fd, paths, True) == [1, 0, -1, -1]
    assert fileio.file_sizes(fd, paths, False) == [1, 0, -1, 3]
    assert fileio.file_sizes(fd, [b"d/link", b"d", b"../d/a"], False) == [-1] * 3


@contextlib.contextmanager
def no_free_fds() -> Iterator[None]:
    """Every file descriptor this process may open in use (``EMFILE``), as in a busy server,
    until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open(os.devnull, os.O_RDONLY)  # the lowest free descriptor: all below in use
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_file_sizes_tells_a_file_it_cannot_look_at_from_a_missing_one(
    root: tuple[Path, int],
) -> None:
    """An open that failed for any reason (``EMFILE``, ``EACCES``, ``EIO``...) read as a
    missing file (-1), and the catalog dropped the records of blocks still on disk: only a
    path that is not there (or not a regular file) is -1; another failure is ``-1 - errno``."""
    path, fd = root
    (path / "d" / "a").write_bytes(b"abc")
    with no_free_fds():
        got = fileio.file_sizes(fd, [b"d/a", b"d/gone"], False)
        stopped = fileio.file_sizes(fd, [b"d/a", b"d/a"], True)
    assert got == [-1 - errno.EMFILE, -1 - errno.EMFILE]  # neither could be looked at
    assert stopped == [-1 - errno.EMFILE, -1]  # stops there: not known to be there
    assert fileio.file_sizes(fd, [b"d/a", b"d/gone"], False) == [3, -1]


def test_write_files_publishes_atomically(root: tuple[Path, int]) -> None:
    path, fd = root
    flag = bytearray(1)
    got = fileio.write_files(
        fd,
        [b"d", b"d"],
        [b".a.tmp", b".b.tmp"],
        [b"a", b"b"],
        [[b"head", memoryview(b"-body")], [b"b"]],
        1,
        False,
        flag,
    )
    assert got == [0, 0]
    assert (path / "d" / "a").read_bytes() == b"head-body"
    assert (path / "d" / "b").read_bytes() == b"b"
    assert sorted(os.listdir(path / "d")) == ["a", "b"]  # no temporary file left
    assert oct((path / "d" / "a").stat().st_mode & 0o777) == "0o600"


def test_write_files_publishes_empty_chunks_as_the_python_path_does(
    root: tuple[Path, int],
) -> None:
    """Empty chunks are written as nothing wherever they are, as ``write_all`` skips them:
    a file whose chunks are all empty is published empty (it once failed with EIO, the
    first write of nothing taken for a device that takes no more)."""
    path, fd = root
    got = fileio.write_files(
        fd,
        [b"d", b"d", b"d"],
        [b".a.tmp", b".b.tmp", b".c.tmp"],
        [b"a", b"b", b"c"],
        [[b""], [b"", b""], [b"", b"x", b""]],
        1,
        False,
        bytearray(1),
    )
    assert got == [0, 0, 0]
    assert [(path / "d" / n).read_bytes() for n in "abc"] == [b"", b"", b"x"]
    assert sorted(os.listdir(path / "d")) == ["a", "b", "c"]  # no temporary file left


def test_write_files_publishes_nothing_once_abandoned(root: tuple[Path, int]) -> None:
    path, fd = root
    flag = bytearray(b"\x01")
    got = fileio.write_files(fd, [b"d"], [b".a.tmp"], [b"a"], [[b"x"]], 2, False, flag)
    assert got == [fileio.ABANDONED]
    assert os.listdir(path / "d") == []


def test_write_files_failures_leave_no_temporary_file(root: tuple[Path, int]) -> None:
    path, fd = root
    (path / "d" / ".busy.tmp").write_bytes(b"someone else's")
    (path / "elsewhere").mkdir()
    os.symlink(path / "elsewhere", path / "linkdir")
    got = fileio.write_files(
        fd,
        [b"missing", b"d", b"linkdir", b"/tmp"],
        [b".t1", b".busy.tmp", b".t3", b".t4"],
        [b"a", b"b", b"c", b"e"],
        [[b"1"], [b"2"], [b"3"], [b"4"]],
        1,
        False,
        bytearray(1),
    )
    assert got[:2] == [-errno.ENOENT, -errno.EEXIST] and got[3] == -errno.EXDEV
    assert got[2] in (-errno.ELOOP, -errno.ENOTDIR)  # a linked directory is never entered
    assert os.listdir(path / "d") == [".busy.tmp"]  # untouched, nothing published
    assert os.listdir(path / "elsewhere") == []


# A file's views or chunks may be any iterable: taking them runs Python code, which here
# empties the list of paths (or names) the call was given, the only reference to them. The
# calls read those lists as they went (and kept pointers into their bytes), so they went on
# past the emptied list and read freed paths: a segfault. They hold what they were given.
_LISTS_EMPTIED = """
import os, sys
from kvpipe.backends.file._native import fileio
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
paths = [b"d/" + name for name in (b"in-a", b"in-b")]  # made here: the list's own
bufs = [bytearray(8), bytearray(8)]
def empty_paths():
    paths.clear()
    yield memoryview(bufs[0])
print(fileio.read_files(fd, paths, [empty_paths(), [memoryview(bufs[1])]], False), bufs)
names = [b"out-" + name for name in (b"a", b"b")]
def empty_names():
    names.clear()
    yield b"chunk-a"
chunks = [empty_names(), [b"chunk-b"]]
print(fileio.write_files(fd, [b"d", b"d"], [b".t-a", b".t-b"], names, chunks, 0, False, b"\\0"))
"""


def test_calls_hold_the_lists_they_were_given(root: tuple[Path, int]) -> None:
    path, _ = root
    (path / "d" / "in-a").write_bytes(b"first")
    (path / "d" / "in-b").write_bytes(b"second")
    child = subprocess.run(  # a crash must fail this test, not end the run
        [sys.executable, "-c", _LISTS_EMPTIED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, (child.returncode, child.stderr)
    assert child.stdout.splitlines() == [
        "[5, 6] [bytearray(b'first\\x00\\x00\\x00'), bytearray(b'second\\x00\\x00')]",
        "[0, 0]",
    ]
    assert (path / "d" / "out-a").read_bytes() == b"chunk-a"
    assert (path / "d" / "out-b").read_bytes() == b"chunk-b"


def test_write_files_takes_temps_and_names_only_as_names_in_their_directory(
    tmp_path: Path,
) -> None:
    """A temporary file or a final name is one path component, as the Python path checks
    (``Root.write_atomic``): anything else (a ``/``, ``..``) is refused, file by file, never
    written out of the store or through a link. (The directory was confined, but a name was
    taken as is: ``../../escaped`` was published beside the root, ``sub/z`` through a link.)"""
    (tmp_path / "store" / "d").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "store" / "d" / "sub")
    temps = [b".t1", b"../../.t2", b"sub/.t3", b".t4", b".t5", b".t6", b""]
    names = [b"../../escaped", b"x", b"y", b"sub/z", b"..", b".", b"w"]
    fd = os.open(tmp_path / "store", os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = fileio.write_files(
            fd,
            [b"d"] * len(names),
            temps,
            names,
            [[b"data"]] * len(names),
            0,
            False,
            bytearray(1),
        )
    finally:
        os.close(fd)
    assert got == [-errno.EINVAL] * len(names)
    assert os.listdir(tmp_path / "store" / "d") == ["sub"]
    assert os.listdir(tmp_path / "elsewhere") == []
    assert sorted(os.listdir(tmp_path)) == ["elsewhere", "store"]


_SPARE_FIFO = """
import os, sys
from kvpipe.backends.file._native import fileio
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
spares = [b"d/.spare"]
print(fileio.write_files(fd, [b"d"], [b".t"], [b"a"], [[b"data"]], 0, False, bytearray(1), spares))
"""


def test_write_files_does_not_wait_on_a_fifo_at_a_spare(root: tuple[Path, int]) -> None:
    """Something else than a regular file at a spare's name (a FIFO put there) is not
    reused: the write goes to a new file. (Opening the FIFO for writing waited for a reader,
    for ever, with the store's thread in it.)"""
    path, _ = root
    os.mkfifo(path / "d" / ".spare")
    try:
        child = subprocess.run(
            [sys.executable, "-c", _SPARE_FIFO, str(path)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("write_files waited on the FIFO")
    assert child.returncode == 0, (child.returncode, child.stderr)
    assert child.stdout.split() == ["[0]"]
    assert (path / "d" / "a").read_bytes() == b"data"
    assert os.listdir(path / "d") == ["a"]  # the spare's name was removed, as any unused


_WRITE_OVER_SPARE = """
import json, os
from kvpipe.backends.file import _fileio
fd = os.open({root!r}, os.O_RDONLY | os.O_DIRECTORY)
print(json.dumps(_fileio.write_files(
    fd, [b"d"], [b".t"], [b"a"], [[b"new"]], 0, False, bytearray(1), [b"d/.spare"]
)))
"""


def test_write_files_cuts_a_longer_spare_even_where_fstat_fails(root: tuple[Path, int]) -> None:
    """A reused spare longer than the new block is cut to its length; where looking at its
    size (fstat) failed, the cut was skipped and the block published with the old file's
    bytes past it (read later as corrupt)."""
    path, _ = root
    (path / "d" / ".spare").write_bytes(b"an old and longer block")
    code = _WRITE_OVER_SPARE.format(root=str(path))
    got = run_with_faults(path, code, KVPIPE_FAULT_FSTAT_AFTER_WRITE="1")
    assert got == [0]
    assert (path / "d" / "a").read_bytes() == b"new"
    assert os.listdir(path / "d") == ["a"]
