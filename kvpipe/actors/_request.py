"""Request states: the common part of every call, and of writes and reads (their blocks,
keys and slices); how an error is labelled and described. See :mod:`._state`."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal

import anyio
import numpy as np
import numpy.typing as npt

from .._engine import OrderMark
from .._errors import (
    ActorCrashed,
    BackendError,
    KVPipeError,
    OperationTimeout,
    PipelineClosed,
)
from .._keys import BlockKeys, Tokens
from .._plan import SliceSpec

__all__ = ("CallState", "RequestState", "SlicedState", "describe_error", "error_label")

log = logging.getLogger("kvpipe.requests")
IntArray = npt.NDArray[np.int64]


class RequestState:
    """Common part: id, deadline, and the event the caller waits on."""

    kind: ClassVar[str] = "request"

    def __init__(self, request_id: str, deadline: float, started: float) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.started = started
        self.error: BaseException | None = None
        self._done = anyio.Event()
        self._scopes: dict[object, tuple[int, anyio.CancelScope]] = {}

    @property
    def done(self) -> bool:
        """Whether the request has ended."""
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait until the request has ended."""
        await self._done.wait()

    @contextmanager
    def bound(
        self, deadline: float, tag: object = None, first_block: int = 0
    ) -> Iterator[anyio.CancelScope]:
        """A cancel scope that ends at ``deadline`` or when the request ends — or, for a
        read, when loading stops at or before ``first_block``. ``tag`` names it uniquely."""
        scope = anyio.CancelScope(deadline=deadline)
        key = tag if tag is not None else object()
        self._scopes[key] = (first_block, scope)
        if self.done:
            scope.cancel()
        try:
            with scope:
                yield scope
        finally:
            self._scopes.pop(key, None)

    def cancel_scopes(self, from_block: int = 0) -> None:
        """Cancel work in flight on blocks at or after ``from_block``."""
        for first, scope in list(self._scopes.values()):
            if first >= from_block:
                scope.cancel()

    def _end(self) -> None:
        self._done.set()
        self.cancel_scopes()

    def fail(self, error: BaseException) -> None:
        """End the request with an error the caller will see."""
        if not self.done:
            self.error = error
            self._end()

    def crashed(self, actor: str, exc: BaseException) -> None:
        """The actor holding this request crashed."""
        self.fail(ActorCrashed(actor, f"actor {actor!r} crashed: {exc!r}"))

    def describe(self) -> str:
        """The request's id and how far it got, for logs."""
        return f"{self.kind} {self.request_id}"

    def outcome(self) -> str:
        """How the request ended, as a metrics label (see :class:`~kvpipe.actors.Observer`)."""
        return "ok" if self.error is None else error_label(self.error)


class CallState(RequestState):
    """A lookup, locate or flush_index: one value or one error."""

    kind: ClassVar[str] = "call"

    def __init__(
        self,
        request_id: str,
        deadline: float,
        started: float,
        op: Literal["lookup", "locate", "flush"],
        tokens: Tokens,
        include_partial: bool,
        **params: Any,
    ) -> None:
        super().__init__(request_id, deadline, started)
        self.op = op
        self.tokens = tokens
        self.include_partial = include_partial
        self.params = params
        self.keys: BlockKeys | None = None
        self.value: Any = None

    def describe(self) -> str:
        return f"{self.op} {self.request_id}"

    def succeed(self, value: Any) -> None:
        """End the request with a value."""
        if not self.done:
            self.value = value
            self._end()


class SlicedState(RequestState):
    """Common part of writes and reads: the blocks asked for, their keys and slices."""

    def __init__(
        self,
        request_id: str,
        deadline: float,
        started: float,
        tokens: Tokens,
        block_ids: IntArray,
        start_block: int,
        end_block: int,
        include_partial: bool,
    ) -> None:
        super().__init__(request_id, deadline, started)
        self.tokens = tokens
        self.block_ids = block_ids
        self.start_block = start_block
        self.end_block = end_block
        self.include_partial = include_partial
        self.keys: BlockKeys | None = None
        self.slices: tuple[SliceSpec, ...] = ()
        #: Where the producer's device work stood at call time; copies wait for it.
        self.after: OrderMark | None = None

    @property
    def requested(self) -> int:
        """Blocks asked for."""
        return self.end_block - self.start_block


def error_label(exc: BaseException) -> str:
    """A short label for the error a call ended with (metrics ``outcome``)."""
    if isinstance(exc, PipelineClosed):
        return "closed"
    if isinstance(exc, OperationTimeout):
        return "timeout"
    if isinstance(exc, BackendError):
        return "backend_error"
    if isinstance(exc, ActorCrashed):
        return "actor_crashed"
    return "error"


def describe_error(exc: BaseException) -> str:
    """A short description of an error for results and logs."""
    if isinstance(exc, KVPipeError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
