"""What every actor shares: its context, the backend-call helpers, and the actor loop.

Each message is handled in its own task (up to the actor's concurrency), so one slow store
call does not hold up other requests; the requests an actor holds are tracked so that, if it
crashes, the supervisor fails exactly those.
"""

from __future__ import annotations

import abc
import logging
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._cache import KVCache
from .._clock import current_time
from .._config import PipelineConfig
from .._engine import CopyEngine, run_copy
from .._errors import AbandonedAtClose, BackendError
from .._hostcopy import gather_sealed, seal_slots
from .._keys import Scope, key_digest
from .._layout import CacheLayout
from .._lograte import LogLimiters
from .._plan import CopySegment, SliceSpec, copy_plan
from .._staging import StagingLease, StagingPool
from .._workers import INLINE_COPY_BYTES, Abandoned, Lane, NotStarted, ThreadRunner
from ..backends._base import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend
from ._channels import Outboxes, SliceJob
from ._observe import Metrics, ObservationKind, Observers
from ._state import ReadState, RequestState, WriteState, describe_error

__all__ = (
    "Actor",
    "ActorContext",
    "PipelineHooks",
    "SliceJob",
    "backend_call",
    "block_statuses",
    "shielded_copy",
    "task",
)

M = TypeVar("M")
T = TypeVar("T")
log = logging.getLogger("kvpipe.actors")


class PipelineHooks:
    """Test and fault-injection seam: called by every actor before it handles a message.

    Subclass and pass to ``open_pipeline(hooks=...)``. An exception raised from
    :meth:`on_message` is an actor crash (the supervisor restarts the actor and fails the
    requests it held); use it to test crash handling.
    """

    def on_message(self, actor: str, request_id: str) -> None:
        """Called in ``actor`` before it handles a message of ``request_id``."""


#: A put of at most this many bytes is gathered into staging, and the store copies what it
#: keeps: leasing memory of its own costs more than that copy.
SMALL_PUT_BYTES = 32 << 10


def keeps_own_memory(count: int, payload_nbytes: int) -> bool:
    """Whether a put of ``count`` blocks to a store that keeps its values is gathered into
    memory of the store's own (:meth:`StorageBackend.value_memory`) rather than staging."""
    return count * payload_nbytes > SMALL_PUT_BYTES


@dataclass(eq=False)
class ActorContext:
    """Everything the actors of one pipeline share."""

    config: PipelineConfig
    cache: KVCache
    layout: CacheLayout
    scope: Scope
    backend: StorageBackend
    pool: StagingPool
    runner: ThreadRunner
    segments: tuple[CopySegment, ...]
    payload_nbytes: int
    value_nbytes: int
    slice_blocks: int
    copy_limiter: Lane
    io_limiter: Lane
    hooks: PipelineHooks
    outboxes: Outboxes
    engine: CopyEngine
    #: The store keeps values and copies run on the host: puts may be gathered into memory
    #: the store keeps, gets may be lent (one copy fewer).
    keep_values: bool = False
    metrics: Metrics = field(default_factory=Metrics)
    observers: Observers | None = None
    #: The pipeline's bounds on repeated log lines (:mod:`kvpipe._lograte`): its own, so a
    #: flood of another pipeline's (another store's) never hides this one's first line.
    limits: LogLimiters = field(default_factory=LogLimiters)

    def __post_init__(self) -> None:
        if self.observers is None:
            self.observers = Observers(self.metrics.counters)

    @property
    def host_copies(self) -> bool:
        """Copies run on the host (a CPU cache): the writer and reader copy their own slices."""
        return self.engine.name == "host"

    async def gather_and_seal(self, job: SliceJob) -> bool:
        """Gather a write slice's blocks (all layers and roles) into its staging — memory of
        its own when the store keeps values — and seal each with its trailer. On the host,
        one worker-thread call does both (in one pass over the bytes where it can:
        :func:`~kvpipe._hostcopy.gather_sealed`).

        Returns:
            Whether it did. ``False``: the request ended first, or its deadline passed (a
            gather still waiting for a copy thread, say), which ends it: the caller learns
            by the deadline, not by the deadline guard's slack later. Or the engine
            abandoned a device gather at the close deadline
            (:class:`~kvpipe._errors.AbandonedAtClose`): no crash, and the request is left
            to the close, which fails it (``PipelineClosed``) at that deadline.

        Cancellation: not shielded. A gather cut off leaves its thread running with its own
        hold on the staging, and the job is dropped, so no half-gathered slot is ever put.
        """
        state, spec = job.state, job.spec
        with state.bound(state.deadline, ("gather", spec.index), spec.first_block):
            try:
                await self._gather_and_seal(job)
            except NotStarted:  # a device gather: the model's stream was busy till then
                pass
            except AbandonedAtClose:  # a device gather, at the close deadline
                return False  # the close fails the write: no timeout, no crash
            else:
                return True
        state.end("total_timeout", "deadline passed waiting to gather")  # no-op if ended
        return False

    async def _gather_and_seal(self, job: SliceJob) -> None:
        state, spec = job.state, job.spec
        blocks = state.block_ids[spec.first_block : spec.end_block]
        digests = self.digests_of(state, spec)
        payload, checksum = self.payload_nbytes, self.config.verify_checksums
        nbytes = spec.count * payload
        if not self.host_copies:  # a device cache: the engine gathers, the host seals
            staging = job.staging
            plan = copy_plan(self.segments, blocks, staging.slots)
            # Not queued behind the model's work past the deadline: a device copy, once
            # queued, is shielded and would hold the write (and this worker) until it ends.
            await self.engine.gather(plan, staging, state.after, start_by=state.deadline)
            job.checksums = await self.run_copy(
                nbytes if checksum else 0,
                seal_slots,
                staging.pool.buffer,
                staging.slots,
                payload,
                digests,
                checksum,
                hold=staging,
            )
        elif self.keep_values and keeps_own_memory(spec.count, payload):
            # Allocated in the worker thread: a large allocation on the event loop's thread
            # would wait behind the page faults of copies running in other threads.
            rows, slot_nbytes = self.cache.row_groups(self.segments), self.pool.slot_nbytes
            new_values, store = self.backend.value_memory, self.backend.name
            limits = self.limits

            def gather_into_new() -> StagingLease | None:
                try:
                    data = new_values(slot_nbytes, spec.count)
                except MemoryError:  # gathered into staging, then: the store copies it
                    return None
                except Exception as exc:  # a store's failure, not the actor's: as above
                    limits.of(log).log(
                        logging.WARNING,
                        store,
                        "%s.value_memory raised %r; gathering into staging instead",
                        store,
                        exc,
                    )
                    return None
                buffer, slots = data.pool.buffer, data.slots
                gather_sealed(rows, buffer, slots, blocks, payload, digests, checksum)
                return data

            job.data = await self.run_copy(nbytes, gather_into_new, hold=job.lease, on_cache=True)
        if job.data is None and self.host_copies:
            staging, rows = job.lease, self.cache.row_groups(self.segments)
            args = (rows, staging.pool.buffer, staging.slots, blocks, payload, digests, checksum)
            if nbytes <= INLINE_COPY_BYTES:
                # Small: on the event loop without a checkpoint (the put that follows yields).
                job.checksums = gather_sealed(*args)
            else:
                job.checksums = await self.run_copy(
                    nbytes, gather_sealed, *args, hold=staging, on_cache=True
                )
        self.metrics.counters["bytes_gathered"] += nbytes

    def observe(self, kind: ObservationKind, seconds: float, outcome: str) -> None:
        """Report a timing to the pipeline's observers (nothing to do when there are none)."""
        observers = self.observers
        if observers is not None and observers.active:
            observers.emit(kind, seconds, outcome)

    async def run_copy(
        self,
        nbytes: int,
        fn: Callable[..., T],
        *args: Any,
        hold: StagingLease,
        start_by: float | None = None,
        on_cache: bool = False,
    ) -> T:
        """:func:`kvpipe._engine.run_copy` in the pipeline's copy threads; ``on_cache``: it
        reads or writes the caller's cache (kept referenced, and named by a close that
        abandons it, until it returns)."""
        uses = self.cache if on_cache else None
        return await run_copy(
            self.runner,
            self.copy_limiter,
            nbytes,
            fn,
            *args,
            hold=hold,
            start_by=start_by,
            uses=uses,
        )

    def digests_of(self, state: WriteState | ReadState, spec: SliceSpec) -> list[bytes]:
        """Digests of a slice's keys (for block trailers)."""
        assert state.keys is not None
        return [key_digest(k) for k in state.keys[spec.first_block : spec.end_block]]

    def key_batch(self, request_id: str, keys: Sequence[str], first: int, tokens: Any) -> KeyBatch:
        """A key-only batch of consecutive blocks."""
        end = min((first + len(keys)) * self.layout.block_size, len(tokens))
        return KeyBatch(self.scope, request_id, keys, first, tokens[:end])

    def staged_batch(
        self,
        job: SliceJob,
        kind: type[PutBatch] | type[GetBatch],
        lo: int = 0,
        hi: int | None = None,
    ) -> Any:
        """The put or get batch of a slice job's blocks ``[lo, hi)`` (default: all of them),
        over their slots of its staging lease."""
        state, spec = job.state, job.spec
        assert state.keys is not None
        first, keys = spec.first_block + lo, state.keys
        end = spec.end_block if hi is None else spec.first_block + hi
        # The tokens through the batch's last block (a partial one's: to the sequence's end)
        token_end = min(end * self.layout.block_size, len(state.tokens))
        batch = kind(
            self.scope,
            state.request_id,
            keys[first:end],
            first,
            state.tokens[:token_end],
            keys[first - 1] if first > 0 else None,
            lease=job.staging,
            value_nbytes=self.value_nbytes,
            runner=self.runner,
            limiter=self.io_limiter,
            offset=lo,
        )
        if isinstance(batch, PutBatch):
            batch.may_keep = job.data is not None
            batch.checksums = job.checksums  # from the seal: the store need not hash again
        else:
            batch.may_lend = self.keep_values
        return batch


async def backend_call(
    backend: StorageBackend, op: str, fn: Callable[..., Awaitable[T]], *args: Any
) -> T:
    """Call a backend method, translating any exception into :class:`BackendError`.

    No local holds the error raised: this frame is on its traceback, so the error, the frame
    and what it holds (the batch, the store) would be a reference cycle."""
    try:
        return await fn(*args)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(backend.name, op, describe_error(exc)) from exc


_STATUS_TYPE = frozenset({BlockStatus})


async def block_statuses(
    backend: StorageBackend, op: Literal["put_blocks", "get_blocks"], batch: Any, n: int
) -> list[BlockStatus]:
    """``backend.put_blocks(batch)`` or ``backend.get_blocks(batch)`` (:func:`backend_call`),
    its answer validated: ``n`` items, each a :class:`BlockStatus`.

    Raises:
        BackendError: The call failed, or answered anything else (not even a sequence:
            ``None``, a count): the call's failure, never a crash of the actor.
    """
    statuses = await backend_call(backend, op, getattr(backend, op), batch)
    try:
        out = list(statuses)
    except TypeError:
        raise BackendError(
            backend.name, op, f"returned {type(statuses).__name__}, not statuses, one per block"
        ) from None
    if len(out) != n or not set(map(type, out)) <= _STATUS_TYPE:
        raise BackendError(backend.name, op, f"returned {len(out)} statuses for {n} blocks")
    return out


async def shielded_copy(call: Awaitable[T]) -> T:
    """Await ``call``, a copy into the caller's cache (or one that must not be left half
    done), shielded from cancellation: the request's end never cuts it off.

    Its wait is bounded by the close, not by the request: at the close deadline plus half
    the grace the close cancels the actors and abandons every wait for a worker thread
    (:meth:`~kvpipe._workers.ThreadRunner.abandon_waits`). The copy then runs on in its
    thread (the runner keeps the cache referenced, and the close names it at ERROR, until
    it returns), and the actors' cancellation is raised here: the actor unwinds as it
    does from any wait cancelled at close.

    Raises:
        Abandoned: The wait was abandoned while the caller was not cancelled (never at a
            close, which cancels the actors first).
    """
    try:
        with anyio.CancelScope(shield=True):
            return await call
    except Abandoned:
        pass  # out of the handler: the cancellation below is not chained to it
    await anyio.lowlevel.checkpoint()  # the actors' cancellation, raised outside the shield
    raise Abandoned("a copy's wait was abandoned, its caller not cancelled")


async def task(fn: Callable[..., Awaitable[object]], *args: Any) -> None:
    """Run ``fn(*args)`` as a task of an actor's: when it ends cancelled (its actor crashed,
    or was cancelled at the close deadline), the frames of its traceback let go of what they
    hold first. On asyncio the exception of a task that ended cancelled is kept in a
    reference cycle (anyio's task group), and with it those frames: the actor, its requests
    and their staging would outlive the pipeline until the cyclic collector ran."""
    try:
        await fn(*args)
    except anyio.get_cancelled_exc_class() as exc:
        traceback.clear_frames(exc.__traceback__)
        del fn, args
        raise


class Actor(abc.ABC, Generic[M]):
    """An actor: a loop over its inbox that handles each message in its own task.

    Args:
        ctx: The shared context.
        inbox: The receiving end of its channel (it outlives the actor across restarts).
        concurrency: How many messages it handles at once (``None``: unbounded — only for
            actors whose messages each hold staging, which bounds them).
    """

    name: ClassVar[str] = "actor"

    def __init__(
        self,
        ctx: ActorContext,
        inbox: MemoryObjectReceiveStream[M],
        concurrency: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.inbox = inbox
        self._limit = concurrency
        self._workers = 0
        self._idle = 0
        self._tg: anyio.abc.TaskGroup | None = None
        self._held: Counter[RequestState] = Counter()

    def held_requests(self) -> list[RequestState]:
        """Requests this actor is handling now."""
        return [s for s, n in self._held.items() if n > 0]

    async def run(self) -> None:
        """Receive and handle messages until the inbox is closed and drained, in worker tasks
        that live as long as the actor (another whenever all are busy, up to concurrency)."""
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._spawn()
        finally:
            self._tg = None

    async def detach(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        """Run ``fn(*args)`` in a task of the actor's own, holding no request: work that
        goes on after a request's part in it (a best-effort clean-up, bounded). The actor
        stops only once it has returned; an exception it raises crashes the actor. Outside
        the actor's loop (a handler called on its own) it is awaited here."""
        if self._tg is None:
            await fn(*args)
        else:
            self._tg.start_soon(task, fn, *args)

    def _spawn(self) -> None:
        assert self._tg is not None
        self._workers += 1
        self._tg.start_soon(task, self._worker)

    async def _worker(self) -> None:
        while True:
            self._idle += 1
            try:
                msg = await self.inbox.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                return
            finally:
                self._idle -= 1
            if isinstance(msg, SliceJob) and not msg.take():  # in the step that took it
                del msg  # withdrawn by its sender, which kept it (see send)
                continue
            if self._idle == 0 and (self._limit is None or self._workers < self._limit):
                self._spawn()
            await self._dispatch(msg)
            del msg

    async def _dispatch(self, msg: M) -> None:
        state = self.state_of(msg)
        self._held[state] += 1
        state.holders += 1
        try:
            self.ctx.hooks.on_message(self.name, state.request_id)
        except BaseException:
            self.discard(msg)
            raise
        await self.handle(msg)
        # Only a normal return lets go of the request: otherwise the actor is crashing while
        # holding it, and the supervisor must fail it.
        state.holders -= 1
        self._held[state] -= 1
        if self._held[state] <= 0:
            del self._held[state]
        if not state.holders and not state.done and current_time() >= state.deadline:
            # Its last holder lets go past its deadline: its messages only wait in inboxes.
            # The caller's side, which ends such a request at the deadline, saw it held then.
            state.end("total_timeout", "deadline passed while queued")

    async def lease(self, state: WriteState | ReadState, spec: SliceSpec) -> StagingLease | None:
        """Wait for a slice's staging until the request's deadline; ``None`` when that passed,
        the request ended, or (a read) loading stopped at or before the slice first."""
        with state.bound(state.deadline, ("lease", spec.index), spec.first_block):
            return await self.ctx.pool.acquire(spec.count)
        return None

    @staticmethod
    def try_send(outbox: MemoryObjectSendStream[T], msg: T) -> bool | None:
        """Send ``msg`` now if ``outbox`` has room: ``True`` when sent, ``None`` when it is
        full, ``False`` when the pipeline is closing."""
        try:
            outbox.send_nowait(msg)
        except anyio.WouldBlock:
            return None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    async def send_until(
        self,
        outbox: MemoryObjectSendStream[T],
        msg: T,
        state: RequestState,
        first_block: int = 0,
    ) -> bool | None:
        """Send ``msg`` of request ``state``, waiting while ``outbox`` is full until the
        request's deadline at most, and no longer than the request lasts (a read's: nor once
        loading has stopped at or before ``first_block``): ``True`` when sent, ``None`` when
        the wait ended first, ``False`` when the pipeline is closing. Unless ``True``, the
        sender still owns what ``msg`` carries."""
        sent = self.try_send(outbox, msg)
        if sent is not None:
            return sent
        with state.bound(state.deadline, None, first_block):
            return await self.send(outbox, msg)
        return None

    @staticmethod
    async def send(outbox: MemoryObjectSendStream[T], msg: T) -> bool:
        """Send ``msg``, waiting while ``outbox`` is full (without yielding when it has room).
        ``False`` when the pipeline is closing: the sender still owns what ``msg`` carries.

        A cancelled wait raises, and the sender still owns ``msg`` — except a
        :class:`SliceJob` a receiver took in the step the wait was cancelled in (anyio's
        stream hands it over and still delivers the cancellation): that counts as sent,
        ``True``, and the scope stays cancelled for the caller's next checkpoint. A job not
        taken is withdrawn (:attr:`SliceJob.withdrawn`): a receiver taking the job ahead of
        it in that step moves it into the inbox all the same, and the actor that receives
        it later drops it."""
        try:
            try:
                outbox.send_nowait(msg)
            except anyio.WouldBlock:
                if isinstance(msg, SliceJob):
                    msg.taken = False
                try:
                    await outbox.send(msg)
                except anyio.get_cancelled_exc_class():
                    if isinstance(msg, SliceJob):
                        if msg.taken:
                            return True
                        msg.withdrawn = True
                    raise
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return False
        return True

    @staticmethod
    def state_of(msg: M) -> RequestState:
        """The request a message belongs to: a slice job's, or the message itself."""
        if isinstance(msg, SliceJob):
            return msg.state
        assert isinstance(msg, RequestState)
        return msg

    @abc.abstractmethod
    async def handle(self, msg: M) -> None:
        """Handle one message: receive → call → send.

        The handler owns what the message carries (its staging lease) from the moment it is
        called: it passes it on or releases it, also when it fails or is cancelled.
        """

    def discard(self, msg: M) -> None:
        """Release what a message carries when it will not be handled at all."""
        if isinstance(msg, SliceJob):
            msg.release()
