"""Per-request state shared by the actors of one event loop, and how each request ends.

A state ends exactly once (first outcome wins). After it has ended no actor sends anything of
it to the store, and — for reads — nothing touches the caller's cache any more.

Because every write and read ends here, this is also where a request that stopped short is
logged, once, whatever stopped it: at WARNING with its id, the slice it stopped at, the
blocks stored or loaded and the reason (at INFO when the caller cancelled it; at DEBUG for a
read that simply found no more blocks stored, or whose failed block the reader has logged).
"""

from __future__ import annotations

from ._read_state import ReadState
from ._request import CallState, RequestState, SlicedState, describe_error, error_label
from ._write_state import WriteState

__all__ = (
    "CallState",
    "ReadState",
    "RequestState",
    "SlicedState",
    "WriteState",
    "describe_error",
    "error_label",
)
