"""The public pipeline: ``open_pipeline`` and the calls an inference server makes.

Every call validates its arguments first (``RequestError`` before anything is queued), then
hands a request to :class:`kvpipe._runtime.Runtime` and waits for its outcome. No call blocks
the event loop; every call returns by its deadline (plus ``deadline_slack`` at worst).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, final

import anyio
import anyio.abc

from ._cache import KVCache
from ._config import PipelineConfig
from ._errors import ConfigError, IncompleteRead, RequestError
from ._keys import Scope
from ._results import (
    ActorCrash,
    BlockLocation,
    PipelineStatistics,
    ReadResult,
    Residency,
    WriteResult,
)
from ._runtime import UNWIND_GRACE, Runtime
from ._validate import (
    check_flag,
    check_request,
    check_start_block,
    check_timeout,
    check_tokens,
)
from ._workers import ThreadRunner
from .actors import Observer, PipelineHooks
from .actors._state import CallState, ReadState, WriteState
from .backends import StorageBackend

if TYPE_CHECKING:
    from ._keys import Tokens
    from ._validate import IntArray
    from .cuda._driver import Driver

    #: A write's or read's state arguments after its request id (see ``Pipeline._checked``).
    _Checked = tuple[float, float, Tokens, IntArray, int, int, bool]

__all__ = ("Pipeline", "open_pipeline")

_ids = itertools.count(1)


def _new_id(kind: str) -> str:
    return f"{kind}-{os.getpid()}-{next(_ids)}"


@final
class Pipeline:
    """A running pipeline over one cache and one store. Get one from :func:`open_pipeline`."""

    def __init__(
        self,
        cache: KVCache,
        store: StorageBackend,
        *,
        config: PipelineConfig | None = None,
        namespace: str = "default",
        rank: int = 0,
        world_size: int = 1,
        hooks: PipelineHooks | None = None,
        device_driver: Driver | None = None,
        observer: Observer | None = None,
    ) -> None:
        if not isinstance(cache, KVCache):
            raise ConfigError("cache", f"expected a kvpipe.KVCache, got {type(cache).__name__}")
        if cache.freed:
            raise ConfigError("cache", "the cache was freed")
        if not isinstance(store, StorageBackend):
            raise ConfigError(
                "store", f"expected a kvpipe.StorageBackend, got {type(store).__name__}"
            )
        if store.closed:
            raise ConfigError("store", f"the {store.name} store is closed; open a new one")
        self.config = config if config is not None else PipelineConfig()
        if not isinstance(self.config, PipelineConfig):
            raise ConfigError("config", "expected a kvpipe.PipelineConfig")
        self.cache = cache
        self.store = store
        self.layout = cache.layout
        self.scope = Scope(namespace, self.layout.fingerprint, rank, world_size)
        self._runtime = Runtime(
            cache, store, self.config, self.scope, hooks=hooks, device_driver=device_driver
        )
        self.slice_blocks = self._runtime.slice_blocks
        if observer is not None:
            self.add_observer(observer)

    # -- lifecycle ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop accepting requests, let in-flight ones finish (each by its deadline, at most
        ``close_timeout``), stop the actors and return all staging.

        Bounded by ``close_timeout`` plus a 1 s grace, hung copies included. A copy between
        the cache and staging still running in a worker thread half the grace past the
        close deadline (a write's gather; a read's copy into the cache, which the read
        otherwise waits for: that read fails with :class:`PipelineClosed`) is abandoned to
        its thread: the exit logs at ERROR that the cache may still be read or
        written and keeps it referenced until that copy ends (logged at WARNING); its
        memory must not be freed until then. Without that ERROR, nothing of kvpipe's reads
        or writes the cache once the pipeline's block has exited.

        Raises:
            WrongEventLoop: Called from another thread or event loop than the one that
                opened the pipeline (nothing is closed: hand the call to that loop).

        Cancellation: shielded — closing always completes.
        """
        await self._runtime.aclose()

    @property
    def closed(self) -> bool:
        """Whether the pipeline no longer accepts requests."""
        return not self._runtime.open

    # -- calls -------------------------------------------------------------------------------

    async def write(
        self,
        token_ids: Any,
        block_ids: Any,
        *,
        start_block: int = 0,
        include_partial: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
        stream: int | None = None,
    ) -> WriteResult:
        """Store blocks ``start_block ..`` of a sequence from the cache.

        Leading blocks already stored are skipped; the rest go to the store in slices, in
        order, stopping at the first slice that does not store completely — so what is stored
        is always a contiguous prefix, and the result says exactly how much.

        Args:
            token_ids: The sequence's token ids (1-D ints).
            block_ids: ``block_ids[i]`` is the cache block holding sequence block ``i``.
            start_block: First sequence block to write.
            include_partial: Also write the partial last block (key ``...:partial:N``).
            timeout: Total seconds for the call (default ``config.total_timeout``).
            request_id: An id for logs and results (generated when ``None``).
            stream: Device caches: the ``CUstream`` the model wrote these blocks on. kvpipe
                records an event on it *now*, and reads no block before the work queued
                there so far has completed. ``None``: the framework's current stream
                (Paddle, PyTorch). Host caches: must be ``None``.

        Returns:
            A :class:`WriteResult`; timeouts and backend failures are reported in it, not
            raised.

        Raises:
            RequestError: Bad arguments (nothing was queued), ``stream`` given for a host
                cache, or no stream found for a device cache.
            DeviceError: The event could not be recorded on ``stream``.
            PipelineClosed: The pipeline is closed or closed during the call.
            WrongEventLoop: Called from another thread or event loop than the pipeline's
                (nothing was queued).

        Cancellation and timeouts: each slice gets ``min(slice_timeout, time left)``; the
            call returns by its total deadline. If the calling task is cancelled, no further
            slice is sent, the slice in flight is cancelled, and what was already stored stays
            stored (a contiguous prefix).
        """
        checked = self._checked(token_ids, block_ids, start_block, include_partial, timeout)
        # Bound only on return: a frame holding the request while its error passes would
        # make a reference cycle (see Runtime.run).
        state = await self._runtime.run_marked(
            WriteState(request_id or _new_id("write"), *checked), stream
        )
        assert state.result is not None
        return state.result

    async def read(
        self,
        token_ids: Any,
        block_ids: Any,
        *,
        start_block: int = 0,
        include_partial: bool = False,
        require_all: bool = False,
        timeout: float | None = None,
        request_id: str | None = None,
        stream: int | None = None,
    ) -> ReadResult:
        """Load stored blocks ``start_block ..`` of a sequence into the cache.

        Counts the leading stored blocks (stopping at the first miss), fetches them into
        staging, verifies each (trailer, key, checksum) and scatters the leading sound run
        into ``block_ids``. Blocks past ``loaded`` may hold anything.

        Args:
            token_ids: The sequence's token ids.
            block_ids: ``block_ids[i]`` is the cache block to fill with sequence block ``i``.
            start_block: First sequence block to load.
            include_partial: Also load the partial last block.
            require_all: Raise :class:`IncompleteRead` unless every block loaded.
            timeout: Total seconds for the call (default ``config.total_timeout``).
            request_id: An id for logs and results.
            stream: Device caches: the ``CUstream`` whose work queued so far may still use
                the blocks to be filled; no byte is written into the cache before it has
                completed (an event is recorded on it now). ``None``: the framework's
                current stream. Host caches: must be ``None``. Work queued after the call
                returns sees the loaded blocks (the call returns after the copy completed).

        Returns:
            A :class:`ReadResult`.

        Raises:
            RequestError: Bad arguments (``require_all`` too must be a bool), or ``stream``
                as for :meth:`write`.
            DeviceError: The event could not be recorded on ``stream``.
            IncompleteRead: ``require_all`` and not every block loaded.
            PipelineClosed: The pipeline is closed or closed during the call.
            WrongEventLoop: Called from another thread or event loop than the pipeline's
                (nothing was queued).

        Cancellation and timeouts: each slice's fetch gets ``min(slice_timeout, time
            left)`` (one that runs out stops loading at that slice); fetches in flight are
            cancelled at the deadline or when the caller is cancelled; the call returns only
            after any copy into the cache has finished, so nothing writes into
            ``block_ids`` after it returns. The one exception is the pipeline's close: a
            copy still running half the close's grace past its deadline is abandoned to its
            thread (the call raises :class:`PipelineClosed`; the close names the cache at
            ERROR, see :meth:`aclose`).
        """
        check_flag(require_all, "require_all")
        checked = self._checked(token_ids, block_ids, start_block, include_partial, timeout)
        state = await self._runtime.run_marked(  # bound only on return, as in write
            ReadState(request_id or _new_id("read"), *checked), stream
        )
        result = state.result
        assert result is not None
        if require_all and not result.complete:
            raise IncompleteRead(
                f"read {result.request_id}: loaded {result.loaded} of {result.requested} "
                f"blocks ({result.stop_reason}; failed blocks {list(result.failed_blocks)[:8]})",
                result,
                result.failed_blocks,
            )
        return result

    def _checked(
        self,
        token_ids: Any,
        block_ids: Any,
        start_block: int,
        include_partial: bool,
        timeout: float | None,
    ) -> _Checked:
        """A write's or read's state arguments after the request id, validated."""
        r = check_request(
            token_ids,
            block_ids,
            start_block,
            include_partial,
            self.layout.block_size,
            self.cache.num_blocks,
        )
        total = check_timeout(timeout, self.config.total_timeout)
        now = anyio.current_time()
        return now + total, now, r.tokens, r.block_ids, r.start_block, r.end_block, include_partial

    async def lookup(
        self,
        token_ids: Any,
        *,
        start_block: int = 0,
        include_partial: bool = False,
        timeout: float | None = None,
    ) -> int:
        """How many blocks of the sequence are stored from ``start_block`` on, stopping at the
        first block that is not (blocks before ``start_block`` are not asked about: a server
        that holds them itself asks only for the rest).

        Raises:
            RequestError: Bad token ids, ``start_block`` not an int in ``[0, blocks]``, or
                ``include_partial`` not a bool.
            BackendError: The store failed the query.
            OperationTimeout: No answer within ``timeout`` (default ``config.lookup_timeout``),
                or one ``exists`` call of the store took longer than ``config.slice_timeout``.
            ActorCrashed: The scheduler crashed while answering it (retrying is safe).
            PipelineClosed: The pipeline is closed.
            WrongEventLoop: Called from another thread or event loop than the pipeline's.

        Cancellation: cancelling the caller abandons the query; nothing changes in the store.
        """
        return int(await self._call("lookup", token_ids, include_partial, timeout, start_block))

    async def flush_index(
        self,
        token_ids: Any,
        *,
        start_block: int = 0,
        residency: Residency = Residency.GPU,
        include_partial: bool = False,
        timeout: float | None = None,
    ) -> int:
        """Record that this node (``config.node_id``) holds blocks ``start_block ..`` in
        ``residency`` — without moving data. Returns how many blocks were recorded.

        Raises:
            RequestError: Bad arguments.
            BackendError: The store failed to record them.
            OperationTimeout: Not recorded within ``timeout`` (default
                ``config.lookup_timeout``; some records may be).
            ActorCrashed: The scheduler crashed while recording them (flushing again is
                idempotent).
            PipelineClosed: The pipeline is closed.
            WrongEventLoop: Called from another thread or event loop than the pipeline's.

        Cancellation: some records may have been written; flushing again is idempotent.
        """
        if not isinstance(residency, Residency):
            raise RequestError(f"residency must be a kvpipe.Residency, got {residency!r}")
        value = await self._call(
            "flush", token_ids, include_partial, timeout, start_block, residency=residency
        )
        return int(value)

    async def locate(
        self, token_ids: Any, *, include_partial: bool = False, timeout: float | None = None
    ) -> list[BlockLocation]:
        """Where each leading block resides, per the flush-only index (stops at the first
        block no node has a record for).

        Raises:
            RequestError: Bad token ids, or ``include_partial`` not a bool.
            BackendError: The store failed the query.
            OperationTimeout: No answer within ``timeout`` (default
                ``config.lookup_timeout``); ``slice_timeout`` does not apply.
            ActorCrashed: The scheduler crashed while answering it (retrying is safe).
            PipelineClosed: The pipeline is closed.
            WrongEventLoop: Called from another thread or event loop than the pipeline's.

        Cancellation: cancelling the caller abandons the query (the store call in flight is
            cancelled); nothing changes in the store.
        """
        return list(await self._call("locate", token_ids, include_partial, timeout))

    async def _call(
        self,
        op: Literal["lookup", "locate", "flush"],
        token_ids: Any,
        include_partial: Any,
        timeout: float | None,
        start_block: Any = 0,
        **params: Any,
    ) -> Any:
        """Check a key-only call's arguments, then run it (``locate`` starts at block 0)."""
        tokens = check_tokens(token_ids)
        include_partial = check_flag(include_partial, "include_partial")
        size = self.layout.block_size
        blocks = -(-len(tokens) // size) if include_partial else len(tokens) // size
        start = check_start_block(start_block, blocks)
        limit = check_timeout(timeout, self.config.lookup_timeout)
        now = anyio.current_time()
        limit_from = "timeout" if timeout is not None else "lookup_timeout"
        state = await self._runtime.run(  # bound only on return, as in write
            CallState(
                _new_id(op),
                now + limit,
                now,
                op,
                tokens,
                include_partial,
                limit_from=limit_from,
                start_block=start,
                **params,
            )
        )
        return state.value

    # -- introspection -----------------------------------------------------------------------

    def add_observer(self, observer: Observer) -> None:
        """Attach an observer of timings: ``observer(kind, seconds, outcome)`` is called for
        every backend call of a write or read slice (``"write_slice"``, ``"read_slice"``) and
        for every call of this pipeline once it has ended (``"write"``, ``"read"``,
        ``"lookup"``, ``"locate"``, ``"flush"``). See :class:`kvpipe.Observer`.

        Observers run in the event loop's thread, inside the pipeline's work: they must be
        quick and must not block. One that raises is counted
        (``statistics().counters["observer_errors"]``), never propagated.
        """
        self._runtime.observers.add(observer)

    def remove_observer(self, observer: Observer) -> None:
        """Detach an observer added by :meth:`add_observer` (unknown ones are ignored)."""
        self._runtime.observers.remove(observer)

    def crashes(self) -> tuple[ActorCrash, ...]:
        """The actor crashes since open, the latest 1000 (``statistics().restarts`` counts
        every one): which actor, when, which requests it failed."""
        return tuple(self._runtime.metrics.crashes)

    def statistics(self) -> PipelineStatistics:
        """An immutable snapshot of queues, in-flight requests, restarts, counters, staging.

        Counters, slices and restarts are kept after the pipeline has closed. The snapshot only
        reads (copying each mapping at once), so a metrics exporter may take it from another
        thread; its parts may then be a few microseconds apart.
        """
        return self._runtime.statistics()


@asynccontextmanager
async def open_pipeline(
    cache: KVCache,
    store: StorageBackend,
    *,
    config: PipelineConfig | None = None,
    namespace: str = "default",
    rank: int = 0,
    world_size: int = 1,
    hooks: PipelineHooks | None = None,
    device_driver: Driver | None = None,
    observer: Observer | None = None,
) -> AsyncIterator[Pipeline]:
    """Start a pipeline's actors over ``cache`` and ``store``; stop them on exit.

    Args:
        cache: The KV cache blocks are moved from and into.
        store: The storage backend (opened here if it is not: :meth:`StorageBackend.open`;
            kvpipe does not close it).
        config: Settings (default ``PipelineConfig()``).
        namespace: Scopes every key (a model / deployment name).
        rank: Tensor-parallel rank of this process.
        world_size: Tensor-parallel world size.
        hooks: Fault-injection seam for tests (see :class:`PipelineHooks`).
        device_driver: Test seam for device caches: the CUDA driver interface the engine
            calls (default: the real driver through cuda-python).
        observer: Receives slice and call timings from the start (see
            :meth:`Pipeline.add_observer`).

    Raises:
        ConfigError: A bad argument, a closed store, staging too small for one block or
            that cannot be allocated, or the store's ``register_staging`` failed
            (``field`` ``"store"``).
        Unsupported: A device cache where CUDA, its device or NVRTC is not usable.
        DeviceError: The device path failed to open (nothing stays allocated).
        BackendError: The store could not be opened (:meth:`StorageBackend.open`).

    Cancellation: leaving the block (normally, by an exception or by cancellation) closes the
        pipeline: in-flight requests get until their deadlines (at most ``close_timeout``),
        then the actors stop and staging is returned; for a device cache the engine then
        waits for its streams and frees its device and pinned memory (pinned staging is left
        allocated, and logged, if a worker thread abandoned at close may still use it).
        All of it is bounded by ``close_timeout`` plus a 1 s grace: a copy out of or into
        ``cache`` still running in a worker thread then is abandoned, named at ERROR, and
        ``cache`` kept referenced until it ends (see :meth:`Pipeline.aclose`).
    """
    pipe = Pipeline(
        cache,
        store,
        config=config,
        namespace=namespace,
        rank=rank,
        world_size=world_size,
        hooks=hooks,
        device_driver=device_driver,
        observer=observer,
    )
    runtime = pipe._runtime
    runner = ThreadRunner(pipe.config.close_timeout, nice=pipe.config.worker_nice)
    error: BaseException | None = None
    tg: anyio.abc.TaskGroup | None = None
    try:
        await runtime.prepare()
        async with runner, anyio.create_task_group() as tg:
            await runtime.start(tg, runner)
            try:
                yield pipe
            finally:
                try:
                    await pipe.aclose()
                finally:  # should aclose fail (or raise asyncio's own cancel once closed),
                    # the shielded actors must still end, and the threads by its deadline
                    runtime.cancel_actors()
                    if runtime.close_deadline is not None:
                        # Until the actors' waits for them end too, half the grace past it:
                        # a thread that ends just past the deadline is not abandoned (nor
                        # its staging kept) for nothing; the rest of the grace is left for
                        # unregistering the staging (Runtime.release).
                        runner.close_by(runtime.close_deadline + UNWIND_GRACE / 2)
    except BaseExceptionGroup as group:
        # Unwrap the task group's group: a group only when several things failed at once.
        if len(group.exceptions) != 1:
            raise
        error = group.exceptions[0]
    finally:
        tg = None  # no frame of a traceback keeps the task group (and its errors)
        await runtime.release(staging_in_use=runner.running > 0)
    if error is not None:
        try:
            raise error
        finally:
            error = None
