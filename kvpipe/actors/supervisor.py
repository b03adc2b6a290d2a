"""One-for-one supervision of the pipeline's actors.

Each actor runs under its own loop here. When one crashes (an exception escapes it), the
requests it was handling are failed (never left hanging), and the actor is restarted on the
same inbox. More than ``max_restarts`` crashes of one actor within ``window`` seconds
(measured on the event loop's clock, so a mock clock works) escalate: the supervisor stops
every actor and calls ``on_escalate``, which closes the pipeline.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, final

import anyio

from .._results import ActorCrash
from ._base import Actor, Metrics

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
        self._scope: anyio.CancelScope | None = None
        self.current: dict[str, Actor[Any]] = {}

    async def run(self) -> None:
        """Run every child until the inboxes close, an escalation, or cancellation."""
        async with anyio.create_task_group() as tg:
            self._scope = tg.cancel_scope
            for child in self._children:
                tg.start_soon(self._supervise, child, name=f"kvpipe-{child.name}")

    def stop(self) -> None:
        """Cancel every child."""
        if self._scope is not None:
            self._scope.cancel()

    async def _supervise(self, child: ChildSpec) -> None:
        crashes: deque[float] = deque()
        while True:
            actor = child.factory()
            self.current[child.name] = actor
            try:
                await actor.run()
                return
            except Exception as exc:
                cause = _root_cause(exc)
                held = actor.held_requests()
                now = anyio.current_time()
                crashes.append(now)
                while crashes and crashes[0] < now - self._window:
                    crashes.popleft()
                ids = "; ".join(s.describe() for s in held[:8]) or "none"
                if len(held) > 8:
                    ids += f"; and {len(held) - 8} more"
                escalate = len(crashes) > self._max_restarts
                self._metrics.crashes.append(
                    ActorCrash(
                        child.name,
                        now,
                        tuple(s.request_id for s in held),
                        repr(cause),
                        not escalate,
                    )
                )
                if escalate:
                    log.error(
                        "actor %s crashed %d times within %.0f s (last: %r); closing the "
                        "pipeline; requests it held: %s",
                        child.name,
                        len(crashes),
                        self._window,
                        cause,
                        ids,
                        exc_info=cause,
                    )
                    self._on_escalate(child.name, cause)
                    self.stop()
                    return
                self._metrics.restarts[child.name] += 1
                # Logged before the requests are failed, so the line shows how far each got;
                # each write or read it stops then logs its own WARNING (reason actor_crashed).
                log.warning(
                    "actor %s crashed (%r); restarting (%d of %d allowed within %.0f s); "
                    "failed %d request(s): %s",
                    child.name,
                    cause,
                    len(crashes),
                    self._max_restarts,
                    self._window,
                    len(held),
                    ids,
                    exc_info=cause,
                )
                for state in held:
                    state.crashed(child.name, cause)
