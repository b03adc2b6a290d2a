"""The state of a write: slices stored strictly in order; how it ends and is logged. See
:mod:`._state`."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import anyio

from .._results import SliceOutcome, StopReason, WriteResult
from ._request import SlicedState

__all__ = ("WriteState",)

log = logging.getLogger("kvpipe.requests")


class WriteState(SlicedState):
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
