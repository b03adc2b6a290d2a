"""Pipeline configuration, validated once at construction (never re-read per call)."""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, final

from ._errors import ConfigError

__all__ = ("PipelineConfig",)

#: FastDeploy's AttentionStore variables, accepted when the KVPIPE_ ones are unset.
_FALLBACK_ENV: Final = {
    "slice_block_num": "AS_WRITE_SLICE_BLOCK_NUM",
    "slice_timeout": "AS_WRITE_SLICE_TIMEOUT",
    "total_timeout": "AS_WRITE_TOTAL_TIMEOUT",
}


def default_copy_threads() -> int:
    """Two copy threads, but no more than the processors this process may run on, less one:
    the event loop's thread keeps a processor to itself (docs/performance.md)."""
    try:
        processors = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        processors = os.cpu_count() or 2
    return max(1, min(2, processors - 1))


_TRUE: Final = {"1", "true", "yes", "on"}
_FALSE: Final = {"0", "false", "no", "off"}


@final
@dataclass(frozen=True, slots=True)
class PipelineConfig:
    """Settings of one pipeline. Invalid values raise :class:`kvpipe.ConfigError`.

    Attributes:
        slice_block_num: Blocks per slice (one backend call each). ``>= 1``.
        slice_timeout: Seconds one slice may take; a slice gets
            ``min(slice_timeout, time left of the request)``.
        total_timeout: Seconds a whole write or read may take, from the call.
        lookup_timeout: Seconds a ``lookup`` / ``locate`` / ``flush_index`` may take.
        staging_bytes: Bytes of host staging memory (the bounded pool every slice borrows
            from). A slice larger than the pool is cut to fit (logged at open). At most the
            machine's physical memory.
        queue_depth: Capacity of every channel between actors.
        copy_threads: Worker threads for gather/scatter copies on the host path. Default:
            2, or 1 where the process may run on 2 processors or fewer (the event loop's
            thread keeps one to itself: :func:`default_copy_threads`).
        io_threads: Worker threads available to backends for blocking I/O.
        worker_nice: How much lower than the event loop's thread kvpipe's worker threads
            (copies, checksums, backend I/O) run: their nice value is raised by this much
            (Linux; 0 to 19, 0: the same priority), so the server's event loop keeps
            answering on a machine with few cores.
        node_id: This node's name in the residency index (``flush_index``): printable,
            without spaces or ``@`` (stores name records ``<key>@<node>``).
        max_restarts: Crashes of one actor tolerated within ``restart_window`` seconds;
            one more closes the pipeline.
        restart_window: The window of ``max_restarts``, in seconds.
        deadline_slack: Seconds past a request's deadline after which the caller stops
            waiting for the actors and takes the result as it stands. A safety net: the
            actors themselves end every slice by the deadline.
        verify_checksums: Write a checksum into every block and verify it on read.
        close_timeout: Seconds ``aclose`` may take: in-flight requests, worker threads, the
            store's unregistering of the staging and the CUDA engine's drain all end by one
            deadline, this long after the close began. Past it, what still runs is abandoned
            (logged) and the memory it may use is kept allocated, never freed under it;
            cleaning up what no longer runs (actors unwinding, staging unregistered from the
            store) gets up to 1 s more.
    """

    slice_block_num: int = 500
    slice_timeout: float = 10.0
    total_timeout: float = 30.0
    lookup_timeout: float = 5.0
    staging_bytes: int = 1 << 30
    queue_depth: int = 64
    copy_threads: int = field(default_factory=default_copy_threads)
    io_threads: int = 8
    worker_nice: int = 10
    node_id: str = field(default_factory=socket.gethostname)
    max_restarts: int = 3
    restart_window: float = 60.0
    deadline_slack: float = 0.25
    verify_checksums: bool = True
    close_timeout: float = 10.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f.name, str(f.type), getattr(self, f.name))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> PipelineConfig:
        """Build a config from ``KVPIPE_<FIELD>`` environment variables.

        ``KVPIPE_SLICE_BLOCK_NUM``, ``KVPIPE_SLICE_TIMEOUT`` and ``KVPIPE_TOTAL_TIMEOUT`` fall
        back to FastDeploy's ``AS_WRITE_SLICE_BLOCK_NUM`` / ``AS_WRITE_SLICE_TIMEOUT`` /
        ``AS_WRITE_TOTAL_TIMEOUT``. Keyword overrides win over the environment: the variables
        of a field given as an override are not read.

        Args:
            environ: The environment to read (default ``os.environ``).
            **overrides: Field values that take precedence.

        Raises:
            ConfigError: A variable does not parse or is out of range; ``field`` names the
                variable.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in overrides:  # not read at all: a bad variable for it fails nothing
                continue
            names = [f"KVPIPE_{f.name.upper()}"]
            if f.name in _FALLBACK_ENV:
                names.append(_FALLBACK_ENV[f.name])
            for name in names:
                raw = env.get(name)
                if raw is None or raw.strip() == "":
                    continue
                values[f.name] = _parse(name, str(f.type), raw.strip())
                # The value alone: a whole config built around it would also check the other
                # fields' defaults (1 GiB of staging against this machine's memory).
                try:
                    _check(f.name, str(f.type), values[f.name])
                except ConfigError as exc:
                    raise ConfigError(name, str(exc).split(": ", 1)[1]) from None
                break
        values.update(overrides)
        return cls(**values)

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _check(name: str, kind: str, value: Any) -> None:
    """Check one field's value (``kind``: its annotation).

    Raises:
        ConfigError: The value is invalid; ``field`` is ``name``.
    """
    if name == "worker_nice":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
            raise ConfigError(name, f"must be an int from 0 to 19, got {value!r}")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(name, f"must be an int >= 1, got {value!r}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(name, f"must be a number, got {value!r}")
        try:
            finite = math.isfinite(value)
        except OverflowError:  # an int too large for a float
            finite = False
        if not finite or value <= 0:
            raise ConfigError(name, f"must be finite and > 0, got {value!r}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be a bool, got {value!r}")
    elif kind == "str" and (not isinstance(value, str) or not value.strip()):
        raise ConfigError(name, f"must be a non-empty string, got {value!r}")
    if name == "node_id" and (
        not value.isprintable() or any(c.isspace() or c == "@" for c in value)
    ):
        raise ConfigError(name, f"must be printable, without spaces or '@', got {value!r}")
    if name == "staging_bytes":
        physical = physical_memory()
        if physical is not None and value > physical:
            raise ConfigError(
                name,
                f"{value} B ({value >> 30} GiB) asked, but this machine has {physical} B "
                f"({physical / 2**30:.1f} GiB) of physical memory",
            )


def physical_memory() -> int | None:
    """Bytes of physical memory of this machine, or ``None`` where the OS does not say."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def _parse(name: str, kind: str, raw: str) -> Any:
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise ConfigError(name, f"{raw!r} is not a valid {kind}") from None
    if kind == "bool":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ConfigError(name, f"{raw!r} is not a boolean (use 1/0, true/false)")
    return raw
