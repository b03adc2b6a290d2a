"""The vendor ``setup`` of :class:`kvpipe.MooncakeStore`'s client, run once at a time.

With a metadata server that accepts connections and never answers, the vendor's ``setup``
blocks for about 90 s. A caller that gives up on it (its deadline) leaves it running, so
every ``open`` waits for the one running rather than start another (one more thread and
client, and later a mounted segment, per caller that gave up); and a client whose setup
ends after the store closed is closed, not left with its segment mounted. Uses the vendor
client it is handed, never imports the vendor package.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Final, final

import anyio
import anyio.lowlevel

from .._workers import _call_soon

__all__ = ("PENDING", "Setup")

log = logging.getLogger("kvpipe.mooncake")

#: :attr:`Setup.result` while the vendor call runs.
PENDING: Final = object()


@final
class Setup:
    """One ``client.setup(*args)``: :meth:`run` it in a worker thread, then wait for
    :attr:`done` on the event loop that created it (by :attr:`deadline`).

    Args:
        client: The vendor client to set up.
        args: ``setup``'s arguments.
        deadline: Event-loop time by which an ``open`` stops waiting for it.
    """

    def __init__(self, client: Any, args: tuple[Any, ...], deadline: float) -> None:
        self.client = client
        self.deadline = deadline
        #: Set (on the event loop) once :attr:`result` is known.
        self.done = anyio.Event()
        #: What ``setup`` returned (an int), the exception it raised, or :data:`PENDING`.
        self.result: object = PENDING
        self._args = args
        self._token = anyio.lowlevel.current_token()
        self._lock = threading.Lock()
        self._orphaned = False

    def run(self) -> None:
        """Call ``setup`` (worker thread only); never raises."""
        try:
            result: object = int(self.client.setup(*self._args))
        except Exception as exc:
            result = exc
        with self._lock:
            self.result = result
            close = self._orphaned and result == 0
        if close:  # the store closed meanwhile: nothing else will close this client
            try:
                answer: object = int(self.client.close())
            except Exception as exc:
                answer = repr(exc)
            if answer != 0:  # nobody to raise to: its segment may still be mounted
                log.error(
                    "mooncake: closing a client set up after its store closed returned %s",
                    answer,
                )
        try:
            _call_soon(self._token, self.done.set)
        except Exception as exc:  # the event loop is gone: nobody waits
            log.debug("mooncake: setup ended after its event loop: %s", repr(exc))

    def orphan(self) -> bool:
        """The store closes without taking the client: the thread closes it if its setup
        succeeds from now on.

        Returns:
            Whether the setup had already succeeded: the caller must close the client.
        """
        with self._lock:
            self._orphaned = True
            return self.result == 0
