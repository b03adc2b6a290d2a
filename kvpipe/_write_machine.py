"""The state machine of one write: events in, decisions out — no event loop, no I/O, and
time only as an input (``now``). It alone knows a write's invariants:

- **Contiguous prefix.** Slices are stored strictly in order (:meth:`WriteMachine.is_turn`);
  ``written`` counts the leading ``OK`` blocks of the slices, in order, and the first slice
  that falls short ends the write: no later slice is sent.
- **Counted is stored.** A slice's blocks count only through :meth:`~WriteMachine.slice_done`
  with the backend's own leading run, and only while the write has not ended.
- **One outcome per slice sent.** A slice sent to the store (:meth:`~WriteMachine.sent`) gets
  its outcome from :meth:`~WriteMachine.slice_done`, or, when the total deadline ends the
  write first (whichever task reaches it first), from :meth:`~WriteMachine.end`: then it is
  ``total_timeout`` with nothing counted, whatever its store call reports later.
- **Settled exactly once.** The first ending wins (:attr:`~WriteMachine.ended`); every later
  event is ignored, so the result (or the error) never changes once it exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Literal, TypeVar, final

from ._plan import SliceSpec, leading
from ._results import ReadResult, SliceOutcome, SliceStatus, StopReason, WriteResult
from .backends._base import BlockStatus

__all__ = ("Ending", "RequestMachine", "WriteMachine", "leading_ok", "put_outcome")

#: Why a request ends from outside its own slices (the pipeline closing is :meth:`fail`).
Ending = Literal["total_timeout", "cancelled", "actor_crashed"]

_Result = TypeVar("_Result", WriteResult, ReadResult)


def leading_ok(statuses: Sequence[BlockStatus]) -> int:
    """How many leading statuses are :attr:`~BlockStatus.OK` (stop at the first other)."""
    return leading(statuses, BlockStatus.OK)


def put_outcome(
    spec: SliceSpec,
    elapsed: float,
    statuses: list[BlockStatus] | None,
    error: str | None,
    total: bool,
) -> tuple[SliceOutcome, str | None, int]:
    """A slice's outcome from its store call: the backend's ``statuses``, else the ``error``
    it raised, else (neither) it ran out of time — the write's whole time when ``total``.

    Returns:
        The outcome, its detail, and how many blocks the store reported stored past the first
        it did not store (they count for nothing).
    """

    def outcome(written: int, status: SliceStatus) -> SliceOutcome:
        return SliceOutcome(spec.index, spec.first_block, spec.count, written, elapsed, status)

    if error is not None:
        return outcome(0, "backend_error"), error, 0
    if statuses is None:
        detail = f"slice {spec.index} ran out of time after {elapsed:.3f} s"
        return outcome(0, "total_timeout" if total else "slice_timeout"), detail, 0
    written = leading_ok(statuses)
    if written == spec.count:
        return outcome(written, "complete"), None, 0
    strays = sum(s is BlockStatus.OK for s in statuses[written + 1 :])
    detail = f"block {spec.first_block + written}: {statuses[written].value}"
    return outcome(written, "incomplete"), detail, strays


class RequestMachine(Generic[_Result]):
    """What the state machines of a write and of a read share: the blocks asked for, the
    slices, and the outcome (a result, or an error the caller sees instead).

    Args:
        request_id: The request's id (for the result).
        start_block: First block asked for.
        end_block: One past the last block asked for.
        started: When the call was made (the result's ``elapsed`` counts from it).
    """

    __slots__ = ("end_block", "error", "request_id", "result", "slices", "start_block", "started")

    def __init__(self, request_id: str, start_block: int, end_block: int, started: float) -> None:
        self.request_id = request_id
        self.start_block = start_block
        self.end_block = end_block
        self.started = started
        self.slices: tuple[SliceSpec, ...] = ()
        self.result: _Result | None = None
        #: The error the caller sees instead of a result, once settled.
        self.error: BaseException | None = None

    @property
    def requested(self) -> int:
        """Blocks asked for."""
        return self.end_block - self.start_block

    @property
    def ended(self) -> bool:
        """Whether the request has ended (a result or an error exists)."""
        return self.result is not None or self.error is not None


@final
class WriteMachine(RequestMachine[WriteResult]):
    """One write (see the module docstring)."""

    __slots__ = ("cut_off", "outcomes", "sent_at", "skipped", "turn", "written")

    def __init__(self, request_id: str, start_block: int, end_block: int, started: float) -> None:
        super().__init__(request_id, start_block, end_block, started)
        self.skipped = 0
        self.written = 0
        self.outcomes: list[SliceOutcome] = []
        #: The index of the slice whose turn it is to go to the store.
        self.turn = 0
        #: When slice ``turn`` was sent to the store, while its outcome is still to come.
        self.sent_at: float | None = None
        #: The outcome :meth:`end` recorded for the slice then in its store call (the total
        #: deadline cut it off), if any.
        self.cut_off: SliceOutcome | None = None

    # -- decisions ---------------------------------------------------------------------------

    def is_turn(self, index: int) -> bool:
        """Whether slice ``index`` may go to the store now."""
        return not self.ended and self.turn == index

    # -- events ------------------------------------------------------------------------------

    def planned(self, skipped: int, slices: tuple[SliceSpec, ...], now: float) -> None:
        """The probe found ``skipped`` leading blocks stored; the rest go as ``slices``.
        With nothing left to write the write ends complete."""
        if self.ended:
            return
        if not 0 <= skipped <= self.requested:
            raise ValueError(f"skipped {skipped} of {self.requested} blocks")
        self.skipped = skipped
        self.slices = slices
        if not slices:
            self._settle(now)

    def sent(self, index: int, now: float) -> None:
        """Slice ``index`` went to the store at ``now``. Its outcome comes through
        :meth:`slice_done`, or through :meth:`end` if the total deadline ends the write first.

        Raises:
            ValueError: Not this slice's turn.
        """
        if self.ended:
            return
        if index != self.turn or self.turn >= len(self.slices):
            raise ValueError(f"slice {index} sent out of turn (turn {self.turn})")
        self.sent_at = now

    def slice_done(self, outcome: SliceOutcome, detail: str | None, now: float) -> None:
        """A slice's store call ended with ``outcome``; the first incomplete slice ends the
        write, the last complete one settles it.

        Raises:
            ValueError: Not this slice's turn, or it claims more blocks than it carries.
        """
        if self.ended:
            return
        if outcome.index != self.turn or self.turn >= len(self.slices):
            raise ValueError(f"slice {outcome.index} done out of turn (turn {self.turn})")
        if not 0 <= outcome.written <= outcome.blocks:
            raise ValueError(f"slice {outcome.index}: {outcome.written} of {outcome.blocks}")
        if (outcome.outcome == "complete") != (outcome.written == outcome.blocks):
            raise ValueError(f"slice {outcome.index}: {outcome.outcome} with {outcome.written}")
        self.outcomes.append(outcome)
        self.written += outcome.written
        self.turn += 1
        self.sent_at = None
        if outcome.outcome != "complete":
            reason: StopReason = (
                "incomplete_slice" if outcome.outcome == "incomplete" else outcome.outcome
            )
            self._settle(now, reason, detail)
        elif self.turn == len(self.slices):
            self._settle(now)

    def end(self, cause: Ending, detail: str | None, now: float) -> None:
        """End now with what has been written (no later slice is sent). At the total
        deadline, a slice still in its store call is recorded as ``total_timeout`` with
        nothing written (:attr:`cut_off`): the deadline cut it off, whoever reported that
        first. (Cut off by the caller's cancellation or a crash, it is not recorded.)"""
        if self.ended:
            return
        if cause == "total_timeout" and self.sent_at is not None:
            spec = self.slices[self.turn]
            self.cut_off = SliceOutcome(
                spec.index, spec.first_block, spec.count, 0, now - self.sent_at, "total_timeout"
            )
            self.outcomes.append(self.cut_off)
            self.turn += 1
            self.sent_at = None
        self._settle(now, cause, detail)

    def fail(self, error: BaseException) -> None:
        """End with an error the caller sees instead of a result (the pipeline closing)."""
        if not self.ended:
            self.error = error

    def _settle(
        self, now: float, reason: StopReason | None = None, detail: str | None = None
    ) -> None:
        stored = self.skipped + self.written
        if stored == self.requested:  # nothing to write (an ending then stops nothing)
            reason = detail = None
        self.result = WriteResult(
            request_id=self.request_id,
            requested=self.requested,
            skipped=self.skipped,
            written=self.written,
            complete=stored == self.requested,
            stop_reason=reason,
            slices=tuple(self.outcomes),
            elapsed=now - self.started,
            error=detail,
        )

    # -- for logs ----------------------------------------------------------------------------

    def where_stopped(self) -> str:
        """Where an incomplete write stopped, in words."""
        last = self.outcomes[-1] if self.outcomes else None
        if last is not None and last.outcome != "complete":
            return (
                f"slice {last.index} (blocks {last.first_block}-"
                f"{last.first_block + last.blocks - 1}: {last.written} of {last.blocks} written)"
            )
        if self.turn < len(self.slices):
            spec = self.slices[self.turn]
            return (
                f"slice {spec.index} (blocks {spec.first_block}-{spec.end_block - 1}: not stored)"
            )
        return "the dedup probe, before any slice was planned"
