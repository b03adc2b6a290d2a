"""Mooncake Store as a kvpipe backend.

Zero-copy: the staging memory is registered once and every slice moves straight from / into
it (``batch_put_from``, ``batch_upsert_from`` only to replace a stored value that differs, and
``batch_get_into``), in worker threads. Per-key result codes are translated, never trusted
blindly, and a key that fails to read is not trusted by ``exists`` again until stored anew (see
``docs/backends.md``). The vendor import happens only here; without the package,
:class:`MooncakeStore` raises :class:`kvpipe.Unsupported`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import Any, Final, NamedTuple, TypeVar, final

import anyio
import numpy as np

from .._errors import BackendError, ConfigError, Unsupported
from .._lograte import LogLimiter
from .._results import ResidencyEntry
from .._shield import DeferredCancel, shielded
from .._workers import WorkerThreads, in_thread_to_its_end
from ._base import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend, validate_key
from ._inflight import InFlight, ThreadGate
from ._mooncake_index import ResidencyIndex
from ._mooncake_setup import Setup

__all__ = ("MooncakeStore",)

log = logging.getLogger("kvpipe.mooncake")
T = TypeVar("T")

NO_SPACE: Final = -200
NOT_FOUND: Final = -704
INVALID_PARAMS: Final = -600
#: The code of keys whose vendor write call raised (after others were published).
_RAISED: Final = -1
#: What a stored value of the put's size but other bytes reads as (not a vendor code).
_DIFFERENT: Final = -1_000_000
#: Put scratch memory the vendor would not unregister: never freed under it.
_KEPT: list[Any] = []
#: Bytes of scratch a put reads stored values into at once to compare them (registered with
#: the transfer engine, pinned under RDMA): a slice of 500 stored 2 MiB blocks is compared in
#: pieces, not with 1 GiB of scratch.
SCRATCH_MAX: Final = 64 << 20
_DISTRUST_MAX: Final = 100_000


def _load_client() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise Unsupported(
            "kvpipe.MooncakeStore needs the Mooncake client: pip install "
            "mooncake-transfer-engine-non-cuda (CPU hosts) or mooncake-transfer-engine (GPU "
            f"hosts), and apt-get install libibverbs1 ({exc})"
        ) from exc
    return MooncakeDistributedStore()


def _each_key_once(
    get_into: Callable[..., Sequence[int]], buffers: list[memoryview]
) -> Callable[[list[str], list[int], list[int]], list[int]]:
    """``batch_get_into`` for a batch that names a key more than once. The vendor moves one
    value per distinct key (into the last of its buffers) yet reports every buffer filled; so
    each key is fetched once, into its first buffer, and copied into its others."""

    def batch_get_into(keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        first: dict[str, int] = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        picked = list(first.values())
        codes = list(
            get_into(
                [keys[i] for i in picked],
                [addresses[i] for i in picked],
                [sizes[i] for i in picked],
            )
        )
        if len(codes) != len(picked):
            raise ValueError(f"{len(codes)} codes for {len(picked)} distinct keys")
        code_of = dict(zip(first, codes, strict=True))
        out = []
        for i, key in enumerate(keys):
            j = first[key]
            if i != j and code_of[key] == sizes[j]:
                buffers[i][:] = buffers[j]
            out.append(code_of[key])
        return out

    return batch_get_into


@contextlib.contextmanager
def _translated(op: str) -> Iterator[None]:
    """An exception other than a :class:`BackendError` raised as one for ``op`` (chained)."""
    try:
        yield
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError("mooncake", op, repr(exc)) from exc


def _codes(name: str, codes: Sequence[int], n: int) -> list[int]:
    """``codes`` as a list of ints, after checking there is one per key.

    Raises:
        BackendError: Another number of codes, or an answer that is not int codes.
    """
    try:
        out = [int(c) for c in codes]
    except (TypeError, ValueError) as exc:
        raise BackendError("mooncake", name, f"not int codes: {exc!r}") from exc
    if len(out) != n:
        raise BackendError("mooncake", name, f"{len(out)} codes for {n}")
    return out


def _region(buffer: memoryview) -> tuple[int, int]:
    """A staging buffer's (address, bytes)."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data), len(buffer)


class _Lines(NamedTuple):
    """Where a store's worker-thread calls log: a master that is down (or going down) fails
    every call alike, so the lines are bounded (:mod:`kvpipe._lograte`), kinds by call and
    exception type, per store (another store's never hide this one's), and name its master.
    """

    repeats: LogLimiter
    master: str


def _put_from_staging(
    lines: _Lines,
    client: Any,
    distrusted: frozenset[str],
    keys: list[str],
    addresses: list[int],
    size: int,
    views: list[memoryview],
) -> list[tuple[int, str]]:
    """The blocking body of :meth:`MooncakeStore.put_blocks` (worker thread only).

    The vendor's upsert of a stored key hides it from ``batch_is_exist`` while it runs, and
    one of a value of another size drops the stored value before it knows the new one fits
    (in a full store it then fails with ``-200`` and the key is gone, its space not at once
    reusable); its ``batch_put_from`` of a stored key answers 0 and keeps the stored value.
    So:

    1. ``batch_is_exist`` sorts the keys; a key answered with an error code fails with it.
    2. A stored key is read (``batch_get_into`` a scratch buffer registered for the
       call); when it holds exactly the bytes being put it is left alone
       (``"unchanged"``): such a re-put never hides the key nor puts it at risk. kvpipe's
       keys are content-derived, so a pipeline's re-puts are of this kind. One holding a
       value of another size is not replaced: it fails (``"other_size"``) and keeps its
       value, which only a delete removes.
    3. New keys, and stored ones gone by the time they were read, are put with
       ``batch_put_from`` (``"put"``); those it answered 0 for are looked up again with
       ``batch_is_exist``, and one not found fails (``"not_visible"``): another writer's
       put of it has begun and not ended (see :func:`_check_visible`).
    4. Stored keys holding other bytes of this size, and distrusted ones (a read failed
       earlier: not read again here, it may hang), are replaced with ``batch_upsert_from``
       (``"replaced"``). A stored key that could not be read now fails (``"unreadable"``),
       its value untouched; the store distrusts it, so the next put of it replaces it.

    The writes come last, so an exception before them leaves the store as it was; one from
    the second write, after the first published values, fails only that write's keys
    (logged): a value this call published is reported, never taken back.

    Returns:
        Per key, the vendor's code (0: stored; for ``"other_size"``, the stored size) and
        how it was stored.
    """

    n = len(keys)
    stored = _codes("batch_is_exist", client.batch_is_exist(keys), n)
    out = [(min(code, 0), "put") for code in stored]  # an error code fails its key with it
    fresh = [i for i in range(n) if stored[i] == 0]
    replace = [i for i in range(n) if stored[i] > 0 and keys[i] in distrusted]
    known = [i for i in range(n) if stored[i] > 0 and keys[i] not in distrusted]
    if known:
        stored_keys = [keys[i] for i in known]
        for i, code in _read_and_compare(lines, client, stored_keys, known, size, views):
            if code == NOT_FOUND:
                fresh.append(i)
            elif code == 0:
                out[i] = (0, "unchanged")
            elif code == _DIFFERENT:
                replace.append(i)
            elif code > 0:
                out[i] = (code, "other_size")
            else:  # not read: the value is kept, and not trusted until stored anew
                out[i] = (code, "unreadable")
    published = False
    for name, picked, how in (
        ("batch_put_from", sorted(fresh), "put"),
        ("batch_upsert_from", sorted(replace), "replaced"),
    ):
        if not picked:
            continue
        try:
            codes = _codes(
                name,
                getattr(client, name)(
                    [keys[i] for i in picked],
                    [addresses[i] for i in picked],
                    [size] * len(picked),
                ),
                len(picked),
            )
        except Exception as exc:
            if not published:
                raise
            lines.repeats.log(
                logging.ERROR,
                f"published:{name}:{type(exc).__name__}",
                "mooncake %s: %s raised after values were published: %s",
                lines.master,
                name,
                repr(exc),
            )
            codes = [_RAISED] * len(picked)
        for i, code in zip(picked, codes, strict=True):
            out[i] = (code, how)
            published = published or code == 0
    _check_visible(lines, client, keys, out)
    return out


def _check_visible(lines: _Lines, client: Any, keys: list[str], out: list[tuple[int, str]]) -> None:
    """Fail (``"not_visible"``) each key ``batch_put_from`` answered 0 for that
    ``batch_is_exist`` does not find now. The vendor answers 0 for a key whose put another
    writer has begun and not ended (its "already exists" counts as success), though it can
    be neither found nor read until that put ends, and never if it fails. A key that this
    call published answers 1. Where the check itself fails (an error code, an exception:
    logged), the vendor's 0 stands: a value this call may have published is never taken
    back."""
    put = [i for i, got in enumerate(out) if got == (0, "put")]
    if not put:
        return
    try:
        found = _codes("batch_is_exist", client.batch_is_exist([keys[i] for i in put]), len(put))
    except Exception as exc:
        lines.repeats.log(
            logging.ERROR,
            f"check_visible:{type(exc).__name__}",
            "mooncake %s: batch_is_exist after a put raised: %s",
            lines.master,
            repr(exc),
        )
        return
    for i, code in zip(put, found, strict=True):
        if code == 0:
            out[i] = (NOT_FOUND, "not_visible")


def _read_and_compare(
    lines: _Lines,
    client: Any,
    keys: list[str],
    at: list[int],
    size: int,
    views: list[memoryview],
) -> list[tuple[int, int]]:
    """Read stored ``keys`` (at positions ``at`` of ``views``) into scratch memory registered
    for the call, at most :data:`SCRATCH_MAX` bytes (one key) at a time, and compare them
    with the ``size``-byte values being put.

    Returns:
        Per key, its position and: 0 (it holds those bytes), :data:`_DIFFERENT` (other
        bytes of this size), its stored size (another size), :data:`NOT_FOUND` (gone
        since), or the vendor's negative code (the read, or ``get_size``, failed).
    """
    step = max(1, SCRATCH_MAX // size)
    out: list[tuple[int, int]] = []
    for lo in range(0, len(keys), step):
        piece = keys[lo : lo + step], at[lo : lo + step]
        out += _compare_piece(lines, client, *piece, size, views)
    return out


def _code_name(what: str, code: int) -> str:
    """The statistic counting a vendor answer ``code`` to a read: ``{what}_code_{code}`` for
    an error code (a short, fixed set), ``{what}_other_size`` for a value's byte count (of
    another size than asked: as many names as sizes would be unbounded labels)."""
    return f"{what}_other_size" if code > 0 else f"{what}_code_{code}"


def _compare_piece(
    lines: _Lines,
    client: Any,
    keys: list[str],
    at: list[int],
    size: int,
    views: list[memoryview],
) -> list[tuple[int, int]]:
    """:func:`_read_and_compare` of one piece, in one scratch buffer."""
    scratch = np.empty((len(keys), size), np.uint8)
    base = int(scratch.ctypes.data)
    rc = int(client.register_buffer(base, scratch.nbytes))
    if rc != 0:
        raise BackendError("mooncake", "register_buffer", f"scratch: returned {rc}")
    get_into = client.batch_get_into
    if len(set(keys)) < len(keys):
        get_into = _each_key_once(get_into, [row.data for row in scratch])
    try:
        got = _codes(
            "batch_get_into",
            get_into(keys, [base + j * size for j in range(len(keys))], [size] * len(keys)),
            len(keys),
        )
    finally:
        try:
            answer: object = int(client.unregister_buffer(base))
        except Exception as exc:  # it may still be registered, as with an error code
            answer = repr(exc)
        if answer != 0:  # still registered: never freed under the transfer engine
            _KEPT.append(scratch)
            lines.repeats.log(
                logging.ERROR,
                "scratch_unregister",
                "mooncake %s: unregister_buffer of put scratch returned %s; kept",
                lines.master,
                answer,
            )
    out = []
    for key, i, row, code in zip(keys, at, scratch, got, strict=True):
        if code == size:
            same = np.array_equal(row, np.frombuffer(views[i], np.uint8, size))
            out.append((i, 0 if same else _DIFFERENT))
        elif 0 < code < size:
            out.append((i, code))
        elif code == INVALID_PARAMS:  # what a value longer than the buffer answers
            length = int(client.get_size(key))
            out.append((i, length if length > size else code if length > 0 else length))
        else:
            out.append((i, code))
    return out


@final
class MooncakeStore(StorageBackend):
    """Blocks in a Mooncake Store.

    Args:
        master: ``host:port`` of ``mooncake_master`` (anything else: ``ConfigError``).
        metadata: URL of the metadata server (``http://host:port/metadata``).
        local_hostname: This client's address as other clients reach it.
        protocol: ``"tcp"`` or ``"rdma"``.
        device_name: RDMA device (``""`` for TCP).
        global_segment_size: Bytes this client contributes to the store (0: none, a client
            that only moves values to and from other clients' segments).
        local_buffer_size: Bytes of the client's local transfer buffer. The block calls
            (zero-copy, from and into the staging) do not use it; the residency index
            (``flush_index``, ``locate``) does: with 0 those fail (``BackendError``).
        setup_timeout: Seconds ``open`` may take (the master is probed first), and each of
            ``aclose``'s two waits.
        client: An already set-up ``MooncakeDistributedStore`` to use instead (not closed by
            :meth:`aclose`).

    Raises:
        ConfigError: A size that is not an int >= 0, or a ``setup_timeout`` that is not a
            finite number > 0 (refused here, not at the first call).

    Use ``async with MooncakeStore(...) as store`` or ``await store.open()``.
    """

    name = "mooncake"
    exists_answers_every_key = True  # batch_is_exist answers each key

    def __init__(
        self,
        master: str,
        metadata: str,
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 1 << 30,
        local_buffer_size: int = 64 << 20,
        setup_timeout: float = 30.0,
        client: Any = None,
    ) -> None:
        for field, size in (
            ("global_segment_size", global_segment_size),
            ("local_buffer_size", local_buffer_size),
        ):
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ConfigError(field, f"must be an int >= 0 (bytes), got {size!r}")
        if isinstance(setup_timeout, bool) or not (
            isinstance(setup_timeout, int | float) and 0 < setup_timeout < math.inf
        ):
            raise ConfigError("setup_timeout", f"must be finite and > 0, got {setup_timeout!r}")
        host, _, port = master.rpartition(":") if isinstance(master, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("master", f"expected HOST:PORT, got {master!r}")
        self.master = master
        self.metadata = metadata
        self.local_hostname = local_hostname
        self.protocol = protocol
        self.device_name = device_name
        self.global_segment_size = global_segment_size
        self.local_buffer_size = local_buffer_size
        self.setup_timeout = setup_timeout
        self._client = client
        self._own_client = client is None
        if client is None:  # fail at construction, not at first use
            try:
                import mooncake.store  # noqa: F401
            except ImportError:
                _load_client()
        #: Per staging region (address, bytes): the register_staging calls not undone yet.
        self._registered: Counter[tuple[int, int]] = Counter()
        #: Regions registered with the vendor, or that may be (a call given up on after it
        #: started may complete); one unregister_buffer is still owed for each.
        self._vendor: set[tuple[int, int]] = set()
        #: Regions with a vendor (un)registration awaited now; set when it is over. Other
        #: calls for the region wait for it: those of one region never run at once.
        self._busy: dict[tuple[int, int], anyio.Event] = {}
        #: Regions :meth:`aclose` took to unregister and has not (yet) unregistered: failed,
        #: or still to do in its thread past the deadline. Their owners must keep them.
        self._left: set[tuple[int, int]] = set()
        #: Keys not trusted by ``exists``; the value is the read given up on that put the key
        #: here (``None``: a read that failed).
        self._distrust: OrderedDict[str, object] = OrderedDict()
        #: Reads given up on whose vendor call has since returned (appended by its thread):
        #: (the read, keys, codes, value size).
        self._settled: deque[tuple[object, list[str], list[int], int]] = deque()
        self._gate = ThreadGate(self.name, 4)
        self._open_lock = anyio.Lock()
        #: The vendor ``setup`` running or ended but not yet taken by an ``open``.
        self._setup: Setup | None = None
        self._setup_threads = WorkerThreads()
        self._counters: Counter[str] = Counter()
        #: Its worker threads' log lines: bounded per store, naming its master.
        self._lines = _Lines(LogLimiter(log), master)
        self._inflight = InFlight(lambda: BackendError(self.name, "call", "the store is closing"))
        self._index = ResidencyIndex(self.name, self._call)

    async def open(self) -> None:
        """Connect (idempotent): probe the master, then ``setup`` the client.

        Raises:
            BackendError: The master does not answer, or ``setup`` fails or times out.

        Cancellation: the wait stops; a ``setup`` still running runs on, and the next
        ``open`` waits for it (by the same deadline) rather than start another. A client
        whose setup ends after :meth:`aclose` is closed.
        """
        async with self._open_lock:
            if self._client is not None:
                return
            if self._inflight.closing:  # never set up a client that nothing would close
                raise BackendError(self.name, "open", "the store is closed")
            setup = self._setup
            if setup is None:
                setup = await self._start_setup()
            with anyio.move_on_at(setup.deadline):
                await setup.done.wait()
            if not setup.done.is_set():
                raise BackendError(self.name, "setup", f"no answer in {self.setup_timeout} s")
            self._setup = None
            if isinstance(setup.result, Exception):
                raise BackendError(self.name, "setup", repr(setup.result)) from setup.result
            if setup.result != 0:
                raise BackendError(self.name, "setup", f"returned {setup.result}")
            self._client = setup.client

    async def _start_setup(self) -> Setup:
        """Probe the master, then start the vendor ``setup`` of a new client in a worker
        thread (it becomes :attr:`_setup`)."""
        host, _, port = self.master.rpartition(":")
        try:
            with anyio.fail_after(min(5.0, self.setup_timeout)):
                stream = await anyio.connect_tcp(host, int(port))
                await stream.aclose()
        except (OSError, TimeoutError) as exc:
            raise BackendError(
                self.name, "open", f"master {self.master} unreachable: {exc}"
            ) from exc
        # Clients must advertise the loopback address on a one-machine setup.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_hostname)
        args = (
            self.local_hostname,
            self.metadata,
            self.global_segment_size,
            self.local_buffer_size,
            self.protocol,
            self.device_name,
            self.master,
        )
        setup = Setup(_load_client(), args, anyio.current_time() + self.setup_timeout)
        try:
            self._setup_threads.submit(setup.run)
        except RuntimeError as exc:
            raise BackendError(self.name, "setup", f"no thread to run it: {exc}") from exc
        self._setup = setup
        return setup

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` has run: every later call is refused."""
        return self._inflight.closing

    async def aclose(self) -> None:
        """Unregister staging and close the client (if this store created it), once every
        vendor call still running has returned (closing under one crashes the process).

        Timeouts: each wait, for running calls and for unregistering and closing, is bounded
        by ``setup_timeout``; past it the client is left open, or its close left to finish in
        a worker thread, logged.

        Its worker threads are none of the event loop library's shared ones (a server may
        have them all busy).

        Raises:
            BackendError: The vendor client's ``close`` raised or answered an error code.
                Staging is unregistered before it, each buffer whatever the others did (a
                failure is logged).

        Cancellation: shielded, from asyncio's own (``Task.cancel``) too: one received
        meanwhile is raised once closed (in place of the vendor ``close``'s error).
        """
        deferred = DeferredCancel()
        try:
            with anyio.CancelScope(shield=True):
                await self._close(deferred)
        finally:
            deferred.raise_if_received()

    async def _close(self, deferred: DeferredCancel) -> None:
        """:meth:`aclose`'s work, each wait through ``deferred`` (asyncio's own cancel)."""
        await shielded(self._open_lock.acquire, deferred=deferred)
        try:
            client = self._client
            self._setup_threads.shutdown()  # a setup running runs on to its end
            if client is None:  # never opened (or closed): refuse every later call
                self._inflight.drain(0)  # nothing runs without a client
                self._gate.close()
                setup, self._setup = self._setup, None
                if setup is not None and setup.orphan():  # set up, never taken
                    await self._release(setup.client, [], True, deferred)
                return
            idle = await in_thread_to_its_end(
                self._inflight.drain, self.setup_timeout, deferred=deferred
            )
            self._gate.close()  # its calls are refused, or still run (given up on)
            if not idle:
                log.error(
                    "mooncake: %d vendor call(s) still running after %.0f s; the "
                    "client is left open",
                    self._inflight.running,
                    self.setup_timeout,
                )
                return
            self._client = None
            registered, self._vendor = list(self._vendor), set()
            self._registered = Counter()
            self._left.update(registered)  # until each is unregistered (by its thread)
            await self._release(client, registered, self._own_client, deferred)
        finally:
            self._open_lock.release()

    async def _release(
        self, client: Any, registered: list[tuple[int, int]], close: bool, deferred: DeferredCancel
    ) -> None:
        """Unregister ``registered`` from ``client`` and ``close`` it, in a thread of its own,
        waited for up to ``setup_timeout`` (then left to finish there, logged).

        Raises:
            BackendError: The vendor ``close`` raised, or answered an error code.
        """
        deadline = anyio.current_time() + self.setup_timeout
        try:
            await in_thread_to_its_end(
                self._release_sync, client, registered, close, deferred=deferred, deadline=deadline
            )
        except TimeoutError:
            log.error(
                "mooncake: unregistering staging and closing the client took more "
                "than %.0f s; left to finish in a worker thread",
                self.setup_timeout,
            )

    def _release_sync(self, client: Any, registered: list[tuple[int, int]], close: bool) -> None:
        """:meth:`_release` in its thread: each buffer unregistered whatever the others did
        (a failure is logged), then the vendor ``close``."""
        for ptr, size in registered:
            try:
                rc = client.unregister_buffer(ptr)
            except Exception as exc:
                rc = repr(exc)
            if rc == 0:
                self._left.discard((ptr, size))
            else:
                log.error(
                    "mooncake: unregistering staging at %#x (%d bytes) at close returned %s",
                    ptr,
                    size,
                    rc,
                )
        if not close:
            return
        with _translated("close"):
            rc = client.close()
        if rc != 0:
            raise BackendError(self.name, "close", f"returned {rc}")

    async def _ready(self) -> Any:
        if self._client is None:
            await self.open()
        return self._client

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        op = getattr(fn, "__name__", "call")
        with _translated(op):
            return await self._gate.run(op, self._inflight.track(fn), *args)

    async def register_staging(self, buffer: memoryview) -> None:
        """Register memory values move from or into with the transfer engine, counted: once
        with the vendor however many pipelines register it. The vendor calls for one buffer
        run one at a time: a call made while another caller's registration or last
        unregistration of the buffer runs waits for its outcome, and registers the buffer
        anew where it is not registered then.

        Raises:
            BackendError: The vendor call failed (nothing is registered, nor counted).

        Cancellation: the call counts as registered wherever it was cancelled (its caller
        counts it so, and unregisters it): a vendor call already started is abandoned and
        may still complete (:meth:`unregister_staging` or :meth:`aclose` undoes it); one not
        started yet never starts, and unregistering the call then undoes nothing with the
        vendor, as where the call waited for another caller's that failed, or for the store
        to open.
        """
        region = _region(buffer)
        self._registered[region] += 1  # an owner, until the call fails
        try:
            client = await self._ready()
            async with self._turn(region):
                if region not in self._vendor:
                    await self._register(client, region)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException:
            self._uncount(region)
            raise

    @contextlib.asynccontextmanager
    async def _turn(self, region: tuple[int, int]) -> AsyncIterator[None]:
        """Wait until no vendor call for ``region`` is awaited, then await one's (while the
        block runs)."""
        while (busy := self._busy.get(region)) is not None:
            await busy.wait()
        done = self._busy[region] = anyio.Event()
        try:
            yield
        finally:
            del self._busy[region]
            done.set()

    async def _register(self, client: Any, region: tuple[int, int]) -> None:
        """The vendor ``register_buffer`` of ``region`` (its turn held). Cancelled once the
        call started, the region counts as registered (the call may still complete); before,
        the call never starts.

        Raises:
            BackendError: The vendor call failed.
        """
        lock = threading.Lock()
        started = abandoned = False

        def register_buffer(ptr: int, size: int) -> int:
            nonlocal started
            with lock:
                if abandoned:
                    return 0  # its caller gave up before it started: never registers
                started = True
            rc: int = client.register_buffer(ptr, size)
            return rc

        try:
            rc = await self._call(register_buffer, *region)
        except anyio.get_cancelled_exc_class():
            with lock:
                abandoned = True
                began = started
            if began:  # it may still complete
                self._vendor.add(region)
            raise
        if rc != 0:
            raise BackendError(self.name, "register_buffer", f"returned {rc}")
        self._vendor.add(region)

    def _uncount(self, region: tuple[int, int]) -> None:
        self._registered[region] -= 1
        if self._registered[region] <= 0:
            del self._registered[region]

    async def unregister_staging(self, buffer: memoryview) -> None:
        """Undo one :meth:`register_staging` of ``buffer``: the last one unregisters it with
        the vendor, once any vendor call for it still awaited is over. Abandoned on
        cancellation.

        Raises:
            BackendError: The vendor call failed (the next unregistration of the buffer, or
                :meth:`aclose`, tries again); or :meth:`aclose` took the buffer to unregister
                and did not (it failed, or is still running past its deadline): it may still
                be registered, so the caller must not free it.
        """
        region = _region(buffer)
        if region in self._left:
            raise BackendError(self.name, "unregister_buffer", "left registered at close")
        if self._registered[region] <= 0:
            return
        self._uncount(region)
        async with self._turn(region):
            if region in self._left:
                raise BackendError(self.name, "unregister_buffer", "left registered at close")
            if region in self._registered or region not in self._vendor or self._client is None:
                return
            rc = await self._call(self._client.unregister_buffer, region[0])
            if rc != 0:  # still registered: the caller keeps it
                raise BackendError(self.name, "unregister_buffer", f"returned {rc}")
            self._vendor.discard(region)

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        """Zero-copy put from the batch's staging buffers, in one worker thread (see
        :func:`_put_from_staging`): a new key is stored with ``batch_put_from`` (and fails
        where it is not found right after, another writer's put of it not ended), a stored key
        that already holds the same bytes is left alone, one holding a value of another size
        fails (``FAILED``, its value kept: the vendor's replacement of it could drop it), and
        only a stored key holding other bytes of the same size (or that this store
        distrusts) is replaced, with ``batch_upsert_from``.

        Cancellation: the wait stops; the vendor calls run on with the staging leased.
        """
        client = await self._ready()
        keys = [validate_key(k) for k in batch.keys]
        self._take_settled()
        distrusted = frozenset(k for k in keys if k in self._distrust)
        with _translated("put"):
            outcomes = await batch.run_sync(
                self._inflight.track(_put_from_staging),
                self._lines,
                client,
                distrusted,
                keys,
                batch.buffer_addresses(),
                batch.value_nbytes,
                batch.values,
            )
        out = []
        for key, (code, how) in zip(keys, outcomes, strict=True):
            if code == 0:
                out.append(BlockStatus.OK)
                self._distrust.pop(key, None)
                if how != "put":
                    self._counters[f"blocks_{how}"] += 1
            elif how in ("other_size", "not_visible"):
                out.append(BlockStatus.FAILED)
                self._counters[f"put_{how}"] += 1
            elif how == "unreadable":
                out.append(BlockStatus.FAILED)
                self._counters[_code_name("put_read", code)] += 1
                self._distrust_key(key)
            else:
                out.append(BlockStatus.NO_SPACE if code == NO_SPACE else BlockStatus.FAILED)
                self._counters[f"put_code_{code}"] += 1
        self._counters["blocks_put"] += out.count(BlockStatus.OK)
        return out

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        """``batch_get_into`` the batch's staging buffers; a key that exists but cannot be
        read is not trusted by :meth:`exists` again until it is stored anew.

        Cancellation: the wait stops and, where the vendor call has begun, the keys are not
        trusted while it runs on (a segment owner hanging or gone): those it then reads (or
        finds missing) are trusted again, the others stay distrusted unless put anew
        meanwhile. A call that had not begun never begins.
        """
        client = await self._ready()
        keys = [validate_key(k) for k in batch.keys]
        get_into = client.batch_get_into
        if len(set(keys)) < len(keys):
            get_into = _each_key_once(get_into, batch.buffers)
        size = batch.value_nbytes
        given_up = object()  # this read, once its caller stops waiting
        lock = threading.Lock()
        began = abandoned = False
        returned: list[int] | None = None

        def fetch(names: list[str], addresses: list[int], lengths: list[int]) -> Sequence[int]:
            nonlocal began, returned
            with lock:
                if abandoned:  # its caller gave up before it began: nothing is read
                    return []
                began = True
            codes: Sequence[int] = get_into(names, addresses, lengths)
            with lock:
                returned = [int(c) for c in codes]
                if abandoned:
                    self._settled.append((given_up, keys, returned, size))
            return codes

        fetch.__name__ = get_into.__name__
        try:
            with _translated(get_into.__name__):
                codes = await batch.run_sync(
                    self._inflight.track(fetch), keys, batch.buffer_addresses(), [size] * len(keys)
                )
        except anyio.get_cancelled_exc_class():
            with lock:
                abandoned = True
                running, done = began and returned is None, returned
            if running:
                for key in keys:
                    self._distrust_key(key, given_up)
            elif done is not None:  # it returned just as its caller gave up
                self._settle(None, keys, done, size)
            raise
        out = []
        for key, code in zip(keys, _codes(get_into.__name__, codes, len(keys)), strict=True):
            if code == batch.value_nbytes:
                out.append(BlockStatus.OK)
            elif code == NOT_FOUND:
                out.append(BlockStatus.MISSING)
            else:
                out.append(BlockStatus.CORRUPT if code > 0 else BlockStatus.FAILED)
                self._counters[_code_name("get", code)] += 1
                self._distrust_key(key)
        self._counters["blocks_got"] += out.count(BlockStatus.OK)
        return out

    def _distrust_key(self, key: str, read: object = None) -> None:
        self._distrust[key] = read
        self._distrust.move_to_end(key)
        while len(self._distrust) > _DISTRUST_MAX:
            self._distrust.popitem(last=False)

    def _settle(self, read: object, keys: list[str], codes: list[int], size: int) -> None:
        """The vendor call of a read given up on returned ``codes``: a key it read (or found
        missing) is trusted again unless distrusted since for another reason (``read`` is
        the read given up on, ``None`` where it distrusted none); one it failed to read is
        distrusted, unless put anew since (its value is no longer the one that failed) or
        given up on by a later read (whose own outcome then decides)."""
        if len(codes) != len(keys):
            codes = [-1] * len(keys)
        for key, code in zip(keys, codes, strict=True):
            if code in (size, NOT_FOUND):
                if read is not None and self._distrust.get(key) is read:
                    del self._distrust[key]
            else:
                self._counters[_code_name("get", code)] += 1
                if read is None or self._distrust.get(key) is read:
                    self._distrust_key(key)

    def _take_settled(self) -> None:
        """Settle the reads given up on whose vendor calls have returned since (event loop
        only)."""
        while self._settled:
            self._settle(*self._settled.popleft())

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        """``batch_is_exist``, minus keys that failed to read since they were stored; the call
        is abandoned on cancellation.

        Raises:
            BackendError: The call failed or answered with an error code.
        """
        client = await self._ready()
        keys = [validate_key(k) for k in batch.keys]
        codes = _codes("batch_is_exist", await self._call(client.batch_is_exist, keys), len(keys))
        if any(c < 0 for c in codes):
            raise BackendError(self.name, "batch_is_exist", f"error codes {sorted(set(codes))}")
        self._take_settled()
        return [c == 1 and k not in self._distrust for k, c in zip(keys, codes, strict=True)]

    async def delete(self, keys: Sequence[str]) -> None:
        """Remove keys (forced: a recent reader's lease does not keep a bad block alive); the
        call is abandoned on cancellation and may still remove them."""
        client = await self._ready()
        keys = [validate_key(k) for k in keys]
        codes = _codes("batch_remove", await self._call(client.batch_remove, keys, True), len(keys))
        failed = [c for c in codes if c not in (0, NOT_FOUND)]
        if failed:
            raise BackendError(self.name, "batch_remove", f"codes {sorted(set(failed))}")

    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        """One record per (key, node), written under two names one after the other (a
        record being rewritten stays readable under the other); the node joins the registry of
        node ids. Vendor calls are abandoned on cancellation.

        Raises:
            BackendError: A vendor call failed.
            RequestError: An entry that cannot name or hold a record (see
                :func:`~kvpipe.backends._base.validate_entry`: a bad key, a node id not
                printable or with a space or ``@``, a residency that is no ``Residency``,
                a time that is no finite number; a ``ValueError``), before anything is
                written.
        """
        await self._index.put(await self._ready(), entries)

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[ResidencyEntry]]:
        """Every node's record for each key (reads the node registry, then the records).
        Vendor calls are abandoned on cancellation.

        Raises:
            BackendError: A vendor call failed.
        """
        return await self._index.get(await self._ready(), keys)

    def statistics(self) -> Mapping[str, float]:
        """Counters of this client (blocks moved, codes seen, distrusted keys). Read only: a
        metrics exporter calls it from its own thread (reads given up on are settled by the
        next ``exists`` or put, on the event loop)."""
        return {**self._counters, "distrusted_keys": len(self._distrust)}
