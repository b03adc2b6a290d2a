"""Staging registered with a store, never freed while the store may still use it.

A store (Mooncake's transfer engine) may read and write registered memory until it is
unregistered. So a registration whose call was cancelled counts as made (the vendor call may
still complete), and staging whose unregistration failed, did not end by the deadline, or
that a call abandoned at close may still use, is kept alive in :data:`KEPT` for the rest of
the process: a leak, logged, rather than memory freed under the store. A store that keeps the
default ``register_staging`` and ``unregister_staging`` registers nothing: its staging is
never kept (an abandoned call's thread holds what it uses until it returns).
"""

from __future__ import annotations

import logging
from typing import final

import anyio

from ._base import StorageBackend

__all__ = ("KEPT", "Registrations")

log = logging.getLogger("kvpipe.backends")

#: Staging that may still be registered with (or used by) a store: kept alive for good.
KEPT: list[memoryview] = []


@final
class Registrations:
    """The staging buffers one owner (a pipeline, a :class:`ValueClient`) registered with
    ``store``."""

    __slots__ = ("_buffers", "_registers", "kept", "store")

    def __init__(self, store: StorageBackend) -> None:
        self.store = store
        #: Whether the store registers memory at all (it overrides ``register_staging`` or
        #: ``unregister_staging``): staging a store never registered is freed by reference
        #: counting once nothing uses it, an abandoned call's thread included; never kept.
        kind = type(store)
        self._registers = (
            kind.register_staging is not StorageBackend.register_staging
            or kind.unregister_staging is not StorageBackend.unregister_staging
        )
        self._buffers: list[memoryview] = []
        #: Whether any buffer was kept alive instead of unregistered (its memory must not be
        #: freed by its owner either).
        self.kept = False

    async def add(self, buffer: memoryview) -> None:
        """Register ``buffer`` with the store (nothing to do for a store that keeps the default
        ``register_staging`` and ``unregister_staging``: it registers nothing).

        Raises:
            Exception: Whatever the store raised: nothing was registered.

        Cancellation: the buffer counts as registered (the store's call may still complete),
        so it is unregistered, or kept, at :meth:`aclose`.
        """
        if not self._registers:
            return  # nothing to unregister, nothing to keep
        self._buffers.append(buffer)
        try:
            await self.store.register_staging(buffer)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException:
            self._buffers.remove(buffer)
            raise

    def keep(self, why: str) -> None:
        """Keep every buffer alive for good, registered: a call abandoned at close (``why``)
        may still use it."""
        if self._buffers:
            KEPT.extend(self._buffers)
            self._buffers = []
            self.kept = True
            log.error("staging stays registered with %s and allocated: %s", self.store.name, why)

    async def aclose(self, deadline: float) -> None:
        """Unregister every buffer by ``deadline``; one the store failed to unregister, or
        all that remain at the deadline, are kept (:meth:`keep`).

        Cancellation: shielded; the deadline bounds it. A cancellation that gets through the
        shield (asyncio's own, ``Task.cancel``) keeps the buffers not unregistered yet, as the
        deadline does, and is raised.
        """
        buffers, self._buffers = self._buffers, []
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_at(deadline) as bound:
                while buffers:
                    try:
                        await self.store.unregister_staging(buffers[0])
                    except Exception as exc:
                        KEPT.append(buffers[0])
                        self.kept = True
                        log.warning(
                            "unregistering staging from %s failed (the staging memory is "
                            "kept, not freed): %s",
                            self.store.name,
                            repr(exc),
                        )
                    del buffers[0]
        except BaseException:  # cut short: what may still be registered is never freed
            self._buffers = buffers
            self.keep("unregistering staging was cancelled")
            raise
        if bound.cancelled_caught:
            self._buffers = buffers
            self.keep("unregistering staging did not end by the close deadline")
