"""The one error hierarchy of kvpipe.

Every error kvpipe raises derives from :class:`KVPipeError`. Errors from vendor clients
(a storage SDK, the CUDA driver) are translated at the boundary of the module that calls
them and chained (``raise BackendError(...) from exc``); they are never swallowed.

::

    KVPipeError
    ├── ConfigError          (also ValueError)  bad PipelineConfig field or env variable
    ├── RequestError         (also ValueError)  bad request, rejected before anything is queued
    ├── LayoutError          (also ValueError)  bad CacheLayout or tensors for it
    ├── PipelineClosed                          the pipeline is closed or has escalated
    ├── IncompleteRead                          read(require_all=True) could not load every block
    ├── OperationTimeout     (also TimeoutError) lookup / locate / flush_index ran out of time
    ├── ActorCrashed                            the actor holding the request crashed
    ├── BackendError                            a storage backend failed a whole call
    ├── DeviceError                             a CUDA driver or NVRTC call failed
    └── Unsupported                             the feature is not available here
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._results import ReadResult

__all__ = (
    "ActorCrashed",
    "BackendError",
    "ConfigError",
    "DeviceError",
    "IncompleteRead",
    "KVPipeError",
    "LayoutError",
    "OperationTimeout",
    "PipelineClosed",
    "RequestError",
    "Unsupported",
    "WrongEventLoop",
)


class KVPipeError(Exception):
    """Root of every error kvpipe raises."""


class ConfigError(KVPipeError, ValueError):
    """A configuration value is invalid.

    Attributes:
        field: The ``PipelineConfig`` field (or environment variable) that was wrong.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class RequestError(KVPipeError, ValueError):
    """A request is malformed; it was rejected before anything was queued."""


class LayoutError(KVPipeError, ValueError):
    """A cache layout, or tensors offered for it, do not match."""


class PipelineClosed(KVPipeError):
    """The pipeline is closed, closing, or has escalated after repeated actor crashes."""


class WrongEventLoop(KVPipeError, RuntimeError):
    """A pipeline was called from another event loop (or thread) than the one it was opened
    on. Its actors run on that loop only: open one pipeline per event loop, or hand the call
    to the pipeline's loop (``anyio.from_thread.run`` with its portal or token). Also raised
    by the synchronous FastDeploy adapters when called from inside a running event loop,
    which their blocking call would stall."""


class IncompleteRead(KVPipeError):
    """``read(require_all=True)`` could not load every requested block.

    Attributes:
        result: The :class:`kvpipe.ReadResult` that says what did load.
        failed_blocks: Block indices that failed (also in ``result.failed_blocks``).
    """

    def __init__(self, message: str, result: ReadResult, failed_blocks: Sequence[int]) -> None:
        super().__init__(message)
        self.result = result
        self.failed_blocks = tuple(failed_blocks)


class OperationTimeout(KVPipeError, TimeoutError):
    """A lookup, locate or flush_index call did not finish within its timeout."""


class ActorCrashed(KVPipeError):
    """The actor that held this request crashed; the actor was restarted.

    Attributes:
        actor: Name of the crashed actor.
    """

    def __init__(self, actor: str, message: str) -> None:
        super().__init__(message)
        self.actor = actor


class BackendError(KVPipeError):
    """A storage backend failed a whole call (as opposed to reporting per-block failures).

    Attributes:
        backend: The backend's name.
        operation: The backend method that failed.
    """

    def __init__(self, backend: str, operation: str, message: str) -> None:
        super().__init__(f"{backend}.{operation}: {message}")
        self.backend = backend
        self.operation = operation


class DeviceError(KVPipeError):
    """A CUDA driver or NVRTC call failed (translated at the boundary of :mod:`kvpipe.cuda`).

    Attributes:
        call: The driver function that failed (``"cuMemAlloc"``, ``"nvrtcCompileProgram"``).
        code: The vendor's error name (``"CUDA_ERROR_OUT_OF_MEMORY"``), or ``""``.
    """

    def __init__(self, call: str, code: str, message: str = "") -> None:
        detail = f": {message}" if message else ""
        super().__init__(f"{call} failed: {code or 'error'}{detail}")
        self.call = call
        self.code = code


class AbandonedAtClose(DeviceError):
    """A device copy's wait ended at the close deadline
    (:meth:`~kvpipe._engine.CopyEngine.close_by`), not by a failure: the copy never started,
    or still runs on the device, which may still write its staging slots (then retired) or,
    a scatter, the caller's cache. No actor crashes on it: its request is left to the close,
    which fails it (``PipelineClosed``) at that deadline, as every request it cuts off; the
    engine logs a copy it leaves running. Internal (not exported): a caller of the engine
    sees a :class:`DeviceError`."""


class Unsupported(KVPipeError):
    """The requested feature is not available here (no driver, no package, no device)."""
