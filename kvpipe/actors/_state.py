"""Per-request state shared by the actors of one event loop, and how each request ends.

A state ends exactly once (first outcome wins). After it has ended no actor sends anything of
it to the store, and — for reads — nothing touches the caller's cache any more.

Because every write and read ends here, this is also where a request that stopped short is
logged, once, whatever stopped it: at WARNING with its id, the slice it stopped at, the
blocks stored or loaded and the reason (at INFO when the caller cancelled it; at DEBUG for a
read that simply found no more blocks stored, or whose failed block the reader has logged).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import anyio
import numpy as np
import numpy.typing as npt

from .._engine import OrderMark
from .._errors import (
    ActorCrashed,
    BackendError,
    KVPipeError,
    OperationTimeout,
    PipelineClosed,
)
from .._keys import BlockKeys, Tokens
from .._plan import SliceSpec
from .._results import ReadResult, ReadStopReason, SliceOutcome, StopReason, WriteResult

__all__ = ("CallState", "ReadState", "RequestState", "WriteState")

log = logging.getLogger("kvpipe.requests")
IntArray = npt.NDArray[np.int64]


class RequestState:
    """Common part: id, deadline, and the event the caller waits on."""

    kind: ClassVar[str] = "request"

    def __init__(self, request_id: str, deadline: float, started: float) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.started = started
        self.error: BaseException | None = None
        self._done = anyio.Event()
        self._scopes: dict[object, tuple[int, anyio.CancelScope]] = {}

    @property
    def done(self) -> bool:
        """Whether the request has ended."""
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait until the request has ended."""
        await self._done.wait()

    @contextmanager
    def bound(
        self, deadline: float, tag: object = None, first_block: int = 0
    ) -> Iterator[anyio.CancelScope]:
        """A cancel scope that ends at ``deadline`` or when the request ends — or, for a
        read, when loading stops at or before ``first_block``. ``tag`` names it uniquely."""
        scope = anyio.CancelScope(deadline=deadline)
        key = tag if tag is not None else object()
        self._scopes[key] = (first_block, scope)
        if self.done:
            scope.cancel()
        try:
            with scope:
                yield scope
        finally:
            self._scopes.pop(key, None)

    def cancel_scopes(self, from_block: int = 0) -> None:
        """Cancel work in flight on blocks at or after ``from_block``."""
        for first, scope in list(self._scopes.values()):
            if first >= from_block:
                scope.cancel()

    def _end(self) -> None:
        self._done.set()
        self.cancel_scopes()

    def fail(self, error: BaseException) -> None:
        """End the request with an error the caller will see."""
        if not self.done:
            self.error = error
            self._end()

    def crashed(self, actor: str, exc: BaseException) -> None:
        """The actor holding this request crashed."""
        self.fail(ActorCrashed(actor, f"actor {actor!r} crashed: {exc!r}"))

    def describe(self) -> str:
        """The request's id and how far it got, for logs."""
        return f"{self.kind} {self.request_id}"

    def outcome(self) -> str:
        """How the request ended, as a metrics label (see :class:`~kvpipe.actors.Observer`)."""
        return "ok" if self.error is None else error_label(self.error)


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
        **params: Any,
    ) -> None:
        super().__init__(request_id, deadline, started)
        self.op = op
        self.tokens = tokens
        self.include_partial = include_partial
        self.params = params
        self.keys: BlockKeys | None = None
        self.value: Any = None

    def describe(self) -> str:
        return f"{self.op} {self.request_id}"

    def succeed(self, value: Any) -> None:
        """End the request with a value."""
        if not self.done:
            self.value = value
            self._end()


class _Sliced(RequestState):
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
        self.keys: BlockKeys | None = None
        self.slices: tuple[SliceSpec, ...] = ()
        #: Where the producer's device work stood at call time; copies wait for it.
        self.after: OrderMark | None = None

    @property
    def requested(self) -> int:
        """Blocks asked for."""
        return self.end_block - self.start_block


class WriteState(_Sliced):
    """A write: slices go to the store strictly in order, each after the previous one."""

    kind: ClassVar[str] = "write"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skipped = 0
        self.written = 0
        self.outcomes: list[SliceOutcome] = []
        self.stop_reason: StopReason | None = None
        self.stop_detail: str | None = None
        self.result: WriteResult | None = None
        self._next_turn = 0
        self._turn = anyio.Event()

    async def wait_turn(self, index: int) -> bool:
        """Wait until slice ``index`` may go to the store; ``False`` if the request ended."""
        while not self.done and self._next_turn != index:
            await self._turn.wait()
        return not self.done

    def slice_done(self, outcome: SliceOutcome, detail: str | None = None) -> None:
        """Record a slice's outcome; the first incomplete slice ends the request."""
        if self.done:
            return
        self.outcomes.append(outcome)
        self.written += outcome.written
        self._next_turn += 1
        self._turn.set()
        self._turn = anyio.Event()
        if outcome.outcome != "complete":
            reason: StopReason = (
                "incomplete_slice" if outcome.outcome == "incomplete" else outcome.outcome
            )
            self.stop(reason, detail)
        elif self._next_turn == len(self.slices):
            self._finish()

    def stop(self, reason: StopReason, detail: str | None = None) -> None:
        """End the write now with what has been written; no later slice is sent."""
        if self.done:
            return
        self.stop_reason = reason
        self.stop_detail = detail
        self._finish()

    def crashed(self, actor: str, exc: BaseException) -> None:
        self.stop("actor_crashed", f"actor {actor!r} crashed: {exc!r}")

    def describe(self) -> str:
        stored = self.skipped + self.written
        where = f", at slice {self._next_turn}" if self._next_turn < len(self.slices) else ""
        return f"write {self.request_id} ({stored} of {self.requested} blocks stored{where})"

    def outcome(self) -> str:
        if self.result is None:
            return super().outcome()
        return "complete" if self.result.complete else (self.result.stop_reason or "incomplete")

    def finish_now(self, now: float) -> None:
        """End a write that needs no slice (everything skipped or nothing to write)."""
        if not self.done:
            self._finish(now)

    def _finish(self, now: float | None = None) -> None:
        now = anyio.current_time() if now is None else now
        self.result = WriteResult(
            request_id=self.request_id,
            requested=self.requested,
            skipped=self.skipped,
            written=self.written,
            complete=self.skipped + self.written == self.requested,
            stop_reason=self.stop_reason,
            slices=tuple(self.outcomes),
            elapsed=now - self.started,
            error=self.stop_detail,
        )
        self._turn.set()
        self._end()
        if not self.result.complete:
            self._log_stopped()

    def _log_stopped(self) -> None:
        level = logging.INFO if self.stop_reason == "cancelled" else logging.WARNING
        if not log.isEnabledFor(level):
            return
        last = self.outcomes[-1] if self.outcomes else None
        if last is not None and last.outcome != "complete":
            where = (
                f"slice {last.index} (blocks {last.first_block}-"
                f"{last.first_block + last.blocks - 1}: {last.written} of {last.blocks} written)"
            )
        elif self._next_turn < len(self.slices):
            spec = self.slices[self._next_turn]
            where = (
                f"slice {spec.index} (blocks {spec.first_block}-{spec.end_block - 1}: not stored)"
            )
        else:
            where = "before its first slice"
        log.log(
            level,
            "write %s incomplete: %d of %d blocks stored (%d skipped, %d written); stopped at "
            "%s: %s (%s)",
            self.request_id,
            self.skipped + self.written,
            self.requested,
            self.skipped,
            self.written,
            where,
            self.stop_reason,
            self.stop_detail or "no detail",
        )


class ReadState(_Sliced):
    """A read: slices are fetched concurrently; only the leading verified run counts."""

    kind: ClassVar[str] = "read"

    def __init__(self, *args: Any, require_all: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.require_all = require_all
        self.stop_block: int | None = None
        self.stop_reason: ReadStopReason | None = None
        self.stop_detail: str | None = None
        self.failed: set[int] = set()
        self.loaded_per_slice: dict[int, int] = {}
        self.pending: set[int] = set()
        self.result: ReadResult | None = None
        self._aborted = False
        self._scatters = 0

    def plan(self, slices: tuple[SliceSpec, ...]) -> None:
        """Set the slices; every one of them must later be resolved exactly once.

        With no slice at all the read ends at once.
        """
        self.slices = slices
        self.pending = {s.index for s in slices}
        if not slices:
            self._settle()

    def stopped_before(self, block: int) -> bool:
        """Whether ``block`` is at or past the point where loading stopped (or ended)."""
        return (
            self._aborted or self.done or (self.stop_block is not None and block >= self.stop_block)
        )

    def stop_at(
        self, block: int, reason: ReadStopReason, failed: list[int], detail: str | None = None
    ) -> None:
        """Loading cannot go past ``block``; later slices are cancelled and dropped."""
        self.failed.update(failed)
        if self.stop_block is None or block < self.stop_block:
            self.stop_block = block
            self.stop_reason = reason
            self.stop_detail = detail
            self.cancel_scopes(block)

    def resolve(self, index: int, loaded: int) -> None:
        """Slice ``index`` is settled with ``loaded`` leading blocks in the cache."""
        if index not in self.pending:
            return
        self.pending.discard(index)
        self.loaded_per_slice[index] = loaded
        if not self.pending:
            self._settle()

    def scatter_begin(self) -> bool:
        """Claim the right to write into the caller's cache; ``False`` once ended."""
        if self._aborted or self.done:
            return False
        self._scatters += 1
        return True

    def scatter_end(self) -> None:
        """A scatter claimed by :meth:`scatter_begin` has finished."""
        self._scatters -= 1
        if self._aborted and self._scatters == 0:
            self._settle()

    def abort(self, reason: ReadStopReason, detail: str | None = None) -> None:
        """End now (timeout, cancellation, crash): no new scatter starts; the result is
        published once scatters in flight have finished."""
        if self.done or self._aborted:
            return
        self._aborted = True
        if self.stop_reason is None or self.stop_block is None:
            self.stop_reason = reason
            self.stop_detail = detail
        self.cancel_scopes()
        if self._scatters == 0:
            self._settle()

    def crashed(self, actor: str, exc: BaseException) -> None:
        self.abort("actor_crashed", f"actor {actor!r} crashed: {exc!r}")

    def describe(self) -> str:
        where = f", stopping at block {self.stop_block}" if self.stop_block is not None else ""
        return f"read {self.request_id} ({self.requested} blocks{where})"

    def outcome(self) -> str:
        if self.result is None:
            return super().outcome()
        return "complete" if self.result.complete else (self.result.stop_reason or "incomplete")

    def fail(self, error: BaseException) -> None:
        self._aborted = True
        self.cancel_scopes()
        if self._scatters == 0:
            super().fail(error)
        else:
            self.error = error

    def _loaded(self) -> int:
        loaded = 0
        for s in self.slices:
            got = self.loaded_per_slice.get(s.index, 0)
            loaded += got
            if got < s.count:
                break
        return loaded

    def _settle(self) -> None:
        if self.done:
            return
        if self.error is not None:
            self._end()
            return
        loaded = self._loaded()
        if loaded < self.requested and self.stop_reason is None:
            self.stop_reason = "failed_block"
        first_missing = self.start_block + loaded
        failed = set(self.failed)
        if loaded < self.requested and not any(b >= first_missing for b in failed):
            failed.add(first_missing)
        self.result = ReadResult(
            request_id=self.request_id,
            requested=self.requested,
            loaded=loaded,
            complete=loaded == self.requested,
            failed_blocks=tuple(sorted(b for b in failed if b >= self.start_block)),
            stop_reason=None if loaded == self.requested else self.stop_reason,
            elapsed=anyio.current_time() - self.started,
            error=self.stop_detail,
        )
        self._end()
        if loaded < self.requested:
            self._log_stopped(loaded)

    def _log_stopped(self, loaded: int) -> None:
        reason = self.stop_reason
        level = _READ_STOP_LEVELS.get(reason or "", logging.WARNING)
        if not log.isEnabledFor(level):
            return
        where = next(
            (
                f"slice {s.index} (blocks {s.first_block}-{s.end_block - 1})"
                for s in self.slices
                if s.first_block <= self.start_block + loaded < s.end_block
            ),
            "before its first slice",
        )
        log.log(
            level,
            "read %s incomplete: %d of %d blocks loaded; stopped at %s: %s (%s)",
            self.request_id,
            loaded,
            self.requested,
            where,
            reason,
            self.stop_detail or "no detail",
        )


#: Log levels of a read that stopped short, by reason (others: WARNING). Finding no more
#: blocks stored is normal; a failed block was logged by the reader already.
_READ_STOP_LEVELS: dict[str, int] = {
    "not_stored": logging.DEBUG,
    "failed_block": logging.DEBUG,
    "cancelled": logging.INFO,
}


def error_label(exc: BaseException) -> str:
    """A short label for the error a call ended with (metrics ``outcome``)."""
    if isinstance(exc, PipelineClosed):
        return "closed"
    if isinstance(exc, OperationTimeout):
        return "timeout"
    if isinstance(exc, BackendError):
        return "backend_error"
    if isinstance(exc, ActorCrashed):
        return "actor_crashed"
    return "error"


def describe_error(exc: BaseException) -> str:
    """A short description of an error for results and logs."""
    if isinstance(exc, KVPipeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
