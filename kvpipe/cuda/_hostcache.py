"""Host caches in pinned memory, the same size as the device caches (:func:`create_host_cache`).

One pinned allocation per role holds that role's tensors of every layer, each exactly
``num_blocks * role.block_nbytes`` bytes (scales at 2 bytes per bf16 element).
"""

from __future__ import annotations

import numpy as np

from .._cache import KVCache
from .._errors import LayoutError
from .._layout import CacheLayout, numpy_dtype
from ._driver import CudaDriver, Driver
from ._pinned import PinnedBuffer

__all__ = ("create_host_cache",)


def create_host_cache(
    layout: CacheLayout,
    num_blocks: int,
    *,
    device: int = 0,
    device_driver: Driver | None = None,
) -> KVCache:
    """Allocate a zeroed host cache in pinned memory: per role, exactly the bytes of the
    device cache of the same layout. :meth:`KVCache.free` frees the pinned memory and
    releases the driver context. Neither changes the calling thread's current CUDA context
    (the caller's framework may have another device's current).

    Args:
        layout: The layout to allocate.
        num_blocks: Blocks per tensor (> 0).
        device: The CUDA device whose primary context allocates and frees the memory. The
            memory is pinned for every device (``PORTABLE``); pass the device this process
            works on, so that no context is created on another GPU (one on device 0 costs
            that GPU hundreds of MiB, in every tensor-parallel rank that opens it).
        device_driver: Test seam: the driver interface to allocate with (default: the real
            CUDA driver through cuda-python).

    Raises:
        LayoutError: ``num_blocks`` is not positive, or ``device`` is not an int >= 0.
        Unsupported: No CUDA driver or device here (use :func:`kvpipe.create_kv_cache`
            instead).
        DeviceError: The driver failed the allocation (what was allocated is freed).
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise LayoutError(f"num_blocks must be a positive int, got {num_blocks!r}")
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise LayoutError(f"device must be a CUDA device ordinal (an int >= 0), got {device!r}")
    drv = device_driver if device_driver is not None else CudaDriver()
    drv.open(device)
    buffers: list[PinnedBuffer] = []
    try:
        tensors: dict[tuple[str, int], np.ndarray[tuple[int, ...], np.dtype[np.generic]]] = {}
        for spec in layout.role_specs:
            per_layer = num_blocks * spec.block_nbytes
            with drv.current():  # the caller's thread keeps its own current context
                buf = PinnedBuffer(drv, layout.num_layers * per_layer, mapped=False)
            buffers.append(buf)
            raw = buf.array()
            raw[:] = 0
            for layer in range(layout.num_layers):
                chunk = raw[layer * per_layer : (layer + 1) * per_layer]
                tensors[spec.name, layer] = chunk.view(numpy_dtype(spec.dtype)).reshape(
                    num_blocks, *spec.block_shape
                )
        cache = KVCache.from_tensors(layout, tensors)
    except BaseException:
        _release(drv, buffers)
        raise
    return KVCache(
        layout,
        cache.tensors(),
        cache.byte_rows,
        "numpy",
        release=lambda: _release(drv, buffers),
    )


def _release(driver: Driver, buffers: list[PinnedBuffer]) -> None:
    try:
        with driver.current():  # the calling thread keeps its own current context
            for buf in buffers:
                buf.free()
    finally:
        driver.close()
