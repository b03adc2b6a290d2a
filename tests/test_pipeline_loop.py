"""A pipeline answers only on the event loop that opened it: a call from another thread's
loop is refused at once (it used to wait out its whole deadline, its actors never seeing it)."""

from __future__ import annotations

import anyio
import anyio.to_thread
import numpy as np
import pytest

import kvpipe

LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
TOKENS = np.arange(16 * 4)


@pytest.mark.parametrize("call", ["write", "read", "lookup"])
async def test_a_call_from_another_threads_loop_is_refused_at_once(call: str) -> None:
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=8)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:

        async def elsewhere() -> object:
            # A short deadline: before the fix this returned (or timed out) after it.
            if call == "write":
                return await pipe.write(TOKENS, np.arange(4), timeout=2)
            if call == "read":
                return await pipe.read(TOKENS, np.arange(4), timeout=2)
            return await pipe.lookup(TOKENS, timeout=2)

        def in_thread() -> object:
            try:
                return anyio.run(elsewhere)
            except kvpipe.WrongEventLoop as exc:
                return exc

        outcome = await anyio.to_thread.run_sync(in_thread)
        assert isinstance(outcome, kvpipe.WrongEventLoop), outcome
        assert isinstance(outcome, RuntimeError)
        # the pipeline's own loop is unaffected
        assert (await pipe.write(TOKENS, np.arange(4))).complete


async def test_the_device_probe_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first probe of a process imports cuda-python (43-67 ms measured): not on the
    loop's thread."""
    import threading

    from kvpipe import _runtime
    from kvpipe.cuda import DeviceProbe

    probed_in: list[int] = []

    def probe() -> DeviceProbe:
        probed_in.append(threading.get_ident())
        return DeviceProbe(False, 0, "no CUDA here (test)")

    monkeypatch.setattr(_runtime, "probe_device", probe)
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=8)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as opened:
        assert opened.statistics().device_note == "no CUDA here (test)"
    assert probed_in and threading.get_ident() not in probed_in


async def test_aclose_from_another_threads_loop_is_refused_at_once() -> None:
    """``aclose`` is a call too: from another loop it closed the inboxes and set cancel scopes
    of the pipeline's loop from a foreign thread, which woke none of the actors there; it
    waited the close deadline plus the unwind grace, logged that the actors did not stop,
    and left the pipeline closed to its own loop."""
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=8)
    config = kvpipe.PipelineConfig(close_timeout=0.05)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), config=config) as pipe:

        def in_thread() -> object:
            try:
                return anyio.run(pipe.aclose)
            except kvpipe.WrongEventLoop as exc:
                return exc

        outcome = await anyio.to_thread.run_sync(in_thread)
        assert isinstance(outcome, kvpipe.WrongEventLoop), outcome
        # the pipeline's own loop is unaffected: still open, and answering
        assert not pipe.closed
        assert (await pipe.write(TOKENS, np.arange(4))).complete
    assert pipe.closed
