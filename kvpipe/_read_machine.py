"""The state machine of one read: events in, decisions out — no event loop, no I/O, and
time only as an input (``now``). Slices are fetched concurrently, but only the leading run of
verified blocks counts. It alone knows a read's invariants:

- **Leading run.** ``loaded`` is the leading run of fully loaded slices plus the loaded head
  of the first short one; nothing at or past the point where loading stopped
  (:meth:`ReadMachine.stop_at`) is fetched or scattered any more.
- **Nothing scattered after an abort.** Once the read is aborted (deadline, cancellation,
  crash, closing) :meth:`~ReadMachine.scatter_begin` refuses; scatters already running finish
  first, and only then is the read settled — so when the caller gets its result nothing
  writes into its cache any more.
- **Settled exactly once.** Every planned slice is resolved once; the result (or the error)
  is set once and never changes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple, final

from ._plan import SliceSpec, leading
from ._results import ReadResult, ReadStopReason
from ._write_machine import Ending, RequestMachine
from .backends._base import BlockStatus

__all__ = ("FetchedSlice", "ReadMachine", "ShortSlice", "fetch_failure")


def fetch_failure(index: int, error: str | None, total: bool) -> tuple[ReadStopReason, str]:
    """Why slice ``index``'s fetch brought nothing, and its detail: the ``error`` the store
    raised, else (none) it ran out of time — the read's whole time when ``total``."""
    if error is not None:
        return "backend_error", error
    return "total_timeout" if total else "slice_timeout", f"slice {index} ran out of time"


class ShortSlice(NamedTuple):
    """Where a fetched slice stops short, and why (:meth:`FetchedSlice.short`)."""

    #: The first block not loaded: loading stops there.
    block: int
    #: Why, in words.
    why: str
    #: For the log limiter: ``verify``, or the block's status.
    kind: str
    #: The block was gone since the probe (evicted meanwhile): no failure, but as one the
    #: probe found missing (``not_stored``).
    gone: bool
    #: The slice's blocks that failed, sorted.
    failed: list[int]

    @property
    def detail(self) -> str:
        """Where and why, for the result."""
        return f"block {self.block}: {self.why}"


@final
class FetchedSlice:
    """A fetched slice from block ``first``: the store's ``statuses`` (one per block), the
    ``checks`` of its leading fetched blocks (``None``: sound), and what follows from them."""

    __slots__ = ("checks", "confirmed", "failed_checks", "first", "statuses", "valid")

    def __init__(self, first: int, statuses: list[BlockStatus], checks: list[str | None]) -> None:
        self.first = first
        self.statuses = statuses
        self.checks = checks
        #: Leading blocks fetched and sound.
        self.valid = leading(checks, None)
        #: Every block that failed a check, also one that passes when fetched again (damaged
        #: on its way from the store): what ``blocks_failed_verify`` counts, once per block.
        self.failed_checks = (
            {i for i, c in enumerate(checks) if c is not None}
            if self.valid < len(checks)
            else set()
        )
        #: Blocks that failed their check twice: to delete from the store.
        self.confirmed: set[int] = set()

    @property
    def fetched(self) -> int:
        """Leading blocks fetched (and checked)."""
        return len(self.checks)

    def refetch_from(self) -> int | None:
        """The first block fetched that failed its check: it and the rest of those fetched
        are fetched once more (``None``: none failed)."""
        bad = self.valid
        return bad if bad < self.fetched else None

    def refetched(self, lo: int, again: list[BlockStatus], checks: list[str | None]) -> None:
        """Blocks from ``lo`` were fetched again (``again``), their leading ones checked."""
        failed_again = {lo + i for i, c in enumerate(checks) if c is not None}
        self.confirmed = {i for i in failed_again if self.checks[i] is not None}
        self.failed_checks |= failed_again
        self.statuses[lo : self.fetched] = again
        self.checks = self.checks[:lo] + checks
        self.valid = leading(self.checks, None)

    def corrupt(self, keys: Sequence[str]) -> list[tuple[int, str]]:
        """The blocks (index, key) that failed their check twice, of the slice's ``keys``."""
        return [(self.first + i, keys[i]) for i in sorted(self.confirmed)]

    def short(self) -> ShortSlice | None:
        """Where loading stops in the slice (``None``: every block is sound)."""
        valid, fetched, statuses = self.valid, self.fetched, self.statuses
        if valid == len(statuses):
            return None
        failed = {i for i, s in enumerate(statuses) if s is not BlockStatus.OK}
        failed.update(i for i, c in enumerate(self.checks) if c is not None)
        if valid < fetched:
            why = self.checks[valid]
            assert why is not None
            kind, gone = "verify", False
        else:
            why = kind = statuses[valid].value
            gone = statuses[valid] is BlockStatus.MISSING
        first = self.first
        return ShortSlice(first + valid, why, kind, gone, sorted(first + i for i in failed))


@final
class ReadMachine(RequestMachine[ReadResult]):
    """One read (see the module docstring); :attr:`ended` once settled."""

    __slots__ = (
        "_ending",
        "_error",
        "aborted",
        "failed",
        "loaded_per_slice",
        "pending",
        "scatters",
        "stop_block",
        "stop_detail",
        "stop_reason",
    )

    def __init__(self, request_id: str, start_block: int, end_block: int, started: float) -> None:
        super().__init__(request_id, start_block, end_block, started)
        self.stop_block: int | None = None
        self.stop_reason: ReadStopReason | None = None
        self.stop_detail: str | None = None
        self.failed: set[int] = set()
        self.loaded_per_slice: dict[int, int] = {}
        self.pending: set[int] = set()
        #: No new scatter may start (deadline, cancellation, crash or closing).
        self.aborted = False
        self._error: BaseException | None = None
        self._ending: tuple[Ending, str | None] | None = None
        #: Scatters into the caller's cache running now.
        self.scatters = 0

    # -- decisions ---------------------------------------------------------------------------

    def stopped_before(self, block: int) -> bool:
        """Whether ``block`` is at or past where loading stopped (or the read ended)."""
        return (
            self.aborted or self.ended or (self.stop_block is not None and block >= self.stop_block)
        )

    def loadable(self, first: int, count: int) -> int:
        """How many of the ``count`` blocks from ``first`` lie before where loading stopped
        (all of them while it has not): the most a scatter of them may copy."""
        stop = self.stop_block
        return count if stop is None else max(0, min(count, stop - first))

    # -- events ------------------------------------------------------------------------------

    def plan(self, slices: tuple[SliceSpec, ...], now: float) -> None:
        """Set the slices; each must later be resolved exactly once. None: settle now."""
        if self.ended:
            return
        self.slices = slices
        self.pending = {s.index for s in slices}
        if not slices:
            self._settle(now)

    def stop_at(
        self,
        block: int,
        reason: ReadStopReason,
        failed: Iterable[int] = (),
        detail: str | None = None,
    ) -> int | None:
        """Loading cannot go past ``block``. Returns the block from which work in flight is
        to be cancelled (``None``: loading had already stopped at or before it)."""
        self.failed.update(failed)
        if self.stop_block is not None and block >= self.stop_block:
            return None
        self.stop_block = block
        self.stop_reason = reason
        self.stop_detail = detail
        return block

    def resolve(self, index: int, loaded: int, now: float) -> None:
        """Slice ``index`` is settled with ``loaded`` leading blocks in the cache (a second
        resolution of the same slice is ignored). The read settles when no slice is pending
        and no scatter is running."""
        if index not in self.pending:
            return
        spec = next(s for s in self.slices if s.index == index)
        if not 0 <= loaded <= spec.count:
            raise ValueError(f"slice {index}: loaded {loaded} of {spec.count}")
        self.pending.discard(index)
        self.loaded_per_slice[index] = loaded
        if not self.pending and self.scatters == 0:
            self._settle(now)

    def scatter_begin(self) -> bool:
        """Claim the right to write into the caller's cache; ``False`` once aborted."""
        if self.aborted or self.ended:
            return False
        self.scatters += 1
        return True

    def scatter_end(self, now: float) -> None:
        """A scatter claimed by :meth:`scatter_begin` has finished."""
        if self.scatters <= 0:
            raise ValueError("scatter_end without scatter_begin")
        self.scatters -= 1
        if self.scatters == 0 and (self.aborted or not self.pending):
            self._settle(now)

    def end(self, cause: Ending, detail: str | None, now: float) -> None:
        """Abort now: no new scatter starts; settled once the running ones have finished."""
        if self.ended or self.aborted:
            return
        self.aborted = True
        self._ending = (cause, detail)
        if self.scatters == 0:
            self._settle(now)

    def fail(self, error: BaseException, now: float) -> None:
        """Abort with an error the caller sees instead of a result (the pipeline closing);
        ignored once the read has ended or been aborted (the first ending wins)."""
        if self.ended or self.aborted:
            return
        self.aborted = True
        self._error = error
        if self.scatters == 0:
            self._settle(now)

    # -- the result ----------------------------------------------------------------------------

    def loaded(self) -> int:
        """Blocks loaded so far, as a leading run."""
        loaded = 0
        for s in self.slices:
            got = self.loaded_per_slice.get(s.index, 0)
            loaded += got
            if got < s.count:
                break
        return loaded

    def _settle(self, now: float) -> None:
        if self.ended:
            return
        if self._error is not None:
            self.error = self._error
            return
        loaded = self.loaded()
        complete = loaded == self.requested  # an abort as the last blocks landed cut nothing
        failed: set[int] = set()
        if not complete:
            first_missing = self.start_block + loaded
            failed.update(self.failed)
            if self._ending is not None and (
                self.stop_block is None or first_missing < self.stop_block
            ):  # the abort, not a stop recorded further on, is what ended loading
                self.stop_reason, self.stop_detail = self._ending
                failed.add(first_missing)
            self.stop_reason = self.stop_reason or "failed_block"
            if not any(b >= first_missing for b in failed):
                failed.add(first_missing)
        self.result = ReadResult(
            request_id=self.request_id,
            requested=self.requested,
            loaded=loaded,
            complete=complete,
            failed_blocks=tuple(sorted(b for b in failed if b >= self.start_block)),
            stop_reason=None if complete else self.stop_reason,
            elapsed=now - self.started,
            error=None if complete else self.stop_detail,
        )

    def where_stopped(self) -> str:
        """Where an incomplete read stopped, in words (for logs)."""
        at = self.start_block + self.loaded()
        return next(
            (
                f"slice {s.index} (blocks {s.first_block}-{s.end_block - 1})"
                for s in self.slices
                if s.first_block <= at < s.end_block
            ),
            "the probe, before any slice was planned",
        )
