"""Waits that no cancellation cuts short, asyncio's own included.

anyio's shielded cancel scope keeps out anyio's cancellation, and trio's; on asyncio it cannot
keep out the task's own (``Task.cancel``: ``asyncio.timeout``, ``asyncio.wait_for``, a server
cancelling a request's handler when its client disconnects), which is thrown into the task
wherever it waits, shielded or not. :func:`shielded` waits on through it and says what it
received, for its caller to raise once what had to finish has finished.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import anyio

__all__ = ("DeferredCancel", "shielded")


class DeferredCancel:
    """A cancellation received during :func:`shielded` waits, to be raised after them.

    Only the message is kept, not the exception: its traceback holds the frames it passed
    (and what they hold) in a cycle with the local that would keep it.
    """

    __slots__ = ("args",)

    def __init__(self) -> None:
        #: The first one's arguments (its message); ``None``: none was received.
        self.args: tuple[object, ...] | None = None

    def raise_if_received(self) -> None:
        """Raise the cancellation received, if any (the event loop's own class).

        Raises:
            BaseException: The cancellation received.
        """
        if self.args is not None:
            args, self.args = self.args, None
            raise anyio.get_cancelled_exc_class()(*args)


async def shielded(
    wait: Callable[[], Awaitable[object]],
    deadline: float = math.inf,
    deferred: DeferredCancel | None = None,
) -> bool:
    """Await ``wait()`` until it returns or ``deadline`` passes, whatever cancels the task
    meanwhile. A cancellation that gets through anyio's shield (asyncio's own) is recorded in
    ``deferred``, and the wait starts again (``wait`` must allow that: an event's wait).

    Returns:
        Whether ``wait()`` returned (``False``: the deadline passed first).
    """
    while True:
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_at(deadline) as scope:
                await wait()
            return not scope.cancelled_caught
        except anyio.get_cancelled_exc_class() as exc:
            if deferred is not None and deferred.args is None:
                deferred.args = exc.args
