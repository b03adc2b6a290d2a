"""A file store on a disk that fills: the room a put may take, and settling its records when
the catalog cannot grow (blocking; the store runs this in its worker threads).

A put may use what ``statvfs`` says an ordinary user may still allocate, less
:data:`CATALOG_HEADROOM` for the catalog (no bound where the file system reports no size),
so the catalog can always record what was written.
If another process takes the last bytes, settling frees space by removing the batch's newly
published files from its tail until the catalog takes the rest: never a published file
without its record, nor a record without its file. Only the put's own files go: a file that
another put of the same key published since stays (that put reported it ``OK``). A catalog
that cannot record the put for another reason (locked past SQLite's busy timeout, damaged)
leaves its records unsettled, logged, and the put's published blocks stored.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
from collections.abc import Mapping, Sequence
from typing import Final

from . import _native
from ._catalog import UNKNOWN, Catalog, CatalogFull, SizeOf
from ._format import block_location
from ._fs import Root

__all__ = ("CATALOG_HEADROOM", "room", "settle", "sizes")

log = logging.getLogger("kvpipe.file_store")

#: Free bytes a put leaves for the catalog (SQLite's WAL grows to about 4 MiB).
CATALOG_HEADROOM: Final = 4 << 20


def room(root: Root) -> int:
    """Bytes the next put may write under ``root`` (never negative). A file system that
    reports no size at all (``f_blocks`` 0: ramfs, some FUSE file systems) sets no bound
    here; a write that meets ``ENOSPC`` there is still ``NO_SPACE``."""
    st = os.fstatvfs(root.fd)
    if st.f_blocks == 0:
        return sys.maxsize
    return max(0, st.f_bavail * st.f_frsize - CATALOG_HEADROOM)


def sizes(root: Root) -> SizeOf:
    """The sizes of the block files at keys' names under ``root`` (for
    :meth:`Catalog.reconcile`): in one native call where the extension is built. A file that
    cannot be looked at (``EMFILE``, ``EACCES``, ``EIO``...) is :data:`UNKNOWN`, never
    missing (its record stays), and logged once per call."""
    fileio = _native.fileio

    def by_os(keys: Sequence[str]) -> list[int | None]:
        found: list[int | None] = []
        errors: list[tuple[str, int]] = []
        for key in keys:
            try:
                found.append(root.size(*block_location(key)))
            except OSError as exc:
                found.append(UNKNOWN)
                errors.append((key, exc.errno or 0))
        _unknown(root, errors)
        return found

    def native(keys: Sequence[str]) -> list[int | None]:
        found = fileio.file_sizes(root.fd, _native.block_paths(keys), False)
        _unknown(root, [(k, -1 - n) for k, n in zip(keys, found, strict=True) if n < -1])
        return [n if n >= 0 else None if n == -1 else UNKNOWN for n in found]

    return by_os if fileio is None else native


def _unknown(root: Root, errors: Sequence[tuple[str, int]]) -> None:
    """Log the block files a size lookup could not look at: (key, errno) each."""
    if errors:
        key, err = errors[0]
        log.warning(
            "file store %s: cannot look at %d block file(s) (first %s: %s); their records "
            "are left as they are",
            root.path,
            len(errors),
            key,
            _native.errno_text(err) if err else "unknown error",
        )


def settle(
    catalog: Catalog,
    root: Root,
    written: Sequence[str],
    failed: Sequence[str],
    headers: Mapping[str, bytes],
    parents: Mapping[str, str | None] | None = None,
) -> list[str]:
    """Record a put's outcome (:meth:`Catalog.settle`); when the disk is too full for that,
    remove the newest of ``written``'s files, one at a time, until it is not. ``headers``:
    the header of each file the put published, by key; a file at a key's name with another
    header (another put of the key published it since) is not removed, and the key stays
    stored. ``parents``: each key's parent in the put's batch (:meth:`Catalog.settle`).

    Returns:
        The keys of ``written`` whose files were removed (not stored after all: ``NO_SPACE``).
    """
    left = list(written)
    kept: list[str] = []  # another put's block is there now: it stays
    dropped: list[str] = []
    while True:
        try:
            catalog.settle([*left, *kept], [*failed, *dropped], sizes(root), parents)
            return dropped
        except CatalogFull as exc:
            if not left:
                # Nothing left to free: the records stay unsettled until the next open, or
                # a put that must evict, settles them from the files there are.
                log.error(
                    "file store %s: disk full, %d reservation(s) left unsettled: %s",
                    root.path,
                    len(failed) + len(dropped) + len(kept),
                    str(exc),
                )
                return dropped
            key = left.pop()
            header = headers.get(key)
            if header is not None and root.discard_own(*block_location(key), header):
                dropped.append(key)
            else:
                kept.insert(0, key)
        except sqlite3.Error as exc:
            # Locked past SQLite's busy timeout (another process holds the write lock), or
            # damaged. The files are published and sound, and readers find them by their
            # names: they are stored, whatever the catalog says.
            log.error(
                "file store %s: the catalog cannot record a put (%s); the blocks written are "
                "stored, %d record(s) left unsettled (an open or a put that must evict "
                "settles them once this process has exited, or after stale_temp_after)",
                root.path,
                str(exc),
                len(left) + len(kept) + len(failed) + len(dropped),
            )
            return dropped
