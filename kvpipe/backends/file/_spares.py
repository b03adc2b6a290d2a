"""Deleted block files kept for later puts (blocking; the store calls it in its threads).

A deleted (or evicted) block file is moved aside under a temporary name of this process in
its directory, so a later put writes over it and renames it into place instead of allocating
a new file (an inode and fresh blocks). Readers stay safe: the native writer takes a spare
only under an exclusive ``flock`` (none where the file system has no locks), and a reader
reads a file renamed since it opened it as missing (:func:`._fs.still_block`). What is
held is bounded by ``limit_bytes`` and removed at close; a dead process's spares are removed
by the next open's sweep.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import threading
from collections import deque
from collections.abc import Sequence
from typing import final

from ._format import temp_name
from ._fs import HOST, Root

__all__ = ("Spares", "remove_taken")

log = logging.getLogger("kvpipe.file_store")


@final
class Spares:
    """A bounded pool of deleted block files (paths beneath the root, by file size).
    Thread-safe.

    Args:
        limit_bytes: At most this many bytes of files held; 0 keeps none (a deleted block
            file is removed, as without the pool).
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._by_size: dict[int, deque[tuple[tuple[str, ...], str]]] = {}
        self._held = 0
        self._files = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Bytes of the files held now."""
        return self._held

    @property
    def files(self) -> int:
        """Files held now."""
        return self._files

    def retire(self, root: Root, parts: Sequence[str], name: str) -> bool:
        """Delete block file ``parts/name``: move it into the pool, or remove it when the pool
        is full (or something else than a regular file is there).

        Returns:
            Whether something was at that name.

        Raises:
            OSError: The file could not be moved nor removed.
        """
        if not self.limit_bytes:
            return root.unlink(parts, name)
        try:
            with root.directory(parts, create=False) as dfd:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or not self._room(st.st_size):
                    os.unlink(name, dir_fd=dfd)
                    return True
                spare = temp_name(name, HOST, os.getpid(), secrets.token_hex(4))
                try:
                    os.rename(name, spare, src_dir_fd=dfd, dst_dir_fd=dfd)
                except OSError:
                    self._give_back(st.st_size)
                    raise
                with contextlib.suppress(OSError):  # fresh to another process's stale sweep
                    os.utime(spare, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        with self._lock:
            self._by_size.setdefault(st.st_size, deque()).append((tuple(parts), spare))
        return True

    def take(self, nbytes: int) -> bytes | None:
        """A held file of ``nbytes`` (else of any size, cut or grown by the writer), taken
        out of the pool: the writer uses or removes it. ``None`` when none is held."""
        with self._lock:
            size = nbytes if self._by_size.get(nbytes) else next(iter(self._by_size), None)
            if size is None:
                return None
            queue = self._by_size[size]
            parts, name = queue.popleft()
            if not queue:
                del self._by_size[size]
            self._held -= size
            self._files -= 1
        return "/".join((*parts, name)).encode()

    def drain(self, root: Root) -> None:
        """Remove every held file (at close, or when the disk is full)."""
        with self._lock:
            held = self._by_size
            self._by_size = {}
            for size, queue in held.items():
                self._held -= size * len(queue)
                self._files -= len(queue)
        for parts, name in (entry for queue in held.values() for entry in queue):
            _remove(root, parts, name)

    def _room(self, nbytes: int) -> bool:
        """Reserve room for a file of ``nbytes``; whether there was."""
        with self._lock:
            if self._held + nbytes > self.limit_bytes:
                return False
            self._held += nbytes
            self._files += 1
            return True

    def _give_back(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes
            self._files -= 1


def remove_taken(root: Root, taken: Sequence[bytes | None]) -> None:
    """Remove spare files taken out of a pool (:meth:`Spares.take`) that a write did not get
    to use (it failed before it began); any already gone are skipped. Never raises."""
    for path in taken:
        if path is not None:
            *parts, name = path.decode().split("/")
            _remove(root, parts, name)


def _remove(root: Root, parts: Sequence[str], name: str) -> None:
    """Remove a spare file; an error is logged, not raised."""
    try:
        root.remove_temp(parts, name)
    except OSError as exc:
        log.warning("file store %s: cannot remove %s: %s", root.path, name, str(exc))
