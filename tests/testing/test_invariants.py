"""The invariant checker catches each kind of violation (fed synthetic runs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import kvpipe
from kvpipe._keys import Scope, as_tokens, block_keys
from kvpipe.backends import BlockStatus
from kvpipe.testing.faults import FaultPlan, FaultyStore, StoreCall
from kvpipe.testing.invariants import Checker, Outcome, Verdict

LAYOUT = kvpipe.CacheLayout.mla(num_layers=1, kv_lora_rank=8, rope_dim=8, block_size=4)
SCOPE = Scope("inv", LAYOUT.fingerprint)
TOKENS = np.arange(12)


def _source() -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, 8)
    rng = np.random.default_rng(0)
    for rows in cache.byte_rows:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    return cache


def _write(
    written: int,
    skipped: int = 0,
    elapsed: float = 0.1,
    error: Exception | None = None,
    reason: str | None = None,
) -> Outcome:
    slices = (
        (kvpipe.SliceOutcome(0, skipped, 3 - skipped, written, elapsed, "complete"),)
        if written
        else ()
    )
    result = kvpipe.WriteResult(
        "w1", 3, skipped, written, skipped + written == 3, reason, slices, elapsed
    )  # type: ignore[arg-type]
    return Outcome(
        "write",
        "w1",
        TOKENS,
        np.array([2, 3, 4]),
        False,
        0,
        elapsed,
        1.0,
        result=None if error else result,
        error=error,
    )


def _payload(cache: kvpipe.KVCache, b: int) -> bytes:
    return b"".join(rows[b].tobytes() for rows in cache.byte_rows)


def _store() -> FaultyStore:
    return FaultyStore(kvpipe.MemoryStore(), FaultPlan())


def _putting(statuses: tuple[BlockStatus, ...] | None, outcome: str = "ok") -> FaultyStore:
    """A store whose log holds w1's one put of blocks 0-2, which returned ``statuses``."""
    store = _store()
    call = StoreCall("put", 0, "w1", 0, (), 0.0, statuses=statuses)
    call.finished, call.outcome = 0.1, outcome
    store.calls.append(call)
    return store


OK3 = (BlockStatus.OK,) * 3
OK_FAILED_OK = (BlockStatus.OK, BlockStatus.FAILED, BlockStatus.OK)


def test_stored_holds_when_every_counted_block_is_there() -> None:
    source = _source()
    checker = Checker(source, SCOPE, 0.1)
    checker.wrote(_write(3))
    keys = block_keys(SCOPE, as_tokens(TOKENS), 4, False)
    checker.check_stored(
        _putting((BlockStatus.OK,) * 3),
        {k: _payload(source, 2 + i) + b"trailer" for i, k in enumerate(keys)},
    )
    assert checker.verdicts["stored"].held and checker.verdicts["stored"].checked == 3


@pytest.mark.parametrize("breakage", ["missing", "other bytes"])
def test_stored_catches_counted_blocks_that_are_not_right(breakage: str) -> None:
    source = _source()
    checker = Checker(source, SCOPE, 0.1)
    checker.wrote(_write(3))
    keys = block_keys(SCOPE, as_tokens(TOKENS), 4, False)
    stored = {k: _payload(source, 2 + i) for i, k in enumerate(keys)}
    if breakage == "missing":
        del stored[keys[2]]
    else:
        stored[keys[1]] = _payload(source, 7)
    checker.check_stored(_putting((BlockStatus.OK,) * 3), stored)
    assert not checker.verdicts["stored"].held


@pytest.mark.parametrize(("corruptions", "held"), [(0, False), (1, False), (2, True)])
def test_stored_excuses_a_deleted_block_only_after_two_corrupted_fetches(
    corruptions: int, held: bool
) -> None:
    """kvpipe deletes a block that failed verification twice; the faults corrupt fetches,
    never the store, so a deleted block the faults corrupted less than twice was a good one
    (deleted after a single failure, corruption in transit: it was excused all the same)."""
    source = _source()
    keys = block_keys(SCOPE, as_tokens(TOKENS), 4, False)
    store = _putting(OK3)
    for n in range(corruptions):
        get = StoreCall("get", n, "r1", 0, tuple(keys), 1.0 + n, corrupted=(keys[1],))
        get.finished, get.outcome = 1.5 + n, "ok"
        store.calls.append(get)
    delete = StoreCall("delete", 0, "", 0, (keys[1],), 3.0)
    delete.finished, delete.outcome = 3.1, "ok"
    store.calls.append(delete)
    checker = Checker(source, SCOPE, 0.1)
    checker.wrote(_write(3))
    checker.check_stored(store, {k: _payload(source, 2 + i) for i, k in enumerate(keys) if i != 1})
    verdict = checker.verdicts["stored"]
    assert verdict.held is held, verdict.details
    assert checker.removed_after_verification == (1 if held else 0)


@pytest.mark.parametrize(("lie_at", "held"), [(0.05, True), (5.0, False)])
def test_stored_excuses_skipped_blocks_only_for_a_lie_to_the_write_itself(
    lie_at: float, held: bool
) -> None:
    """A write whose dedup probe the store lied to skipped blocks that are not stored: its
    skipped blocks are not judged. A lie to the read of the same request id, later, used to
    excuse the write's skipped blocks all the same."""
    source = _source()
    keys = block_keys(SCOPE, as_tokens(TOKENS), 4, False)
    store = _store()
    put = StoreCall("put", 0, "w1", 2, (keys[2],), 0.06, statuses=(BlockStatus.OK,))
    put.finished, put.outcome = 0.07, "ok"
    lie = StoreCall("exists", 0, "w1", 0, tuple(keys), lie_at, injected=["lie"])
    lie.finished, lie.outcome = lie_at + 0.01, "ok"
    store.calls += [lie, put] if lie_at < 0.06 else [put, lie]
    write = _write(1, skipped=2)
    write.started = 0.0
    checker = Checker(source, SCOPE, 0.1)
    checker.wrote(write)
    checker.check_stored(store, {keys[2]: _payload(source, 4)})
    verdict = checker.verdicts["stored"]
    assert verdict.held is held, verdict.details


def _counted_slice(written: int, outcome: str) -> Outcome:
    """w1 writing blocks 0-2 in one slice that counted ``written`` with ``outcome``."""
    o = _write(written)
    assert isinstance(o.result, kvpipe.WriteResult)
    stop = None if outcome == "complete" else outcome
    o.result = kvpipe.WriteResult(
        "w1",
        3,
        0,
        written,
        written == 3,
        stop,  # type: ignore[arg-type]
        (kvpipe.SliceOutcome(0, 0, 3, written, 0.1, outcome),),  # type: ignore[arg-type]
        0.1,
    )
    return o


@pytest.mark.parametrize(
    ("written", "outcome", "returned", "call_outcome", "held"),
    [
        (3, "complete", OK3, "ok", True),
        (1, "incomplete", OK_FAILED_OK, "incomplete", True),
        # the deadline cut the slice off while its put was returning: nothing counts
        (0, "total_timeout", OK3, "ok", True),
        (0, "slice_timeout", None, "cancelled", True),
        # a put the pipeline gave up on, stored later by a late completion: it counted
        (2, "slice_timeout", None, "cancelled", False),
        (3, "complete", None, "cancelled", False),
        (2, "backend_error", None, "error", False),
        # fewer or more than the leading run its put returned
        (0, "incomplete", OK_FAILED_OK, "incomplete", False),
        (2, "incomplete", OK_FAILED_OK, "incomplete", False),
    ],
)
def test_stored_judges_each_slice_by_what_its_put_returned(
    written: int,
    outcome: str,
    returned: tuple[BlockStatus, ...] | None,
    call_outcome: str,
    held: bool,
) -> None:
    """Every block is in the store with the right bytes (a late completion stored the lot),
    so only the put's answer at the time tells a count that is a lie."""
    source = _source()
    keys = block_keys(SCOPE, as_tokens(TOKENS), 4, False)
    stored = {k: _payload(source, 2 + i) for i, k in enumerate(keys)}
    checker = Checker(source, SCOPE, 0.1)
    checker.wrote(_counted_slice(written, outcome))
    checker.check_stored(_putting(returned, call_outcome), stored)
    verdict = checker.verdicts["stored"]
    assert verdict.held is held, verdict.details


def test_stored_catches_written_that_its_slices_do_not_add_up_to() -> None:
    source = _source()
    keys = block_keys(SCOPE, as_tokens(TOKENS), 4, False)
    o = _counted_slice(1, "incomplete")
    assert isinstance(o.result, kvpipe.WriteResult)
    o.result = dataclasses.replace(o.result, written=2)
    checker = Checker(source, SCOPE, 0.1)
    checker.wrote(o)
    checker.check_stored(
        _putting(OK_FAILED_OK, "incomplete"),
        {k: _payload(source, 2 + i) for i, k in enumerate(keys)},
    )
    assert not checker.verdicts["stored"].held


def _call(
    op: str,
    n: int,
    first: int,
    start: float,
    end: float,
    outcome: str,
    rid: str = "w1",
    addresses: tuple[int, ...] = (),
) -> StoreCall:
    c = StoreCall(op, n, rid, first, (), start, addresses=addresses, value_nbytes=64)
    c.finished, c.outcome = end, outcome
    return c


def test_prefix_catches_a_slice_sent_after_an_incomplete_one() -> None:
    store = _store()
    store.calls += [
        _call("put", 0, 0, 0.0, 1.0, "ok"),
        _call("put", 1, 4, 1.0, 2.0, "incomplete"),
        _call("put", 2, 8, 2.0, 3.0, "ok"),
    ]
    checker = Checker(_source(), SCOPE, 0.1)
    checker.check_prefix(store)
    assert not checker.verdicts["prefix"].held
    good = _store()
    good.calls += store.calls[:2]
    checker = Checker(_source(), SCOPE, 0.1)
    checker.check_prefix(good)
    assert checker.verdicts["prefix"].held


def test_prefix_catches_slices_out_of_order() -> None:
    store = _store()
    store.calls += [_call("put", 0, 4, 0.0, 1.0, "ok"), _call("put", 1, 0, 1.0, 2.0, "ok")]
    checker = Checker(_source(), SCOPE, 0.1)
    checker.check_prefix(store)
    assert not checker.verdicts["prefix"].held


def test_deadline_catches_an_overrun_and_reports_it() -> None:
    checker = Checker(_source(), SCOPE, 0.25)
    checker.wrote(_write(3, elapsed=1.2))  # limit 1.0, slack 0.25: fine
    checker.wrote(_write(3, elapsed=1.4))  # 0.4 past: broken
    worst, _ = checker.check_deadlines()
    assert worst == pytest.approx(0.4)
    assert not checker.verdicts["deadline"].held


def test_staging_catches_two_live_calls_on_one_buffer_and_a_changed_late_buffer() -> None:
    store = _store()
    store.calls += [
        _call("put", 0, 0, 0.0, 2.0, "ok", addresses=(100, 200)),
        _call("get", 0, 0, 1.0, 3.0, "ok", "r", addresses=(300, 200)),
    ]
    checker = Checker(_source(), SCOPE, 0.1)
    checker.check_staging(store)
    assert not checker.verdicts["staging"].held
    store = _store()
    late = _call("put", 0, 0, 0.0, 1.0, "cancelled", addresses=(100,))
    late.released, late.digests, late.late_digests = 5.0, (1,), (2,)
    store.calls += [late, _call("put", 1, 0, 6.0, 7.0, "ok", addresses=(100,))]
    checker = Checker(_source(), SCOPE, 0.1)
    checker.check_staging(store)
    details = checker.verdicts["staging"].details
    assert len(details) == 1 and "changed" in details[0]


def _stats(**changes: object) -> kvpipe.PipelineStatistics:
    base: dict[str, object] = dict(
        open=False,
        device_path="host",
        device_note="",
        in_flight={},
        queue_depths={"writer": 0},
        queue_capacity=4,
        restarts={},
        slices={},
        counters={},
        staging_capacity_bytes=1,
        staging_in_use_bytes=0,
        staging_waiters=0,
        slice_blocks=4,
    )
    base.update(changes)
    return kvpipe.PipelineStatistics(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "bad",
    [{"staging_in_use_bytes": 64}, {"in_flight": {"write": 1}}, {"threads_running": 1}],
)
def test_idle_catches_what_is_left_behind(bad: dict[str, object]) -> None:
    checker = Checker(_source(), SCOPE, 0.1)
    checker.check_idle(_stats(**bad), capacity=4)
    assert not checker.verdicts["idle"].held
    checker = Checker(_source(), SCOPE, 0.1)
    checker.sample(_stats(queue_depths={"writer": 5}))
    checker.check_idle(_stats(), capacity=4)
    assert not checker.verdicts["idle"].held


def test_loaded_catches_a_block_loaded_with_wrong_bytes() -> None:
    source, dst = _source(), kvpipe.create_kv_cache(LAYOUT, 8)
    for rows_s, rows_d in zip(source.byte_rows, dst.byte_rows, strict=True):
        rows_d[[5, 6]] = rows_s[[2, 3]]
    result = kvpipe.ReadResult("r1", 3, 2, False, (2,), "failed_block", 0.1)
    o = Outcome(
        "read",
        "r1",
        TOKENS,
        np.array([2, 3, 4]),
        False,
        0,
        0.1,
        1.0,
        result=result,
        dst_ids=np.array([5, 6, 7]),
    )
    checker = Checker(source, SCOPE, 0.1)
    checker.read(o)
    checker.check_loaded({"r1": dst})
    assert checker.verdicts["loaded"].held and checker.verdicts["loaded"].checked == 2
    for rows in dst.byte_rows:
        rows[6] ^= 1
    checker = Checker(source, SCOPE, 0.1)
    checker.read(o)
    checker.check_loaded({"r1": dst})
    assert not checker.verdicts["loaded"].held


def test_crash_catches_a_request_failed_by_an_actor_that_did_not_hold_it() -> None:
    crash = kvpipe.ActorCrash("writer", 1.0, ("other",), "boom", True)
    checker = Checker(_source(), SCOPE, 0.1)
    checker.wrote(_write(0, reason="actor_crashed"))
    checker.check_crashes(False, [crash])
    assert not checker.verdicts["crash"].held
    checker = Checker(_source(), SCOPE, 0.1)
    checker.wrote(_write(0, reason="actor_crashed"))
    checker.check_crashes(False, [kvpipe.ActorCrash("writer", 1.0, ("w1",), "boom", True)])
    assert checker.verdicts["crash"].held
    checker = Checker(_source(), SCOPE, 0.1)
    checker.wrote(_write(0, error=kvpipe.PipelineClosed("closed")))
    checker.check_crashes(False, [])
    assert not checker.verdicts["crash"].held


def test_crash_judges_each_call_by_the_pipeline_that_ran_it() -> None:
    """A workload's write and read of one request id run through two pipelines: a crash of
    the writing pipeline's writer that held ``w1`` does not excuse a read of ``w1`` failed
    by a crash in the reading pipeline that held nothing, nor does the writing pipeline's
    close excuse a ``PipelineClosed`` from the open reading one (pooled, both went
    unnoticed)."""
    crash = kvpipe.ActorCrash("writer", 1.0, ("w1",), "boom", True)

    def read(error: Exception) -> Outcome:
        return Outcome("read", "w1", TOKENS, np.array([2, 3, 4]), False, 0, 0.1, 1.0, error=error)

    for error, closed in (
        (kvpipe.ActorCrashed("reader", "boom"), {"write": False, "read": False}),
        (kvpipe.PipelineClosed("closed"), {"write": True, "read": False}),
    ):
        checker = Checker(_source(), SCOPE, 0.1)
        checker.wrote(_write(0, reason="actor_crashed"))
        checker.outcomes.append(read(error))
        checker.check_crashes(closed, {"write": [crash], "read": []})
        assert not checker.verdicts["crash"].held
        assert any("w1" in f for f in checker.verdicts["crash"].details)
        checker = Checker(_source(), SCOPE, 0.1)
        checker.wrote(_write(0, reason="actor_crashed"))
        checker.outcomes.append(read(error))
        checker.check_crashes(True, [crash])  # pooled: both excused, as before
        assert checker.verdicts["crash"].held


def test_a_verdict_counts_every_failure_beyond_the_details_it_keeps() -> None:
    """Verdict.fail keeps the first 10 details; the failures past them were not counted
    anywhere, so a report of 10 and one of 10,000 broken blocks read alike."""
    v = Verdict("stored")
    for i in range(25):
        v.fail(f"block {i}")
    assert not v.held and v.failures == 25 and len(v.details) == 10


@pytest.mark.slow  # real time: writer processes killed mid-write
async def test_every_kill_of_the_writer_leaves_a_stored_request_to_judge(tmp_path: Path) -> None:
    """The kill scenario killed its writer a random 0.05-0.4 s after the first write began:
    a kill during that write left nothing stored, nothing was judged, and the scenario
    passed on an empty store. It now kills only once one request is stored whole."""
    from kvpipe.testing.killwrite import run_kill_scenario

    result = await run_kill_scenario(str(tmp_path), seed=3, kills=2)
    verdicts = {v.name: v for v in result.verdicts}
    assert verdicts["stored"].held and verdicts["loaded"].held
    assert verdicts["stored"].checked >= 2 and verdicts["loaded"].checked >= 2 * 16
