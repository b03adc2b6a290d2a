"""Writing block files (blocking; the store runs this in its worker threads).

Where the native extension (:mod:`._fileio`) is built, a thread publishes its share of a
batch in one call that releases the GIL throughout; otherwise, or for a file the native call
could not publish (no shard directory yet, direct I/O refused), each file goes through
:meth:`Root.write_atomic`. Headers are made in Python either way.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, final

import xxhash

from .._base import BlockStatus
from . import _native
from ._direct import Pages, Scratch, direct_chunks
from ._format import block_location, pack_header, temp_name
from ._fs import HOST, DirectIORefused, Durability, Root, UnsyncedDirectory
from ._spares import remove_taken

__all__ = ("Abandon", "WriteHooks", "unwritten", "write_batch", "write_one")

_DURABILITY: Final = {"none": 0, "data": 1, "full": 2}


@final
class Abandon:
    """Set when a put's caller stopped waiting: no file not yet renamed into place is
    published after that (a byte the native writer reads too)."""

    __slots__ = ("flag",)

    def __init__(self) -> None:
        self.flag = bytearray(1)

    def set(self) -> None:
        self.flag[0] = 1

    def is_set(self) -> bool:
        return bool(self.flag[0])


@final
@dataclass(frozen=True, slots=True)
class WriteHooks:
    """What writing needs from the store.

    Attributes:
        durability: The store's durability.
        refuse_direct: Turn direct I/O off for good (a direct write was refused).
        count: Add to the store's counters.
        errors: Where one batch's error lines go (the store logs them once per batch).
        abandoned: The put's :class:`Abandon`.
        published: The header of each block file the put published, by key: what tells
            its own file from one another put of the key published since
            (:func:`._space.settle` removes only its own).
    """

    durability: Durability
    refuse_direct: Callable[[Root, OSError], None]
    count: Callable[..., None]
    errors: list[str]
    abandoned: Abandon
    published: dict[str, bytes] = field(default_factory=dict)


def _chunks(
    key: str,
    value: memoryview,
    fingerprint: str,
    direct: bool,
    pages: Pages,
    checksum: int | None,
) -> tuple[bytes, Sequence[bytes | memoryview]]:
    """A block file's header, and its contents: the header, then the value (page-aligned
    for direct I/O). ``checksum``: the value's XXH3-64 where the caller computed it
    already."""
    if checksum is None:
        checksum = xxhash.xxh3_64_intdigest(value)
    header = pack_header(key, len(value), checksum, time.time(), fingerprint, direct)
    return header, direct_chunks(header, value, pages) if direct else (header, value)


def write_one(
    hooks: WriteHooks,
    root: Root,
    key: str,
    value: memoryview,
    fingerprint: str,
    direct: bool,
    scratch: Scratch,
    checksum: int | None,
) -> BlockStatus:
    """Publish one block file through ``os`` calls (``checksum``: see :func:`_chunks`)."""
    if hooks.abandoned.is_set():
        return BlockStatus.FAILED
    parts, name = block_location(key)
    header, chunks = _chunks(key, value, fingerprint, direct, scratch.pages(1)[0], checksum)
    try:
        if root.write_atomic(parts, name, chunks, hooks.durability, hooks.abandoned.is_set, direct):
            hooks.published[key] = header
            hooks.count(direct_writes=int(direct))
            return BlockStatus.OK
        return BlockStatus.FAILED
    except DirectIORefused as exc:
        hooks.refuse_direct(root, exc)
        return write_one(hooks, root, key, value, fingerprint, False, scratch, checksum)
    except UnsyncedDirectory as exc:
        hooks.published[key] = header
        return _unsynced(hooks, key, str(exc))
    except OSError as exc:
        return _failed(hooks, key, exc.errno or errno.EIO, str(exc))
    except Exception as exc:  # nothing published (write_batch's callers count on a status)
        return unwritten(hooks, [key], exc)[0]


def write_batch(
    hooks: WriteHooks,
    root: Root,
    keys: Sequence[str],
    values: Sequence[memoryview],
    fingerprint: str,
    direct: bool,
    scratch: Scratch,
    checksums: Sequence[int | None],
    spares: Sequence[bytes | None],
) -> list[BlockStatus]:
    """Publish a batch of block files in one native call. ``checksums``: each value's XXH3-64
    where known; ``spares``: deleted block files to write over (:mod:`._spares`), each used
    or removed.

    Raises:
        Exception: Making the files' contents failed (out of memory, say): nothing was
            written. (The native call, once it has written, fails only to make its list of
            results, out of memory.)
    """
    fileio = _native.fileio
    assert fileio is not None
    try:
        pages = scratch.pages(len(keys))
        where = [block_location(k) for k in keys]
        dirs = [os.path.join(*parts).encode() for parts, _ in where]
        names = [name.encode() for _, name in where]
        pid = os.getpid()
        temps = [temp_name(name, HOST, pid, secrets.token_hex(4)).encode() for _, name in where]
        made = [
            _chunks(k, v, fingerprint, direct, p, c)
            for k, v, p, c in zip(keys, values, pages, checksums, strict=True)
        ]
        codes = fileio.write_files(
            root.fd,
            dirs,
            temps,
            names,
            [chunks for _, chunks in made],
            _DURABILITY[hooks.durability],
            direct,
            hooks.abandoned.flag,
            spares,
        )
    except BaseException:
        remove_taken(root, spares)  # out of the pool already: removed, not left on disk
        raise
    statuses: list[BlockStatus] = []
    for key, value, code, checksum, (header, _) in zip(
        keys, values, codes, checksums, made, strict=True
    ):
        if code == 0:
            hooks.published[key] = header
            hooks.count(direct_writes=int(direct))
            statuses.append(BlockStatus.OK)
        elif code == fileio.ABANDONED:
            statuses.append(BlockStatus.FAILED)
        elif code >= fileio.UNSYNCED:
            hooks.published[key] = header
            why = _native.errno_text(code - fileio.UNSYNCED)
            statuses.append(
                _unsynced(hooks, key, f"published, but syncing its directory failed: {why}")
            )
        elif code == -errno.ENOENT or code == -errno.EINVAL:
            # ENOENT: the shard directory does not exist yet (write_one makes it); EINVAL:
            # direct I/O refused (write_one turns it off and writes through the page cache).
            statuses.append(
                write_one(hooks, root, key, value, fingerprint, direct, scratch, checksum)
            )
        else:
            statuses.append(_failed(hooks, key, -code, _native.errno_text(-code)))
    return statuses


def unwritten(hooks: WriteHooks, keys: Sequence[str], exc: Exception) -> list[BlockStatus]:
    """``FAILED`` for blocks whose writing raised ``exc`` before they were published (counted
    ``io_errors``; one error line)."""
    if keys:
        more = f" (and {len(keys) - 1} more not written)" if len(keys) > 1 else ""
        hooks.errors.append(f"{keys[0]}: {type(exc).__name__}: {exc}{more}")
        hooks.count(io_errors=len(keys))
    return [BlockStatus.FAILED] * len(keys)


def _failed(hooks: WriteHooks, key: str, err: int, why: str) -> BlockStatus:
    """A block file that could not be written: ``NO_SPACE`` (counted ``no_space``) when its
    disk or quota is full, else ``FAILED`` (counted ``io_errors``)."""
    hooks.errors.append(f"{key}: {why}")
    if err in (errno.ENOSPC, errno.EDQUOT):
        hooks.count(no_space=1)
        return BlockStatus.NO_SPACE
    hooks.count(io_errors=1)
    return BlockStatus.FAILED


def _unsynced(hooks: WriteHooks, key: str, why: str) -> BlockStatus:
    """A block file published, whose directory could not be synced (``"full"``): ``OK``,
    as it is visible and stays (a block reported otherwise must never have been visible),
    counted ``io_errors`` and logged."""
    hooks.errors.append(f"{key}: {why}")
    hooks.count(io_errors=1)
    return BlockStatus.OK
