"""The device scenario's own code on the test double of the driver (its figures mean
nothing there: ``FakeDriver`` is not evidence of GPU speed)."""

from __future__ import annotations

import threading

import anyio
import pytest

from kvpipe._errors import DeviceError
from kvpipe.benchmarks import device, report
from kvpipe.benchmarks.device import DeviceBenchConfig, run_device_bench
from tests.cuda.fake_driver import FakeDriver

SMALL = DeviceBenchConfig(
    size="256KiB",
    total_bytes=3 << 20,
    rounds=2,
    request_bytes=1 << 20,
    slice_bytes=512 << 10,
    concurrency=2,
    threads=2,
)


async def test_runs_and_checks_what_it_read_back() -> None:
    fake = FakeDriver()
    ticks: list[str] = []
    result = await run_device_bench(SMALL, ticks.append, driver=fake)
    assert fake.violations == []
    fake.assert_clean()
    assert result["device_path"] == "cuda"
    assert result["blocks"] == 12 and result["slice_blocks"] == 2
    for op in ("write", "read"):
        assert result[op]["rounds"] == 2
        assert result[op]["gbps_median"] > 0 and result[op]["plain_gbps_median"] > 0
    assert set(result["link_gbps"]) == {"d2h", "h2d"}
    assert set(result["host_gbps"]) == {"copy", "copy_hash"}
    assert 0 < result["host_gbps"]["copy_hash"] and 0 < result["host_gbps"]["copy"]
    assert ticks == ["device: round 0/2", "device: round 1/2", "device: round 2/2"]
    results = {
        "device": result,
        "when": "now",
        "machine": "here",
        "seconds": {"device": 1.0},
        "command": "kvpipe bench --scenario device",
    }
    text = report.markdown(results, "device")
    assert f"| write | {result['write']['gbps_median']} / " in text
    assert f"**{result['link_gbps']['d2h']} GB/s device to host" in text
    assert f"**{result['host_gbps']['copy']} GB/s copied, " in text
    updated, missing = report.update_doc(
        "<!-- kvpipe-bench:device -->\nold\n<!-- /kvpipe-bench:device -->", results
    )
    assert missing == [] and "old" not in updated and "| read |" in updated
    assert len(report.tables(results, "device")) == 1


async def test_a_plain_loop_that_drops_a_block_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = device._Bench._plain_slice

    def lossy(self: device._Bench, k: int, first: int, write: bool) -> None:
        if write or first != 0:
            real(self, k, first, write)

    monkeypatch.setattr(device._Bench, "_plain_slice", lossy)
    with pytest.raises(RuntimeError, match="plain read back differ"):
        await run_device_bench(SMALL, driver=FakeDriver())


async def test_leaves_no_context_current_in_the_threads_it_ran_on() -> None:
    """The benchmark's device work runs in the event loop library's shared worker threads:
    afterwards none has the driver's context current. (It used to leave it current there:
    a server's later work on those threads would run in kvpipe's context, on whatever
    device the benchmark used.)"""
    fake = FakeDriver()
    await run_device_bench(SMALL, driver=fake)
    fake.assert_clean()
    left = [(t.name, fake.current_of(t.ident)) for t in threading.enumerate() if t.ident]
    assert [(name, ctx) for name, ctx in left if ctx] == []


@pytest.mark.parametrize(
    "call", ["stream_create", "event_create", "host_alloc", "memcpy_htod_async"]
)
async def test_a_setup_that_fails_frees_what_it_had(call: str) -> None:
    """A device error while the scenario sets up (say no device memory or pinned memory left
    for its buffers) is raised with everything set up before it freed: the caller's driver
    may stay open (here: the test double's ledger must be empty)."""
    fake = FakeDriver()
    fake.fail_next(call)
    with pytest.raises(DeviceError, match="injected"):
        await run_device_bench(SMALL, driver=fake)
    fake.assert_clean()


async def test_a_cancelled_run_frees_the_device_memory() -> None:
    """Cancelled mid-run (a caller's timeout, Ctrl-C), the scenario still frees its device
    buffers, streams and pinned memory before it returns."""
    fake = FakeDriver()
    with anyio.CancelScope() as scope:

        def tick(what: str) -> None:
            scope.cancel()

        await run_device_bench(SMALL, tick, driver=fake)
    assert scope.cancelled_caught
    fake.assert_clean()
