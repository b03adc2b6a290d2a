"""Reading block files (blocking; the store runs this in its worker threads).

Where the native reader (:mod:`._fileio`) is built, a batch of files is read in one call
that releases the GIL throughout; otherwise each file goes through :meth:`Root.read_into`.
Either way every file's header, size and checksum are checked, and a file that fails is
quarantined and reported ``CORRUPT``.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import final

import xxhash

from .._base import BlockStatus
from .._values import VALUES_FINGERPRINT
from . import _native
from ._direct import Pages, Scratch, finish_read, is_aligned, read_views
from ._format import HEADER_NBYTES, HeaderError, block_location, unpack_header
from ._fs import DirectIORefused, NotARegularFile, Root

__all__ = (
    "PayloadCheck",
    "ReadHooks",
    "check_file",
    "read_batch",
    "read_cached",
    "read_mapped",
    "read_one",
    "regular_files",
)


#: Whether a payload hashes to the checksum given (the header's); see :func:`check_file`.
PayloadCheck = Callable[[int], bool]


@final
@dataclass(frozen=True, slots=True)
class ReadHooks:
    """What reading needs from the store.

    Attributes:
        direct: Whether direct I/O is on now.
        refuse_direct: Turn direct I/O off for good (a direct read was refused).
        count: Add to the store's counters.
        errors: Where one batch's error lines go (the store logs them once per batch).
    """

    direct: Callable[[], bool]
    refuse_direct: Callable[[Root, OSError], None]
    count: Callable[..., None]
    errors: list[str]


def read_one(
    hooks: ReadHooks,
    root: Root,
    key: str,
    buf: memoryview,
    fingerprint: str,
    scratch: Scratch,
) -> BlockStatus:
    """Read and check one block file through ``os`` calls."""
    parts, name = block_location(key)
    pages = scratch.pages(1)[0]
    direct = hooks.direct() and is_aligned(buf)
    try:
        try:
            got = root.read_into(parts, name, read_views(buf, pages, direct), direct)
        except DirectIORefused as exc:
            hooks.refuse_direct(root, exc)
            direct = False
            got = root.read_into(parts, name, read_views(buf, pages, direct))
    except NotARegularFile as exc:
        return _quarantine(hooks, root, key, str(exc), len(buf), fingerprint)
    except OSError as exc:
        hooks.errors.append(f"{key}: {exc}")
        hooks.count(io_errors=1)
        return BlockStatus.FAILED
    if got is None:
        return BlockStatus.MISSING
    return _judge(hooks, root, key, buf, pages, direct, got, fingerprint, None)


def read_batch(
    hooks: ReadHooks,
    root: Root,
    keys: Sequence[str],
    bufs: Sequence[memoryview],
    fingerprint: str,
    scratch: Scratch,
    native: bool = True,
) -> list[BlockStatus]:
    """Read and check a batch of block files: in one native call where ``native``, else
    (and where a direct read would need a buffer that is not aligned: one mode per call)
    one by one by :func:`read_one`, as is a file the native reader could not handle."""
    direct = hooks.direct()
    if not native or (direct and not all(is_aligned(b) for b in bufs)):
        return [
            read_one(hooks, root, k, b, fingerprint, scratch)
            for k, b in zip(keys, bufs, strict=True)
        ]
    fileio = _native.fileio
    assert fileio is not None
    pages = scratch.pages(len(keys))
    views = [read_views(b, p, direct) for b, p in zip(bufs, pages, strict=True)]
    results = fileio.read_files(root.fd, _native.block_paths(keys), views, direct)
    statuses: list[BlockStatus] = []
    for key, buf, page, got in zip(keys, bufs, pages, results, strict=True):
        if got >= 0:
            statuses.append(_judge(hooks, root, key, buf, page, direct, got, fingerprint, None))
        elif got in (-errno.EINVAL, -errno.ENOSYS, -errno.EPERM):
            # EINVAL: direct I/O refused (read_one turns it off); ENOSYS/EPERM: no openat2
            # here (read_one walks the path instead).
            statuses.append(read_one(hooks, root, key, buf, fingerprint, scratch))
        elif (status := _not_read(hooks, root, key, got, len(buf), fingerprint)) is not None:
            statuses.append(status)
        else:
            hooks.errors.append(f"{key}: {_native.errno_text(-got)}")
            hooks.count(io_errors=1)
            statuses.append(BlockStatus.FAILED)
    return statuses


def read_cached(
    hooks: ReadHooks,
    root: Root,
    key: str,
    buf: memoryview,
    fingerprint: str,
    scratch: Scratch,
    payload_ok: PayloadCheck | None = None,
) -> BlockStatus | None:
    """Read and check one block file in one native call if the page cache holds all of it
    (``buf`` need not start on a page); ``None`` when it does not (``buf`` may then hold part
    of it) or the call failed in a way :func:`read_batch` reports or works around."""
    fileio = _native.fileio
    assert fileio is not None
    pages = scratch.pages(1)[0]
    views = [pages.header, buf, pages.pad]
    (got,) = fileio.read_cached_files(root.fd, _native.block_paths([key]), [views])
    if got >= 0:
        return _judge(hooks, root, key, buf, pages, False, got, fingerprint, payload_ok)
    return _not_read(hooks, root, key, got, len(buf), fingerprint)


def read_mapped(
    hooks: ReadHooks,
    root: Root,
    key: str,
    nbytes: int,
    fingerprint: str,
    place: Callable[[memoryview, int], bool | None],
) -> BlockStatus | None:
    """Check one block file that the page cache holds whole by mapping it: its header here,
    its ``nbytes`` of value by ``place(value, checksum)`` (a :class:`~.._base.FetchSink`'s
    ``fetched`` with ``mapped=True``: one copy, from the page cache into the cache rows).
    The file stays locked against a writer reusing it until it is unmapped; nothing here
    reads the mapping (a page of it may fault), only the sink's guarded call. ``None``: the
    page cache does not hold it whole, it cannot be locked or mapped at its size, or the sink
    declined the mapping: read it instead."""
    fileio = _native.fileio
    assert fileio is not None
    fd, size = fileio.open_cached(root.fd, _native.block_paths([key])[0])
    if fd < 0:
        return _not_read(hooks, root, key, fd, nbytes, fingerprint)
    try:
        if size < HEADER_NBYTES + nbytes:
            return None  # torn or foreign: the read says why
        raw = os.pread(fd, HEADER_NBYTES, 0)
        mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):  # ValueError: it shrank since open_cached looked
        return None
    finally:
        os.close(fd)  # the mapping holds its own descriptor, and with it the lock
    whole = memoryview(mem)
    value = whole[HEADER_NBYTES : HEADER_NBYTES + nbytes]
    declined = False

    def placed(checksum: int) -> bool:
        nonlocal declined
        verdict = place(value, checksum)
        declined = verdict is None
        return declined or bool(verdict)

    try:
        why = check_file(key, raw, size, value, fingerprint, placed)
    finally:
        value.release()
        whole.release()
        mem.close()
    if declined:
        return None
    if why is None:
        return BlockStatus.OK
    return _refuse(hooks, root, key, why, raw, nbytes, fingerprint)


def regular_files(root: Root, keys: Sequence[str], native: bool = True) -> list[bool]:
    """Whether each key's block file is there (a regular file), in one native call where
    ``native``, else file by file, stopping at the first that is not.

    Raises:
        OSError: A block file could not be looked at (``EMFILE``, ``EACCES``, ``EIO``...):
            it may be there, so it is not answered missing.
    """
    if not native:
        found = [False] * len(keys)
        for i, key in enumerate(keys):
            if root.size(*block_location(key)) is None:
                break
            found[i] = True
        return found
    fileio = _native.fileio
    assert fileio is not None
    sizes = fileio.file_sizes(root.fd, _native.block_paths(keys), True)
    for key, n in zip(keys, sizes, strict=True):
        if n < -1:
            err = -1 - n
            raise OSError(err, f"cannot look at block file {key}: {_native.errno_text(err)}")
    return [n >= 0 for n in sizes]


def _not_read(
    hooks: ReadHooks, root: Root, key: str, code: int, nbytes: int, fingerprint: str
) -> BlockStatus | None:
    """A native call's failure ``code`` (a negative errno or ``NOT_REGULAR``) on ``key``'s
    block file as ``CORRUPT`` (quarantined), ``MISSING``, or ``None`` (any other)."""
    assert _native.fileio is not None
    if code == _native.fileio.NOT_REGULAR:
        return _quarantine(hooks, root, key, "not a regular file", nbytes, fingerprint)
    return BlockStatus.MISSING if code == -errno.ENOENT else None


def _judge(
    hooks: ReadHooks,
    root: Root,
    key: str,
    buf: memoryview,
    pages: Pages,
    direct: bool,
    got: int,
    fingerprint: str,
    payload_ok: PayloadCheck | None,
) -> BlockStatus:
    """The verdict on a block file read into ``buf`` (``got`` bytes in all)."""
    finish_read(buf, pages, direct)
    raw = bytes(pages.header)
    why = check_file(key, raw, got, buf, fingerprint, payload_ok)
    if why is None:
        return BlockStatus.OK
    # A file shorter than a header left the rest of the scratch page as an earlier read
    # left it: no header of its own to refuse it by.
    own = raw if got >= len(raw) else b""
    return _refuse(hooks, root, key, why, own, len(buf), fingerprint)


def _refuse(
    hooks: ReadHooks, root: Root, key: str, why: str, raw: bytes, nbytes: int, fingerprint: str
) -> BlockStatus:
    """``CORRUPT`` for a block file that failed ``why``: quarantined (:func:`_quarantine`),
    unless it is a :class:`~.._values.ValueClient`'s value (whose size no layout fixes)
    and its sound header (``raw``) says it holds this key at another size than the
    ``nbytes`` asked for: a caller's mistake, or another deployment's value under the same
    key, which stays for the readers of its own size. (A pipeline's block of another size
    than its layout's is damaged: quarantined.)"""
    try:
        header = unpack_header(raw)
    except HeaderError:
        header = None
    if (
        header is not None
        and header.key == key
        and header.fingerprint == fingerprint == VALUES_FINGERPRINT
        and header.payload_nbytes != nbytes
    ):
        hooks.errors.append(f"{key}: a value of {header.payload_nbytes} B, not {nbytes}: kept")
        return BlockStatus.CORRUPT
    return _quarantine(hooks, root, key, why, nbytes, fingerprint)


def _quarantine(
    hooks: ReadHooks, root: Root, key: str, why: str, nbytes: int, fingerprint: str
) -> BlockStatus:
    """Move the bad file at ``key``'s name aside; ``MISSING`` where the file there is a
    valid block after all (a put published it since the read), which stays."""
    found: list[bool] = []

    def valid(fd: int) -> bool:
        size = os.fstat(fd).st_size
        header = os.pread(fd, HEADER_NBYTES, 0)
        value = bytearray(nbytes)
        got = len(header) + os.preadv(fd, [value], HEADER_NBYTES)
        whole = size if got == HEADER_NBYTES + nbytes else got
        found.append(check_file(key, header, whole, memoryview(value), fingerprint) is None)
        return found[-1]

    if root.quarantine(*block_location(key), valid=valid):
        hooks.errors.append(f"{key}: corrupt ({why}), quarantined")
        hooks.count(quarantined=1)
    elif any(found):
        return BlockStatus.MISSING
    else:
        hooks.errors.append(f"{key}: corrupt ({why})")
    return BlockStatus.CORRUPT


def check_file(
    key: str,
    raw: bytes,
    got: int,
    buf: memoryview,
    fingerprint: str,
    payload_ok: PayloadCheck | None = None,
) -> str | None:
    """Why a block file read as ``raw`` (its header) and ``buf`` (its payload), ``got`` bytes
    in all, cannot be trusted; ``None`` when it can.

    ``payload_ok``: checks the payload against the header's checksum, last, where its reader
    hashes it anyway (a :class:`~.._base.FetchSink`); by default it is hashed here."""
    if got < len(raw):
        return f"file of {got} B, shorter than a header"
    try:
        header = unpack_header(raw)
    except HeaderError as exc:
        return str(exc)
    if header.key != key:
        return "file holds another key"
    if header.fingerprint != fingerprint:
        return f"layout {header.fingerprint}, expected {fingerprint}"
    if header.payload_nbytes != len(buf):
        return f"payload of {header.payload_nbytes} B, expected {len(buf)}"
    if got != header.file_nbytes:
        # shorter, or longer (it filled more than a valid file can: see Root.read_into)
        return f"{got} B read, its header says the file has {header.file_nbytes}"
    if payload_ok is not None:
        if not payload_ok(header.checksum):
            return "payload checksum mismatch"
    elif xxhash.xxh3_64_intdigest(buf) != header.checksum:
        return "payload checksum mismatch"
    return None
