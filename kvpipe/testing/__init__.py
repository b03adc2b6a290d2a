"""Test support for kvpipe and for users' own backends.

- :class:`BackendConformance`: the conformance suite every backend passes (needs pytest,
  imported only when it is asked for, so the CLI's fault scenarios work without it).
- :class:`Batches`: real put and get batches over real staging, as the pipeline builds them.
- :class:`FaultyStore` and :class:`FaultPlan`: the fault injector behind ``kvpipe faults``
  (``docs/reliability.md``), to run over your own backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .batches import Batches
    from .conformance import BackendConformance
    from .faults import FaultPlan, FaultyStore

__all__ = ("BackendConformance", "Batches", "FaultPlan", "FaultyStore")

_HOMES = {
    "BackendConformance": "conformance",
    "Batches": "batches",
    "FaultPlan": "faults",
    "FaultyStore": "faults",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
