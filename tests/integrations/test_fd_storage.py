"""``KVPipeStorage`` (FastDeploy's ``file`` / ``mooncake`` backend) at the edges of its
contract: argument checks, calls after ``close``, and batches whose values differ in size."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence

import anyio
import pytest
import trio.testing

import kvpipe
from kvpipe.integrations._fd_storage import _TRAILER
from kvpipe.integrations.fastdeploy import KVPipeStorage


def _buf(data: bytes) -> tuple[ctypes.Array[ctypes.c_char], int]:
    b = ctypes.create_string_buffer(data, len(data))
    return b, ctypes.addressof(b)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("bad", [None, "0x10", 1.5])
def test_set_and_get_refuse_a_location_of_the_wrong_type_alike(bad: object) -> None:
    """``set`` raised ``RequestError`` (a ``ValueError``) for a location that is no int
    while ``get`` returned -1 for the same argument; the class says a wrong argument type
    raises ``TypeError``, as ``batch_set`` and ``batch_get`` do. Both now raise it."""
    _keep, ptr = _buf(b"x" * 8)
    with KVPipeStorage(store=kvpipe.MemoryStore()) as fs:
        assert fs.set("k", ptr, 8) == 0
        for call in (fs.set, fs.get, lambda *a: fs.batch_set([a[0]], [a[1]], [a[2]])):
            with pytest.raises(TypeError, match="target_location"):
                call("k", bad, 8)
        with pytest.raises(TypeError, match="target_location"):
            fs.batch_get(["k"], [bad], [8])  # type: ignore[list-item]


@pytest.mark.parametrize(("where", "size"), [(0, 8), (-8, 8), (None, 0), (None, -1)])
def test_set_and_get_answer_a_location_that_is_no_buffer_alike(
    where: int | None, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A zero or negative pointer or size: ``batch_get`` answered -1 for that key (as
    FastDeploy's own ``FileStore``, whose ``test_get_invalid_target_size`` expects it) while
    ``batch_set`` raised ``RequestError`` for the whole batch and stored none of its other
    keys. Both now answer -1 for that key, with one WARNING, and serve the others."""
    _keep, ptr = _buf(b"y" * 8)
    loc = ptr if where is None else where
    with KVPipeStorage(store=kvpipe.MemoryStore()) as fs:
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            assert fs.batch_set(["bad", "good"], [loc, ptr], [size, 8]) == [-1, 0]
        assert len(_warnings(caplog)) == 1, _warnings(caplog)
        assert fs.exists(["bad", "good"]) == {"bad": False, "good": True}
        assert fs.set("bad", loc, size) == -1
        assert fs.get("good", loc, size) == -1
        assert fs.batch_get(["good", "good"], [loc, ptr], [size, 8]) == [-1, 8]


@pytest.mark.parametrize("how", ["no buffer", "lengths differ"])
def test_arguments_naming_no_buffer_log_a_bounded_number_of_warnings(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A manager that keeps passing a location or size that names no buffer (or lists of
    different lengths) logged one WARNING per call, with no bound: a FastDeploy bug of that
    kind flooded the log at the manager's call rate, unlike every other repeated line of the
    adapters. The first shows; the others go to DEBUG until the interval passes."""
    _keep, ptr = _buf(b"z" * 8)
    n = 30
    with (
        KVPipeStorage(store=kvpipe.MemoryStore()) as fs,
        caplog.at_level(logging.DEBUG, "kvpipe.integrations"),
    ):
        for _ in range(n):
            if how == "no buffer":
                assert fs.batch_set(["k"], [0], [8]) == [-1]
                assert fs.batch_get(["k"], [ptr], [0]) == [-1]
            else:
                assert fs.batch_set(["k"], [ptr], [8, 8]) == [-1]
                assert fs.batch_get(["k"], [ptr, ptr], [8]) == [-1]
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings  # one per operation
    assert {w.split()[1].rstrip(":") for w in warnings} == {"batch_set", "batch_get"}, warnings
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "KVPipeStorage" in r.msg]
    assert len(debug) == 2 * (n - 1)


def test_clear_after_close_fails_like_a_store_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The docs: a call after ``close()`` answers as a failed store does, with one WARNING
    naming ``PipelineClosed``. ``clear()`` answered ``True`` (success) in silence, whether or
    not this instance had stored anything, though it removed nothing."""
    _keep, ptr = _buf(b"c" * 16)
    store = kvpipe.MemoryStore()
    fs = KVPipeStorage(store=store)
    assert fs.batch_set(["a"], [ptr], [16]) == [0]
    fs.close()
    with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
        assert fs.clear() is False
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "PipelineClosed" in warnings[0], warnings
    assert len(store.keys()) == 1  # nothing was removed


#: A scale key's bytes beside a cache key's (FastDeploy's block-wise fp8: one batch holds
#: the blocks' keys and values, then their key and value scales, of another size).
BIG, SMALL = 64, 16


class _FailsOneSize(kvpipe.MemoryStore):  # type: ignore[misc]
    """Fails (raises, or hangs until cancelled) every put / get of ``SMALL``-byte values."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.armed = False

    async def _fail(self, nbytes: int) -> None:
        if self.armed and nbytes == SMALL + _TRAILER.size:
            if self.how == "hangs":
                await anyio.sleep_forever()
            raise kvpipe.BackendError("memory", "put", "the scale values' device is gone")

    async def put_blocks(self, batch: kvpipe.PutBatch) -> Sequence[kvpipe.BlockStatus]:
        await self._fail(batch.value_nbytes)
        return await super().put_blocks(batch)

    async def get_blocks(self, batch: kvpipe.GetBatch) -> Sequence[kvpipe.BlockStatus]:
        await self._fail(batch.value_nbytes)
        return await super().get_blocks(batch)


@pytest.mark.parametrize("how", ["raises", "hangs"])
def test_a_failing_size_group_keeps_what_the_other_sizes_stored(
    how: str, caplog: pytest.LogCaptureFixture, virtual_loop: trio.testing.MockClock
) -> None:
    """kvpipe stores one batch_set's values a value size at a time. When a later size's
    put failed (the store raised, or the deadline passed in it), the earlier size's values
    stayed stored, yet every key answered -1 and none was remembered: FastDeploy was told
    nothing was stored, and clear() could never remove those entries.

    In virtual time (``virtual_loop``): with a real 0.5 s timeout, the earlier size's put
    had to finish within it, which a loaded machine need not allow (its keys then answered
    -1 on a correct adapter). Now the deadline, 30 s, passes in no real time and only in
    the hanging put."""
    _keep, ptr = _buf(b"b" * BIG)
    store = _FailsOneSize(how)
    store.armed = True
    with KVPipeStorage(store=store, timeout=30.0) as fs:
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            assert fs.batch_set(["k", "v", "ks"], [ptr] * 3, [BIG, BIG, SMALL]) == [0, 0, -1]
        assert len(_warnings(caplog)) == 1, _warnings(caplog)
        assert fs.clear() is True
        assert store.keys() == []  # clear() removed what batch_set stored


@pytest.mark.parametrize("how", ["raises", "hangs"])
def test_a_failing_size_group_keeps_what_the_other_sizes_fetched(
    how: str, caplog: pytest.LogCaptureFixture, virtual_loop: trio.testing.MockClock
) -> None:
    """batch_get likewise: the values of one size, fetched and sound, were dropped (-1, the
    caller's buffer untouched) because another size's fetch failed after them. In virtual
    time, as the test above."""
    src, ptr = _buf(bytes(range(BIG)))
    store = _FailsOneSize(how)
    with KVPipeStorage(store=store, timeout=30.0) as fs:
        assert fs.batch_set(["k", "v", "ks"], [ptr] * 3, [BIG, BIG, SMALL]) == [0, 0, 0]
        store.armed = True
        dst, dp = _buf(bytes(3 * BIG))
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            got = fs.batch_get(["k", "v", "ks"], [dp, dp + BIG, dp + 2 * BIG], [BIG, BIG, SMALL])
        assert got == [BIG, BIG, -1]
        assert dst.raw == src.raw * 2 + bytes(BIG)
        assert len(_warnings(caplog)) == 1, _warnings(caplog)


def test_a_batch_set_cut_off_by_close_keeps_no_keys_after_it() -> None:
    """``close()`` lets go of the keys kept for ``clear`` (which cannot run after it). A
    ``batch_set`` that close cut off in its second chunk remembered its first chunk's keys
    once close had emptied the set: the object kept them for as long as it lived."""
    import threading

    from kvpipe.integrations._fd_storage import BATCH_SET_CHUNK

    in_second = threading.Event()

    class HangsInSecondPut(kvpipe.MemoryStore):  # type: ignore[misc]
        puts = 0

        async def put_blocks(self, batch: kvpipe.PutBatch) -> Sequence[kvpipe.BlockStatus]:
            self.puts += 1
            if self.puts == 2:
                in_second.set()
                await anyio.sleep_forever()
            return await super().put_blocks(batch)

    n = BATCH_SET_CHUNK + 1
    _keep, ptr = _buf(b"z" * 16)
    fs = KVPipeStorage(store=HangsInSecondPut())
    closed = threading.Event()
    run = fs._run

    def descheduled(*args: object, **kw: object) -> object:
        """The caller thread, cut off, resumes only once close() has returned."""
        got = run(*args, **kw)  # type: ignore[arg-type]
        if got is None:
            assert closed.wait(10)
        return got

    fs._run = descheduled  # type: ignore[method-assign]
    result: list[list[int]] = []
    caller = threading.Thread(
        target=lambda: result.append(fs.batch_set([f"k{i}" for i in range(n)], [ptr] * n, [16] * n))
    )
    caller.start()
    assert in_second.wait(10)
    fs.close()
    closed.set()
    caller.join(10)
    assert result == [[0] * BATCH_SET_CHUNK + [-1]]
    assert len(fs._own) == 0


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"tp_size": -2}, "tp_size"), ({"tp_size": 2.5}, "tp_size"), ({"tp_rank": True}, "tp_rank")],
)
def test_a_tp_size_or_rank_that_names_none_is_refused(kw: dict[str, object], field: str) -> None:
    """tp_size scopes every key; -2 or 2.5 were taken as they were (keys scoped by "tp-2"),
    a bool rank as 1. None (or 0), as FastDeploy may pass, is still one rank."""
    with pytest.raises(kvpipe.ConfigError) as caught:
        KVPipeStorage(store=kvpipe.MemoryStore(), **kw)
    assert caught.value.field == field
    with KVPipeStorage(store=kvpipe.MemoryStore(), tp_size=None, tp_rank=None) as s:
        assert (s.tp_size, s.tp_rank) == (1, 0)


def test_calls_after_close_log_a_bounded_number_of_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """FastDeploy keeps calling a storage whose store closed (or is down) for every request:
    each call logged one WARNING, thousands a second. The first of each kind shows; the
    others go to DEBUG until the interval passes (:mod:`kvpipe._lograte`)."""
    _keep, ptr = _buf(b"c" * 16)
    fs = KVPipeStorage(store=kvpipe.MemoryStore())
    assert fs.batch_set(["a"], [ptr], [16]) == [0]
    fs.close()
    n = 30
    with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
        for _ in range(n):
            assert fs.batch_get(["a"], [ptr], [16]) == [-1]
            assert fs.batch_set(["b"], [ptr], [16]) == [-1]
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings  # one per operation
    assert all("PipelineClosed" in w for w in warnings), warnings
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "KVPipeStorage" in r.msg]
    assert len(debug) == 2 * (n - 1)


class _Down(kvpipe.MemoryStore):  # type: ignore[misc]
    """A store that fails every lookup, naming itself."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.down = name

    async def exists(self, batch: kvpipe.KeyBatch) -> list[bool]:
        raise kvpipe.BackendError("memory", "exists", f"{self.down} is down")


def test_one_instances_repeated_warnings_do_not_hide_anothers_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two instances in one process shared one log limiter: while one's store was down
    (a WARNING per interval, the rest at DEBUG), another's store going down logged its
    first failure of the same kind at DEBUG, and later ones only when they happened to
    come first after an interval, so the operator saw the first store fail and never the
    second. Each instance's repeats are bounded on their own."""
    with (
        KVPipeStorage(store=_Down("store A")) as a,
        KVPipeStorage(store=_Down("store B")) as b,
        caplog.at_level(logging.DEBUG, "kvpipe.integrations"),
    ):
        for _ in range(10):
            assert a.exists(["k"]) == {"k": False}
        assert b.exists(["k"]) == {"k": False}
        assert a.exists(["k"]) == {"k": False}
    warnings = _warnings(caplog)
    assert len(warnings) == 2, warnings
    assert "store A is down" in warnings[0] and "store B is down" in warnings[1], warnings


@pytest.mark.parametrize("how", ["short", "corrupt", "another key's"])
def test_values_that_fail_their_checks_log_one_bounded_warning_naming_key_and_why(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A value that fails its checks on every call (stored short or of another size,
    corrupt, another key's) logged 'batch_get: N of M values failed their checks' at
    WARNING on every call (FastDeploy asks again for every request), naming neither the key
    nor why. The first names FastDeploy's key (not the hashed one) and the check it failed;
    the rest go to DEBUG until the interval passes. A missing key is no failed check."""
    import numpy as np

    store = kvpipe.MemoryStore()
    _keep, ptr = _buf(bytes(range(64)))
    out, op = _buf(b"\0" * 64)
    with KVPipeStorage(store=store) as fs:
        assert fs.batch_set(["victim"], [ptr], [64]) == [0]
        (victim,) = store.keys()
        assert fs.batch_set(["other"], [ptr], [64]) == [0]
        (other,) = set(store.keys()) - {victim}
        data = store._data
        if how == "corrupt":
            flipped = np.array(data[victim])
            flipped[5] ^= 0xFF
            data[victim] = flipped
        elif how == "another key's":
            data[victim] = data[other]
        size = 32 if how == "short" else 64
        n = 30
        with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
            for _ in range(n):
                assert fs.batch_get(["missing", "victim"], [op, op], [64, size]) == [-1, -1]
    assert out.raw == b"\0" * 64  # nothing reached the buffer
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    (line,) = warnings
    assert "1 of 2 values failed their checks" in line and "'victim'" in line, line
    assert "missing" not in line and "fd@" not in line, line
    why = {"short": "of another size", "corrupt": "checksum", "another key's": "another key"}
    assert why[how] in line, line
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "their checks" in r.msg]
    assert len(debug) == n - 1


@pytest.mark.parametrize(
    ("k", "v", "timeout"),
    [
        (["k0", None], ["v0", "v1"], 10.0),  # a key that is no str
        (["k0", ""], ["v0", "v1"], 10.0),  # an empty key
        (["k0"], 7, 10.0),  # no list
        (["k0"], ["v0"], "soon"),  # a timeout that is no number
        (["k0"], ["v0"], "10"),  # nor is a number's text (float() took it)
        (["k0"], ["v0"], None),  # nor None (taken as the instance's timeout)
        (["k0"], ["v0"], True),  # nor a bool (taken as 1 s)
    ],
)
def test_query_answers_0_for_bad_arguments_never_raising(
    k: object, v: object, timeout: object, caplog: pytest.LogCaptureFixture
) -> None:
    """FastDeploy's read_storage_task calls query outside the handler that sends the
    task's done signal (cache_transfer_manager.py): a query that raised (TypeError from a
    key, ValueError from float(timeout)) left the engine waiting for that signal for good.
    As KVPipeAttentionStore.query: 0, logged at ERROR; the others are answered as before."""
    _keep, ptr = _buf(b"q" * 8)
    with KVPipeStorage(store=kvpipe.MemoryStore()) as fs:
        assert fs.batch_set(["k0", "v0"], [ptr, ptr], [8, 8]) == [0, 0]
        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            assert fs.query(k, v, timeout=timeout) == 0  # type: ignore[arg-type]
        assert fs.query(["k0"], ["v0"]) == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "bad arguments" in errors[0], errors


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "30", None, True])
def test_a_timeout_that_is_no_positive_number_is_refused_at_construction(bad: object) -> None:
    """timeout was kept as given: 0 or less (or NaN) made every batch_set / batch_get /
    exists answer as a store that missed its deadline (-1, False, one WARNING each), and
    "30" or None raised TypeError from every call: a wrong setting that showed only once
    the server ran, most of it as a failing store. As PipelineConfig's timeouts, it is a
    finite number > 0, else a ConfigError naming the field when the object is made."""
    with pytest.raises(kvpipe.ConfigError) as caught:
        KVPipeStorage(store=kvpipe.MemoryStore(), timeout=bad)  # type: ignore[arg-type]
    assert caught.value.field == "timeout"
    _keep, ptr = _buf(b"t" * 8)
    with KVPipeStorage(store=kvpipe.MemoryStore(), timeout=5) as fs:
        assert fs.batch_set(["k"], [ptr], [8]) == [0]
