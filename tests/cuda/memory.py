"""A minimal :class:`kvpipe.cuda._kernels.Memory` over numpy regions, for pure kernel tests."""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

Bytes = npt.NDArray[np.uint8]


class RegionMemory:
    """Named regions at fake addresses; every access must stay inside one region."""

    def __init__(self) -> None:
        self._regions: list[tuple[int, Bytes]] = []
        self._next = 0x1000_0000

    def add(self, data: Bytes) -> int:
        """Map ``data`` (kept by reference) at a new address; returns the address."""
        address = self._next
        self._next += -(-max(len(data), 1) // 4096) * 4096 + 4096
        bisect.insort(self._regions, (address, data), key=lambda t: t[0])
        return address

    def _locate(self, address: int, nbytes: int) -> tuple[Bytes, int]:
        i = bisect.bisect_right(self._regions, address, key=lambda t: t[0]) - 1
        if i < 0:
            raise AssertionError(f"access at {address:#x} before any region")
        start, data = self._regions[i]
        off = address - start
        if off + nbytes > len(data):
            raise AssertionError(f"{nbytes} B at {address:#x} overrun a {len(data)} B region")
        return data, off

    def read(self, address: int, nbytes: int) -> Bytes:
        data, off = self._locate(address, nbytes)
        return data[off : off + nbytes]

    def write(self, address: int, data: Bytes) -> None:
        region, off = self._locate(address, len(data))
        region[off : off + len(data)] = data
