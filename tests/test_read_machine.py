"""The read state machine, without an event loop: random interleavings of slice
resolutions, stops, scatters and endings, checked against its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe._plan import plan_slices
from kvpipe._read_machine import FetchedSlice, ReadMachine, ShortSlice, fetch_failure
from kvpipe._results import ReadStopReason
from kvpipe.backends._base import BlockStatus

_STOPS: tuple[ReadStopReason, ...] = ("failed_block", "slice_timeout", "total_timeout")


@settings(max_examples=600, deadline=None)
@given(st.integers(0, 30), st.integers(1, 6), st.data())
def test_random_interleavings_keep_every_invariant(
    blocks: int, per: int, data: st.DataObject
) -> None:
    """A model of the read alongside the machine: when it must be settled (no scatter
    running, and every slice resolved or the read aborted: never before, never later), with
    which leading run and which stop reason. Planned as the scheduler plans it: a probe that
    found a miss records the stop first and plans the slices before it; a failed probe
    records a stop at the first block and plans none."""
    start = data.draw(st.integers(0, 3))
    m = ReadMachine("r", start, start + blocks, started=0.0)
    probe = data.draw(st.sampled_from(["all", "miss", "error"])) if blocks else "all"
    available = blocks
    stop: tuple[int, ReadStopReason] | None = None  # the earliest stop recorded (the model's)
    if probe == "miss":
        available = data.draw(st.integers(0, blocks - 1))
        m.stop_at(start + available, "not_stored", [start + available])
        stop = (start + available, "not_stored")
    elif probe == "error":
        available = 0
        m.stop_at(start, "backend_error", [], "exists failed")
        stop = (start, "backend_error")
    slices = plan_slices(start, start + available, per, 16, (start + blocks) * 16)
    m.plan(slices, now=0.0)
    by_index = {s.index: s for s in slices}
    loaded: dict[int, int] = {}
    running = 0
    settled_result = m.result
    settled_error = m.error
    ending: str | None = None  # the first ending: "fail", or the cause of "end"
    expected_reason: ReadStopReason | None = None
    settled_loaded = 0
    now = 0.0

    def leading_run() -> int:
        run = 0
        for s in slices:
            got = loaded.get(s.index, 0)
            run += got
            if got < s.count:
                break
        return run

    def expect_settled_now() -> None:
        nonlocal expected_reason, settled_loaded
        settled_loaded = leading_run()
        first_missing = start + settled_loaded
        if settled_loaded == blocks:
            expected_reason = None
        elif ending not in (None, "fail") and (stop is None or first_missing < stop[0]):
            expected_reason = ending  # type: ignore[assignment]
        else:
            expected_reason = stop[1] if stop is not None else "failed_block"

    if m.ended:
        expect_settled_now()
    for _ in range(data.draw(st.integers(0, 4 * len(slices) + 4))):
        now += 1
        was_aborted, was_ended = m.aborted, m.ended
        event = data.draw(
            st.sampled_from(["resolve", "resolve", "begin", "finish", "stop", "end", "fail"])
        )
        if event == "resolve" and m.pending:
            index = data.draw(st.sampled_from(sorted(m.pending)))
            spec = by_index[index]
            # the actors never load past where loading stopped (the swapper scatters only
            # what is loadable; a slice past the stop is resolved with nothing)
            got = data.draw(st.integers(0, m.loadable(spec.first_block, spec.count)))
            if m.stopped_before(spec.first_block):
                got = 0
            m.resolve(index, got, now)
            if not was_ended:
                loaded.setdefault(index, got)
        elif event == "begin":
            ok = m.scatter_begin()
            assert ok == (not was_aborted and not was_ended)  # nothing after an abort
            running += ok
        elif event == "finish" and running:
            m.scatter_end(now)
            running -= 1
        elif event == "stop" and blocks:
            block = start + data.draw(st.integers(0, blocks - 1))
            reason = data.draw(st.sampled_from(_STOPS))
            m.stop_at(block, reason, [block], "bad")
            if not was_ended and (stop is None or block < stop[0]):
                stop = (block, reason)
        elif event == "end":
            cause = data.draw(st.sampled_from(["total_timeout", "cancelled", "actor_crashed"]))
            m.end(cause, "x", now)  # type: ignore[arg-type]
            if not was_aborted and not was_ended:
                ending = cause
        elif event == "fail":
            m.fail(RuntimeError("closing"), now)
            if not was_aborted and not was_ended:
                ending = "fail"
        assert m.scatters == running
        # settled exactly when nothing is left to wait for: no scatter running, and every
        # slice resolved or the read aborted (never while a scatter may still write into the
        # caller's cache; never later, or the caller waits for its deadline guard)
        must_be_settled = running == 0 and (m.aborted or not m.pending)
        assert m.ended == (was_ended or must_be_settled), (event, running, m.pending)
        if m.ended and not was_ended:
            expect_settled_now()
        if m.ended and ending not in (None, "fail"):
            assert m.result is not None, "a failure after the read ended replaced its result"
        if m.ended and ending == "fail":
            assert m.error is not None and m.result is None
        if settled_result is not None:
            assert m.result is settled_result and m.error is None
        if settled_error is not None:
            assert m.error is settled_error and m.result is None
        settled_result, settled_error = m.result, m.error
    if m.result is not None:
        r = m.result
        assert r.loaded == settled_loaded <= blocks
        assert r.complete == (r.loaded == blocks)
        assert r.stop_reason == expected_reason
        if not r.complete:
            first_missing = start + r.loaded
            assert r.failed_blocks and all(start <= b < start + blocks for b in r.failed_blocks)
            assert any(b >= first_missing for b in r.failed_blocks)


def test_an_aborted_read_waits_for_the_scatter_in_flight() -> None:
    m = ReadMachine("r", 0, 8, started=0.0)
    m.plan(plan_slices(0, 8, 4, 16, 128), now=0.0)
    assert m.scatter_begin()
    m.end("cancelled", "caller cancelled", now=1.0)
    assert not m.ended and not m.scatter_begin()
    m.resolve(0, 4, now=2.0)
    m.scatter_end(now=3.0)
    assert m.result is not None and m.result.loaded == 4 and m.result.stop_reason == "cancelled"
    assert m.result.elapsed == 3.0


def test_an_abort_while_the_last_scatter_lands_every_block_leaves_the_read_complete() -> None:
    """The deadline guard ends the read while its last scatter runs; the scatter lands every
    block. Nothing was cut short: no failed block (it named block 8, one past the read's
    range), no stop reason, no error."""
    m = ReadMachine("r", 0, 8, started=0.0)
    m.plan(plan_slices(0, 8, 4, 16, 128), now=0.0)
    m.resolve(0, 4, now=1.0)
    assert m.scatter_begin()
    m.end("total_timeout", "deadline passed", now=2.0)
    m.resolve(1, 4, now=3.0)
    m.scatter_end(now=3.0)
    assert m.result is not None and (m.result.loaded, m.result.complete) == (8, True)
    assert (m.result.failed_blocks, m.result.stop_reason, m.result.error) == ((), None, None)


def test_the_first_ending_wins_over_a_failure_while_the_scatter_finishes() -> None:
    """The read timed out while a scatter ran, then the pipeline closed before that scatter
    ended: the caller gets the partial result of the timeout, not ``PipelineClosed``."""
    m = ReadMachine("r", 0, 8, started=0.0)
    m.plan(plan_slices(0, 8, 4, 16, 128), now=0.0)
    assert m.scatter_begin()
    m.end("total_timeout", "deadline passed", now=1.0)
    m.fail(RuntimeError("pipeline closed"), now=1.5)
    m.resolve(0, 4, now=2.0)
    m.scatter_end(now=3.0)
    assert m.error is None and m.result is not None
    assert (m.result.loaded, m.result.stop_reason) == (4, "total_timeout")


@pytest.mark.parametrize("reached_the_miss", [True, False])
def test_an_abort_short_of_the_recorded_stop_is_the_stop_reason(reached_the_miss: bool) -> None:
    """The probe found block 6 missing; the deadline ends the read while slice 1 (blocks
    4-5) is being scattered. Where that scatter still lands, loading reached the miss, which
    is why the read stopped; where it does not, the deadline is."""
    m = ReadMachine("r", 0, 8, started=0.0)
    m.plan(plan_slices(0, 6, 4, 16, 128), now=0.0)
    m.stop_at(6, "not_stored", [6])
    m.resolve(0, 4, now=1.0)
    assert m.scatter_begin()
    m.end("total_timeout", "deadline passed", now=2.0)
    m.resolve(1, 2 if reached_the_miss else 0, now=3.0)
    m.scatter_end(now=3.0)
    assert m.result is not None
    if reached_the_miss:
        assert (m.result.loaded, m.result.stop_reason) == (6, "not_stored")
    else:
        assert (m.result.loaded, m.result.stop_reason) == (4, "total_timeout")
        assert m.result.error == "deadline passed" and m.result.failed_blocks == (4, 6)


def test_stop_at_only_moves_the_stop_earlier() -> None:
    m = ReadMachine("r", 0, 12, started=0.0)
    m.plan(plan_slices(0, 12, 4, 16, 192), now=0.0)
    assert m.stop_at(8, "failed_block", [8]) == 8
    assert m.stop_at(10, "failed_block", [10]) is None
    assert m.stop_at(5, "slice_timeout", [5, 6, 7]) == 5
    assert m.stopped_before(5) and not m.stopped_before(4)
    for i, got in enumerate((4, 1, 0)):
        m.resolve(i, got, now=1.0)
    assert m.result is not None and m.result.loaded == 5
    assert m.result.stop_reason == "slice_timeout" and m.result.failed_blocks == (5, 6, 7, 8, 10)


def test_loadable_counts_the_blocks_before_the_stop() -> None:
    m = ReadMachine("r", 0, 12, started=0.0)
    m.plan(plan_slices(0, 12, 4, 16, 192), now=0.0)
    assert m.loadable(4, 4) == 4  # no stop yet: all of them
    m.stop_at(6, "failed_block", [6])
    assert [m.loadable(first, 4) for first in (0, 4, 8)] == [4, 2, 0]
    assert m.loadable(4, 1) == 1


def test_misuse_is_refused() -> None:
    m = ReadMachine("r", 0, 4, started=0.0)
    m.plan(plan_slices(0, 4, 4, 16, 64), now=0.0)
    with pytest.raises(ValueError):
        m.scatter_end(now=1.0)
    with pytest.raises(ValueError):
        m.resolve(0, 5, now=1.0)


_OK, _MISSING, _FAILED = BlockStatus.OK, BlockStatus.MISSING, BlockStatus.FAILED


def test_a_fetch_without_an_answer_is_the_stores_error_or_out_of_time() -> None:
    assert fetch_failure(3, "disk on fire", total=True) == ("backend_error", "disk on fire")
    assert fetch_failure(3, None, total=False) == ("slice_timeout", "slice 3 ran out of time")
    assert fetch_failure(3, None, total=True) == ("total_timeout", "slice 3 ran out of time")


def test_a_sound_slice_stops_nowhere() -> None:
    fetch = FetchedSlice(8, [_OK] * 3, [None] * 3)
    assert fetch.refetch_from() is None and fetch.short() is None and fetch.valid == 3
    assert fetch.corrupt(["a", "b", "c"]) == [] and not fetch.failed_checks


@pytest.mark.parametrize(
    ("status", "gone"), [(_MISSING, True), (_FAILED, False), (BlockStatus.CORRUPT, False)]
)
def test_a_block_the_store_did_not_fetch_stops_the_slice(status: BlockStatus, gone: bool) -> None:
    fetch = FetchedSlice(8, [_OK, status, _OK, _FAILED], [None])
    assert fetch.refetch_from() is None
    short = fetch.short()
    assert short == ShortSlice(9, status.value, status.value, gone, [9, 11])
    assert short.detail == f"block 9: {status.value}"


def test_a_block_that_fails_its_check_is_fetched_again_from_there() -> None:
    fetch = FetchedSlice(8, [_OK] * 3 + [_MISSING], [None, "bad trailer", None])
    assert fetch.refetch_from() == 1 and fetch.failed_checks == {1}
    assert fetch.short() == ShortSlice(9, "bad trailer", "verify", False, [9, 11])


def test_a_block_damaged_in_transit_passes_when_fetched_again() -> None:
    fetch = FetchedSlice(8, [_OK] * 3 + [_MISSING], [None, "bad trailer", None])
    fetch.refetched(1, [_OK, _OK], [None, None])
    assert fetch.valid == 3 and fetch.corrupt(["a", "b", "c", "d"]) == []
    assert fetch.failed_checks == {1}  # counted all the same
    assert fetch.short() == ShortSlice(11, "missing", "missing", True, [11])


def test_a_block_that_fails_its_check_twice_is_corrupt() -> None:
    fetch = FetchedSlice(8, [_OK] * 4, [None, "bad key", None, "bad sum"])
    assert fetch.refetch_from() == 1
    # block 1 fails both checks; block 2 fails to come back, so block 3 is not checked again
    fetch.refetched(1, [_OK, _FAILED, _OK], ["bad key"])
    assert fetch.statuses == [_OK, _OK, _FAILED, _OK] and fetch.fetched == 2
    assert fetch.corrupt(["a", "b", "c", "d"]) == [(9, "b")]
    assert fetch.failed_checks == {1, 3}
    assert fetch.short() == ShortSlice(9, "bad key", "verify", False, [9, 10])
