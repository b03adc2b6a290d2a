"""The plain-code contenders of the file-store benchmark (blocking; run in threads): raw
writes and reads of one file per block through the page cache or with ``O_DIRECT``, the
hand-written read-then-scatter into a layer-major cache, and page-cache control (warm, evict).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = (
    "drop_cached",
    "hand_read",
    "page_aligned_copy",
    "raw_read",
    "raw_write",
    "warm_cached",
)


def raw_write(
    root: str, buf: np.ndarray, threads: int, durability: str, direct: bool = False
) -> None:
    """Write each row of ``buf`` to its own file under ``root``, ``threads`` at a time, with
    ``durability``'s syncs; ``direct``: with ``O_DIRECT`` (rows page-aligned whole pages)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)

    def one(i: int) -> None:
        fd = os.open(os.path.join(root, f"{i}.blk"), flags, 0o600)
        try:
            view = memoryview(buf[i]).cast("B")
            while view:
                view = view[os.write(fd, view) :]
            if durability != "none":
                os.fdatasync(fd)
        finally:
            os.close(fd)
        if durability == "full":
            dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(dfd)
            os.close(dfd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(buf))))


def page_aligned_copy(rows: np.ndarray) -> np.ndarray:
    """A copy of 2-D ``rows`` in anonymous (page-aligned) memory; rows must be whole pages."""
    assert rows.shape[1] % mmap.PAGESIZE == 0, "direct I/O baseline needs whole pages"
    out = np.frombuffer(mmap.mmap(-1, rows.nbytes), np.uint8).reshape(rows.shape)
    out[:] = rows
    return out


def _files(root: str) -> list[str]:
    return [os.path.join(d, name) for d, _, names in os.walk(root) for name in names]


def drop_cached(root: str) -> int:
    """Evict every file under ``root`` from the page cache (``POSIX_FADV_DONTNEED``).

    Works without privileges for clean pages, i.e. after ``fdatasync``: the next reads come
    from the disk. Returns the number of files advised.
    """
    paths = _files(root)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(paths)


def warm_cached(root: str) -> int:
    """Read every file under ``root`` through the page cache, so the cache holds it (a file
    written with ``O_DIRECT`` is not there until something reads it so). Returns the number
    of files read."""
    paths = _files(root)
    scratch = bytearray(1 << 20)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [scratch]):
                pass
        finally:
            os.close(fd)
    return len(paths)


def _read_whole(path: str, view: memoryview, flags: int) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        got = 0
        while got < len(view):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                raise OSError(f"{path}: short read")
            got += n
    finally:
        os.close(fd)


def raw_read(root: str, out: np.ndarray, threads: int, direct: bool = False) -> None:
    """Read the files :func:`raw_write` wrote back into the rows of ``out`` (one contiguous
    buffer)."""
    flags = os.O_DIRECT if direct else 0

    def one(i: int) -> None:
        _read_whole(os.path.join(root, f"{i}.blk"), memoryview(out[i]).cast("B"), flags)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(out))))


def hand_read(root: str, rows: Sequence[np.ndarray], threads: int) -> None:
    """What a user would write by hand to load blocks into a layer-major cache: read each
    block file (written by :func:`raw_write` from the rows concatenated) into one buffer per
    thread, then copy its rows (every layer's key and value) into ``rows``; no checksum."""
    widths = [r.shape[1] for r in rows]
    starts = np.cumsum([0, *widths[:-1]]).tolist()
    local = threading.local()

    def one(i: int) -> None:
        buf: np.ndarray | None = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty(sum(widths), np.uint8)
        _read_whole(os.path.join(root, f"{i}.blk"), buf.data, 0)
        for dst, at, width in zip(rows, starts, widths, strict=True):
            dst[i] = buf[at : at + width]

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(rows[0]))))
