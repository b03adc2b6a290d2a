"""The timing and counting seam: what the actors count (:class:`Metrics`) and report
(:class:`Observers`): the writer and reader each backend call of a slice, the pipeline each
whole call. With no observer attached a report costs one attribute test.
"""

from __future__ import annotations

import logging
import traceback
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Final, Literal, Protocol, final

from .._results import ActorCrash

__all__ = ("CRASH_HISTORY", "Metrics", "ObservationKind", "Observer", "Observers")

#: Crashes :attr:`Metrics.crashes` keeps, the latest (a server's pipeline lives for months).
CRASH_HISTORY: Final = 1000

log = logging.getLogger("kvpipe.actors")


#: What an observation times: one backend call of a write or read slice (``put_blocks`` /
#: ``get_blocks``), or one whole call of the pipeline, from the call to its outcome.
ObservationKind = Literal["write_slice", "read_slice", "write", "read", "lookup", "locate", "flush"]


class Observer(Protocol):
    """Receives timings from a pipeline, in the event loop's thread, in the middle of its
    work: it must return quickly and must not block (a metrics histogram's ``observe``).

    ``outcome`` is, for a slice, its outcome as counted in ``statistics().slices``
    (``complete``, ``incomplete``, ``slice_timeout``, ``total_timeout``, ``backend_error``;
    a read slice is ``incomplete`` when a block was missing or failed verification); for a
    ``write`` / ``read``, ``complete`` or the result's ``stop_reason``; for ``lookup``,
    ``locate`` and ``flush``, ``ok`` or the error (``timeout``, ``backend_error``,
    ``actor_crashed``); and ``closed`` or ``cancelled`` for a call the pipeline's closing or
    the caller's cancellation ended.
    """

    def __call__(self, kind: ObservationKind, seconds: float, outcome: str) -> None:
        """Record that ``kind`` took ``seconds`` and ended with ``outcome``."""


@final
class Observers:
    """The observers attached to one pipeline.

    An observer that raises is not allowed to break the pipeline: the error is counted in
    ``counters["observer_errors"]`` and the first one is logged with its traceback.

    Args:
        counters: Where errors of observers are counted (the pipeline's counters).
    """

    __slots__ = ("_counters", "active")

    def __init__(self, counters: Counter[str]) -> None:
        self._counters = counters
        #: The observers, in the order they were added; empty when none is attached.
        self.active: tuple[Observer, ...] = ()

    def add(self, observer: Observer) -> None:
        """Attach ``observer`` (attaching one twice reports to it twice)."""
        self.active = (*self.active, observer)

    def remove(self, observer: Observer) -> None:
        """Detach ``observer`` (once); unknown ones are ignored."""
        items = list(self.active)
        if observer in items:
            items.remove(observer)
            self.active = tuple(items)

    def emit(self, kind: ObservationKind, seconds: float, outcome: str) -> None:
        """Report to every observer (callers test :attr:`active` first on hot paths)."""
        for observer in self.active:
            try:
                observer(kind, seconds, outcome)
            except Exception as exc:
                self._counters["observer_errors"] += 1
                if self._counters["observer_errors"] == 1:
                    # As text: a log record holding the error (or the observer) would keep
                    # its traceback's frames and their callers (the pipeline, its store).
                    log.warning(
                        "observer %s raised (further errors are only counted, in "
                        "statistics().counters['observer_errors'])\n%s",
                        repr(observer),
                        "".join(traceback.format_exception(exc)).rstrip(),
                    )


@dataclass
class Metrics:
    """Counters the actors update (in the event loop's thread only)."""

    counters: Counter[str] = field(default_factory=Counter)
    slices: Counter[str] = field(default_factory=Counter)
    restarts: Counter[str] = field(default_factory=Counter)
    crashes: deque[ActorCrash] = field(default_factory=lambda: deque(maxlen=CRASH_HISTORY))
