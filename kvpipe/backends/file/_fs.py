"""Confined, atomic file operations under one root directory (blocking; run in threads).

Paths are resolved beneath an open descriptor of the root with no symbolic links
(``openat2``, else one ``O_NOFOLLOW`` component at a time), so no link inside the root leads
outside it; components must match a strict pattern (no ``..``, separators or NUL). Files are
created ``0600``, directories ``0700``.

A block is published atomically: written to a temporary file in its final directory,
``fdatasync``-ed per the durability, renamed over the final name, and with ``"full"`` the
directory synced. A reader never sees a partial file under a final name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Literal, final

from ..._errors import ConfigError
from ._format import PAGE, block_location, is_temp_name, parse_temp_name, temp_name
from ._sysio import (
    HOST,
    DirectIORefused,
    NotARegularFile,
    UnsafePath,
    alive,
    all_cached,
    openat2,
    owner_is_dead,
    owner_token,
    read_cached,
    read_fully,
    refused,
    skip,
    write_all,
)

__all__ = (
    "HOST",
    "DirectIORefused",
    "Durability",
    "NotARegularFile",
    "Root",
    "UnsafePath",
    "UnsyncedDirectory",
    "owner_is_dead",
    "owner_token",
    "store_root",
)

Durability = Literal["none", "data", "full"]
_COMPONENT: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Components of the directory a block file lives in (``blocks/<namespace>/<shard>``); above
#: it, every directory is one to walk into (a namespace may end in ``.kvb``).
_BLOCK_DIR_DEPTH: Final = len(block_location("_")[0])


def _check(name: str) -> str:
    if not _COMPONENT.fullmatch(name) or name in (".", ".."):
        raise UnsafePath(errno.EINVAL, f"invalid path component {name!r}")
    return name


def store_root(root: object) -> str:
    """``root`` as the path of a store's directory, checked before anything touches the disk.

    Raises:
        TypeError: ``root`` is not a ``str`` or an ``os.PathLike`` of ``str`` (bytes included).
        ConfigError: ``root`` is empty (it would make the current directory the store) or
            holds a NUL character.
    """
    path = os.fspath(root) if isinstance(root, os.PathLike) else root
    if not isinstance(path, str):
        raise TypeError(
            f"a store root must be a str or os.PathLike[str], not {type(path).__name__}: {root!r}"
        )
    if not path:
        raise ConfigError(
            "root",
            "is empty: give the store's directory (an empty path would "
            "make the current directory the store)",
        )
    if "\0" in path:
        raise ConfigError("root", f"contains a NUL character: {path!r}")
    return path


class UnsyncedDirectory(OSError):
    """A block file was published (renamed into place), then syncing its directory failed:
    the block is visible and stays (it cannot be taken back), but may not survive a crash."""


@final
@dataclass(frozen=True, slots=True)
class TempFile:
    """A temporary file found under the root."""

    parts: tuple[str, ...]
    name: str
    removable: bool


def _passes(dfd: int, name: str, valid: Callable[[int], bool]) -> bool:
    """Whether ``name`` in directory ``dfd`` is a regular file that ``valid`` passes."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and valid(fd)
    except OSError:
        return False
    finally:
        os.close(fd)


def _put_back(src: int, stamp: str, dst: int, name: str) -> None:
    """Return a valid block moved to ``src/stamp`` to ``dst/name``, unless a newer block is
    there by now (then it is superseded and removed)."""
    try:
        os.link(stamp, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
    except FileExistsError:
        pass
    except OSError:  # no hard links here: rename it back unless a newer block is there
        try:
            os.stat(name, dir_fd=dst, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(stamp, name, src_dir_fd=src, dst_dir_fd=dst)
        return  # else the valid one stays in quarantine/ rather than replace the newer one
    os.unlink(stamp, dir_fd=src)


def still_block(fd: int, st: os.stat_result) -> bool:
    """Whether the block file opened at ``fd`` (``st``: its ``fstat`` right after the open)
    may be read: a shared lock keeps a writer reusing it (:mod:`._spares`) out, and an
    unchanged change time says it was not renamed between the open and the lock. ``False``:
    read it as missing. ``True`` where the file system has no locks."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return os.fstat(fd).st_ctime_ns == st.st_ctime_ns


@final
class Root:
    """An open store root. Thread-safe: it only holds the root's descriptor.

    Args:
        path: The root directory (created ``0700`` if missing). The root itself may be a
            symbolic link; nothing below it may be.
    """

    def __init__(self, path: str | os.PathLike[str], create: bool = True) -> None:
        self.path = os.path.realpath(os.fspath(path))
        if create:
            try:
                os.makedirs(self.path, mode=0o700, exist_ok=True)
            except FileExistsError as exc:  # something else than a directory is there
                what = "a regular file" if os.path.isfile(self.path) else "not a directory"
                raise NotADirectoryError(
                    errno.ENOTDIR, f"the store root exists and is {what}", self.path
                ) from exc
        self.fd = os.open(self.path, _DIR_FLAGS & ~os.O_NOFOLLOW)

    def close(self) -> None:
        os.close(self.fd)

    def confined_opens(self) -> bool:
        """Whether this kernel resolves paths beneath the root in one call (``openat2``), as
        the native reader needs."""
        fd = openat2(self.fd, ".", os.O_PATH | os.O_DIRECTORY)
        if fd is None:
            return False
        os.close(fd)
        return True

    @contextlib.contextmanager
    def directory(
        self, parts: Sequence[str], create: bool, sync_new: bool = False
    ) -> Iterator[int]:
        """An open descriptor of ``root/parts...`` (created ``0700`` when ``create``).

        Args:
            sync_new: Where a directory on the way was missing (made now, by this call or
                another writer), sync each directory from there on into its parent
                (``fsync`` of the parent), so that a crash cannot lose it and what is put
                in it (``"full"`` durability).

        Raises:
            FileNotFoundError: A component is missing and ``create`` is false.
            UnsafePath: A component is invalid or is a symbolic link.
            OSError: A directory could not be made or synced.
        """
        for part in parts:
            _check(part)
        fresh = False  # a directory on the way was missing just now
        try:
            fast = (
                openat2(self.fd, "/".join(parts), os.O_RDONLY | os.O_DIRECTORY) if parts else None
            )
        except FileNotFoundError:
            if not create:
                raise
            fast, fresh = None, True
        except NotADirectoryError as exc:
            raise UnsafePath(errno.ENOTDIR, f"{'/'.join(parts)!r} is not a directory") from exc
        if fast is not None:
            try:
                yield fast
            finally:
                os.close(fast)
            return
        fd = os.dup(self.fd)
        try:
            for part in parts:
                try:
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o700, dir_fd=fd)
                    nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
                    fresh = True
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise UnsafePath(exc.errno, f"{part!r} is not a plain directory") from exc
                    raise
                if fresh and sync_new:
                    try:
                        os.fsync(fd)  # its entry for ``part`` (made by us or another writer)
                    except BaseException:
                        os.close(nxt)
                        raise
                os.close(fd)
                fd = nxt
            yield fd
        finally:
            os.close(fd)

    def write_atomic(
        self,
        parts: Sequence[str],
        name: str,
        chunks: Sequence[bytes | memoryview],
        durability: Durability,
        abandoned: Callable[[], bool],
        direct: bool,
    ) -> bool:
        """Publish ``chunks`` as ``parts/name`` atomically.

        Args:
            abandoned: Whether the put was abandoned; when it was by the rename, the temporary
                file is removed and nothing is published.
            direct: Write with ``O_DIRECT``: every chunk's address and length must then be a
                multiple of the device's block size (4096 is always enough).

        Returns:
            ``True`` when published, ``False`` when abandoned.

        With ``"full"``, a directory made for the file is synced into its parent first.

        Raises:
            DirectIORefused: ``direct`` was asked for and the file system or the alignment
                does not allow it; nothing was published.
            UnsyncedDirectory: Published, but syncing the directory (``"full"``) failed.
            OSError: The write failed (or a directory made for it could not be synced);
                nothing was published and the temporary file is gone.
        """
        _check(name)
        with self.directory(parts, create=True, sync_new=durability == "full") as dfd:
            tmp = temp_name(name, HOST, os.getpid(), secrets.token_hex(4))
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            if direct:
                flags |= os.O_DIRECT
            try:
                fd = os.open(tmp, flags, 0o600, dir_fd=dfd)
            except OSError as exc:
                if direct and exc.errno == errno.EINVAL:  # refused after creating it
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp, dir_fd=dfd)
                raise refused(exc, direct) from exc
            try:
                try:
                    try:
                        write_all(fd, chunks)
                    except OSError as exc:
                        raise refused(exc, direct) from exc
                    if durability != "none":
                        os.fdatasync(fd)
                finally:
                    os.close(fd)
                if abandoned():
                    os.unlink(tmp, dir_fd=dfd)
                    return False
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dfd)
                raise
            if durability == "full":
                try:
                    os.fsync(dfd)
                except OSError as exc:
                    raise UnsyncedDirectory(
                        exc.errno, f"published, but syncing its directory failed: {exc.strerror}"
                    ) from exc
            return True

    def read_into(
        self, parts: Sequence[str], name: str, views: Sequence[memoryview], direct: bool = False
    ) -> int | None:
        """Read a block file from its start into ``views`` (until they are full or the file
        ends), in as few system calls as possible.

        Args:
            direct: Read what the page cache does not hold with ``O_DIRECT``: every view's
                address and length must then be a multiple of the device's block size.

        Returns:
            The bytes read, or ``None`` when the file does not exist (or no longer is this
            block: :func:`still_block`; a file that changed under the open, renamed over by
            a put, is opened once more). The caller checks the header and the count (a valid
            file fills less than ``views`` can hold) before trusting what was read.

        Raises:
            UnsafePath: The file or a directory on its way is a symbolic link.
            NotARegularFile: Something else than a regular file is at that name.
            DirectIORefused: ``direct`` was asked for and the file system or the alignment
                does not allow it.
            OSError: Reading failed.
        """
        # O_NONBLOCK: opening a FIFO planted at a block's name must not wait for a writer.
        flags = os.O_RDONLY | os.O_NONBLOCK
        for again in (False, True):
            fd = self._open_file(parts, name, flags)
            if fd is None:
                return None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise NotARegularFile(errno.EINVAL, f"{name!r} is not a regular file")
                if still_block(fd, st):
                    return self._read_open(fd, flags, st, views, direct)
                # Changed since the open (a put renamed a new block over the name, a delete
                # moved it aside): whatever is at the name now is opened once more.
                if again or os.fstat(fd).st_ctime_ns == st.st_ctime_ns:
                    return None  # not changed: a writer holds it
            finally:
                os.close(fd)
        return None

    @staticmethod
    def _read_open(
        fd: int, flags: int, st: os.stat_result, views: Sequence[memoryview], direct: bool
    ) -> int:
        """:meth:`read_into` of the block file open at ``fd`` (``st``: its ``fstat``; opened
        with ``flags``), checked by :func:`still_block`."""
        if not direct:
            return read_fully(fd, list(views))
        got, complete = (
            read_cached(fd, list(views), st.st_size) if all_cached(fd, st.st_size) else (0, False)
        )
        if complete:
            return got
        start = got // PAGE * PAGE  # direct reads start on a page
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            return read_fully(fd, skip(views, start), start)
        except OSError as exc:
            raise refused(exc, direct) from exc

    def size(self, parts: Sequence[str], name: str) -> int | None:
        """The size of regular file ``parts/name``; ``None`` when there is none (symbolic
        links are not)."""
        try:
            fd = self._open_file(parts, name, os.O_PATH)
        except (UnsafePath, NotADirectoryError):
            return None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            return st.st_size if stat.S_ISREG(st.st_mode) else None
        finally:
            os.close(fd)

    def _open_file(self, parts: Sequence[str], name: str, flags: int) -> int | None:
        """Open ``parts/name`` (never through a link); ``None`` when it does not exist."""
        _check(name)
        for part in parts:
            _check(part)
        try:
            fd = openat2(self.fd, "/".join((*parts, name)), flags | os.O_NOFOLLOW)
            if fd is not None:
                return fd
            with self.directory(parts, create=False) as dfd:
                try:
                    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise UnsafePath(exc.errno, f"{name!r} is a symbolic link") from exc
                    raise
        except FileNotFoundError:
            return None
        except NotADirectoryError as exc:
            raise UnsafePath(
                errno.ENOTDIR, f"{name!r}: a path component is not a directory"
            ) from exc

    def unlink(self, parts: Sequence[str], name: str) -> bool:
        """Remove ``parts/name``; ``False`` when it was not there."""
        return self._unlink(parts, _check(name))

    def quarantine(
        self, parts: Sequence[str], name: str, valid: Callable[[int], bool] | None = None
    ) -> bool:
        """Move a bad entry out of the block tree into ``quarantine/`` — or, when that is not
        possible (a planted ``quarantine`` link, no space), remove it. Never raises.

        Args:
            valid: Whether the regular file open at this descriptor is a valid block. The
                entry moved is checked with it, and put back if it passes: a put published
                a block at the name after the bad file was read (only eviction or a delete
                may remove a published block).

        Returns:
            Whether the entry is gone from its block name.
        """
        _check(name)
        try:
            with (
                self.directory(parts, create=False) as src,
                self.directory(("quarantine",), create=True) as dst,
            ):
                stamp = f"{name}.{int(time.time())}.{secrets.token_hex(2)}"
                os.rename(name, stamp, src_dir_fd=src, dst_dir_fd=dst)
                if valid is not None and _passes(dst, stamp, valid):
                    _put_back(dst, stamp, src, name)
                    return False
            return True
        except FileNotFoundError:
            return False
        except OSError:
            pass
        try:
            with self.directory(parts, create=False) as src:
                if valid is not None and _passes(src, name, valid):
                    return False
                try:
                    os.unlink(name, dir_fd=src)
                except IsADirectoryError:
                    os.rmdir(name, dir_fd=src)
            return True
        except OSError:
            return False

    def discard_own(self, parts: Sequence[str], name: str, header: bytes) -> bool:
        """Remove the block file at ``parts/name`` if it is the one this process published
        with ``header`` (its creation time tells it from another put's block of the key);
        never raises.

        Another put of the key may publish it again at any moment, so the file is moved
        aside before it is removed, and put back if it turns out to be that other put's.

        Returns:
            Whether the file was removed: ``False`` when another put's block is there (it
            stays, as a block only eviction or a delete may remove), or none.
        """
        _check(name)

        def mine(fd: int) -> bool:
            return os.pread(fd, len(header), 0) == header

        try:
            with self.directory(parts, create=False) as dfd:
                if not _passes(dfd, name, mine):
                    return False
                aside = temp_name(name, HOST, os.getpid(), secrets.token_hex(4))
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                if _passes(dfd, aside, mine):
                    os.unlink(aside, dir_fd=dfd)
                    return True
                _put_back(dfd, aside, dfd, name)  # published between the check and the move
                with contextlib.suppress(FileNotFoundError):  # a newer block replaced it
                    os.unlink(aside, dir_fd=dfd)
                return False
        except OSError:
            return False

    def remove_temp(self, parts: Sequence[str], name: str) -> bool:
        """Remove one of the store's temporary files; ``False`` when it is not there.

        Raises:
            UnsafePath: ``name`` is not a temporary file name of this store.
        """
        if parse_temp_name(name) is None:  # its full pattern: no separator, no NUL
            raise UnsafePath(errno.EINVAL, f"{name!r} is not a temporary file of the store")
        return self._unlink(parts, name)

    def _unlink(self, parts: Sequence[str], name: str) -> bool:
        try:
            with self.directory(parts, create=False) as dfd:
                os.unlink(name, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def walk(self, top: Sequence[str]) -> Iterator[tuple[tuple[str, ...], list[os.DirEntry[str]]]]:
        """Every directory under ``top`` (not following links) and its other entries
        (files, links, FIFOs, and, where block files live, directories named like them)."""
        base = os.path.join(self.path, *top)
        if not os.path.isdir(base) or os.path.islink(base):
            return
        stack = [tuple(top)]
        while stack:
            parts = stack.pop()
            files = []
            try:
                with os.scandir(os.path.join(self.path, *parts)) as it:
                    for entry in it:
                        # a directory at a block's name is an entry to judge, not a shard
                        at_block = len(parts) == _BLOCK_DIR_DEPTH and entry.name.endswith(".kvb")
                        if entry.is_dir(follow_symlinks=False) and not at_block:
                            stack.append((*parts, entry.name))
                        else:
                            files.append(entry)
            except FileNotFoundError:
                continue
            yield parts, files

    def temp_files(self, stale_after: float) -> Iterator[TempFile]:
        """Temporary files under ``blocks/``, with whether their writer is gone."""
        now = time.time()
        for parts, entries in self.walk(("blocks",)):
            for entry in entries:
                if not is_temp_name(entry.name):
                    continue
                try:
                    age = now - entry.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                owner = parse_temp_name(entry.name)
                dead = owner is not None and owner[0] == HOST and not alive(owner[1])
                yield TempFile(parts, entry.name, dead or age > stale_after)
