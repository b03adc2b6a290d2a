"""The file store's optional C extension, :mod:`._fileio` (built by ``setup.py`` where a C
compiler is at hand): ``fileio`` is the module, or ``None`` where it was not built; and what
the code calling it shares."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from typing import Any, Final

from ._format import block_location

__all__ = ("block_paths", "errno_text", "fileio")

fileio: Any
try:
    from . import _fileio as fileio
except ImportError:  # not built: the store reads and writes through Python's os calls
    fileio = None

_WHY: Final = {errno.ELOOP: "crosses a symbolic link", errno.EXDEV: "leaves the store"}


def block_paths(keys: Iterable[str]) -> list[bytes]:
    """Each key's block file, relative to the store's root, as the extension takes it."""
    return [os.path.join(*parts, name).encode() for parts, name in map(block_location, keys)]


def errno_text(err: int) -> str:
    """What an error number the extension answered means for a block file."""
    return _WHY.get(err, os.strerror(err))
