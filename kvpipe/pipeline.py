"""The public pipeline: ``open_pipeline`` and the calls an inference server makes.

Every call validates its arguments first (``RequestError`` before anything is queued), then
hands a request to the scheduler actor and waits for its outcome. No call blocks the event
loop; every call returns by its deadline (plus ``deadline_slack`` at worst).
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, final

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._blockformat import value_nbytes
from ._cache import KVCache
from ._config import PipelineConfig, in_place_refusal
from ._engine import CopyEngine, HostEngine, OrderMark
from ._errors import (
    ConfigError,
    IncompleteRead,
    KVPipeError,
    OperationTimeout,
    PipelineClosed,
    RequestError,
)
from ._keys import Scope
from ._plan import layout_segments
from ._results import (
    ActorCrash,
    BlockLocation,
    PipelineStatistics,
    ReadResult,
    Residency,
    WriteResult,
)
from ._staging import StagingPool, ThreadRunner, stride_for
from ._validate import check_request, check_timeout, check_tokens
from .actors import (
    ActorContext,
    ChildSpec,
    Metrics,
    ObservationKind,
    Observer,
    Observers,
    PipelineHooks,
    Reader,
    Scheduler,
    Slicer,
    Supervisor,
    Swapper,
    Writer,
)
from .actors._state import CallState, ReadState, RequestState, WriteState
from .backends import StorageBackend
from .cuda import probe_device

if TYPE_CHECKING:
    from .cuda._driver import Driver

__all__ = ("Pipeline", "open_pipeline")

log = logging.getLogger("kvpipe.pipeline")
_STAGES = ("scheduler", "slicer", "swapper", "writer", "reader")
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
        self.config = config if config is not None else PipelineConfig()
        if not isinstance(self.config, PipelineConfig):
            raise ConfigError("config", "expected a kvpipe.PipelineConfig")
        self.cache = cache
        self.store = store
        self.layout = cache.layout
        self.scope = Scope(namespace, self.layout.fingerprint, rank, world_size)
        payload = self.layout.block_nbytes
        self._slot_nbytes = value_nbytes(payload)
        pool_slots = self.config.staging_bytes // stride_for(self._slot_nbytes)
        if pool_slots < 1:
            raise ConfigError(
                "staging_bytes",
                f"{self.config.staging_bytes} B cannot hold one block value of "
                f"{value_nbytes(payload)} B",
            )
        self._pool_slots = pool_slots
        # A device cache's staging is the CUDA engine's pinned memory, allocated at start.
        self._pool: StagingPool | None = (
            StagingPool(self._slot_nbytes, pool_slots) if cache.device == "cpu" else None
        )
        self._engine: CopyEngine | None = None
        self._device_driver = device_driver
        self._registered: list[memoryview] = []
        refusal = in_place_refusal(
            self.config,
            device=cache.device,
            accepts_parts=store.accepts_parts,
            # (a device cache has no host rows to look at: it is refused for its device first)
            rows_contiguous=cache.device != "cpu"
            or all(rows.flags.c_contiguous for rows in cache.byte_rows),
            store_name=store.name,
        )
        if refusal is not None:
            log.warning("write_in_place=True, but writes are gathered into staging: %s", refusal)
        self._in_place = self.config.write_in_place and refusal is None
        self._write_path_note = refusal or ""
        self.slice_blocks = min(self.config.slice_block_num, pool_slots)
        if self.slice_blocks < self.config.slice_block_num:
            log.warning(
                "slice_block_num=%d blocks of %d B do not fit staging_bytes=%d; slices are cut "
                "to %d blocks",
                self.config.slice_block_num,
                payload,
                self.config.staging_bytes,
                self.slice_blocks,
            )
        self._hooks = hooks if hooks is not None else PipelineHooks()
        self._device = probe_device()
        self._in_flight: set[RequestState] = set()
        self._idle = anyio.Event()
        self._idle.set()
        self._open = False
        self._closed_reason: str | None = None
        self._inboxes: dict[str, MemoryObjectReceiveStream[Any]] = {}
        self._outboxes: dict[str, MemoryObjectSendStream[Any]] = {}
        self._ctx: ActorContext | None = None
        self._runner: ThreadRunner | None = None
        # Kept past close, so statistics() still reports what the pipeline did.
        self._metrics = Metrics()
        self._observers = Observers(self._metrics.counters)
        if observer is not None:
            self.add_observer(observer)
        self._supervisor: Supervisor | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def _prepare(self) -> None:
        """Before the actors' task group (so errors reach the caller as they are): for a
        device cache open the CUDA engine, whose pinned memory becomes the staging pool's
        buffer; then register the staging with the store."""
        if self._pool is None:
            await self._open_device()
        assert self._pool is not None
        buffers = [self._pool.buffer.data.cast("B")]
        if self._in_place:
            buffers += [rows.reshape(-1).data for rows in self.cache.byte_rows]
        for buffer in buffers:
            try:
                await self.store.register_staging(buffer)
            except Exception as exc:
                await self._unregister()
                raise ConfigError("store", f"could not register staging memory: {exc!r}") from exc
            self._registered.append(buffer)

    async def _unregister(self) -> None:
        registered, self._registered = self._registered, []
        for buffer in registered:
            try:
                await self.store.unregister_staging(buffer)
            except Exception as exc:
                log.warning("unregistering staging from %s failed: %r", self.store.name, exc)

    async def _open_device(self) -> None:
        """Open the CUDA engine (see :func:`kvpipe.cuda._open.open_device_path`)."""
        from .cuda._open import open_device_path

        self._engine, self._pool = await open_device_path(
            self.cache,
            slot_nbytes=self._slot_nbytes,
            capacity=self._pool_slots,
            budget=self.config.staging_bytes,
            max_blocks=self.slice_blocks,
            max_calls=self.config.copy_threads,
            driver=self._device_driver,
            probe=self._device,
        )

    async def _release(self, staging_in_use: bool) -> None:
        """Unregister staging if still registered, and close the copy engine (after the
        actors and worker threads are done)."""
        with anyio.CancelScope(shield=True):
            await self._unregister()
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.aclose(staging_in_use=staging_in_use)

    async def _start(self, tg: anyio.abc.TaskGroup, runner: ThreadRunner) -> None:
        cfg = self.config
        self._runner = runner
        copy_limiter = anyio.CapacityLimiter(cfg.copy_threads)
        pool = self._pool
        assert pool is not None
        if self._engine is None:
            self._engine = HostEngine(self.cache, pool, runner, copy_limiter, self._device.note)
        engine = self._engine
        for stage in _STAGES:
            send, recv = anyio.create_memory_object_stream[Any](cfg.queue_depth)
            self._outboxes[stage], self._inboxes[stage] = send, recv
        ctx = ActorContext(
            config=cfg,
            cache=self.cache,
            layout=self.layout,
            scope=self.scope,
            backend=self.store,
            pool=pool,
            runner=runner,
            segments=layout_segments(self.layout),
            payload_nbytes=self.layout.block_nbytes,
            value_nbytes=pool.slot_nbytes,
            slice_blocks=self.slice_blocks,
            copy_limiter=copy_limiter,
            io_limiter=anyio.CapacityLimiter(cfg.io_threads),
            hooks=self._hooks,
            outboxes=self._outboxes,
            engine=engine,
            in_place=self._in_place,
            metrics=self._metrics,
            observers=self._observers,
        )
        self._ctx = ctx
        inbox = self._inboxes
        children = [
            ChildSpec("scheduler", lambda: Scheduler(ctx, inbox["scheduler"], cfg.queue_depth)),
            ChildSpec("slicer", lambda: Slicer(ctx, inbox["slicer"], cfg.queue_depth)),
            ChildSpec("swapper", lambda: Swapper(ctx, inbox["swapper"], cfg.copy_threads)),
            ChildSpec("writer", lambda: Writer(ctx, inbox["writer"])),
            ChildSpec("reader", lambda: Reader(ctx, inbox["reader"])),
        ]
        self._supervisor = Supervisor(
            children,
            max_restarts=cfg.max_restarts,
            window=cfg.restart_window,
            metrics=ctx.metrics,
            on_escalate=self._escalate,
        )
        tg.start_soon(self._supervisor.run, name="kvpipe-supervisor")
        self._open = True
        log.info(
            "pipeline open: %s; namespace=%s rank=%d/%d; store=%s; staging %d slots x %d B; "
            "slices of %d blocks; writes %s; device path: %s (%s)",
            self.layout.describe(),
            self.scope.namespace,
            self.scope.rank,
            self.scope.world_size,
            self.store.name,
            pool.capacity,
            pool.stride,
            self.slice_blocks,
            "sent in place from the cache" if self._in_place else "gathered into staging",
            engine.name,
            engine.note,
        )

    def _escalate(self, actor: str, exc: BaseException) -> None:
        self._open = False
        self._closed_reason = f"actor {actor!r} crashed repeatedly: {exc!r}"
        error = PipelineClosed(f"pipeline closed: {self._closed_reason}")
        for state in list(self._in_flight):
            state.fail(error)

    async def aclose(self) -> None:
        """Stop accepting requests, let in-flight ones finish (each by its deadline, at most
        ``close_timeout``), stop the actors and return all staging.

        Cancellation: shielded — closing always completes.
        """
        with anyio.CancelScope(shield=True):
            if self._ctx is None:
                return
            self._open = False
            self._closed_reason = self._closed_reason or "closed"
            with anyio.move_on_after(self.config.close_timeout):
                await self._idle.wait()
            error = PipelineClosed("pipeline closed")
            for state in list(self._in_flight):
                state.fail(error)
            if self._supervisor is not None:
                self._supervisor.stop()
            for send in self._outboxes.values():
                send.close()
            await anyio.lowlevel.checkpoint()
            for recv in self._inboxes.values():
                self._drain(recv)
                recv.close()
            await self._unregister()
            self._ctx = None

    @staticmethod
    def _drain(recv: MemoryObjectReceiveStream[Any]) -> None:
        while True:
            try:
                item = recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            lease = getattr(item, "lease", None)
            if lease is not None and not lease.released:
                lease.release()

    @property
    def closed(self) -> bool:
        """Whether the pipeline no longer accepts requests."""
        return not self._open

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

        Cancellation and timeouts: each slice gets ``min(slice_timeout, time left)``; the
            call returns by its total deadline. If the calling task is cancelled, no further
            slice is sent, the slice in flight is cancelled, and what was already stored stays
            stored (a contiguous prefix).
        """
        req = check_request(
            token_ids,
            block_ids,
            start_block,
            include_partial,
            self.layout.block_size,
            self.cache.num_blocks,
        )
        total = check_timeout(timeout, self.config.total_timeout)
        now = anyio.current_time()
        state = WriteState(
            request_id or _new_id("write"),
            now + total,
            now,
            req.tokens,
            req.block_ids,
            req.start_block,
            req.end_block,
            include_partial,
        )
        await self._run_marked(state, stream)
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
            RequestError: Bad arguments, or ``stream`` as for :meth:`write`.
            DeviceError: The event could not be recorded on ``stream``.
            IncompleteRead: ``require_all`` and not every block loaded.
            PipelineClosed: The pipeline is closed or closed during the call.

        Cancellation and timeouts: fetches in flight are cancelled at the deadline or when
            the caller is cancelled; the call returns only after any copy into the cache has
            finished, so nothing writes into ``block_ids`` after it returns.
        """
        req = check_request(
            token_ids,
            block_ids,
            start_block,
            include_partial,
            self.layout.block_size,
            self.cache.num_blocks,
        )
        total = check_timeout(timeout, self.config.total_timeout)
        now = anyio.current_time()
        state = ReadState(
            request_id or _new_id("read"),
            now + total,
            now,
            req.tokens,
            req.block_ids,
            req.start_block,
            req.end_block,
            include_partial,
            require_all=require_all,
        )
        await self._run_marked(state, stream)
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

    async def lookup(
        self, token_ids: Any, *, include_partial: bool = False, timeout: float | None = None
    ) -> int:
        """How many leading blocks of the sequence are stored, from block 0.

        Raises:
            RequestError: Bad token ids.
            BackendError: The store failed the query.
            OperationTimeout: No answer within ``timeout`` (default ``config.lookup_timeout``).
            PipelineClosed: The pipeline is closed.

        Cancellation: cancelling the caller abandons the query; nothing changes in the store.
        """
        value = await self._call("lookup", token_ids, include_partial, timeout)
        return int(value)

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
            OperationTimeout: Not recorded within ``timeout`` (some records may be).
            PipelineClosed: The pipeline is closed.

        Cancellation: some records may have been written; flushing again is idempotent.
        """
        if not isinstance(residency, Residency):
            raise RequestError(f"residency must be a kvpipe.Residency, got {residency!r}")
        tokens = check_tokens(token_ids)
        n = (
            -(-len(tokens) // self.layout.block_size)
            if include_partial
            else (len(tokens) // self.layout.block_size)
        )
        if (
            isinstance(start_block, bool)
            or not isinstance(start_block, int)
            or not 0 <= start_block <= n
        ):
            raise RequestError(f"start_block {start_block!r} is outside [0, {n}]")
        value = await self._call(
            "flush", tokens, include_partial, timeout, start_block=start_block, residency=residency
        )
        return int(value)

    async def locate(
        self, token_ids: Any, *, include_partial: bool = False, timeout: float | None = None
    ) -> list[BlockLocation]:
        """Where each leading block resides, per the flush-only index (stops at the first
        block no node has a record for).

        Raises:
            RequestError, BackendError, OperationTimeout, PipelineClosed: as for
            :meth:`lookup`.
        """
        value = await self._call("locate", token_ids, include_partial, timeout)
        return list(value)

    async def _call(
        self,
        op: Literal["lookup", "locate", "flush"],
        token_ids: Any,
        include_partial: bool,
        timeout: float | None,
        **params: Any,
    ) -> Any:
        tokens = check_tokens(token_ids)
        limit = check_timeout(timeout, self.config.lookup_timeout)
        now = anyio.current_time()
        state = CallState(_new_id(op), now + limit, now, op, tokens, include_partial, **params)
        await self._run(state)
        return state.value

    # -- the common path ---------------------------------------------------------------------

    async def _run_marked(self, state: WriteState | ReadState, stream: int | None) -> None:
        """:meth:`_run` with the producer's mark recorded now (device caches) and released
        when the request has ended (copies still in flight hold their own reference)."""
        engine = self._engine if self._open else None
        state.after = engine.mark(stream) if engine is not None else None
        try:
            await self._run(state)
        finally:
            mark: OrderMark | None = state.after
            if mark is not None:
                mark.release()

    async def _run(self, state: RequestState) -> None:
        """Submit ``state`` and wait for its end, by its deadline plus the slack."""
        if not self._open:
            raise PipelineClosed(f"pipeline is not open ({self._closed_reason or 'not started'})")
        self._in_flight.add(state)
        self._idle = anyio.Event() if len(self._in_flight) == 1 else self._idle
        cancelled = False
        try:
            with anyio.move_on_at(state.deadline + self.config.deadline_slack):
                try:
                    await self._outboxes["scheduler"].send(state)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    raise PipelineClosed("pipeline closed") from None
                await state.wait()
            if not state.done:
                self._expire(state)
                with anyio.CancelScope(shield=True):
                    await state.wait()
        except anyio.get_cancelled_exc_class():
            cancelled = True
            self._cancel(state)
            if isinstance(state, ReadState):
                with anyio.CancelScope(shield=True):
                    await state.wait()
            raise
        finally:
            self._in_flight.discard(state)
            if not self._in_flight:
                self._idle.set()
            if self._observers.active:
                self._observe(state, cancelled)
        if state.error is not None:
            raise state.error

    def _observe(self, state: RequestState, cancelled: bool) -> None:
        """Report the call's latency and outcome to the observers."""
        kind: ObservationKind = (
            state.op
            if isinstance(state, CallState)
            else ("write" if isinstance(state, WriteState) else "read")
        )
        if not state.done:  # never handed over: the pipeline closed, or the caller left
            outcome = "cancelled" if cancelled else "closed"
        elif cancelled and isinstance(state, CallState):
            outcome = "cancelled"
        else:
            outcome = state.outcome()
        self._observers.emit(kind, anyio.current_time() - state.started, outcome)

    def _expire(self, state: RequestState) -> None:
        self._metrics.counters["deadline_guard_expired"] += 1
        log.warning(
            "request %s: no outcome by its deadline; ending it as timed out", state.request_id
        )
        if isinstance(state, WriteState):
            state.stop("total_timeout", "deadline passed")
        elif isinstance(state, ReadState):
            state.abort("total_timeout", "deadline passed")
        else:
            state.fail(OperationTimeout(f"{state.request_id} timed out"))

    @staticmethod
    def _cancel(state: RequestState) -> None:
        if isinstance(state, WriteState):
            state.stop("cancelled", "caller cancelled")
        elif isinstance(state, ReadState):
            state.abort("cancelled", "caller cancelled")
        else:
            state.fail(KVPipeError("caller cancelled"))

    # -- introspection -----------------------------------------------------------------------

    def add_observer(self, observer: Observer) -> None:
        """Attach an observer of timings: ``observer(kind, seconds, outcome)`` is called for
        every backend call of a write or read slice (``"write_slice"``, ``"read_slice"``) and
        for every call of this pipeline once it has ended (``"write"``, ``"read"``,
        ``"lookup"``, ``"locate"``, ``"flush"``). See :class:`kvpipe.Observer`.

        Observers run in the event loop's thread, inside the pipeline's work: they must be
        quick and must not block. One that raises is counted
        (``statistics().counters["observer_errors"]``), never propagated.
        :class:`kvpipe.PipelineMetrics` attaches one to feed its histograms.
        """
        self._observers.add(observer)

    def remove_observer(self, observer: Observer) -> None:
        """Detach an observer added by :meth:`add_observer` (unknown ones are ignored)."""
        self._observers.remove(observer)

    def crashes(self) -> tuple[ActorCrash, ...]:
        """Every actor crash since open: which actor, when, which requests it failed."""
        return tuple(self._metrics.crashes)

    def statistics(self) -> PipelineStatistics:
        """An immutable snapshot of queues, in-flight requests, restarts, counters, staging.

        Counters, slices and restarts are kept after the pipeline has closed. The snapshot only
        reads (copying each mapping at once), so a metrics exporter may take it from another
        thread; its parts may then be a few microseconds apart.
        """
        ctx = self._ctx
        metrics = self._metrics
        kinds = Counter(
            s.kind if not isinstance(s, CallState) else s.op for s in list(self._in_flight)
        )
        return PipelineStatistics(
            open=self._open,
            device_path=ctx.engine.name if ctx is not None else "host",
            device_note=ctx.engine.note if ctx is not None else self._device.note,
            in_flight=dict(kinds),
            queue_depths={
                stage: recv.statistics().current_buffer_used
                for stage, recv in self._inboxes.items()
            },
            queue_capacity=self.config.queue_depth,
            restarts=dict(metrics.restarts),
            slices=dict(metrics.slices),
            counters=dict(metrics.counters),
            staging_capacity_bytes=self._pool_slots * stride_for(self._slot_nbytes),
            staging_in_use_bytes=self._pool.in_use * self._pool.stride if self._pool else 0,
            staging_waiters=self._pool.waiters if self._pool else 0,
            slice_blocks=self.slice_blocks,
            backend=dict(self.store.statistics()),
            threads_running=self._runner.running if self._runner is not None else 0,
            write_path="in place" if self._in_place else "gathered",
            write_path_note=self._write_path_note,
        )


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
        store: The storage backend (kvpipe does not close it).
        config: Settings (default ``PipelineConfig()``).
        namespace: Scopes every key (a model / deployment name).
        rank: Tensor-parallel rank of this process.
        world_size: Tensor-parallel world size.
        hooks: Fault-injection seam for tests (see :class:`PipelineHooks`).
        device_driver: Test seam for device caches: the CUDA driver interface the engine
            calls (default: the real driver through cuda-python). The tests pass a test
            double that runs the kernels' reference implementations on host memory.
        observer: Receives slice and call timings from the start (see
            :meth:`Pipeline.add_observer`, which attaches one later).

    Raises:
        ConfigError: A bad argument, or staging too small for one block.
        Unsupported: A device cache where CUDA, its device or NVRTC is not usable.
        DeviceError: The device path failed to open (nothing stays allocated).

    Cancellation: leaving the block (normally, by an exception or by cancellation) closes the
        pipeline: in-flight requests get until their deadlines (at most ``close_timeout``),
        then the actors stop and staging is returned; for a device cache the engine then
        waits for its streams and frees its device and pinned memory (pinned staging is left
        allocated, and logged, if a worker thread abandoned at close may still use it).
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
    runner = ThreadRunner(pipe.config.close_timeout)
    try:
        await pipe._prepare()
        async with runner, anyio.create_task_group() as tg:
            await pipe._start(tg, runner)
            try:
                yield pipe
            finally:
                await pipe.aclose()
    finally:
        await pipe._release(staging_in_use=runner.running > 0)
