"""The read state machine, without an event loop: random interleavings of slice
resolutions, stops, scatters and endings, checked against its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe._plan import plan_slices
from kvpipe._read_machine import ReadMachine


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 30), st.integers(1, 6), st.data())
def test_random_interleavings_keep_every_invariant(
    blocks: int, per: int, data: st.DataObject
) -> None:
    m = ReadMachine("r", 0, blocks, started=0.0)
    slices = plan_slices(0, blocks, per, 16, blocks * 16)
    m.plan(slices, now=0.0)
    loaded: dict[int, int] = {}
    running = 0
    settled_result = m.result
    settled_error = m.error
    first_ending: str | None = None  # "end" or "fail": the first one wins
    now = 0.0
    for _ in range(data.draw(st.integers(0, 4 * len(slices) + 4))):
        now += 1
        was_aborted, was_ended = m.aborted, m.ended
        event = data.draw(
            st.sampled_from(["resolve", "resolve", "begin", "finish", "stop", "end", "fail"])
        )
        if event == "resolve" and m.pending:
            index = data.draw(st.sampled_from(sorted(m.pending)))
            got = data.draw(st.integers(0, slices[index].count))
            if m.stopped_before(slices[index].first_block):
                got = 0  # the actors resolve a slice past the stop with nothing loaded
            m.resolve(index, got, now)
            loaded.setdefault(index, got)
        elif event == "begin":
            ok = m.scatter_begin()
            assert ok == (not was_aborted and not was_ended)  # nothing after an abort
            running += ok
        elif event == "finish" and running:
            m.scatter_end(now)
            running -= 1
        elif event == "stop" and blocks:
            m.stop_at(data.draw(st.integers(0, blocks - 1)), "failed_block", [], "bad")
        if event in ("end", "fail") and not was_aborted and not was_ended:
            first_ending = first_ending or event
        if event == "end":
            m.end(
                data.draw(st.sampled_from(["total_timeout", "cancelled", "actor_crashed"])),
                "x",
                now,
            )
        elif event == "fail":
            m.fail(RuntimeError("closing"), now)
        assert m.scatters == running
        if m.ended and first_ending == "end":
            assert m.result is not None, "a failure after the read ended replaced its result"
        if m.ended and first_ending == "fail":
            assert m.error is not None
        # settled only when no scatter runs after an abort; and only once
        if m.ended and m.aborted:
            assert running == 0 or was_ended
        if settled_result is not None:
            assert m.result is settled_result and m.error is None
        if settled_error is not None:
            assert m.error is settled_error and m.result is None
        settled_result, settled_error = m.result, m.error
    if m.result is not None:
        r = m.result
        expect = 0
        for s in slices:
            got = loaded.get(s.index, 0)
            expect += got
            if got < s.count:
                break
        assert r.loaded == expect <= blocks
        assert r.complete == (r.loaded == blocks)
        assert (r.stop_reason is None) == r.complete
        if not r.complete:
            assert r.failed_blocks and min(b for b in r.failed_blocks if b >= r.loaded) >= r.loaded


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
