"""The state of a read: slices fetched concurrently, only the leading verified run
counts; how it ends and is logged. See :mod:`._state`."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import anyio

from .._plan import SliceSpec
from .._results import ReadResult, ReadStopReason
from ._request import SlicedState

__all__ = ("ReadState",)

log = logging.getLogger("kvpipe.requests")


class ReadState(SlicedState):
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
