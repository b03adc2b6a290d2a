"""Copy engines: they execute a copy plan (:mod:`._plan`) between the cache and staging.

:class:`HostEngine` uses numpy on CPU caches; the CUDA engine (:mod:`kvpipe.cuda`) uses kernels
on a stream. Both fill staging in the same block-major layout, so what follows is the same.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, TypeVar, final

import anyio

from ._cache import KVCache
from ._clock import current_time
from ._errors import RequestError
from ._hostcopy import gather, scatter
from ._plan import CopyPlan
from ._staging import StagingLease
from ._workers import INLINE_COPY_BYTES, Lane, NotStarted, ThreadRunner

__all__ = ("CopyEngine", "HostEngine", "OrderMark", "run_copy")

T = TypeVar("T")


async def run_copy(
    runner: ThreadRunner,
    lane: Lane,
    nbytes: int,
    fn: Callable[..., T],
    *args: Any,
    hold: StagingLease,
    start_by: float | None = None,
    uses: object | None = None,
) -> T:
    """``fn(*args)``, host work on ``nbytes`` of staging: inline after one checkpoint when
    small, else in a copy worker thread of ``lane`` (holding ``hold``, and ``uses``, the
    cache it copies out of or into, until it returns: :meth:`ThreadRunner.run`).

    Raises:
        NotStarted: ``start_by`` (event-loop time) passed before the work started, inline
            or in a thread: it never runs (a shielded caller's checkpoint is no cancel point).
    """
    if nbytes <= INLINE_COPY_BYTES:
        await anyio.lowlevel.checkpoint()
        if start_by is not None and current_time() >= start_by:
            raise NotStarted(f"not started by {start_by:.3f}")
        return fn(*args)
    return await runner.run(fn, *args, hold=hold, lane=lane, start_by=start_by, uses=uses)


class OrderMark(abc.ABC):
    """A point in the producer's work that copies must come after (a CUDA event recorded on
    the caller's stream when it called ``write`` or ``read``).

    Reference-counted like a staging lease: the request holds one reference, and each copy
    holds one while it orders itself after the mark. Event-loop thread only.
    """

    @abc.abstractmethod
    def retain(self) -> None:
        """Add a reference.

        Raises:
            RuntimeError: The mark was already released.
        """

    @abc.abstractmethod
    def release(self) -> None:
        """Drop a reference; the last one frees the mark."""


class CopyEngine(abc.ABC):
    """Executes copy plans for one cache and one staging pool.

    Both copy methods return only when the copy has finished (the bytes are in place); a
    caller that must not be interrupted half-way shields the call.
    """

    #: ``"host"`` or ``"cuda"`` (reported by ``statistics().device_path``).
    name: str = "engine"
    #: Why this engine (for logs and statistics).
    note: str = ""

    @abc.abstractmethod
    async def gather(
        self,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None = None,
        *,
        start_by: float | None = None,
    ) -> None:
        """Cache blocks → the lease's staging slots, per ``plan``, after ``after``.

        Args:
            start_by: An event-loop time by which the copy must have started (see
                :meth:`scatter`). For a write's gather, which is of no more use after the
                write's deadline.

        Raises:
            NotStarted: ``start_by`` passed before the copy started (nothing was copied).
        """

    @abc.abstractmethod
    async def scatter(
        self,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None = None,
        *,
        start_by: float | None = None,
    ) -> None:
        """Staging slots → cache blocks, per ``plan``, after ``after``.

        Args:
            start_by: An event-loop time by which the copy must have started: one still
                waiting then (for a copy thread, for device scratch) never starts; one
                started runs to its end. For a read's scatter, which is of no more use
                after the read's deadline.

        Raises:
            NotStarted: ``start_by`` passed before the copy started (nothing was copied).
        """

    def mark(self, stream: int | None) -> OrderMark | None:
        """Record now where the producer's work stands, for copies to wait on (host: ``None``).

        Raises:
            RequestError: ``stream`` was given for a host cache.
        """
        if stream is not None:
            raise RequestError("stream= applies to device caches only; this cache is on the host")
        return None

    def close_by(self, deadline: float) -> None:  # noqa: B027
        """Closing has begun: every wait of this engine (copies too) must end by
        ``deadline`` (event-loop clock); a copy still waiting then raises
        :class:`~kvpipe._errors.AbandonedAtClose`. Default: nothing waits."""

    async def aclose(  # noqa: B027
        self, *, staging_in_use: bool = False, deadline: float | None = None
    ) -> None:
        """Release the engine's resources (default: nothing).

        Args:
            staging_in_use: Something may still use the staging (a worker thread abandoned
                at close): an engine that owns the staging must leave it allocated.
            deadline: When closing must be over (event-loop clock); what has not finished
                by then is abandoned and its memory kept, not freed.
        """


@final
class HostEngine(CopyEngine):
    """numpy copies between a CPU cache and host staging; large ones in worker threads."""

    name = "host"

    def __init__(
        self,
        cache: KVCache,
        runner: ThreadRunner,
        limiter: Lane,
        note: str = "",
    ) -> None:
        self.cache = cache
        self.runner = runner
        self.limiter = limiter
        self.note = note

    async def gather(
        self,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None = None,
        *,
        start_by: float | None = None,
    ) -> None:
        """See :meth:`CopyEngine.gather` (``after`` is always ``None`` for host caches)."""
        rows = self.cache.row_groups(plan.segments)
        await run_copy(
            self.runner,
            self.limiter,
            plan.nbytes,
            gather,
            plan,
            rows,
            lease.pool.buffer,
            hold=lease,
            start_by=start_by,
            uses=self.cache,
        )

    async def scatter(
        self,
        plan: CopyPlan,
        lease: StagingLease,
        after: OrderMark | None = None,
        *,
        start_by: float | None = None,
    ) -> None:
        """See :meth:`CopyEngine.scatter` (a small copy runs at once, on the event loop)."""
        rows = self.cache.row_groups(plan.segments)
        buffer = lease.pool.buffer
        await run_copy(
            self.runner, self.limiter, plan.nbytes, scatter, plan, buffer, rows, hold=lease,
            start_by=start_by, uses=self.cache,
        )  # fmt: skip
