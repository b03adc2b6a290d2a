"""What kvpipe logs under the ``kvpipe`` logger: per-slice lines at DEBUG only, one WARNING
for a write that stops short (its id, the slice, the blocks stored, the reason), a restart at
WARNING, and nothing per block at INFO or above.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe import _lograte
from kvpipe._runtime import Runtime
from kvpipe.actors import reader as reader_module
from kvpipe.backends.file._fs import Root
from tests.fakes import Act, CrashHooks, ScriptedStore
from tests.helpers import fill_random

BS = 16
LAYOUT = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=BS)
CONFIG = kvpipe.PipelineConfig(slice_block_num=8, slice_timeout=0.2, staging_bytes=4 << 20)
#: For the file store's tests, in real time (its calls run in threads): no slice timeout that
#: a loaded machine's scheduling delay could reach (an extra "dedup probe failed" WARNING).
FILE_CONFIG = dataclasses.replace(CONFIG, slice_timeout=30.0)


def _virtual_time() -> Any:
    """trio's MockClock through anyio: waits for deadlines take no real time."""
    return pytest.mark.parametrize(
        "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})]
    )


def _cache(blocks: int = 512) -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, blocks)
    fill_random(cache)
    return cache


def _at_least(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= level and r.name.startswith("kvpipe")]


async def test_a_full_write_and_read_log_nothing_at_info_and_one_debug_line_per_slice(
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocks = 200  # 25 slices of 8
    tokens = np.arange(blocks * BS)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), config=CONFIG) as pipe:
        caplog.clear()  # the one INFO line at open is not the write's
        assert (await pipe.write(tokens, np.arange(blocks))).complete
        assert (await pipe.read(tokens, np.arange(blocks, 2 * blocks))).complete
        assert await pipe.lookup(tokens) == blocks
    assert _at_least(caplog, logging.INFO) == []
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum(m.startswith("write ") and " slice " in m for m in debug) == 25
    assert sum(m.startswith("read ") and " slice " in m for m in debug) == 25
    assert len(debug) == 50  # per slice, never per block


async def test_an_incomplete_write_logs_one_warning_with_id_slice_blocks_and_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Slice 1 (blocks 8-15): the store fails its block 3, i.e. block 11.
    store = ScriptedStore(puts={1: Act(fail=[3])})
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        caplog.clear()
        w = await pipe.write(np.arange(32 * BS), np.arange(32), request_id="req-17")
    assert (w.written, w.stop_reason) == (11, "incomplete_slice")
    warnings = _at_least(caplog, logging.INFO)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    (record,) = warnings
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    for part in ("req-17", "slice 1", "blocks 8-15", "11 of 32 blocks stored", "incomplete_slice"):
        assert part in message, message
    assert "block 11: failed" in message  # the detail: which block, what the store said


@_virtual_time()
async def test_a_slice_timeout_logs_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = ScriptedStore(puts={2: Act(hang=True)})
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        caplog.clear()
        w = await pipe.write(np.arange(32 * BS), np.arange(32), request_id="slow-1")
    assert (w.written, w.stop_reason) == (16, "slice_timeout")
    (record,) = _at_least(caplog, logging.INFO)
    message = record.getMessage()
    for part in ("slow-1", "slice 2", "blocks 16-23", "16 of 32 blocks stored", "slice_timeout"):
        assert part in message, message


async def test_a_restart_logs_warnings_naming_the_request_and_its_progress(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hooks = CrashHooks("writer", ["victim"])
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(
        _cache(), kvpipe.MemoryStore(), config=CONFIG, hooks=hooks
    ) as pipe:
        caplog.clear()
        w = await pipe.write(np.arange(16 * BS), np.arange(16), request_id="victim")
    assert w.stop_reason == "actor_crashed"
    records = _at_least(caplog, logging.INFO)
    assert [(r.name, r.levelno) for r in records] == [
        ("kvpipe.supervisor", logging.WARNING),
        ("kvpipe.requests", logging.WARNING),
    ]
    restart, stopped = (r.getMessage() for r in records)
    assert "actor writer crashed" in restart and "restarting" in restart
    assert "write victim (0 of 16 blocks stored, at slice 0)" in restart
    for part in ("victim", "slice 0", "0 of 16 blocks stored", "actor_crashed"):
        assert part in stopped, stopped


@_virtual_time()
async def test_a_cancelled_write_is_info_not_warning(caplog: pytest.LogCaptureFixture) -> None:
    store = ScriptedStore(puts={0: Act(hang=True)})
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        caplog.clear()
        with anyio.move_on_after(0.05):
            await pipe.write(np.arange(8 * BS), np.arange(8), request_id="gone")
    (record,) = _at_least(caplog, logging.INFO)
    assert record.levelno == logging.INFO and "gone" in record.getMessage()
    assert "cancelled" in record.getMessage()


async def test_the_file_store_logs_failed_blocks_once_per_batch(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> bool:
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(Root, "write_atomic", broken)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with (
        kvpipe.FileStore(tmp_path / "store") as store,
        kvpipe.open_pipeline(_cache(), store, config=FILE_CONFIG) as pipe,
    ):
        caplog.clear()
        w = await pipe.write(np.arange(8 * BS), np.arange(8), request_id="eio")
    assert (w.written, w.stop_reason) == (0, "incomplete_slice")
    records = [(r.name, r.getMessage()) for r in _at_least(caplog, logging.INFO)]
    assert [name for name, _ in records] == ["kvpipe.file_store", "kvpipe.requests"], records
    store_line = records[0][1]
    assert "8 of 8 blocks failed to write" in store_line and "injected I/O error" in store_line
    assert "and 5 more" in store_line  # three named, the rest counted


class _EvictedBeforeTheFetch(kvpipe.MemoryStore):
    """Evicts block 2 of the next fetch just before it (another writer's put pushed it out
    between the read's probe and its fetch)."""

    evict = False

    async def get_blocks(self, batch: kvpipe.backends.GetBatch) -> list[kvpipe.BlockStatus]:
        if self.evict:
            self.evict = False
            await self.delete([batch.keys[2]])
        return list(await super().get_blocks(batch))


async def test_a_block_evicted_since_the_probe_is_debug_as_a_block_not_stored(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A block found stored by the read's probe and gone at its fetch (evicted meanwhile:
    an ordinary race in a store that evicts) was logged at WARNING as a failed block, once
    per read under eviction pressure, while the same absence seen by the probe is DEBUG
    (``not_stored``). A block the store failed to fetch stays a WARNING."""
    store = _EvictedBeforeTheFetch()
    tokens = np.arange(8 * BS)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        assert (await pipe.write(tokens, np.arange(8))).complete
        caplog.clear()
        store.evict = True
        r = await pipe.read(tokens, np.arange(8, 16), request_id="raced")
        assert (r.loaded, r.failed_blocks, r.stop_reason) == (2, (2,), "failed_block")
        assert _at_least(caplog, logging.INFO) == []
        debug = [r.getMessage() for r in caplog.records if "raced" in r.getMessage()]
        assert any("block 2" in m and "missing" in m for m in debug), debug
    store = ScriptedStore(gets={0: Act(fail=[2])})
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        assert (await pipe.write(tokens, np.arange(8))).complete
        caplog.clear()
        r = await pipe.read(tokens, np.arange(8, 16), request_id="failed")
        assert (r.loaded, r.stop_reason) == (2, "failed_block")
        (record,) = _at_least(caplog, logging.INFO)
        assert record.levelno == logging.WARNING and "block 2 failed" in record.getMessage()


@_virtual_time()
async def test_requests_failed_at_close_are_named_in_their_errors_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A write and a read still in their store calls at the close deadline were failed with
    ``PipelineClosed("pipeline closed")``: the error named no request, and nothing was
    logged, so neither the callers nor the log said which requests close abandoned or how
    far they had got (8 of the write's 16 blocks were stored)."""
    store = ScriptedStore(puts={3: Act(hang=True)}, gets={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(
        slice_block_num=8, slice_timeout=30, total_timeout=60, close_timeout=1
    )
    stored, fresh = np.arange(16 * BS), np.arange(16 * BS) + 10_000
    errors: dict[str, BaseException] = {}

    async def call(rid: str, fn: Any, *args: Any) -> None:
        try:
            await fn(*args, request_id=rid)
        except kvpipe.PipelineClosed as exc:
            errors[rid] = exc

    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with anyio.create_task_group() as tg:
        async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
            assert (await pipe.write(stored, np.arange(16))).complete  # puts 0 and 1
            caplog.clear()
            tg.start_soon(call, "w-open", pipe.write, fresh, np.arange(16))  # put 3 hangs
            tg.start_soon(call, "r-open", pipe.read, stored, np.arange(16, 32))  # get 0 hangs
            await store.wait_calls("put", 4)
            await store.wait_calls("get", 1)
    assert sorted(errors) == ["r-open", "w-open"]
    assert "w-open" in str(errors["w-open"]) and "8 of 16 blocks stored" in str(errors["w-open"])
    assert "r-open" in str(errors["r-open"])
    records = _at_least(caplog, logging.INFO)
    assert [(r.name, r.levelno) for r in records] == [("kvpipe.pipeline", logging.WARNING)]
    message = records[0].getMessage()
    for part in ("2 request(s)", "close_timeout", "w-open (8 of 16 blocks stored", "r-open"):
        assert part in message, message
    with pytest.raises(kvpipe.PipelineClosed, match="write w-late"):  # one after close too
        await pipe.write(fresh, np.arange(16), request_id="w-late")


async def test_a_corrupt_block_deleted_from_the_store_is_logged_with_its_request_and_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A block that failed verification twice is deleted from the store; that went unlogged
    (only a deletion that failed was), so a block vanished from the store with no line
    saying so, and the log of a failed deletion named no block."""
    store = ScriptedStore(gets={0: Act(corrupt=[3]), 1: Act(corrupt=[0])})
    tokens = np.arange(8 * BS)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        assert (await pipe.write(tokens, np.arange(8))).complete
        caplog.clear()
        r = await pipe.read(tokens, np.arange(8, 16), request_id="r-bad")
        assert (r.loaded, r.stop_reason) == (3, "failed_block")
        assert store.deleted == [store.calls_of("get")[0].keys[3]]
    records = _at_least(caplog, logging.INFO)
    assert [(r.name, r.levelno) for r in records] == [
        ("kvpipe.reader", logging.WARNING),
        ("kvpipe.reader", logging.WARNING),
    ], [r.getMessage() for r in records]
    failed, deleted = (r.getMessage() for r in records)
    assert "r-bad" in failed and "block 3 failed" in failed
    for part in ("r-bad", "deleted 1", "scripted", "block 3", store.deleted[0]):
        assert part in deleted, deleted


@_virtual_time()
@pytest.mark.parametrize("timeout", [None, 2.5])
async def test_a_lookup_that_times_out_names_its_limit(timeout: float | None) -> None:
    """A lookup whose store does not answer by its deadline raised
    ``OperationTimeout("lookup lookup-<pid>-<n> timed out")``: it named neither the limit
    nor where it came from (the call's ``timeout`` or ``config.lookup_timeout``)."""
    store = ScriptedStore(exists={0: Act(hang=True)})
    config = kvpipe.PipelineConfig(slice_timeout=100, lookup_timeout=4)
    async with kvpipe.open_pipeline(_cache(), store, config=config) as pipe:
        with pytest.raises(kvpipe.OperationTimeout) as caught:
            await pipe.lookup(np.arange(8 * BS), timeout=timeout)
    message = str(caught.value)
    assert message.startswith("lookup lookup-"), message
    if timeout is None:
        assert "4 s (lookup_timeout)" in message, message
    else:
        assert "2.5 s (timeout)" in message, message


async def test_the_file_store_lines_name_the_request_and_its_blocks(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file store's one line per batch (blocks it failed to write, or found corrupt and
    quarantined) named the store and the keys but not the request, which its batch carries:
    with requests in flight together nothing tied the line to the request that failed."""
    tokens = np.arange(16 * BS)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with (
        kvpipe.FileStore(tmp_path / "store") as store,
        kvpipe.open_pipeline(_cache(), store, config=FILE_CONFIG) as pipe,
    ):
        assert (await pipe.write(tokens, np.arange(16))).complete
        for path in (tmp_path / "store").rglob("*.kvb"):  # every block file tampered with
            data = bytearray(path.read_bytes())
            data[100] ^= 1
            path.write_bytes(data)
        caplog.clear()
        r = await pipe.read(tokens[: 8 * BS], np.arange(16, 24), request_id="r-tampered")
        assert (r.loaded, r.stop_reason) == (0, "failed_block")
        (read_line,) = [r for r in caplog.records if r.name == "kvpipe.file_store"]

        def broken(*args: Any, **kwargs: Any) -> bool:
            raise OSError(errno.EIO, "injected I/O error")

        monkeypatch.setattr(Root, "write_atomic", broken)
        caplog.clear()
        w = await pipe.write(tokens[: 8 * BS] + 1, np.arange(8), request_id="w-eio")
        assert (w.written, w.stop_reason) == (0, "incomplete_slice")
        (write_line,) = [r for r in caplog.records if r.name == "kvpipe.file_store"]
    assert read_line.levelno == logging.WARNING
    message = read_line.getMessage()
    for part in ("read r-tampered", "blocks 0-7", "quarantined", str(tmp_path / "store")):
        assert part in message, message
    message = write_line.getMessage()
    for part in ("write w-eio", "blocks 0-7", "injected I/O error"):
        assert part in message, message


@pytest.mark.parametrize(
    "anyio_backend", [("trio", {"clock": trio.testing.MockClock(autojump_threshold=0.1)})]
)
async def test_a_read_ended_before_close_is_not_logged_as_failed_by_it(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read whose caller was cancelled while its check-and-scatter copies (in a copy
    thread, shielded) has ended, but it stays in flight until the copy is out. The close
    deadline passing then does not fail it (the first ending wins: its caller sees its
    cancellation), yet the close's WARNING named it among the requests it "failed"."""
    layout = kvpipe.CacheLayout.gqa(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=BS, dtype="bfloat16"
    )
    cache = kvpipe.create_kv_cache(layout, 32)
    fill_random(cache)
    entered, go = threading.Event(), threading.Event()
    check_and_scatter = reader_module.check_and_scatter

    def held(*args: Any) -> Any:
        entered.set()
        go.wait(10)
        return check_and_scatter(*args)

    stop_all = Runtime._stop_all

    def stop_all_then_go(self: Runtime, *args: Any) -> None:
        stop_all(self, *args)
        go.set()

    monkeypatch.setattr(reader_module, "check_and_scatter", held)
    monkeypatch.setattr(Runtime, "_stop_all", stop_all_then_go)
    config = kvpipe.PipelineConfig(
        slice_block_num=16, total_timeout=600, close_timeout=1, staging_bytes=4 << 20
    )
    tokens = np.arange(16 * BS)
    caplog.set_level(logging.INFO, logger="kvpipe")
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore(), config=config) as pipe:
        assert (await pipe.write(tokens, np.arange(16))).complete
        async with anyio.create_task_group() as tg:
            caller = anyio.CancelScope()

            async def read() -> None:
                with caller:
                    await pipe.read(tokens, np.arange(16, 32), request_id="r-cancelled")

            tg.start_soon(read)
            while not entered.is_set():  # the copy thread has the slice (real time)
                await anyio.lowlevel.checkpoint()
            caller.cancel()
            await pipe.aclose()
    assert caller.cancelled_caught
    messages = [r.getMessage() for r in _at_least(caplog, logging.INFO)]
    failed = [m for m in messages if "request(s) in flight" in m]
    assert not any("r-cancelled" in m for m in failed), failed


class _DownStore(kvpipe.MemoryStore):
    """A store that fails every call once ``down`` (as one that is unreachable)."""

    down = False

    def _check(self, op: str) -> None:
        if self.down:
            raise kvpipe.BackendError("memory", op, "connection refused")

    async def put_blocks(self, batch: Any) -> Any:
        self._check("put_blocks")
        return await super().put_blocks(batch)

    async def get_blocks(self, batch: Any) -> Any:
        self._check("get_blocks")
        return await super().get_blocks(batch)

    async def exists(self, batch: Any) -> Any:
        self._check("exists")
        return await super().exists(batch)


async def test_a_store_that_is_down_logs_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One WARNING per failed request (and one more per write for its dedup probe) is
    # thousands a second under load: the first of each kind shows, the rest go to DEBUG
    # until the interval has passed, then one line counts them.
    now = [1000.0]
    store = _DownStore()
    n = 40
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        monkeypatch.setattr(pipe._runtime.limits, "clock", lambda: now[0])  # the pipeline's
        assert (await pipe.write(np.arange(16 * BS), np.arange(16))).complete
        caplog.clear()
        store.down = True
        for i in range(n):
            w = await pipe.write(np.arange(16 * BS) + 7 + i, np.arange(16), request_id=f"w{i}")
            assert w.stop_reason == "backend_error"
            r = await pipe.read(np.arange(16 * BS), np.arange(16, 32), request_id=f"r{i}")
            assert r.stop_reason == "backend_error"
        loud = _at_least(caplog, logging.WARNING)
        assert len(loud) <= 3, [r.getMessage() for r in loud]  # probe, write, read: once each
        text = "\n".join(r.getMessage() for r in loud)
        assert "w0" in text and "r0" in text  # the first shows which request and why
        assert "connection refused" in text
        quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
        assert any(f"write w{n - 1} incomplete" in m for m in quiet)  # kept, at DEBUG
        caplog.clear()
        now[0] += _lograte.INTERVAL
        await pipe.write(np.arange(16 * BS) + 999, np.arange(16), request_id="later")
    (shown,) = [r for r in _at_least(caplog, logging.WARNING) if r.name == "kvpipe.requests"]
    message = shown.getMessage()
    assert "later" in message and f"and {n - 1} more like it" in message, message


async def test_a_file_store_that_keeps_failing_logs_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A disk that fails every write (full, read-only, dying): the file store logged one
    # WARNING per batch, i.e. per slice of every write, on top of the request's own line.
    def broken(*args: Any, **kwargs: Any) -> bool:
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(Root, "write_atomic", broken)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    n = 30
    async with (
        kvpipe.FileStore(tmp_path / "store") as store,
        kvpipe.open_pipeline(_cache(), store, config=FILE_CONFIG) as pipe,
    ):
        caplog.clear()
        for i in range(n):
            w = await pipe.write(np.arange(8 * BS) + i, np.arange(8), request_id=f"eio{i}")
            assert w.stop_reason == "incomplete_slice"
    loud = [(r.name, r.getMessage()) for r in _at_least(caplog, logging.WARNING)]
    assert [name for name, _ in loud] == ["kvpipe.file_store", "kvpipe.requests"], loud
    assert "eio0" in loud[0][1] and str(tmp_path / "store") in loud[0][1]
    quiet = [r for r in caplog.records if r.levelno == logging.DEBUG]
    assert sum(r.name == "kvpipe.file_store" for r in quiet) == n - 1


class _NamedDownStore(_DownStore):
    """A :class:`_DownStore` whose errors name it (one tier of several in a process)."""

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label

    def _check(self, op: str) -> None:
        if self.down:
            raise kvpipe.BackendError(self.label, op, "connection refused")


async def test_one_stores_flood_does_not_hide_another_stores_first_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two pipelines over two stores in one process (a memory tier and another) shared the
    actors' and the requests' log limiters: while the first store failed every request, the
    second store's first failure of the same kind went to DEBUG until the interval passed,
    so the log never said the second store was failing. Each pipeline's repeats are bounded
    on their own."""
    tokens = np.arange(16 * BS)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    first, second = _NamedDownStore("tier-a"), _NamedDownStore("tier-b")
    async with (
        kvpipe.open_pipeline(_cache(), first, config=CONFIG) as a,
        kvpipe.open_pipeline(_cache(), second, config=CONFIG) as b,
    ):
        for pipe in (a, b):
            assert (await pipe.write(tokens, np.arange(16))).complete
        first.down = second.down = True
        caplog.clear()
        for i in range(5):
            await a.write(tokens + 1 + i, np.arange(16), request_id=f"a-w{i}")
            await a.read(tokens, np.arange(16, 32), request_id=f"a-r{i}")
        flood = {(r.name, r.getMessage().split()[0]) for r in _at_least(caplog, logging.WARNING)}
        assert len(_at_least(caplog, logging.WARNING)) == len(flood)  # bounded: once each
        caplog.clear()
        w = await b.write(tokens + 100, np.arange(16), request_id="b-w0")
        r = await b.read(tokens, np.arange(16, 32), request_id="b-r0")
        assert (w.stop_reason, r.stop_reason) == ("backend_error", "backend_error")
    loud = [r for r in _at_least(caplog, logging.WARNING) if r.name != "kvpipe.pipeline"]
    shown = {(r.name, r.getMessage().split()[0]) for r in loud}
    assert shown == flood, [r.getMessage() for r in loud]  # each kind of line, for b too
    assert all("tier-b" in r.getMessage() for r in loud), [r.getMessage() for r in loud]


async def test_two_file_stores_each_show_their_first_failed_write(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two file stores on two disks, each under its own pipeline, both failing every write:
    the second disk's first failed write showed the file store's line but not the
    request's (hidden by the first disk's at DEBUG)."""

    def broken(*args: Any, **kwargs: Any) -> bool:
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(Root, "write_atomic", broken)
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with (
        kvpipe.FileStore(tmp_path / "disk0") as disk0,
        kvpipe.FileStore(tmp_path / "disk1") as disk1,
        kvpipe.open_pipeline(_cache(), disk0, config=FILE_CONFIG) as a,
        kvpipe.open_pipeline(_cache(), disk1, config=FILE_CONFIG) as b,
    ):
        for i in range(5):
            w = await a.write(np.arange(8 * BS) + i, np.arange(8), request_id=f"a{i}")
            assert w.stop_reason == "incomplete_slice"
        caplog.clear()
        w = await b.write(np.arange(8 * BS), np.arange(8), request_id="b0")
        assert w.stop_reason == "incomplete_slice"
    loud = [(r.name, r.getMessage()) for r in _at_least(caplog, logging.WARNING)]
    assert [name for name, _ in loud] == ["kvpipe.file_store", "kvpipe.requests"], loud
    assert all("b0" in m for _, m in loud), loud
    assert str(tmp_path / "disk1") in loud[0][1], loud


class _KeepsServingCorrupt(ScriptedStore):
    """Serves block 0 of every fetch corrupt (its refetch too, or that refetch ``fails``);
    its deletes ``refuse``, ``hang`` or remove nothing (a replica that serves it again)."""

    def __init__(self, delete: str) -> None:
        gets = {
            i: Act(error=OSError("store went away"))
            if delete == "refetch fails" and i % 2
            else Act(corrupt=[0])
            for i in range(1000)
        }
        super().__init__(gets=gets)
        self.delete_does = delete

    async def delete(self, keys: Any) -> None:
        if self.delete_does == "refused":
            raise kvpipe.BackendError("scripted", "delete", "read-only replica")
        if self.delete_does == "hangs":
            await anyio.sleep_forever()
        self.deleted.extend(keys)  # and kept: served again


@_virtual_time()
@pytest.mark.parametrize("delete", ["done", "refused", "hangs", "refetch fails"])
async def test_a_store_that_keeps_serving_corrupt_blocks_logs_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture, delete: str
) -> None:
    """A store that serves a block corrupt on every fetch (its delete refused, hung, or
    removing nothing) got the reader's 'block 0 failed (...); loading stops there' and its
    line about the deletion (or the failed refetch) at WARNING for every read: two per read
    on top of the request's own, bounded, line. The first of each kind shows (request, block,
    key), the rest at DEBUG; the metrics count every one."""
    store = _KeepsServingCorrupt(delete)
    tokens = np.arange(8 * BS)
    n = 20
    caplog.set_level(logging.DEBUG, logger="kvpipe")
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        assert (await pipe.write(tokens, np.arange(8))).complete
        caplog.clear()
        for i in range(n):
            r = await pipe.read(tokens, np.arange(8, 16), request_id=f"bad{i}")
            assert (r.loaded, r.stop_reason) == (0, "failed_block")
        counters = pipe.statistics().counters
    loud = [r.getMessage() for r in _at_least(caplog, logging.WARNING) if r.name == "kvpipe.reader"]
    assert len(loud) == 2, loud  # the failed block, the deletion (or refetch): once each
    assert any(m.startswith("read bad0: block 0 failed (checksum mismatch)") for m in loud), loud
    quiet = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(f"read bad{n - 1}: block 0 failed" in m for m in quiet), quiet
    assert counters["blocks_failed_verify"] >= n
    if delete == "done":
        assert any("bad0: deleted 1" in m and store.deleted[0] in m for m in loud), loud
        assert counters["corrupt_blocks_deleted"] == n
