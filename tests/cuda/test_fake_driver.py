"""The test double's checks are real: each mistake a GPU would fault on or race with is
caught (so a passing engine test means the engine did not make it)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kvpipe
from kvpipe._plan import layout_segments
from kvpipe.cuda._kernels import GATHER, CopyArgs, launch_shape, pack_args, segment_table
from tests.cuda.fake_driver import DriverViolation, FakeDriver, Gate


@pytest.fixture
def drv() -> FakeDriver:
    d = FakeDriver(latency=0)
    d.open(0)
    d.make_current()
    return d


def _kernel(drv: FakeDriver) -> int:
    from kvpipe.cuda._nvrtc import load_kernels

    module = drv.module_load(load_kernels((8, 0)).image)
    return drv.module_function(module, GATHER)


def _launch_setup(drv: FakeDriver, cache_blocks: int, pair: tuple[int, int], staging_nbytes: int):  # type: ignore[no-untyped-def]
    layout = kvpipe.CacheLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=4, block_size=2)
    segs = layout_segments(layout)
    tensors = [drv.mem_alloc(cache_blocks * s.nbytes) for s in segs]
    table = segment_table(tensors, segs)
    dev_table = drv.mem_alloc(len(table))
    drv.write_device(dev_table, table)
    pairs = drv.mem_alloc(16)
    drv.write_device(pairs, np.array(pair, dtype="<i8").tobytes())
    staging = drv.mem_alloc(staging_nbytes)
    shape = launch_shape(1, len(segs), max(s.nbytes for s in segs))
    args = CopyArgs(dev_table, len(segs), pairs, 1, staging, 64, shape.chunk_bytes)
    return shape, args, staging


def _violation(drv: FakeDriver, *match: str) -> None:
    assert any(m in v for v in drv.violations for m in match), drv.violations
    drv.violations.clear()


def test_kernel_reading_past_an_allocation(drv: FakeDriver) -> None:
    fn = _kernel(drv)
    stream = drv.stream_create()
    shape, args, _ = _launch_setup(drv, cache_blocks=2, pair=(2, 0), staging_nbytes=64)
    drv.launch(fn, shape.grid, shape.block, stream, pack_args(args))
    with pytest.raises(DriverViolation):
        drv.run_until_idle()
    _violation(drv, "overrun", "unallocated")


def test_kernel_writing_past_staging(drv: FakeDriver) -> None:
    fn = _kernel(drv)
    stream = drv.stream_create()
    shape, args, _ = _launch_setup(drv, cache_blocks=2, pair=(0, 1), staging_nbytes=64)
    drv.launch(fn, shape.grid, shape.block, stream, pack_args(args))
    with pytest.raises(DriverViolation):
        drv.run_until_idle()
    _violation(drv, "overrun", "unallocated")


def test_kernel_given_a_host_pointer_for_pinned_memory(drv: FakeDriver) -> None:
    fn = _kernel(drv)
    stream = drv.stream_create()
    shape, args, _ = _launch_setup(drv, cache_blocks=2, pair=(0, 0), staging_nbytes=64)
    host = drv.host_alloc(4096)  # mapped pinned: kernels must use host_device_pointer()
    bad = CopyArgs(args.segs, args.n_seg, args.pairs, 1, host, 64, args.chunk_bytes)
    with pytest.raises(DriverViolation):
        drv.launch(fn, shape.grid, shape.block, stream, pack_args(bad))
    _violation(drv, "host pointer")
    good = CopyArgs(
        args.segs, args.n_seg, args.pairs, 1, drv.host_device_pointer(host), 64, args.chunk_bytes
    )
    drv.launch(fn, shape.grid, shape.block, stream, pack_args(good))
    drv.run_until_idle()
    assert drv.violations == []


def test_grid_that_does_not_cover_the_work(drv: FakeDriver) -> None:
    fn = _kernel(drv)
    stream = drv.stream_create()
    shape, args, _ = _launch_setup(drv, cache_blocks=2, pair=(0, 0), staging_nbytes=64)
    short = (shape.grid[0] - 1, 1, 1)
    drv.launch(fn, short, shape.block, stream, pack_args(args))
    with pytest.raises(DriverViolation):
        drv.run_until_idle()
    _violation(drv, "grid.x")
    with pytest.raises(DriverViolation):
        drv.launch(fn, shape.grid, (2048, 1, 1), stream, pack_args(args))
    _violation(drv, "1024 threads")
    with pytest.raises(DriverViolation):
        drv.launch(fn, shape.grid, shape.block, stream, pack_args(args)[:-1])
    _violation(drv, "bad parameters")


def test_pageable_memory_in_an_async_copy(drv: FakeDriver) -> None:
    stream = drv.stream_create()
    dev = drv.mem_alloc(64)
    pageable = np.zeros(64, np.uint8)
    with pytest.raises(DriverViolation):
        drv.memcpy_htod_async(dev, pageable.ctypes.data, 64, stream)
    _violation(drv, "not pinned memory")


def test_freeing_memory_queued_work_uses(drv: FakeDriver) -> None:
    stream = drv.stream_create()
    dev = drv.mem_alloc(64)
    host = drv.host_alloc(64)
    gate = Gate()
    drv.host_op(stream, lambda: None, gate=gate)
    drv.memcpy_dtoh_async(host, dev, 64, stream)
    with pytest.raises(DriverViolation):
        drv.mem_free(dev)
    _violation(drv, "freed while")
    with pytest.raises(DriverViolation):
        drv.stream_destroy(stream)
    _violation(drv, "ops queued")
    gate.open()
    drv.run_until_idle()
    drv.mem_free(dev)
    drv.host_free(host)


def test_work_runs_only_when_the_device_progresses(drv: FakeDriver) -> None:
    drv.latency = 2
    stream = drv.stream_create()
    dev = drv.mem_alloc(8)
    drv.write_device(dev, b"abcdefgh")
    host = drv.host_alloc(8)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * 8).from_address(host))
    view[:] = 0
    event = drv.event_create()
    drv.memcpy_dtoh_async(host, dev, 8, stream)
    drv.event_record(event, stream)
    assert bytes(view) == bytes(8)  # queued, not done
    assert not drv.event_query(event)
    assert drv.event_query(event) or drv.event_query(event)
    assert bytes(view) == b"abcdefgh"


def test_waits_capture_the_record_at_call_time(drv: FakeDriver) -> None:
    a, b = drv.stream_create(), drv.stream_create()
    event = drv.event_create()
    gate = Gate()
    drv.host_op(a, lambda: None, gate=gate)
    drv.event_record(event, a)
    drv.stream_wait_event(b, event)
    done = drv.event_create()
    drv.event_record(done, b)
    drv.event_record(event, a)  # re-recording does not change what b already waits for
    assert not drv.event_query(done)
    gate.open()
    assert drv.event_query(done)


def test_calls_need_a_current_context() -> None:
    import threading

    drv = FakeDriver()
    drv.open(0)
    drv.make_current()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            drv.mem_alloc(16)
        except DriverViolation as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "no current context" in str(errors[0])


def test_failures_can_be_injected(drv: FakeDriver) -> None:
    drv.fail_next("mem_alloc", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(kvpipe.DeviceError, match="OUT_OF_MEMORY"):
        drv.mem_alloc(16)
    assert drv.mem_alloc(16)


def test_opens_nest_on_one_device_and_another_device_is_refused() -> None:
    d = FakeDriver(device_count=2)
    d.open(1)
    d.open(1)
    with pytest.raises(RuntimeError, match="open on CUDA device 1"):
        d.open(0)
    d.close()
    d.close()
    d.open(0)  # closed: any device again
    d.close()
    d.assert_clean()
