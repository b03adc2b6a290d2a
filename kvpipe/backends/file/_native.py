"""The file store's optional C extension, :mod:`._fileio` (built by ``setup.py`` where a C
compiler is at hand): ``fileio`` is the module, or ``None`` where it was not built."""

from __future__ import annotations

from typing import Any

__all__ = ("fileio",)

fileio: Any
try:
    from . import _fileio as fileio
except ImportError:  # not built: the store reads and writes through Python's os calls
    fileio = None
