"""Pinned host memory under an exact byte budget.

A :class:`PinnedBuffer` is one ``cuMemHostAlloc(PORTABLE | DEVICEMAP)`` of exactly the bytes
asked for (no rounding), seen by numpy without a copy and by kernels through its mapped device
address, and freed exactly once. The engine's staging and :func:`kvpipe.create_host_cache` use
it.
"""

from __future__ import annotations

import ctypes
import logging
from typing import final

import numpy as np
import numpy.typing as npt

from ._driver import Driver

__all__ = ("PinnedBuffer",)

log = logging.getLogger("kvpipe.cuda")
Bytes = npt.NDArray[np.uint8]


@final
class PinnedBuffer:
    """Exactly ``nbytes`` of pinned, device-mapped host memory.

    Args:
        driver: An opened driver.
        nbytes: Bytes to allocate (> 0).
        budget: When given, ``nbytes`` must not exceed it.
        mapped: Also look up the device address (kernels write/read it directly).

    Raises:
        ValueError: ``nbytes`` is not positive or exceeds ``budget``.
        DeviceError: The allocation failed.
    """

    def __init__(
        self, driver: Driver, nbytes: int, *, budget: int | None = None, mapped: bool = True
    ) -> None:
        if nbytes < 1:
            raise ValueError(f"pinned allocation of {nbytes} bytes")
        if budget is not None and nbytes > budget:
            raise ValueError(f"pinned allocation of {nbytes} B exceeds its budget of {budget} B")
        self._driver = driver
        self.budget = budget
        self.host_ptr = driver.host_alloc(nbytes)
        self.allocated_bytes = nbytes
        self.device_ptr: int | None = None
        self._freed = False
        if mapped:
            try:
                self.device_ptr = driver.host_device_pointer(self.host_ptr)
            except BaseException:
                self.free()
                raise

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has run."""
        return self._freed

    def array(self, shape: tuple[int, ...] | None = None) -> Bytes:
        """A ``uint8`` numpy view of the whole buffer (optionally reshaped); valid until
        :meth:`free`.

        Raises:
            RuntimeError: The buffer was freed.
            ValueError: ``shape`` does not cover exactly ``allocated_bytes``.
        """
        if self._freed:
            raise RuntimeError("pinned buffer already freed")
        raw = (ctypes.c_uint8 * self.allocated_bytes).from_address(self.host_ptr)
        arr: Bytes = np.ctypeslib.as_array(raw)
        return arr if shape is None else arr.reshape(shape)

    def free(self) -> None:
        """Free the memory (idempotent). Views from :meth:`array` must not be used after."""
        if self._freed:
            return
        self._freed = True
        self._driver.host_free(self.host_ptr)

    def __repr__(self) -> str:
        state = "freed" if self._freed else "live"
        return f"PinnedBuffer({self.allocated_bytes} B, {state})"
