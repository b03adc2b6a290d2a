"""A file system that refuses ``O_DIRECT`` only after ``open`` has created the file (ramfs;
tmpfs before Linux 6.6): asking for direct I/O there must leave no file behind.

The disk is a ramfs mounted by the test (:func:`tests.helpers.mounted`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvpipe
from kvpipe.backends.file import FileStore, _native
from kvpipe.backends.file._direct import PAGE, Scratch, probe_direct
from kvpipe.backends.file._fs import DirectIORefused, Root
from tests.helpers import fill_random, mounted, needs_native_fileio

LAYOUT = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=512, rope_dim=64, block_size=16)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A fresh ramfs, unmounted afterwards."""
    mnt = tmp_path / "ram"
    mnt.mkdir()
    with mounted(mnt, "ramfs", "mode=0700"):
        probe = mnt / "probe"
        try:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600))
            pytest.skip("this ramfs takes O_DIRECT")
        except OSError as exc:
            assert exc.errno == errno.EINVAL
            assert probe.exists(), "the refusal this file is about: created, then EINVAL"
            probe.unlink()
        yield mnt


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_direct_probe_leaves_nothing(ramfs: Path) -> None:
    fd = os.open(ramfs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert probe_direct(fd, Scratch()) is False
    finally:
        os.close(fd)
    assert _files(ramfs) == []


def test_a_refused_direct_write_leaves_no_temporary_file(ramfs: Path) -> None:
    root = Root(ramfs)
    page = memoryview(np.zeros(PAGE, np.uint8)).cast("B")
    with pytest.raises(DirectIORefused):
        root.write_atomic(["d"], "a", [page], "data", lambda: False, True)
    assert _files(ramfs) == []


def test_a_refused_native_direct_write_leaves_no_temporary_file(ramfs: Path) -> None:
    needs_native_fileio()
    fileio = _native.fileio
    assert fileio is not None
    (ramfs / "d").mkdir()
    page = memoryview(np.zeros(PAGE, np.uint8)).cast("B")
    fd = os.open(ramfs, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = fileio.write_files(fd, [b"d"], [b".a.tmp"], [b"a"], [[page]], 1, True, bytearray(1))
    finally:
        os.close(fd)
    assert got == [-errno.EINVAL]
    assert _files(ramfs) == []


async def test_a_durable_store_on_it_writes_reads_and_leaves_only_its_own_files(
    ramfs: Path,
) -> None:
    cache = kvpipe.create_kv_cache(LAYOUT, 8)
    fill_random(cache, seed=3)
    tokens = np.arange(4 * 16)
    store = FileStore(ramfs / "store", durability="data")
    async with store, kvpipe.open_pipeline(cache, store) as pipe:
        assert (await pipe.write(tokens, [0, 1, 2, 3])).written == 4
        assert (await pipe.read(tokens, [4, 5, 6, 7])).loaded == 4
    for rows in cache.byte_rows:
        assert np.array_equal(rows[4:8], rows[0:4])
    assert not [f for f in _files(ramfs) if "probe" in f or ".tmp" in f], _files(ramfs)
