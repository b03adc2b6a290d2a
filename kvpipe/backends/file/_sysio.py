"""System-call helpers of the file store: ``openat2`` through ctypes, whole-buffer
``preadv`` / ``writev``, direct I/O refusals, and who owns a temporary file or catalog row
(``host:pid``, and whether that process still runs). Blocking; run in threads.

A writer's ``host`` (:data:`HOST`) is its host name and a digest of the kernel's boot id and
its PID namespace: a pid is judged (alive or dead) only by a process that sees the same pids,
never across containers that share a volume and a host name (each has PID namespace of its
own: its pids mean nothing here), nor across hosts or reboots. Temporary files of writers
this process cannot judge go only once stale (``stale_temp_after``).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import platform
import re
import secrets
import socket
import sys
from collections.abc import Sequence
from typing import Final

__all__ = (
    "HOST",
    "all_cached",
    "cached_pages",
    "DirectIORefused",
    "NotARegularFile",
    "UnsafePath",
    "alive",
    "openat2",
    "owner_is_dead",
    "owner_token",
    "read_cached",
    "read_fully",
    "refused",
    "skip",
    "write_all",
)


def _owner_host() -> str:
    """This process's ``host`` as a writer: its host name (up to 47 characters), a dot and
    16 hex digits, a digest of the boot id and the PID namespace (random where either cannot
    be read: then no other process judges this one's pids, nor this one theirs)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:47] or "host"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        seen = secrets.token_hex(8)
    else:
        seen = hashlib.blake2b(f"{boot} {namespace}".encode(), digest_size=8).hexdigest()
    return f"{name}.{seen}"


#: This process's host as a writer: see the module docstring.
HOST: Final = _owner_host()


class UnsafePath(OSError):
    """A path component was invalid or led through a symbolic link."""


class DirectIORefused(OSError):
    """The file system (or the device's alignment) refused a direct (``O_DIRECT``) read or
    write."""


class NotARegularFile(OSError):
    """Something other than a regular file (a directory, FIFO, socket...) sits at a block's
    name."""


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


# openat2(2) (Linux >= 5.6) resolves a relative path in one call, refusing in the kernel any
# symbolic link or escape from the directory.
_SYS_OPENAT2: Final = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
_RESOLVE: Final = 0x02 | 0x04 | 0x08  # NO_MAGICLINKS | NO_SYMLINKS | BENEATH
_libc: Final = ctypes.CDLL(None, use_errno=True)
_have_openat2 = _SYS_OPENAT2 is not None and sys.platform == "linux"


def openat2(dir_fd: int, rel: str, flags: int) -> int | None:
    """``openat2`` beneath ``dir_fd``; ``None`` when the kernel lacks it.

    Raises:
        UnsafePath: The path crosses a symbolic link or leaves the directory.
        OSError: Anything else (``FileNotFoundError`` ...).
    """
    global _have_openat2
    if not _have_openat2:
        return None
    how = _OpenHow(flags | os.O_CLOEXEC, 0, _RESOLVE)
    fd = int(
        _libc.syscall(_SYS_OPENAT2, dir_fd, rel.encode(), ctypes.byref(how), ctypes.sizeof(how))
    )
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM):  # no such syscall, or a seccomp filter refuses it
        _have_openat2 = False
        return None
    if err in (errno.ELOOP, errno.EXDEV):
        raise UnsafePath(err, f"{rel!r} crosses a symbolic link or leaves the store")
    raise OSError(err, os.strerror(err), rel)


def owner_token() -> str:
    """This process as a catalog owner, ``host:pid``."""
    return f"{HOST}:{os.getpid()}"


def owner_is_dead(owner: str | None) -> bool:
    """Whether ``owner`` (``host:pid``) is a process of this host, in this PID namespace,
    that no longer runs."""
    if not owner or ":" not in owner:
        return False
    host, _, pid = owner.rpartition(":")
    return host == HOST and pid.isdigit() and not alive(int(pid))


def alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: Buffers per ``writev`` call (Linux's ``IOV_MAX``).
_IOV_MAX: Final = 1024


def refused(exc: OSError, direct: bool) -> OSError:
    """``exc`` as :class:`DirectIORefused` when it is direct I/O's ``EINVAL``."""
    if direct and exc.errno == errno.EINVAL and type(exc) is OSError:
        return DirectIORefused(errno.EINVAL, f"direct I/O refused: {exc.strerror}")
    return exc


def read_fully(fd: int, views: list[memoryview], start: int = 0) -> int:
    """``preadv`` from offset ``start`` into ``views`` until they are full or the file ends;
    the offset reached."""
    views = [v for v in views if len(v)]
    got, at = start, 0
    while at < len(views):
        n = os.preadv(fd, views[at : at + _IOV_MAX], got)
        if n == 0:
            break
        got += n
        at = _advance(views, at, n)
    return got


#: ``preadv2`` flag: read only what the page cache holds (Linux >= 4.14).
_RWF_NOWAIT: Final = getattr(os, "RWF_NOWAIT", 0)


class _CacheStat(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    )


class _CacheStatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


# cachestat(2) (Linux >= 6.5) counts a file's cached pages without reading any in (a
# RWF_NOWAIT read that misses starts a read-ahead).
_SYS_CACHESTAT: Final = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
_have_cachestat = _SYS_CACHESTAT is not None and sys.platform == "linux"


def cached_pages(fd: int) -> int | None:
    """How many of the file's pages the page cache holds; ``None`` where the kernel cannot
    say."""
    global _have_cachestat
    if not _have_cachestat:
        return None
    stat = _CacheStat()
    whole = _CacheStatRange(0, 0)
    if _libc.syscall(_SYS_CACHESTAT, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _have_cachestat = False
        return None
    return int(stat.nr_cache)


def all_cached(fd: int, size: int) -> bool:
    """Whether the page cache may hold all ``size`` bytes of the file (``True`` where the
    kernel cannot say: a read with ``RWF_NOWAIT`` finds out)."""
    pages = cached_pages(fd)
    return pages is None or pages >= -(-size // mmap.PAGESIZE)


def read_cached(fd: int, views: list[memoryview], size: int) -> tuple[int, bool]:
    """``preadv`` with ``RWF_NOWAIT`` from offset 0 into ``views``: only what the page cache
    holds, up to ``size`` bytes (the file's) or until ``views`` are full. The bytes read, and
    whether that is all there is (not the cache running out, or no ``RWF_NOWAIT`` here)."""
    if not _RWF_NOWAIT:
        return 0, False
    views = [v for v in views if len(v)]
    got = at = 0
    while at < len(views) and got < size:
        try:
            n = os.preadv(fd, views[at : at + _IOV_MAX], got, _RWF_NOWAIT)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL):
                return got, False
            raise
        if n == 0:
            break
        got += n
        at = _advance(views, at, n)
    return got, True


def skip(views: Sequence[memoryview], n: int) -> list[memoryview]:
    """``views`` past their first ``n`` bytes."""
    out = [v for v in views if len(v)]
    at = _advance(out, 0, n)
    return out[at:]


def _advance(views: list[memoryview], at: int, n: int) -> int:
    """Move ``n`` bytes past ``views[at]``: whole views are skipped, a partial one is cut
    from its start in place. The index of the first view not yet full."""
    while at < len(views) and n >= len(views[at]):
        n -= len(views[at])
        at += 1
    if at < len(views) and n:
        views[at] = views[at][n:]
    return at


def write_all(fd: int, chunks: Sequence[bytes | memoryview]) -> None:
    """``writev`` all of ``chunks`` from the file's offset.

    A direct (``O_DIRECT``) write cut short (a full disk) may stop off the device's blocks,
    and the next one from there fails with ``EINVAL``: not a refusal of direct I/O (the
    first write passed), so the rest goes through the page cache, where the real error, if
    any (``ENOSPC``), shows.
    """
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    at = 0
    wrote = False
    while at < len(views):
        try:
            n = os.writev(fd, views[at : at + _IOV_MAX])
        except OSError as exc:
            if wrote and exc.errno == errno.EINVAL and _drop_direct(fd):
                continue
            raise
        wrote = True
        at = _advance(views, at, n)


def _drop_direct(fd: int) -> bool:
    """Turn ``O_DIRECT`` off on ``fd``; ``False`` when it was not on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return True
