"""Direct I/O for block files: page-aligned scratch, the chunks of a direct write, the probe.

``O_DIRECT`` needs every buffer address, length and file offset to be a multiple of the
device's logical block size; a page (4096) satisfies every device. The header is one page; a
value that starts on a page (a staging slot) goes out as its whole pages, its last partial
page copied into a page of zeros, so the file is padded to whole pages (format version 2).
Anything else is written through the page cache. Blocking; run in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Final, final

import numpy as np

from ._format import HEADER_NBYTES, PAGE

__all__ = (
    "MIN_DIRECT_NBYTES",
    "Pages",
    "Scratch",
    "direct_chunks",
    "finish_read",
    "is_aligned",
    "probe_direct",
    "read_views",
)

#: Values smaller than this are written through the page cache: per-file costs dominate them.
MIN_DIRECT_NBYTES: Final = 64 << 10


@final
@dataclass(frozen=True, slots=True)
class Pages:
    """Three page-aligned scratch pages for one file: its header, the tail of a direct
    write or read, and room for a version-2 file's padding."""

    header: memoryview
    tail: memoryview
    pad: memoryview


class Scratch(threading.local):
    """Per-thread page-aligned scratch: :class:`Pages` for as many files as a batch needs,
    and a bounce buffer for one value."""

    def __init__(self) -> None:
        self._pages: list[Pages] = []
        self._bounce: dict[int, memoryview] = {}
        self._grow(1)

    def _grow(self, n: int) -> None:
        mem = mmap.mmap(-1, 3 * PAGE * n)  # anonymous maps start on a page boundary
        view = memoryview(mem)
        self._pages = [
            Pages(
                view[3 * PAGE * i : 3 * PAGE * i + HEADER_NBYTES],
                view[3 * PAGE * i + PAGE : 3 * PAGE * i + 2 * PAGE],
                view[3 * PAGE * i + 2 * PAGE : 3 * PAGE * (i + 1)],
            )
            for i in range(n)
        ]

    def bounce(self, nbytes: int, offset: int = 0) -> memoryview:
        """This thread's buffer of ``nbytes`` starting ``offset`` bytes past a page boundary
        (one per offset; valid until a larger one is asked for)."""
        have = self._bounce.get(offset)
        if have is None or len(have) < nbytes:
            mem = mmap.mmap(-1, -(-(nbytes + offset) // PAGE) * PAGE)
            have = self._bounce[offset] = memoryview(mem)[offset : offset + nbytes]
        return have[:nbytes]

    def pages(self, n: int) -> list[Pages]:
        """Scratch for ``n`` files (valid until the next call from this thread)."""
        if n > len(self._pages):
            self._grow(max(n, 2 * len(self._pages)))
        return self._pages[:n]


def is_aligned(value: memoryview) -> bool:
    """Whether ``value`` can be written directly: large enough, starting on a page."""
    if len(value) < MIN_DIRECT_NBYTES:
        return False
    address: int = np.frombuffer(value, np.uint8).ctypes.data
    return address % PAGE == 0


def direct_chunks(header: bytes, value: memoryview, pages: Pages) -> list[memoryview]:
    """The page-aligned chunks of a direct write of ``header`` then ``value`` (which
    :func:`is_aligned` accepted): the header page, the value's whole pages in place, and its
    last partial page copied into a zero-padded tail page."""
    pages.header[:] = header
    whole = len(value) // PAGE * PAGE
    chunks = [pages.header, value[:whole]]
    rest = len(value) - whole
    if rest:
        pages.tail[:rest] = value[whole:]
        pages.tail[rest:] = bytes(PAGE - rest)
        chunks.append(pages.tail)
    return chunks


def read_views(into: memoryview, pages: Pages, direct: bool) -> list[memoryview]:
    """Where one ``preadv`` of a block file goes: the header page, the payload into ``into``,
    and up to a page of padding (a longer file shows in the count read). With ``direct``,
    the payload's last partial page lands in the tail page, for :func:`finish_read`."""
    if not direct:
        return [pages.header, into, pages.pad]
    whole = len(into) // PAGE * PAGE
    return [pages.header, into[:whole], pages.tail, pages.pad]


def finish_read(into: memoryview, pages: Pages, direct: bool) -> None:
    """Complete a direct read of :func:`read_views`: copy the payload's last partial page."""
    whole = len(into) // PAGE * PAGE
    if direct and whole < len(into):
        into[whole:] = pages.tail[: len(into) - whole]


def probe_direct(dir_fd: int, scratch: Scratch) -> bool:
    """Whether the file system under ``dir_fd`` takes page-aligned ``O_DIRECT`` writes (tmpfs
    before Linux 6.6 does not). Leaves nothing behind. On a full disk it reads the first page
    of the catalog with ``O_DIRECT`` instead (``False`` when there is none).

    Raises:
        OSError: Anything but the file system refusing direct I/O or lacking room
            (permissions...).
    """
    name = f".direct-probe.{os.getpid()}.{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
        try:
            page = scratch.pages(1)[0].tail
            page[:] = bytes(PAGE)
            return os.write(fd, page) == PAGE
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            # a file system without O_DIRECT (ramfs; tmpfs before Linux 6.6) refuses it
            # only after the open has created the file
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)
            return False
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return _probe_read(dir_fd, "catalog.sqlite3", scratch)
        raise


def _probe_read(dir_fd: int, name: str, scratch: Scratch) -> bool:
    """Whether ``name`` under ``dir_fd`` reads with ``O_DIRECT`` (missing: ``False``)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        os.preadv(fd, [scratch.pages(1)[0].tail], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
