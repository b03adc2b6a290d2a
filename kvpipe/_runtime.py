"""What runs behind :class:`kvpipe.Pipeline`: staging, the copy engine, the supervised
actors, the requests in flight, and closing.

``open_pipeline`` drives a :class:`Runtime` through construction (staging sized),
:meth:`~Runtime.prepare`, :meth:`~Runtime.start`, :meth:`~Runtime.aclose` and
:meth:`~Runtime.release`; ``Pipeline`` hands each validated request to :meth:`~Runtime.run`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeVar, final

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream

from ._blockformat import value_nbytes
from ._cache import KVCache
from ._config import PipelineConfig
from ._engine import CopyEngine, HostEngine, OrderMark
from ._errors import BackendError, ConfigError, KVPipeError, PipelineClosed, WrongEventLoop
from ._keys import Scope
from ._lograte import LogLimiters
from ._plan import layout_segments
from ._results import PipelineStatistics
from ._shield import DeferredCancel, shielded
from ._staging import StagingPool, stride_for
from ._workers import Lane, ThreadRunner
from .actors import (
    ActorContext,
    ChildSpec,
    Metrics,
    ObservationKind,
    Observers,
    PipelineHooks,
    Reader,
    Scheduler,
    SliceJob,
    Slicer,
    Supervisor,
    Swapper,
    Writer,
)
from .actors._channels import Inboxes, Outboxes, open_channels
from .actors._state import CallState, ReadState, RequestState, WriteState
from .backends import StorageBackend
from .backends._registration import Registrations
from .cuda import DeviceProbe, probe_device

if TYPE_CHECKING:
    from .cuda._driver import Driver

__all__ = ("Runtime",)

log = logging.getLogger("kvpipe.pipeline")
_State = TypeVar("_State", bound=RequestState)
_Marked = TypeVar("_Marked", WriteState, ReadState)
_STAGES = ("scheduler", "slicer", "swapper", "writer", "reader")
#: Seconds past the close deadline for cleaning up what no longer runs: actors cancelled at
#: the deadline unwinding (they release their staging as they do), and staging nothing uses
#: any more being unregistered from the store (else kept allocated for good).
UNWIND_GRACE: Final = 1.0
#: Requests a close names in its log line (the rest are counted): bounded, not one per request.
_LOGGED_REQUESTS: Final = 8


@final
class Runtime:
    """One pipeline's staging, copy engine, actors and requests in flight.

    Attributes:
        open: Whether requests are accepted.
        slice_blocks: Blocks per slice: ``slice_block_num``, cut to what staging holds.
        engine: The copy engine: a device cache's from :meth:`prepare`, a host cache's from
            :meth:`start`; ``None`` before then and after :meth:`release`.
        metrics: Counters, slices, restarts and crashes (kept past close).
        observers: The observers of timings.
    """

    def __init__(
        self,
        cache: KVCache,
        store: StorageBackend,
        config: PipelineConfig,
        scope: Scope,
        *,
        hooks: PipelineHooks | None,
        device_driver: Driver | None,
    ) -> None:
        self.config = config
        self.cache = cache
        self.store = store
        self.layout = cache.layout
        self.scope = scope
        payload = self.layout.block_nbytes
        self._slot_nbytes = value_nbytes(payload)
        pool_slots = self.config.staging_bytes // stride_for(self._slot_nbytes)
        if pool_slots < 1:
            raise ConfigError(
                "staging_bytes",
                f"{self.config.staging_bytes} B cannot hold one block value of "
                f"{self._slot_nbytes} B",
            )
        self._pool_slots = pool_slots
        # A device cache's staging is the CUDA engine's pinned memory, allocated at start.
        self._pool: StagingPool | None = (
            StagingPool(self._slot_nbytes, pool_slots) if cache.device == "cpu" else None
        )
        self.engine: CopyEngine | None = None
        self._device_driver = device_driver
        self._registrations = Registrations(store)
        self.slice_blocks = min(self.config.slice_block_num, pool_slots)
        if self.slice_blocks < self.config.slice_block_num:
            # A block takes a slot (its payload, trailer and alignment), not its payload.
            log.warning(
                "slice_block_num=%d blocks of %d B (a %d B staging slot each) do not fit "
                "staging_bytes=%d; slices are cut to %d blocks",
                self.config.slice_block_num,
                payload,
                stride_for(self._slot_nbytes),
                self.config.staging_bytes,
                self.slice_blocks,
            )
        self._hooks = hooks if hooks is not None else PipelineHooks()
        #: CUDA's probe, made by :meth:`prepare` in a worker thread: the first of a process
        #: imports ``cuda-python`` (43-67 ms measured), not to be spent on the event loop.
        self._device: DeviceProbe | None = None
        self._in_flight: set[RequestState] = set()
        self._idle = anyio.Event()
        self._idle.set()
        self.open = False
        self._closed_reason: str | None = None
        self._inboxes: Inboxes | None = None
        self._outboxes: Outboxes | None = None
        self._ctx: ActorContext | None = None
        self._runner: ThreadRunner | None = None
        #: The staging pool after :meth:`release` (weakly: alive while a lease holds it).
        self._released_pool: weakref.ref[StagingPool] | None = None
        #: The copy engine's name and note, kept for statistics after close.
        self._engine_seen: tuple[str, str] | None = None
        self.metrics = Metrics()
        self.observers = Observers(self.metrics.counters)
        #: This pipeline's bounds on repeated log lines (:mod:`kvpipe._lograte`), its
        #: actors' and its requests' too: its own, so that another pipeline's flood (another
        #: store's) never hides this one's first line of a kind. A store whose calls ignore
        #: cancellation has every request ended by the deadline guard: that line too is
        #: bounded; ``deadline_guard_expired`` counts each.
        self.limits = LogLimiters()
        self._supervisor: Supervisor | None = None
        #: The scope the actors run in, shielded from the opening task's cancellation.
        self._actors_scope: anyio.CancelScope | None = None
        self._loop: object = None
        self._thread = 0
        #: When closing must be over (event-loop clock): set once, by :meth:`aclose`.
        self.close_deadline: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Before the actors' task group (so errors reach the caller as they are): for a
        device cache open the CUDA engine, whose pinned memory becomes the staging pool's
        buffer; then register the staging with the store. The store is opened first: its
        own opening (a file store's recovery scan) is not charged to the first request."""
        try:
            await self.store.open()
        except KVPipeError:
            raise
        except Exception as exc:
            raise BackendError(self.store.name, "open", repr(exc)) from exc
        self._device = await anyio.to_thread.run_sync(probe_device)
        if self._pool is None:
            from .cuda._open import open_device_path

            self.engine, self._pool = await open_device_path(
                self.cache,
                slot_nbytes=self._slot_nbytes,
                capacity=self._pool_slots,
                budget=self.config.staging_bytes,
                max_blocks=self.slice_blocks,
                max_calls=self.config.copy_threads,
                driver=self._device_driver,
                probe=self._device,
            )
        assert self._pool is not None
        buffer = self._pool.buffer.data.cast("B")
        try:
            await self._registrations.add(buffer)
        except Exception as exc:
            raise ConfigError("store", f"could not register staging memory: {exc!r}") from exc

    def _deadline(self) -> float:
        """The close deadline (set once by :meth:`aclose`; a failed open gets its own)."""
        if self.close_deadline is None:
            self.close_deadline = anyio.current_time() + self.config.close_timeout
        return self.close_deadline

    async def release(self, staging_in_use: bool) -> None:
        """After the actors and worker threads are done: unregister staging (by
        ``UNWIND_GRACE`` past the close deadline), close the copy engine (by the deadline),
        and let go of everything big, so the staging
        is freed now whatever still refers to this runtime. ``staging_in_use``: a worker
        thread abandoned at the close deadline may still read or write it (a store's vendor
        call): it then stays registered with the store and allocated.

        Cancellation: shielded, from asyncio's own (``Task.cancel``) too: one that cuts the
        unregistering short keeps the staging (registered still), and is raised once the
        rest is released."""
        registrations = self._registrations
        if staging_in_use:
            registrations.keep("a call abandoned at close may still use it")
        deferred = DeferredCancel()
        # Nothing uses the staging now: a close whose requests took its whole deadline still
        # unregisters it (a vendor call), within the grace, rather than keep it for good.
        try:
            await registrations.aclose(self._deadline() + UNWIND_GRACE)
        except anyio.get_cancelled_exc_class() as exc:  # asyncio's own: the buffers are kept
            deferred.args = exc.args
        in_use = staging_in_use or registrations.kept
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                await engine.aclose(staging_in_use=in_use, deadline=self._deadline())
            except anyio.get_cancelled_exc_class() as exc:  # raised by it once closed
                deferred.args = deferred.args if deferred.args is not None else exc.args
        pool, self._pool = self._pool, None
        if pool is not None:
            # Statistics after close still count what an abandoned thread leases, for as long
            # as it keeps the pool alive (a weak reference: this runtime keeps nothing big).
            self._released_pool = weakref.ref(pool)
            if not in_use and not pool.close():
                log.error("staging still leased after close; keeping it allocated")
        self._ctx = None
        self._supervisor = None
        self._actors_scope = None
        # The runner stays (it is small): statistics after close count the worker threads
        # abandoned at the close deadline until they return.
        self._outboxes = None
        self._inboxes = None
        # No event reaches them any more; an observer that refers to its pipeline (a
        # caller's closure, say) would otherwise keep it in a cycle through this runtime.
        self.observers.active = ()
        deferred.raise_if_received()

    async def start(self, tg: anyio.abc.TaskGroup, runner: ThreadRunner) -> None:
        """Create the actors' channels and context, and start their supervisor in ``tg``."""
        cfg = self.config
        self._runner = runner
        self._loop = anyio.lowlevel.current_token().native_token
        self._thread = threading.get_ident()
        copy_limiter = Lane(cfg.copy_threads)
        pool = self._pool
        assert pool is not None
        if self.engine is None:
            assert self._device is not None  # probed in prepare
            self.engine = HostEngine(self.cache, runner, copy_limiter, self._device.note)
        engine = self.engine
        self._outboxes, self._inboxes = outboxes, inbox = open_channels(cfg.queue_depth)
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
            io_limiter=Lane(cfg.io_threads),
            hooks=self._hooks,
            outboxes=outboxes,
            engine=engine,
            keep_values=self.store.keeps_values and isinstance(engine, HostEngine),
            metrics=self.metrics,
            observers=self.observers,
            limits=self.limits,
        )
        self._ctx = ctx
        self._engine_seen = (engine.name, engine.note)
        children = [
            ChildSpec("scheduler", lambda: Scheduler(ctx, inbox.scheduler, cfg.queue_depth)),
            ChildSpec("slicer", lambda: Slicer(ctx, inbox.slicer, cfg.queue_depth)),
            ChildSpec("swapper", lambda: Swapper(ctx, inbox.swapper, cfg.copy_threads)),
            # Host cache: whole writes, as many as the slicer runs; device: slices of staging.
            ChildSpec(
                "writer",
                lambda: Writer(ctx, inbox.writer, cfg.queue_depth if ctx.host_copies else None),
            ),
            ChildSpec("reader", lambda: Reader(ctx, inbox.reader)),
        ]
        self._supervisor = Supervisor(
            children,
            max_restarts=cfg.max_restarts,
            window=cfg.restart_window,
            metrics=ctx.metrics,
            on_escalate=self._escalate,
        )
        self._actors_scope = anyio.CancelScope(shield=True)
        tg.start_soon(
            _run_shielded,
            self._supervisor,
            self._actors_scope,
            self._actors_ended,
            name="kvpipe-supervisor",
        )
        self.open = True
        log.info(
            "pipeline open: %s; namespace=%s rank=%d/%d; store=%s; staging %d slots x %d B; "
            "slices of %d blocks; device path: %s (%s)",
            self.layout.describe(),
            self.scope.namespace,
            self.scope.rank,
            self.scope.world_size,
            self.store.name,
            pool.capacity,
            pool.stride,
            self.slice_blocks,
            engine.name,
            engine.note,
        )

    def _escalate(self, actor: str, exc: BaseException) -> None:
        self.open = False
        self._closed_reason = f"actor {actor!r} crashed repeatedly: {exc!r}"
        self._stop_all(f"pipeline closed: {self._closed_reason}")
        # The escalated actor is not restarted: nothing receives from its inbox any more.
        # What waits there lets go of its staging now, as at close, not at aclose.
        recv = self._inboxes.by_name().get(actor) if self._inboxes is not None else None
        if recv is not None:
            self._drain(recv)

    def _actors_ended(self, exc: BaseException) -> None:
        """The actors stopped with ``exc``, which no crash is (a ``KeyboardInterrupt`` or
        ``SystemExit`` from a hook or an observer; trio's Ctrl-C): nothing serves requests
        any more. Fail those in flight now, as an escalation does, rather than leave them,
        and the close, waiting for their deadlines."""
        self.open = False
        reason = f"actors stopped by {_leaf(exc)!r}"
        self._closed_reason = self._closed_reason or reason
        self._stop_all(f"pipeline closed: {reason}")

    def _stop_all(self, message: str, why: str = "") -> None:
        """Fail every request in flight with :class:`PipelineClosed` (``message``, after the
        request and how far it got), logged in one WARNING (``message``, ``why``); then close
        the inboxes: every actor leaves its loop once its inbox is empty. Each caller gets
        an error of its own: one raised in many would carry all their tracebacks."""
        # Not one that has ended, or is ending (a read waiting for its scatters): the first
        # ending wins, so failing it changes nothing (its ending is logged when it settles).
        pending = [s for s in self._in_flight if not s.ending]
        if pending:
            shown = "; ".join(s.describe() for s in pending[:_LOGGED_REQUESTS])
            more = len(pending) - _LOGGED_REQUESTS
            log.warning(
                "%s%s; failed %d request(s) in flight: %s%s",
                message,
                why,
                len(pending),
                shown,
                f"; and {more} more" if more > 0 else "",
            )
        if self._supervisor is not None:  # an actor crashing from now on is not restarted
            self._supervisor.close()
        for state in pending:
            state.fail(PipelineClosed(f"{state.describe()}: {message}"))
        if self._outboxes is not None:
            self._outboxes.close()

    async def aclose(self) -> None:
        """Close by one deadline, ``close_timeout`` from now: stop accepting requests, let
        in-flight ones finish until then, fail the rest, let the actors leave their loops
        (cancelled if still running half of ``UNWIND_GRACE`` past the deadline, their waits
        for worker threads abandoned with them, shielded waits for copies into the cache
        included; then given until ``UNWIND_GRACE`` past it to unwind and let go of their
        staging), then drain
        their inboxes. What still runs at the deadline is abandoned and logged, its memory
        kept (staging is unregistered and freed by :meth:`release`, once the worker threads
        are done). Shielded, from asyncio's own cancellation too (``Task.cancel``): one
        received meanwhile is raised once closed.

        Raises:
            WrongEventLoop: Called from another thread or event loop than the pipeline's
                (its inboxes and cancel scopes are its loop's alone); nothing is closed.
        """
        if self._ctx is None:
            return
        self.check_loop()
        deadline = self._deadline()
        self.open = False
        # Every wait shielded, asyncio's own cancellation included (which anyio's shield lets
        # through: an interrupted close failed no call in flight, and those waited on for their
        # own deadlines); one received meanwhile is raised once closed.
        deferred = DeferredCancel()
        self._closed_reason = self._closed_reason or "closed"
        if self.engine is not None:
            self.engine.close_by(deadline)
        await shielded(self._idle.wait, deadline, deferred)
        self._stop_all(
            "pipeline closed",
            f": close_timeout ({self.config.close_timeout:g} s) passed",
        )
        supervisor = self._supervisor
        if supervisor is not None:
            # The requests' work was cancelled with them: the actors unwind it and leave
            # their loops (normally: no task ending cancelled, no cycle) within a few
            # turns of the loop, or half the grace past the deadline at most.
            await shielded(supervisor.wait_stopped, deadline + UNWIND_GRACE / 2, deferred)
            if not supervisor.stopped:
                working = supervisor.holding()  # in a wait their cancellation missed
                self.cancel_actors()
                # They release their staging as they unwind, which takes a few turns of
                # the loop (nothing waits past a cancellation unbounded): return after.
                await shielded(supervisor.wait_stopped, deadline + UNWIND_GRACE, deferred)
                if not supervisor.stopped:
                    log.error(
                        "actors did not stop %.1f s past the close deadline, cancelled; "
                        "abandoned: %s",
                        UNWIND_GRACE,
                        supervisor.holding() or working or "none holds a request",
                    )
                elif working:
                    # Their waits for worker threads, shielded ones included, ended with them.
                    running = self._runner.running if self._runner is not None else 0
                    log.warning(
                        "actors still working %.1f s past the close deadline were cancelled: %s%s",
                        UNWIND_GRACE / 2,
                        working,
                        f"; their waits for the {running} worker thread call(s) still running "
                        "were abandoned"
                        if running
                        else "",
                    )
        for recv in self._inboxes.by_name().values() if self._inboxes else ():
            self._drain(recv)
            recv.close()
        self._ctx = None
        deferred.raise_if_received()

    def cancel_actors(self) -> None:
        """Cancel the actors if they still run (a no-op once they stopped): at the close
        deadline, and should :meth:`aclose` fail, so the task group that runs them is never
        left waiting on them (they are shielded from its cancellation). Their waits for
        worker threads end too, the shielded ones for copies into the cache included
        (:meth:`ThreadRunner.abandon_waits`): a copy still running is abandoned to its
        thread, which keeps the cache referenced (named at ERROR when the runner is left)."""
        if self._actors_scope is not None:
            self._actors_scope.cancel()
        if self._runner is not None:
            self._runner.abandon_waits()

    @staticmethod
    def _drain(recv: MemoryObjectReceiveStream[Any]) -> None:
        """Let go of the jobs in ``recv``. Each is taken as an actor's loop takes it: one
        that a sender still waiting was moving in (an escalation drains while the other
        actors run) is then the drain's, not that sender's, also when its wait is cancelled
        in the same step (:meth:`~kvpipe.actors.Actor.send`); a withdrawn one is its
        sender's."""
        while True:
            try:
                item = recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            if isinstance(item, SliceJob) and item.take() and not item.lease.released:
                item.release()

    # -- the common path ---------------------------------------------------------------------

    async def run_marked(self, state: _Marked, stream: int | None) -> _Marked:
        """:meth:`run` with the producer's mark recorded now (device caches) and released
        when the request has ended (copies still in flight hold their own reference)."""
        self.check_loop()
        engine = self.engine if self.open else None
        mark: OrderMark | None = engine.mark(stream) if engine is not None else None
        state.after = mark
        call = self.run(state)
        del state  # as in run: no frame the request's error passes holds the request
        try:
            return await call
        finally:
            if mark is not None:
                mark.release()

    def check_loop(self) -> None:
        """Refuse a call from another thread or event loop than the pipeline's own: its
        actors would never see it, and the caller would wait for its whole deadline.

        Raises:
            WrongEventLoop: It is not the pipeline's loop.
        """
        if self._thread and (
            threading.get_ident() != self._thread
            or anyio.lowlevel.current_token().native_token is not self._loop
        ):
            raise WrongEventLoop(
                "this pipeline runs on the event loop of the thread that opened it; it was "
                "called from another loop or thread (open a pipeline per event loop, or hand "
                "the call to its loop)"
            )

    async def run(self, state: _State) -> _State:
        """Submit ``state`` and wait for its end; returns it. A request that no actor holds at
        its deadline (its messages wait in inboxes, or its submission waits for room) is
        ended then; one an actor holds is ended by that actor's deadline scopes, and past
        the slack by this guard.

        Raises:
            BaseException: The error the request ended with. The request keeps it, and its
                traceback every frame it passes: none of them holds the request (callers
                pass it in and take it back from the return value), or the request, the
                error and those frames (this runtime, the caller's) would be a reference
                cycle, freed only by the cyclic garbage collector.
        """
        self.check_loop()
        if not self.open:
            raise PipelineClosed(
                f"{state.describe()}: pipeline is not open ({self._closed_reason or 'not started'})"
            )
        state.limits = self.limits
        self._in_flight.add(state)
        self._idle = anyio.Event() if len(self._in_flight) == 1 else self._idle
        cancelled = False
        try:
            with anyio.move_on_at(state.deadline):
                try:
                    assert self._outboxes is not None
                    try:  # without yielding when the scheduler's inbox has room
                        self._outboxes.scheduler.send_nowait(state)
                    except anyio.WouldBlock:
                        # Until the request ends, too: failed by an escalation, its wait for
                        # room in an inbox nobody drains any more (the scheduler's) would
                        # last its whole deadline where closing the inbox wakes no sender
                        # (anyio before 4.16).
                        with state.bound(state.deadline, "submit"):
                            await self._outboxes.scheduler.send(state)
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    raise PipelineClosed(f"{state.describe()}: pipeline closed") from None
                await state.wait()
            if not state.done and not state.holders:
                # Queued (in inboxes, or never submitted): no actor's scope ends it.
                state.end("total_timeout", "deadline passed while queued")
            with anyio.move_on_at(state.deadline + self.config.deadline_slack):
                await state.wait()
            if not state.done:
                # One whose ending is decided already (a read failed by a close, an
                # escalation or a crash, waiting for its running scatters) has an outcome:
                # not the guard's to count, log or end; it is only waited for.
                if not state.ending:
                    self.metrics.counters["deadline_guard_expired"] += 1
                    self.limits.of(log).log(
                        logging.WARNING,
                        f"deadline_guard:{state.kind}",
                        "request %s: no outcome by its deadline; ending it as timed out",
                        state.request_id,
                    )
                    state.end("total_timeout", "deadline passed")
                deferred = DeferredCancel()
                await shielded(state.wait, deferred=deferred)
                deferred.raise_if_received()
        except anyio.get_cancelled_exc_class():
            cancelled = True
            state.end("cancelled", "caller cancelled")
            if isinstance(state, ReadState):
                # Not even asyncio's own cancellation, which anyio's shield lets through,
                # again (a timeout after a disconnect): a copy into the caller's cache
                # blocks still running would write into them after the read returned.
                await shielded(state.wait)
            raise
        finally:
            self._in_flight.discard(state)
            if not self._in_flight:
                self._idle.set()
            if isinstance(state, ReadState) and state.result is not None:
                self._count_read(state.result.loaded)
            if self.observers.active:
                self._observe(state, cancelled)
        error = state.error
        if error is None:
            return state
        del state
        try:
            raise error
        finally:
            error = None

    def _count_read(self, loaded: int) -> None:
        """Count a read's ``loaded`` blocks: what its result counts, and only that (blocks
        a later slice placed past a short one, or placed as the read ended, are not loaded)."""
        if loaded:  # counters appear once non-zero
            counters = self.metrics.counters
            counters["blocks_read"] += loaded
            counters["bytes_read"] += loaded * self.layout.block_nbytes

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
        self.observers.emit(kind, anyio.current_time() - state.started, outcome)

    # -- introspection -----------------------------------------------------------------------

    def statistics(self) -> PipelineStatistics:
        """The snapshot :meth:`kvpipe.Pipeline.statistics` returns (it only reads).

        Each attribute that :meth:`release` clears is read once: an exporter's thread may take
        the snapshot while the pipeline closes in the event loop's thread."""
        pool, runner, channels = self._pool, self._runner, self._inboxes
        engine = self._engine_seen
        if pool is None and (released := self._released_pool) is not None:
            pool = released()
        inboxes = channels.by_name() if channels is not None else {}
        metrics = self.metrics
        kinds = Counter(
            s.kind if not isinstance(s, CallState) else s.op for s in list(self._in_flight)
        )
        return PipelineStatistics(
            open=self.open,
            device_path=engine[0] if engine is not None else "host",
            device_note=(
                engine[1]
                if engine is not None
                else (self._device.note if self._device is not None else "not probed yet")
            ),
            in_flight=dict(kinds),
            queue_depths={
                stage: inboxes[stage].statistics().current_buffer_used if inboxes else 0
                for stage in _STAGES
            },
            queue_capacity=self.config.queue_depth,
            restarts=dict(metrics.restarts),
            slices=dict(metrics.slices),
            counters=dict(metrics.counters),
            staging_capacity_bytes=self._pool_slots * stride_for(self._slot_nbytes),
            staging_in_use_bytes=pool.in_use * pool.stride if pool else 0,
            staging_waiters=pool.waiters if pool else 0,
            slice_blocks=self.slice_blocks,
            backend=dict(self.store.statistics()),
            threads_running=runner.running if runner is not None else 0,
        )


def _leaf(exc: BaseException) -> BaseException:
    """``exc`` out of the groups of one member each that task groups wrapped it in."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _run_shielded(
    supervisor: Supervisor,
    scope: anyio.CancelScope,
    on_error: Callable[[BaseException], None],
) -> None:
    """Run the actors in ``scope`` (shielded from the cancellation of the task that opened
    the pipeline): they stop when :meth:`Runtime.aclose` (which always follows) closes their
    inboxes, or cancels them at the close deadline, or :meth:`Runtime.cancel_actors`.
    Cancelled with that task, they would drop the requests in flight (their callers then
    wait for the close deadline) and, ending cancelled, hold their frames in reference
    cycles. What else ends them (a ``KeyboardInterrupt``, a ``SystemExit``) goes to
    ``on_error`` first, then on as itself, out of the task groups' groups (``except
    SystemExit`` around the pipeline's block catches it, its exit status holds)."""
    error: BaseException | None = None
    try:
        with scope:
            await supervisor.run()
    except BaseException as exc:
        on_error(exc)
        error = _leaf(exc)
    del on_error
    if error is not None:
        # Raised here, out of the handler: not in a chain with the group that holds it.
        try:
            raise error
        finally:
            error = None
