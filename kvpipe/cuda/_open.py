"""Opening a :class:`CudaEngine`: every resource acquired in order, rolled back on failure."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Literal

import anyio
import numpy as np

from .._cache import KVCache
from .._device_tensors import parse_device
from .._errors import DeviceError, LayoutError, Unsupported
from .._plan import layout_segments
from .._staging import StagingPool, stride_for
from .._workers import in_thread
from ._driver import CudaDriver, Driver
from ._engine import CudaEngine
from ._kernels import KERNELS, segment_table
from ._nvrtc import load_kernels
from ._resources import CudaOptions, EventPool, Ledger

if TYPE_CHECKING:
    from . import DeviceProbe

__all__ = ("open_cuda_engine", "open_device_path")

log = logging.getLogger("kvpipe.cuda")


def open_cuda_engine(
    cache: KVCache,
    *,
    slot_nbytes: int,
    capacity: int,
    budget: int,
    max_blocks: int,
    driver: Driver | None = None,
    options: CudaOptions | None = None,
) -> CudaEngine:
    """Open the device path for a device cache: context, kernels, two streams, pinned staging
    of exactly ``capacity * stride`` bytes (``<= budget``) and the pointer table. Blocking
    (compiles, pins memory): call it from a worker thread.

    Args:
        cache: A device cache (``cache.device == "cuda:N"``).
        slot_nbytes: Bytes of one staging slot's value (payload + trailer).
        capacity: Staging slots.
        budget: Pinned staging bytes allowed.
        max_blocks: Blocks one call moves at most (the slice size).
        driver: The driver interface (default: :class:`CudaDriver`); a test seam.
        options: Tuning (default: :class:`CudaOptions`).

    Raises:
        LayoutError: ``cache`` is not a device cache.
        Unsupported: No driver, no device, or no NVRTC.
        DeviceError: A driver call or the compile failed (everything acquired is released),
            or the pointer table's upload was not seen completed (within
            ``options.drain_timeout``, or its event failed): what the upload may still use,
            and the context, are kept; logged. Anything else raised while waiting for it
            (an interrupt) is raised as it is, and keeps them too.
        ValueError: The staging does not fit ``budget``.
    """
    ordinal = parse_device(cache.device)
    if ordinal is None:
        raise LayoutError("the CUDA engine needs a device cache")
    opts = options if options is not None else CudaOptions()
    drv = driver if driver is not None else CudaDriver()
    info = drv.open(ordinal)
    upload = _Upload()
    try:
        # Current on this thread while opening, then whatever was current before: this is
        # a worker thread of the event loop library's, which other callers' work shares.
        with drv.current(), contextlib.ExitStack() as undo:
            image = load_kernels(info.capability, cache_dir=opts.kernel_cache)
            module = drv.module_load(image.image)
            undo.callback(drv.module_unload, module)
            functions = {name: drv.module_function(module, name) for name in KERNELS}
            streams: dict[Literal["gather", "scatter"], int] = {"gather": drv.stream_create()}
            undo.callback(drv.stream_destroy, streams["gather"])
            streams["scatter"] = drv.stream_create()
            undo.callback(drv.stream_destroy, streams["scatter"])
            ledger = Ledger(drv)
            events = EventPool(drv)
            undo.callback(events.close)
            stride = stride_for(slot_nbytes)
            staging = ledger.pinned_alloc(
                capacity * stride, budget=budget, mapped=info.can_map_host_memory
            )
            undo.callback(ledger.pinned_free, staging)
            table = _upload_table(drv, ledger, events, cache, opts.drain_timeout, upload)
            undo.callback(ledger.mem_free, table)
            engine = CudaEngine(
                driver=drv,
                info=info,
                cache=cache,
                ledger=ledger,
                events=events,
                staging=staging,
                slot_nbytes=slot_nbytes,
                max_blocks=max_blocks,
                module=module,
                functions=functions,
                streams=streams,
                table=table,
                options=opts,
                note=(
                    f"cuda:{ordinal} {info.name} sm_{info.capability[0]}{info.capability[1]}; "
                    f"kernels {image.kind} for {image.arch}; driver {drv.name}"
                ),
            )
            undo.pop_all()
    except BaseException:
        if not upload.stuck:  # a stuck upload's memory lives as long as the context: keep both
            drv.close()
        raise
    return engine


class _Upload:
    """Whether the pointer table's upload is stuck: queued, and not seen completed (what it
    uses, and the context, are then kept)."""

    __slots__ = ("stuck",)

    def __init__(self) -> None:
        self.stuck = False


def _upload_table(
    drv: Driver, ledger: Ledger, events: EventPool, cache: KVCache, timeout: float, upload: _Upload
) -> int:
    """Copy the pointer table to the device and wait for it (once, at open), ``timeout``
    seconds at most.

    Raises:
        DeviceError: A driver call failed, or the upload had not completed after
            ``timeout`` seconds (a stream that never completes). Once the copy is queued, a
            failure before it is seen completed (of recording or querying its event, or
            anything else raised meanwhile: an interrupt, ``MemoryError``) sets
            ``upload.stuck`` and leaves the memory, stream and event it may still use
            allocated (logged), never freed under it; it is raised as it is.
    """
    data = segment_table(cache.pointers, layout_segments(cache.layout))
    table = ledger.mem_alloc(len(data))
    try:
        with contextlib.ExitStack() as done:  # released in reverse order
            host = ledger.pinned_alloc(len(data), mapped=False)
            done.callback(ledger.pinned_free, host)
            host.array()[:] = np.frombuffer(data, dtype=np.uint8)
            stream = drv.stream_create()
            done.callback(drv.stream_destroy, stream)
            event = events.get()
            done.callback(events.put, event)
            drv.memcpy_htod_async(table, host.host_ptr, len(data), stream)
            try:
                drv.event_record(event, stream)
                give_up = time.monotonic() + timeout
                while not drv.event_query(event):
                    if time.monotonic() >= give_up:
                        raise DeviceError(
                            "cuEventQuery",
                            "",
                            f"the pointer table's upload did not complete in {timeout:.3g} s "
                            "(drain_timeout)",
                        )
                    time.sleep(50e-6)
            except BaseException as exc:
                # Queued, and not seen completed: the copy may still read and write these.
                upload.stuck = True
                done.pop_all()
                log.error(
                    "the CUDA pointer table's upload was not seen completed (%s); leaving its "
                    "memory, stream and event allocated",
                    str(exc) or type(exc).__name__,
                )
                raise
    except BaseException:
        if not upload.stuck:  # else the table too may still be written
            ledger.mem_free(table)
        raise
    return table


async def open_device_path(
    cache: KVCache,
    *,
    slot_nbytes: int,
    capacity: int,
    budget: int,
    max_blocks: int,
    max_calls: int,
    driver: Driver | None,
    probe: DeviceProbe,
) -> tuple[CudaEngine, StagingPool]:
    """:func:`open_cuda_engine` in a worker thread, and a staging pool over its pinned memory.

    Cancellation: the open is shielded (a half-opened engine is never lost); a cancellation
    is delivered afterwards, and the caller closes the engine.

    Raises:
        Unsupported: No injected driver and the probe found no usable CUDA device.
        DeviceError, ValueError: As for :func:`open_cuda_engine`.
    """
    if driver is None and not probe.available:
        raise Unsupported(
            f"a {cache.device} cache needs the CUDA device path, which is not usable here: "
            f"{probe.note}"
        )
    opener = functools.partial(
        open_cuda_engine,
        cache,
        slot_nbytes=slot_nbytes,
        capacity=capacity,
        budget=budget,
        max_blocks=max_blocks,
        driver=driver,
        options=CudaOptions(max_calls=max_calls),
    )
    with anyio.CancelScope(shield=True):
        engine = await in_thread(opener)
    buffer = engine.staging.array((capacity, stride_for(slot_nbytes)))
    return engine, StagingPool(slot_nbytes, capacity, buffer=buffer)
