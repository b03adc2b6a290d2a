"""Test support for kvpipe and for users' own backends.

- :class:`BackendConformance`: the conformance suite every backend passes (needs pytest,
  imported only when it is asked for, so the CLI's fault scenarios work without it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .conformance import BackendConformance, Batches

__all__ = ("BackendConformance", "Batches")


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
