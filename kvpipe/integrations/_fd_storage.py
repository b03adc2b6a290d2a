"""``KVPipeStorage``: FastDeploy's ``KVCacheStorage`` (``file`` / ``mooncake``) over a kvpipe
store. Re-exported by :mod:`kvpipe.integrations.fastdeploy`, where the mapping is described."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import numbers
import operator
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import anyio
import xxhash

from .. import (
    BackendError,
    BlockStatus,
    ConfigError,
    FileStore,
    StorageBackend,
    ValueClient,
    WrongEventLoop,
)
from .._lograte import LogLimiter
from ._portal import HOP_SLACK, LoopThread, default_store_dir, store_from_url

__all__ = ("KVPipeStorage",)

log = logging.getLogger("kvpipe.integrations.fastdeploy")

#: Appended to every value: magic, version, payload length, XXH3-64 of payload and of the
#: caller's key; checked before a byte reaches the caller's buffer.
_TRAILER: Final = struct.Struct("<4sIQQQ")
_MAGIC: Final = b"KVFD"
_UNSET: Final[Any] = object()
#: Keys a ``batch_set`` copies and stores per hop onto the loop: its copies alive at once.
BATCH_SET_CHUNK: Final = 32
#: Keys a ``batch_get`` fetches and places per hop onto the loop: its fetched values alive at
#: once.
BATCH_GET_CHUNK: Final = 32


def _key(scope: str, key: str) -> str:
    """A kvpipe key for FastDeploy's key within ``scope`` (namespace and TP size): a hash, so
    no key can name a path."""
    if not isinstance(key, str) or not key:
        raise TypeError(f"keys must be non-empty str, got {key!r}")
    h = hashlib.blake2b(f"{scope}\0{key}".encode(), digest_size=16).hexdigest()
    return f"fd@{h}"


def _copied(ptr: int, nbytes: int, key: str) -> bytearray:
    """``nbytes`` at ``ptr`` and their trailer, copied on the caller's thread: nothing reads
    its buffer after its call returned."""
    value = bytearray(nbytes + _TRAILER.size)
    ctypes.memmove((ctypes.c_char * nbytes).from_buffer(value), ptr, nbytes)
    payload = memoryview(value)[:nbytes]
    value[nbytes:] = _TRAILER.pack(
        _MAGIC, 1, nbytes, xxhash.xxh3_64_intdigest(payload), xxhash.xxh3_64_intdigest(key.encode())
    )
    payload.release()
    return value


def _by_size(sizes: Sequence[int]) -> list[list[int]]:
    """The positions of ``sizes``, grouped by size (the groups in order of first
    appearance)."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        groups.setdefault(n, []).append(i)
    return list(groups.values())


def _verify(value: bytearray, key: str, size: int) -> memoryview | str:
    """The payload when ``value`` is ``size`` bytes plus a sound trailer for ``key``, else
    which check it failed."""
    if len(value) != size + _TRAILER.size:
        return f"{len(value) - _TRAILER.size} bytes stored, {size} asked"
    try:
        magic, version, n, psum, ksum = _TRAILER.unpack_from(value, size)
    except struct.error:
        return "no trailer"
    if (magic, version, n) != (_MAGIC, 1, size):
        return "not a value KVPipeStorage stored (trailer)"
    if ksum != xxhash.xxh3_64_intdigest(key.encode()):
        return "stored for another key (key digest)"
    payload = memoryview(value)[:size]
    if psum != xxhash.xxh3_64_intdigest(payload):
        payload.release()
        return "corrupt (checksum mismatch)"
    return payload


#: Why a value the store did not hand over failed (a store answers ``CORRUPT`` for a value of
#: another size than asked, as for one that failed its own checks).
_STORE_SAYS: Final = {
    BlockStatus.CORRUPT: "the store found it corrupt or of another size than asked",
    BlockStatus.FAILED: "the store failed to fetch it",
}


def _place(
    fetched: list[tuple[int, tuple[BlockStatus, bytearray]]],
    keys: list[str],
    ptrs: list[int],
    sizes: list[int],
    out: list[int],
) -> tuple[int, tuple[int, str] | None]:
    """Copy each fetched value (position ``i``, the store's answer) that passes its checks
    into its pointer (``out[i]``: its size); the number of values that failed them (missing
    ones not counted), and the first of those (its position, and why)."""
    bad, first = 0, None
    for i, (status, value) in fetched:
        if status is BlockStatus.MISSING:
            continue
        checked = _verify(value, keys[i], sizes[i]) if status is BlockStatus.OK else None
        if not isinstance(checked, memoryview):
            bad += 1
            if first is None:
                first = (i, checked or _STORE_SAYS.get(status, f"the store answered {status}"))
            continue
        checked.release()  # the checked payload: value's first bytes
        ctypes.memmove(ptrs[i], (ctypes.c_char * sizes[i]).from_buffer(value), sizes[i])
        out[i] = sizes[i]
    return bad, first


def _int(x: Any, what: str) -> int:
    if isinstance(x, bool):
        raise TypeError(f"{what} must be an int, got a bool")
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(x).__name__}") from None


class KVPipeStorage:
    """FastDeploy's ``KVCacheStorage`` over a kvpipe store; a drop-in for its ``FileStore``
    (and its ``MooncakeStore`` by URL).

    Args:
        file_path: The store's base directory; the store lives in ``<file_path>/<namespace>``.
            Not given: ``KVPIPE_STORE`` (a URL), else ``FILE_BACKEND_STORAGE_DIR``, else
            ``~/.cache/kvpipe/fastdeploy``. ``None`` or ``""``: ``ConfigError`` (a
            ``ValueError``); a directory that cannot be made: ``BackendError``.
        namespace: FastDeploy's model id; scopes every key.
        tp_rank: Only rank 0 creates the directory at construction.
        tp_size: The deployment's TP size; in every key, beside the namespace. FastDeploy's
            keys name the rank only, and a rank's slice of a block (its size too) differs
            at another TP size: deployments at different TP sizes keep apart.
        store: A kvpipe store to use instead (it is closed with this object).
        timeout: Seconds a ``batch_set`` / ``batch_get`` / ``exists`` / ``clear`` call may
            take (its caller waits at most this plus :data:`HOP_SLACK`): a finite number > 0,
            else ``ConfigError``.
        close_timeout: Seconds :meth:`close` may take.
        remember_keys: How many keys :meth:`clear` can remove: the most recently stored or
            seen ones (the oldest are forgotten first, with one WARNING; they stay in the
            store, as entries only another process touched do). Bounds what the object
            keeps over a server's lifetime (about 150 bytes a key).

    Return codes are FastDeploy's: ``set`` 0 / -1, ``get`` bytes copied / -1, ``exists`` a
    dict. Storage failures and missed deadlines return those codes with one WARNING per call;
    so does a key whose target location or size is not positive (-1 for that key, the
    others served), or lists of different lengths (-1 for every key); repeats of each
    kind bounded (:mod:`kvpipe._lograte`). Wrong argument types (a location or size that
    is no int, ``None`` included; a key that is no non-empty str) raise ``TypeError``,
    alike in ``set``, ``get``, ``batch_set`` and ``batch_get``. Any number of threads may
    call at once.
    """

    def __init__(
        self,
        file_path: Any = _UNSET,
        namespace: str | None = "",
        tp_rank: int | None = 0,
        tp_size: int | None = 1,
        *,
        store: StorageBackend | None = None,
        timeout: float = 30.0,
        close_timeout: float = 10.0,
        remember_keys: int = 1 << 20,
        **unknown: Any,
    ) -> None:
        if (
            isinstance(remember_keys, bool)
            or not isinstance(remember_keys, int)
            or remember_keys < 0
        ):
            raise ConfigError("remember_keys", f"must be an int >= 0, got {remember_keys!r}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < math.inf
        ):
            raise ConfigError("timeout", f"must be a finite number > 0, got {timeout!r}")
        if unknown:
            log.debug("KVPipeStorage: ignoring unknown keywords %s", sorted(unknown))
        #: FastDeploy calls again for every request whatever failed the last one (a store
        #: down or closed): its lines are bounded (:mod:`kvpipe._lograte`), per instance:
        #: another's never hide this one's.
        self._repeats = LogLimiter(log)
        if file_path is not _UNSET and (file_path is None or file_path == ""):
            raise ConfigError("file_path", "file_path must be specified for the FileStore backend")
        self.namespace = namespace or ""
        for name, value in (("tp_rank", tp_rank), ("tp_size", tp_size)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0
            ):
                raise ConfigError(name, f"must be an int >= 0 (or None), got {value!r}")
        self.tp_rank = int(tp_rank or 0)
        self.tp_size = int(tp_size or 1)  # FastDeploy may pass None (or 0): one rank
        #: scopes every key: a value stored at one TP size is never asked for at another
        self._scope = f"{self.namespace}\0tp{self.tp_size}"
        self.timeout = float(timeout)
        self.file_path: str | None = None
        if store is None:
            if file_path is _UNSET:
                url = os.environ.get("KVPIPE_STORE", "").strip()
                if url and not url.startswith("file:"):
                    store = store_from_url(url)
                elif url:
                    file_path = str(store_from_url(url).path)  # type: ignore[attr-defined]
                else:
                    file_path = os.environ.get("FILE_BACKEND_STORAGE_DIR") or str(
                        default_store_dir()
                    )
            if store is None:
                base = os.fspath(file_path)
                self.file_path = os.path.join(base, self.namespace) if self.namespace else base
                if self.tp_rank == 0:
                    try:
                        os.makedirs(self.file_path, exist_ok=True)
                    except OSError as exc:  # as the store's own open would say it
                        raise BackendError("file", "open", f"{self.file_path}: {exc}") from exc
                store = FileStore(self.file_path)
        elif file_path is not _UNSET:
            raise ConfigError("file_path", "give file_path or store, not both")
        self.store = store
        #: kvpipe keys this instance stored or saw stored, least recent first, at most
        #: remember_keys of them
        self._own: OrderedDict[str, None] = OrderedDict()
        self._remember_keys = remember_keys
        self._forgot = False
        self._own_lock = threading.Lock()
        self._dedup = 0
        self._loop = LoopThread("kvpipe-fastdeploy-storage", close_timeout)
        try:
            self._loop.enter(_closing(store))
            self._client: ValueClient = self._loop.enter(
                ValueClient(store, namespace="fastdeploy", close_timeout=close_timeout)
            )[0]
        except BaseException:
            self._loop.close()
            raise

    def close(self) -> None:
        """Close the store and stop the loop thread (idempotent; within ``close_timeout``).
        The keys kept for :meth:`clear` (up to ``remember_keys``) go too: it cannot run
        after close."""
        self._loop.close()
        with self._own_lock:
            self._own.clear()

    def __enter__(self) -> KVPipeStorage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def deduplicated(self) -> int:
        """``set`` calls answered 0 because the key was already stored (nothing written)."""
        return self._dedup

    def register_buffer(self, buffer_ptr: int, buffer_size: int) -> None:
        """Nothing to register: values are copied through kvpipe's own staging."""

    def _run(self, what: str, fn: Any, *args: Any, timeout: float | None = None) -> Any:
        """Run ``fn`` in the loop within ``timeout``; ``None`` (after one WARNING) when the
        store failed or the deadline passed."""
        limit = self.timeout if timeout is None else float(timeout)

        async def bounded() -> Any:
            with anyio.move_on_after(limit):
                return await fn(*args)
            raise TimeoutError(f"no result within {limit:.3f} s (timeout)")

        try:
            return self._loop.call(bounded, wait=limit + HOP_SLACK)
        except Exception as exc:
            # No memory for the staging of a new value size: the process's, not the caller's.
            staging = isinstance(exc, ConfigError) and exc.field == "staging_bytes"
            if not staging and isinstance(exc, (TypeError, ValueError, WrongEventLoop)):
                raise  # the caller's mistake, not the store's
            kind = "staging" if staging else type(exc).__name__
            self._repeats.log(
                logging.WARNING, f"{what}:{kind}", "KVPipeStorage %s failed: %r", what, exc
            )
            return None

    def _remember(self, keys: Sequence[str]) -> None:
        """Keep ``keys`` for :meth:`clear`, unless :meth:`close` has begun: it empties the
        set (under the same lock, after marking the loop closed), and a call it cut off
        must not fill it again."""
        with self._own_lock:
            if self._loop.closed:
                return
            for key in keys:
                self._own[key] = None
                self._own.move_to_end(key)
            excess = len(self._own) - self._remember_keys
            for _ in range(max(0, excess)):
                self._own.popitem(last=False)
            warn = excess > 0 and not self._forgot
            self._forgot = self._forgot or excess > 0
        if warn:
            log.warning(
                "KVPipeStorage: more than %d keys stored or seen; clear() will not remove "
                "the oldest (remember_keys)",
                self._remember_keys,
            )

    def _targets(
        self, op: str, keys: list[str], locations: list[int] | None, sizes: list[int] | None
    ) -> tuple[list[str], list[int], list[int], list[int]] | None:
        """A batch call's kvpipe keys, pointers, sizes and the positions whose pointer and
        size name a buffer (both > 0: the others answer -1, as in FastDeploy's own
        ``FileStore``; one WARNING); ``None`` without one location and size per key.
        A manager that passes them so does on every call: those lines are bounded."""
        n = len(keys)
        if locations is None or sizes is None or len(locations) != n or len(sizes) != n:
            self._repeats.log(
                logging.WARNING,
                f"{op}:lengths",
                "KVPipeStorage %s: keys, locations and sizes differ in length",
                op,
            )
            return None
        ours = [_key(self._scope, k) for k in keys]
        ptrs = [_int(p, "target_location") for p in locations]
        nbytes = [_int(s, "target_size") for s in sizes]
        bad = [i for i in range(n) if ptrs[i] <= 0 or nbytes[i] <= 0]
        if bad:
            self._repeats.log(
                logging.WARNING,
                f"{op}:no_buffer",
                "KVPipeStorage %s: %d of %d target locations/sizes name no buffer (first: "
                "%d/%d); -1 for those keys",
                op,
                len(bad),
                n,
                ptrs[bad[0]],
                nbytes[bad[0]],
            )
        valid = [i for i in range(n) if ptrs[i] > 0 and nbytes[i] > 0]
        return ours, ptrs, nbytes, valid

    def batch_set(
        self,
        keys: list[str],
        target_locations: list[int] | None = None,
        target_sizes: list[int] | None = None,
    ) -> list[int]:
        """Store ``target_sizes[i]`` bytes at address ``target_locations[i]`` under ``keys[i]``.

        Returns:
            Per key 0 (stored now or already) or -1 (store failed, deadline passed, a
            location or size that is not positive); -1 for every key when the lists' lengths
            differ. A key already stored is not rewritten (counted in :attr:`deduplicated`).
            Stored :data:`BATCH_SET_CHUNK` keys at a time under one deadline, each chunk a
            value size at a time: a store failure or the deadline ends the call in its
            chunk, the keys stored before it answering 0, those from it on -1 (a value whose
            put was under way may be stored all the same).

        Raises:
            TypeError: A key, location or size of the wrong type (nothing is stored).
        """
        self._loop.check_caller()  # a misuse even where nothing would reach the loop
        n = len(keys)
        targets = self._targets("batch_set", keys, target_locations, target_sizes)
        if targets is None:
            return [-1] * n
        ours, ptrs, sizes, valid = targets
        # In chunks: only a chunk's copies are alive at once, not a copy of the whole batch
        # (a long request's batch is as big as the manager's write buffer).
        deadline = time.monotonic() + self.timeout
        out = [-1] * n
        for lo in range(0, len(valid), BATCH_SET_CHUNK):
            chunk = valid[lo : lo + BATCH_SET_CHUNK]
            values = [_copied(ptrs[i], sizes[i], keys[i]) for i in chunk]
            done = [-1] * len(chunk)  # filled in the loop as each value size is stored
            ok = self._run(
                "batch_set",
                self._put,
                [ours[i] for i in chunk],
                values,
                done,
                timeout=deadline - time.monotonic(),
            )
            del values
            # What was stored before a failure or the deadline counts, and is remembered.
            for i, r in zip(chunk, list(done), strict=True):
                out[i] = r
            if ok is None:
                break
        self._remember([k for k, r in zip(ours, out, strict=True) if r == 0])
        return out

    async def _put(self, ours: list[str], values: list[bytearray], out: list[int]) -> bool:
        """Store the values not stored yet, setting ``out[i]`` to 0 as key ``i`` is found
        stored or stored: one value size at a time (the store's batches are of one size), so
        that a size whose put fails, or is cut off by the deadline, leaves the earlier
        sizes' answers in ``out`` (else -1 for keys in fact stored, and :meth:`clear`
        would never remove them)."""
        present = await self._client.exists(ours)
        todo = [i for i, p in enumerate(present) if not p]
        self._dedup += len(ours) - len(todo)
        for i, p in enumerate(present):
            if p:
                out[i] = 0
        for group in _by_size([len(values[i]) for i in todo]):
            picked = [todo[j] for j in group]
            got = await self._client.put([ours[i] for i in picked], [values[i] for i in picked])
            for i, status in zip(picked, got, strict=True):
                out[i] = 0 if status is BlockStatus.OK else -1
        return True

    def set(
        self, key: str, target_location: int | None = None, target_size: int | None = None
    ) -> int:
        """One key of :meth:`batch_set`: 0 or -1 (``TypeError`` as there)."""
        return self.batch_set([key], [target_location], [target_size])[0]  # type: ignore[list-item]

    def batch_get(
        self,
        keys: list[str],
        target_locations: list[int] | None = None,
        target_sizes: list[int] | None = None,
    ) -> list[int]:
        """Copy each stored value into ``target_locations[i]`` (``target_sizes[i]`` bytes).

        Returns:
            Per key the bytes copied, or -1 (missing, corrupt, of another size, store down,
            a location or size that is not positive); -1 for every key when the lists'
            lengths differ. A value is copied only after its checks passed: the caller's
            buffer never receives a corrupt or short value. Fetched :data:`BATCH_GET_CHUNK`
            keys at a time under one deadline, each chunk a value size at a time: a store
            failure or the deadline ends the call in its chunk, the values fetched before it
            placed, -1 from there on.

        Raises:
            TypeError: A key, location or size of the wrong type (nothing is copied).
        """
        self._loop.check_caller()
        n = len(keys)
        targets = self._targets("batch_get", keys, target_locations, target_sizes)
        if targets is None:
            return [-1] * n
        ours, ptrs, sizes, valid = targets
        out = [-1] * n
        # In chunks under one deadline: only a chunk's values are alive at once, not a copy
        # of the whole batch (a long request's read is as big as the manager's read buffer).
        deadline = time.monotonic() + self.timeout
        bad, first = 0, None
        for lo in range(0, len(valid), BATCH_GET_CHUNK):
            chunk = valid[lo : lo + BATCH_GET_CHUNK]
            got: list[tuple[BlockStatus, bytearray] | None] = [None] * len(chunk)
            args = [ours[i] for i in chunk], [sizes[i] + _TRAILER.size for i in chunk], got
            ok = self._run("batch_get", self._fetch, *args, timeout=deadline - time.monotonic())
            # The sizes fetched before a failure or the deadline are placed all the same.
            fetched = [(i, g) for i, g in zip(chunk, list(got), strict=True) if g is not None]
            del got
            failed, why = _place(fetched, keys, ptrs, sizes, out)
            bad, first = bad + failed, first or why
            del fetched  # before the next chunk is fetched
            if ok is None:
                break
        if first is not None:  # a store that keeps serving them: every call (bounded)
            self._repeats.log(
                logging.WARNING,
                "batch_get:checks",
                "KVPipeStorage batch_get: %d of %d values failed their checks (first: key %r: "
                "%s); -1 for those keys",
                bad,
                n,
                keys[first[0]],
                first[1],
            )
        self._remember([ours[i] for i in range(n) if out[i] > 0])
        return out

    async def _fetch(
        self,
        ours: list[str],
        nbytes: list[int],
        out: list[tuple[BlockStatus, bytearray] | None],
    ) -> bool:
        """Fetch the values into ``out`` one value size at a time, as :meth:`_put` stores
        them: a size whose fetch fails, or is cut off by the deadline, leaves the earlier
        sizes' values in ``out`` (its own stay ``None``)."""
        for group in _by_size(nbytes):
            got = await self._client.get([ours[i] for i in group], [nbytes[i] for i in group])
            for i, pair in zip(group, got, strict=True):
                out[i] = pair
        return True

    def get(
        self, key: str, target_location: int | None = None, target_size: int | None = None
    ) -> int:
        """One key of :meth:`batch_get`: bytes copied or -1 (``TypeError`` as there)."""
        return self.batch_get([key], [target_location], [target_size])[0]  # type: ignore[list-item]

    def exists(self, keys: list[str]) -> dict[str, bool]:
        """``{key: stored}`` for every key (all ``False`` when the store cannot answer)."""
        self._loop.check_caller()
        ours = [_key(self._scope, k) for k in keys]
        got = self._run("exists", self._client.exists, ours) if ours else []
        if got is None:
            return dict.fromkeys(keys, False)
        self._remember([k for k, ok in zip(ours, got, strict=True) if ok])
        return dict(zip(keys, got, strict=True))

    def query(
        self,
        k_cache_keys: list[str] | None = None,
        v_cache_keys: list[str] | None = None,
        k_scale_keys: list[str] | None = None,
        v_scale_keys: list[str] | None = None,
        timeout: float = 10.0,
    ) -> int:
        """How many **leading** blocks have every given part (key, value, the scales when
        given) stored; 0 for empty, ``None`` or mismatched lists, or when the store fails.

        Never raises for its arguments (a key that is no non-empty str, a timeout that is no
        number): 0, logged at ERROR (repeats bounded). FastDeploy's read task calls it
        outside the handler that sends its done signal, so a raise would leave the engine
        waiting for that signal for good. (A call from inside a running event loop still
        raises ``WrongEventLoop``.)
        """
        self._loop.check_caller()
        try:
            if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
                # not float()'s text, nor None as the instance's timeout: as the docs say
                raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
            if not k_cache_keys or not v_cache_keys:
                return 0
            parts = [k_cache_keys, v_cache_keys] + [p for p in (k_scale_keys, v_scale_keys) if p]
            if any(len(p) != len(k_cache_keys) for p in parts):
                return 0
            # Block by block, every part of a block before the next block: the leading run
            # of stored keys, one store call, gives the leading run of complete blocks.
            flat = [_key(self._scope, k) for block in zip(*parts, strict=True) for k in block]
            got = self._run("query", self._client.stored_run, flat, timeout=timeout)
        except (TypeError, ValueError) as exc:  # _run raises only the caller's mistakes so
            self._repeats.log(
                logging.ERROR,
                f"query:{type(exc).__name__}",
                "KVPipeStorage query: bad arguments, answering 0: %s",
                exc,
            )
            return 0
        if got is None:
            return 0
        return int(got) // len(parts)

    def clear(self) -> bool:
        """Remove every entry this instance stored or found stored (nothing else: never a
        foreign file beside them). True on success; False, with one WARNING, when the store
        failed, the deadline passed or :meth:`close` had begun (as any call after it)."""
        self._loop.check_caller()
        with self._own_lock:
            keys = list(self._own)

        async def delete() -> bool:
            await self._client.delete(keys)
            return True

        # Nothing to remove answers True without a hop, unless closed: then, as every call
        # after close, the hop answers PipelineClosed (one WARNING) and clear() False.
        if (keys or self._loop.closed) and self._run("clear", delete) is None:
            return False
        with self._own_lock:
            for key in keys:
                self._own.pop(key, None)
        return True


@contextlib.asynccontextmanager
async def _closing(store: StorageBackend) -> AsyncIterator[StorageBackend]:
    """Enters a store and closes it on exit. A file store whose directory is not there yet
    (a rank other than 0 creates none: rank 0 makes it) opens lazily, on its first call;
    one whose directory is there opens now, so its recovery scan is not charged to the
    first call's timeout."""
    if not isinstance(store, FileStore) or await anyio.Path(store.path).is_dir():
        await store.__aenter__()
    try:
        yield store
    finally:
        await store.aclose()
