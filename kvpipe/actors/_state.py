"""Requests as the actors of one event loop see them: a pure state machine
(:mod:`kvpipe._write_machine`, :mod:`kvpipe._read_machine`) plus the event the caller waits on
and the cancel scopes of the work in flight.

Every request ends through :meth:`RequestState.end` (``total_timeout``, ``cancelled``,
``actor_crashed``) or :meth:`RequestState.fail` (the pipeline closing, or the error a
``lookup`` / ``locate`` / ``flush_index`` raises); the first ending wins. Ending sets the
event and cancels every scope of the request's work in flight; a read is settled only once no
scatter into the caller's cache is running. A write or read that stopped short is logged
here, once, whatever stopped it.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable
from typing import Any, ClassVar, Literal, final

import anyio
import numpy as np
import numpy.typing as npt

from .._clock import current_time
from .._engine import OrderMark
from .._errors import ActorCrashed, BackendError, KVPipeError, OperationTimeout, PipelineClosed
from .._keys import Tokens
from .._lograte import LogLimiters
from .._plan import SliceSpec
from .._read_machine import ReadMachine
from .._results import ReadResult, ReadStopReason, SliceOutcome, WriteResult
from .._write_machine import Ending, WriteMachine

__all__ = (
    "Bound",
    "CallState",
    "Ending",
    "ReadState",
    "RequestState",
    "SlicedState",
    "WriteState",
    "describe_error",
)

log = logging.getLogger("kvpipe.requests")
#: The log limits of a request no pipeline runs (tests drive the actors directly): a
#: pipeline's :meth:`~kvpipe._runtime.Runtime.run` hands each request the pipeline's own.
_UNOWNED = LogLimiters()
IntArray = npt.NDArray[np.int64]


class RequestState(abc.ABC):
    """Common part: id, deadline, the event the caller waits on, and cancel scopes."""

    kind: ClassVar[str] = "request"

    def __init__(self, request_id: str, deadline: float, started: float) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.started = started
        #: Where its ending is logged, bounded: a steady failure (a store down) ends every
        #: request alike, so one line per kind of ending per interval shows at its level,
        #: the others at DEBUG (the metrics count every one). The pipeline's own: another
        #: pipeline's flood (another store's) never hides this one's first line.
        self.limits: LogLimiters = _UNOWNED
        self._done = anyio.Event()
        self._over = False  # the event's state, read on every slice
        self._scopes: dict[object, tuple[int, anyio.CancelScope]] = {}
        #: How many actors' handlers hold the request now (:class:`~kvpipe.actors.Actor`
        #: counts it up when it takes a message, down when its handler returns). Zero while
        #: its messages only wait in inboxes: then nothing but the caller's side ends it at
        #: its deadline. A crashed handler leaves it up: the supervisor ends the request.
        self.holders = 0

    @property
    def done(self) -> bool:
        """Whether the request has ended."""
        return self._over

    @property
    def ending(self) -> bool:
        """Whether the request has ended, or an ending has been decided that a later one
        cannot change (a read aborted, waiting for its running scatters)."""
        return self._over

    @property
    @abc.abstractmethod
    def error(self) -> BaseException | None:
        """The error the caller sees instead of a result (``None``: none)."""

    async def wait(self) -> None:
        """Wait until the request has ended."""
        await self._done.wait()

    def bound(self, deadline: float, tag: object = None, first_block: int = 0) -> Bound:
        """A cancel scope that ends at ``deadline`` or when the request ends — or, for a
        read, when loading stops at or before ``first_block``. ``tag`` names it uniquely;
        cancelled at once if the request has ended, or (a read) loading has stopped there."""
        return Bound(self, deadline, tag if tag is not None else object(), first_block)

    def stopped_before(self, block: int) -> bool:
        """Whether work on ``block`` is of no more use (a read overrides this)."""
        return self._over

    def cancel_scopes(self, from_block: int = 0) -> None:
        """Cancel work in flight on blocks at or after ``from_block``."""
        for first, scope in list(self._scopes.values()):
            if first >= from_block:
                scope.cancel()

    def _ended(self) -> None:
        """The machine has ended: wake the caller, cancel all work in flight."""
        if not self._over:
            self._over = True
            self._done.set()
            self.cancel_scopes()
            self._scopes.clear()

    @abc.abstractmethod
    def end(self, cause: Ending, detail: str, *, actor: str = "") -> None:
        """End now: the total deadline passed, the caller was cancelled, or ``actor``
        crashed while holding the request."""

    @abc.abstractmethod
    def fail(self, error: BaseException) -> None:
        """End with ``error``, which the caller sees (the pipeline closing)."""

    def describe(self) -> str:
        """The request's id and how far it got, for logs."""
        return f"{self.kind} {self.request_id}"

    def outcome(self) -> str:
        """How the request ended, as a metrics label (see :class:`~kvpipe.actors.Observer`)."""
        error = self.error
        if error is None:
            return "ok"
        if isinstance(error, PipelineClosed):
            return "closed"
        if isinstance(error, OperationTimeout):
            return "timeout"
        if isinstance(error, BackendError):
            return "backend_error"
        if isinstance(error, ActorCrashed):
            return "actor_crashed"
        return "error"


@final
class Bound:
    """The context manager of :meth:`RequestState.bound`: a cancel scope registered with its
    request while it is entered."""

    __slots__ = ("_key", "_state", "scope")

    def __init__(self, state: RequestState, deadline: float, key: object, first_block: int) -> None:
        self.scope = anyio.CancelScope(deadline=deadline)
        self._state, self._key = state, key
        state._scopes[key] = (first_block, self.scope)
        if state.done or state.stopped_before(first_block):
            self.scope.cancel()

    def __enter__(self) -> anyio.CancelScope:
        return self.scope.__enter__()

    def __exit__(self, *exc_info: Any) -> bool:
        self._state._scopes.pop(self._key, None)
        return bool(self.scope.__exit__(*exc_info))


class CallState(RequestState):
    """A lookup, locate or flush_index: one value or one error."""

    kind: ClassVar[str] = "call"

    def __init__(
        self,
        request_id: str,
        deadline: float,
        started: float,
        op: Literal["lookup", "locate", "flush"],
        tokens: Tokens,
        include_partial: bool,
        *,
        limit_from: str = "timeout",
        **params: Any,
    ) -> None:
        super().__init__(request_id, deadline, started)
        self.op = op
        #: What set its deadline, for its timeout's message: the call's ``timeout``, or
        #: the config field it defaulted to.
        self.limit_from = limit_from
        self.tokens = tokens
        self.include_partial = include_partial
        self.params = params
        self.keys: tuple[str, ...] | None = None
        self.value: Any = None
        self._error: BaseException | None = None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def describe(self) -> str:
        return f"{self.op} {self.request_id}"

    def succeed(self, value: Any) -> None:
        """End the request with a value."""
        if not self.done:
            self.value = value
            self._ended()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self._error = error
            self._ended()

    def end(self, cause: Ending, detail: str, *, actor: str = "") -> None:
        what = f"{self.op} {self.request_id}"
        if cause == "total_timeout":
            limit = f"{self.deadline - self.started:g} s ({self.limit_from})"
            self.fail(OperationTimeout(f"{what} timed out: no answer within {limit}; {detail}"))
        elif cause == "cancelled":
            self.fail(KVPipeError(f"{what}: {detail}"))
        else:
            self.fail(ActorCrashed(actor, f"{what}: {detail}"))


class SlicedState(RequestState):
    """Common part of writes and reads: the blocks asked for, their keys and slices."""

    def __init__(
        self,
        request_id: str,
        deadline: float,
        started: float,
        tokens: Tokens,
        block_ids: IntArray,
        start_block: int,
        end_block: int,
        include_partial: bool,
    ) -> None:
        super().__init__(request_id, deadline, started)
        self.tokens = tokens
        self.block_ids = block_ids
        self.start_block = start_block
        self.end_block = end_block
        self.include_partial = include_partial
        self.keys: tuple[str, ...] | None = None
        #: Where the producer's device work stood at call time; copies wait for it.
        self.after: OrderMark | None = None

    @property
    def requested(self) -> int:
        """Blocks asked for."""
        return self.end_block - self.start_block

    machine: WriteMachine | ReadMachine

    @property
    def error(self) -> BaseException | None:
        return self.machine.error

    @property
    def slices(self) -> tuple[SliceSpec, ...]:
        """The planned slices."""
        return self.machine.slices

    def outcome(self) -> str:
        result = self.machine.result
        if result is None:
            return super().outcome()
        return "complete" if result.complete else (result.stop_reason or "incomplete")

    def end(self, cause: Ending, detail: str, *, actor: str = "") -> None:
        self.machine.end(cause, detail, current_time())
        self.cancel_scopes()  # now: an aborted read ends only once its scatters have
        self._sync()

    #: Log levels of a request that stopped short, by reason (others: WARNING).
    _STOP_LEVELS: ClassVar[dict[str, int]]

    def _sync(self) -> None:
        """Once the machine has ended: :meth:`_ended`, and log a result that stopped short."""
        if not self.machine.ended or self.done:
            return
        self._ended()
        result = self.machine.result
        if result is not None and not result.complete:
            level = self._STOP_LEVELS.get(result.stop_reason or "", logging.WARNING)
            if log.isEnabledFor(level):
                self.limits.of(log).log(
                    level,
                    f"{self.kind}:{result.stop_reason}",
                    "%s %s incomplete: %s; stopped at %s: %s (%s)",
                    self.kind,
                    self.request_id,
                    self._how_far(result),
                    self.machine.where_stopped(),
                    result.stop_reason,
                    result.error or "no detail",
                )

    @abc.abstractmethod
    def _how_far(self, result: Any) -> str:
        """How much of a result that stopped short got done, for its log line."""


class WriteState(SlicedState):
    """A write (its decisions: :class:`~kvpipe._write_machine.WriteMachine`)."""

    kind: ClassVar[str] = "write"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.machine: WriteMachine = WriteMachine(
            self.request_id, self.start_block, self.end_block, self.started
        )
        #: One event per slice waiting for its turn: a slice done wakes the next one only.
        self._turns: dict[int, anyio.Event] = {}

    @property
    def result(self) -> WriteResult | None:
        """The result, once settled."""
        return self.machine.result

    async def wait_turn(self, index: int) -> None:
        """Wait until slice ``index`` may go to the store, or the write has ended."""
        m = self.machine
        while not m.ended and m.turn != index:
            await self._turns.setdefault(index, anyio.Event()).wait()

    def planned(self, skipped: int, slices: tuple[SliceSpec, ...]) -> None:
        """The probe found ``skipped`` leading blocks stored; the rest go as ``slices``."""
        self.machine.planned(skipped, slices, current_time())
        self._sync()

    def slice_done(
        self, outcome: SliceOutcome, detail: str | None = None, now: float | None = None
    ) -> None:
        """Record a slice's outcome (at ``now``, default the current time); the first
        incomplete slice ends the write."""
        self.machine.slice_done(outcome, detail, current_time() if now is None else now)
        turn = self._turns.pop(self.machine.turn, None)
        if turn is not None:
            turn.set()
        self._sync()

    def fail(self, error: BaseException) -> None:
        self.machine.fail(error)
        self._sync()

    def describe(self) -> str:
        m = self.machine
        where = f", at slice {m.turn}" if m.turn < len(m.slices) else ""
        return (
            f"write {self.request_id} ({m.skipped + m.written} of {self.requested} blocks "
            f"stored{where})"
        )

    _STOP_LEVELS: ClassVar[dict[str, int]] = {"cancelled": logging.INFO}

    def _how_far(self, result: WriteResult) -> str:
        stored = result.skipped + result.written
        return (
            f"{stored} of {result.requested} blocks stored ({result.skipped} skipped, "
            f"{result.written} written)"
        )

    def _ended(self) -> None:
        turns, self._turns = self._turns, {}
        for turn in turns.values():
            turn.set()
        super()._ended()


class ReadState(SlicedState):
    """A read (its decisions: :class:`~kvpipe._read_machine.ReadMachine`)."""

    kind: ClassVar[str] = "read"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.machine: ReadMachine = ReadMachine(
            self.request_id, self.start_block, self.end_block, self.started
        )

    @property
    def result(self) -> ReadResult | None:
        """The result, once settled."""
        return self.machine.result

    @property
    def ending(self) -> bool:
        return self._over or self.machine.aborted

    def plan(self, slices: tuple[SliceSpec, ...]) -> None:
        """Set the slices; each must later be resolved exactly once (none: the read ends)."""
        self.machine.plan(slices, current_time())
        self._sync()

    def stopped_before(self, block: int) -> bool:
        """Whether ``block`` is at or past where loading stopped (or the read ended)."""
        return self.machine.stopped_before(block)

    def stop_at(
        self,
        block: int,
        reason: ReadStopReason,
        failed: Iterable[int] = (),
        detail: str | None = None,
    ) -> None:
        """Loading cannot go past ``block``; work in flight on later blocks is cancelled."""
        cancel_from = self.machine.stop_at(block, reason, failed, detail)
        if cancel_from is not None:
            self.cancel_scopes(cancel_from)

    def resolve(self, index: int, loaded: int) -> None:
        """Slice ``index`` is settled with ``loaded`` leading blocks in the cache."""
        self.machine.resolve(index, loaded, current_time())
        self._sync()

    def time_out(self, spec: SliceSpec, detail: str | None = None) -> None:
        """Slice ``spec`` is settled with nothing loaded, out of time: loading stops at it
        (``total_timeout``) unless it had stopped before."""
        if not self.stopped_before(spec.first_block):
            self.stop_at(spec.first_block, "total_timeout", [spec.first_block], detail)
        self.resolve(spec.index, 0)

    def scatter_begin(self) -> bool:
        """Claim the right to write into the caller's cache; ``False`` once ended."""
        return self.machine.scatter_begin()

    def scatter_end(self) -> None:
        """A scatter claimed by :meth:`scatter_begin` has finished."""
        self.machine.scatter_end(current_time())
        self._sync()

    def fail(self, error: BaseException) -> None:
        self.machine.fail(error, current_time())
        self.cancel_scopes()
        self._sync()

    def describe(self) -> str:
        stop = self.machine.stop_block
        where = f", stopping at block {stop}" if stop is not None else ""
        return f"read {self.request_id} ({self.requested} blocks{where})"

    #: The reader has logged a failed block already.
    _STOP_LEVELS: ClassVar[dict[str, int]] = {
        "not_stored": logging.DEBUG,
        "failed_block": logging.DEBUG,
        "cancelled": logging.INFO,
    }

    def _how_far(self, result: ReadResult) -> str:
        return f"{result.loaded} of {result.requested} blocks loaded"


def describe_error(exc: BaseException) -> str:
    """A short description of an error for results and logs."""
    if isinstance(exc, KVPipeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
