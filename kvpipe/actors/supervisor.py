"""One-for-one supervision of the pipeline's actors.

When an actor crashes, the requests it was handling are failed and it is restarted on the same
inbox. More than ``max_restarts`` crashes of one actor within ``window`` seconds (on the event
loop's clock) escalate: that actor is not restarted, and ``on_escalate`` closes the pipeline.
Once the pipeline has closed (:meth:`Supervisor.close`: its requests failed, its inboxes
closed), an actor that crashes is not restarted and escalates nothing: what waits in its
inbox is let go of instead of handled.

Stopping is not cancelling: once the inboxes are closed, every actor leaves its loop when its
inbox is empty and :meth:`Supervisor.run` returns normally (an actor task ending cancelled
would hold its frames, and staging, in a reference cycle); cancelling the scope it runs in
(``Runtime.cancel_actors``) is the fallback at the close deadline. When :meth:`Supervisor.run`
returns, the supervisor lets go of its actors and callback.
"""

from __future__ import annotations

import logging
import math
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, final

import anyio

from .._results import ActorCrash
from ._base import Actor, SliceJob, task
from ._observe import Metrics

__all__ = ("ChildSpec", "Supervisor")

log = logging.getLogger("kvpipe.supervisor")


@final
@dataclass(frozen=True, slots=True)
class ChildSpec:
    """How to (re)start one actor."""

    name: str
    factory: Callable[[], Actor[Any]]


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _split_crash(exc: BaseException) -> tuple[Exception | None, BaseException | None]:
    """What ended an actor: its errors (a crash; ``None``: none) and the rest (its
    cancellation; ``None``: none), split out of the group its task group raised."""
    if isinstance(exc, Exception):
        return exc, None
    if not isinstance(exc, BaseExceptionGroup):
        return None, exc
    return exc.split(Exception)


def _cancelled_here() -> bool:
    """Whether the calling task's cancel scopes have been cancelled (the actors', at the
    close deadline)."""
    return anyio.current_effective_deadline() == -math.inf


def _forget_frames(exc: BaseException | None, seen: set[int] | None = None) -> None:
    """Clear the locals of every finished frame in ``exc``'s tracebacks (its group members,
    causes and contexts too), so a kept exception holds no actor, request or staging."""
    seen = set() if seen is None else seen
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                _forget_frames(inner, seen)
        _forget_frames(exc.__cause__, seen)
        exc = exc.__context__


def _ignore_escalation(actor: str, exc: BaseException) -> None:
    """The escalation callback after the supervisor has stopped."""


@final
class Supervisor:
    """Runs and restarts actors (see the module docstring)."""

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        max_restarts: int,
        window: float,
        metrics: Metrics,
        on_escalate: Callable[[str, BaseException], None],
    ) -> None:
        self._children = tuple(children)
        self._max_restarts = max_restarts
        self._window = window
        self._metrics = metrics
        self._on_escalate = on_escalate
        self._stopped = anyio.Event()
        self._closed = False
        self._live: dict[str, Actor[Any]] = {}  # the actor of each child, while it runs

    async def run(self) -> None:
        """Run every child until its inbox is closed and drained (or an escalation, or a
        cancellation); then let go of the actors and the callback."""
        try:
            async with anyio.create_task_group() as tg:
                for child in self._children:
                    # Through task(): one cancelled at the close deadline lets go of its
                    # frames (its child's factory holds the actors' context).
                    tg.start_soon(task, self._supervise, child, name=f"kvpipe-{child.name}")
        finally:
            self._children = ()
            self._live.clear()
            self._on_escalate = _ignore_escalation
            self._stopped.set()

    def close(self) -> None:
        """The pipeline has closed (its requests failed, its inboxes closed): the actors only
        drain their inboxes now, and one that crashes is not restarted."""
        self._closed = True

    @property
    def stopped(self) -> bool:
        """Whether :meth:`run` has returned."""
        return self._stopped.is_set()

    async def wait_stopped(self) -> None:
        """Wait until :meth:`run` has returned."""
        await self._stopped.wait()

    def holding(self) -> str:
        """The actors that hold requests now and what they hold, for logs (``""``: none)."""
        parts = []
        for name, actor in self._live.items():
            held = [s.describe() for s in actor.held_requests()]
            if held:
                more = f"; and {len(held) - 4} more" if len(held) > 4 else ""
                parts.append(f"{name} ({'; '.join(held[:4])}{more})")
        return ", ".join(parts)

    async def _supervise(self, child: ChildSpec) -> None:
        crashes: deque[float] = deque()
        while True:
            actor = self._live[child.name] = child.factory()
            ended: BaseException | None = None
            try:
                await actor.run()
                return
            except BaseException as exc:
                # An actor cancelled (at the close deadline) as one of its tasks fails ends
                # in a group of both: a crash all the same, and the cancellation goes on.
                error, ended = _split_crash(exc)
                if error is None:
                    raise
                # On asyncio anyio's task group leaves a task that ended cancelled out of the
                # group: the cancellation shows in the scope the actors run in, not in it.
                cancelled = ended is not None or _cancelled_here()
                stop = self._on_crash(child, actor, error, crashes, restart=not cancelled)
                del error
                if stop and self._closed:  # not restarted: nothing drains its inbox but this
                    _let_go_of_inbox(actor)
                if (stop or cancelled) and ended is None:
                    return
            finally:
                self._live.pop(child.name, None)
                del actor
            if ended is not None:  # raised here: not in a chain with the actor's error
                try:
                    raise ended
                finally:
                    ended = None

    def _on_crash(
        self,
        child: ChildSpec,
        actor: Actor[Any],
        exc: BaseException,
        crashes: deque[float],
        *,
        restart: bool = True,
    ) -> bool:
        """Record, log and fail what the crashed actor held; ``True`` to stop (escalated, or
        the pipeline has closed). ``restart=False``: the actor was cancelled as it crashed,
        and is not restarted."""
        cause = _root_cause(exc)
        held = actor.held_requests()
        now = anyio.current_time()
        crashes.append(now)
        # Each crash's age compared with the window, not its time with ``now - window``: the
        # age of a recent crash is exact (its clock readings are close), that bound rounded.
        while crashes and now - crashes[0] > self._window:
            crashes.popleft()
        ids = "; ".join(s.describe() for s in held[:8]) or "none"
        if len(held) > 8:
            ids += f"; and {len(held) - 8} more"
        cancelled = not restart
        closed = self._closed  # nothing needs the actor: no restart, nothing to escalate
        escalate = not closed and len(crashes) > self._max_restarts
        restart = restart and not escalate and not closed
        self._metrics.crashes.append(
            ActorCrash(child.name, now, tuple(s.request_id for s in held), repr(cause), restart)
        )
        # As text: a log record holding the exception would keep its frames.
        trace = "".join(traceback.format_exception(cause)).rstrip()
        if escalate:
            log.error(
                "actor %s crashed %d times within %.0f s (last: %r); closing the pipeline; "
                "requests it held: %s\n%s",
                child.name,
                len(crashes),
                self._window,
                cause,
                ids,
                trace,
            )
            self._on_escalate(child.name, cause)  # fails every request: the pipeline closed
        else:
            # Logged before the requests are failed, so the line shows how far each got.
            if restart:
                self._metrics.restarts[child.name] += 1
                allowed = f"{len(crashes)} of {self._max_restarts} allowed"
                how, fate = f"; restarting ({allowed} within {self._window:.0f} s)", "failed"
            elif cancelled:
                how, fate = " as it was cancelled at the close deadline; not restarted", "failed"
            else:
                how = " after the pipeline closed; not restarted"
                fate = "held (failed by the close)"
            log.warning(
                "actor %s crashed (%r)%s; %s %d request(s): %s\n%s",
                child.name,
                cause,
                how,
                fate,
                len(held),
                ids,
                trace,
            )
            why = f"actor {child.name!r} crashed: {cause!r}"
            for state in held:
                state.end("actor_crashed", why, actor=child.name)
        _forget_frames(exc)
        return escalate or closed


def _let_go_of_inbox(actor: Actor[Any]) -> None:
    """Let go of what waits in the inbox of ``actor``, which is not restarted: each message
    taken as its loop takes it (a withdrawn job is its sender's), then discarded."""
    while True:
        try:
            msg = actor.inbox.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
            return
        if isinstance(msg, SliceJob) and (not msg.take() or msg.lease.released):
            continue
        actor.discard(msg)
