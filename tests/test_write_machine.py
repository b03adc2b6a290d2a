"""The write state machine, without an event loop: random event orders, checked against the
invariants it alone is responsible for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe._plan import plan_slices
from kvpipe._results import SliceOutcome, SliceStatus
from kvpipe._write_machine import Ending, WriteMachine, leading_ok, put_outcome
from kvpipe.backends._base import BlockStatus

_FAILURES: tuple[SliceStatus, ...] = ("slice_timeout", "total_timeout", "backend_error")


def _outcome(spec_index: int, first: int, count: int, written: int, kind: str) -> SliceOutcome:
    status: SliceStatus
    if kind == "ok":
        status, written = "complete", count
    elif kind == "short":
        status, written = "incomplete", min(written, count - 1)
    else:
        status, written = kind, 0  # type: ignore[assignment]
    return SliceOutcome(spec_index, first, count, written, 0.1, status)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 40),  # blocks asked for
    st.integers(1, 7),  # blocks per slice
    st.data(),
)
def test_random_event_orders_keep_every_invariant(
    blocks: int, per: int, data: st.DataObject
) -> None:
    start = data.draw(st.integers(0, 3))
    m = WriteMachine("w", start, start + blocks, started=0.0)
    skipped = data.draw(st.integers(0, blocks))
    slices = plan_slices(start + skipped, start + blocks, per, 16, (start + blocks) * 16)
    # The caller's side may end a write still queued for the scheduler: planned then
    # changes nothing.
    ended_first = data.draw(st.sampled_from([None, None, None, "total_timeout", "fail"]))
    if ended_first == "fail":
        m.fail(RuntimeError("closing"))
    elif ended_first is not None:
        m.end(ended_first, "deadline passed while queued", 0.2)
    m.planned(skipped, slices, now=0.5)
    if ended_first is not None:
        assert m.skipped == 0 and m.slices == () and m.written == 0
        assert (m.result is None) == (ended_first == "fail")
        if m.result is not None:
            assert m.result.stop_reason == (ended_first if blocks else None)
        return
    settled = m.result
    expected_written = 0
    stopped = False
    #: Why the model says the write ended (``""``: complete), once it has.
    ended: str | None = "" if not slices else None
    in_flight: int | None = None  # the slice sent whose outcome is still to come
    cut_off: int | None = None  # the slice the total deadline cut off in its store call
    now = 1.0
    for _ in range(data.draw(st.integers(0, 4 * len(slices) + 3))):
        now += 1
        event = data.draw(
            st.sampled_from(["send", "slice", "slice", "slice", "end", "fail", "wrong"])
        )
        was_ended = m.ended
        if event == "send" and m.turn < len(slices):
            m.sent(m.turn, now)
            if not was_ended:
                in_flight = m.turn
        elif event == "slice" and m.turn < len(slices):
            spec = slices[m.turn]
            kind = data.draw(st.sampled_from(["ok", "ok", "short", *_FAILURES]))
            out = _outcome(
                spec.index, spec.first_block, spec.count, data.draw(st.integers(0, 8)), kind
            )
            m.slice_done(out, "detail", now)
            if not was_ended and not stopped:
                expected_written += out.written
                stopped = out.outcome != "complete"
                in_flight = None
                if stopped:
                    ended = "incomplete_slice" if out.outcome == "incomplete" else out.outcome
                elif spec.index == len(slices) - 1:
                    ended = ""  # the last slice stored whole: complete
        elif event == "wrong" and len(slices) > 1:
            wrong = (m.turn + 1) % len(slices)
            spec = slices[wrong]
            out = _outcome(spec.index, spec.first_block, spec.count, 0, "ok")
            if was_ended:
                m.slice_done(out, None, now)  # ignored once ended
            else:
                with pytest.raises(ValueError):
                    m.slice_done(out, None, now)
        elif event == "end":
            cause = data.draw(st.sampled_from(["total_timeout", "cancelled", "actor_crashed"]))
            m.end(cause, "x", now)
            if not was_ended and cause == "total_timeout" and in_flight is not None:
                cut_off = in_flight
            if ended is None:
                ended = cause
        elif event == "fail":
            m.fail(RuntimeError("closing"))
            if ended is None:
                ended = "fail"
        # ended exactly when the model says so: not before, and never later (a write that
        # has nothing left to do but stays open holds its caller until the deadline guard)
        assert m.ended == (ended is not None), (event, ended)
        assert (m.error is not None) == (ended == "fail")
        # exactly once: whatever came first stays
        if settled is not None or (was_ended and m.error is not None):
            assert m.result is settled
        settled = m.result
        assert not (m.result is not None and m.error is not None)
        if m.ended:
            assert not any(m.is_turn(i) for i in range(len(slices)))
    if m.result is not None:
        r = m.result
        assert r.written == expected_written == m.written
        assert r.skipped == skipped and r.requested == blocks
        assert r.complete == (r.skipped + r.written == blocks)
        # the contiguous prefix: every slice before the last recorded one is complete
        assert all(o.outcome == "complete" for o in r.slices[:-1])
        assert [o.index for o in r.slices] == list(range(len(r.slices)))
        assert (r.stop_reason is None) == r.complete
        if not r.complete:
            assert r.stop_reason == ended
        if not r.complete and r.slices and r.slices[-1].outcome == "incomplete":
            assert r.stop_reason == "incomplete_slice"
        # a slice sent when the total deadline ended the write has its one outcome
        if cut_off is not None:
            last = r.slices[-1]
            assert (last.index, last.outcome, last.written) == (cut_off, "total_timeout", 0)
            assert m.cut_off is last and r.stop_reason == "total_timeout"
        else:
            assert m.cut_off is None


def test_nothing_to_write_settles_at_once() -> None:
    m = WriteMachine("w", 0, 4, started=1.0)
    m.planned(4, (), now=3.0)
    assert m.result is not None and m.result.complete and m.result.skipped == 4
    assert m.result.elapsed == 2.0


def test_a_slice_claiming_more_than_it_carries_is_refused() -> None:
    m = WriteMachine("w", 0, 4, started=0.0)
    m.planned(0, plan_slices(0, 4, 4, 16, 64), now=0.0)
    with pytest.raises(ValueError):
        m.slice_done(SliceOutcome(0, 0, 4, 5, 0.1, "complete"), None, 1.0)
    with pytest.raises(ValueError):
        m.slice_done(SliceOutcome(0, 0, 4, 4, 0.1, "incomplete"), None, 1.0)


def _sent_slice_1() -> WriteMachine:
    m = WriteMachine("w", 0, 8, started=0.0)
    m.planned(0, plan_slices(0, 8, 4, 16, 128), now=0.0)
    m.slice_done(SliceOutcome(0, 0, 4, 4, 1.0, "complete"), None, 1.0)
    m.sent(1, 2.0)
    return m


def test_the_total_deadline_records_the_slice_in_its_store_call_whoever_reports_it() -> None:
    m = _sent_slice_1()
    m.end("total_timeout", "deadline passed waiting for staging", 5.0)
    cut_off = SliceOutcome(1, 4, 4, 0, 3.0, "total_timeout")
    assert m.cut_off == cut_off
    assert m.result is not None and m.result.slices[-1] == cut_off
    assert (m.result.written, m.result.stop_reason) == (4, "total_timeout")
    # the put's own report, later, changes nothing: nothing of it is counted
    m.slice_done(SliceOutcome(1, 4, 4, 4, 3.0, "complete"), None, 5.0)
    assert m.result.slices == (SliceOutcome(0, 0, 4, 4, 1.0, "complete"), cut_off)
    assert m.result.written == 4


@pytest.mark.parametrize("cause", ["cancelled", "actor_crashed"])
def test_a_slice_cut_off_by_cancellation_or_a_crash_is_not_recorded(cause: Ending) -> None:
    m = _sent_slice_1()
    m.end(cause, "x", 5.0)
    assert m.cut_off is None
    assert m.result is not None and [o.index for o in m.result.slices] == [0]


def test_a_slice_sent_out_of_turn_is_refused() -> None:
    m = _sent_slice_1()
    with pytest.raises(ValueError):
        m.sent(0, 3.0)


_OK, _FAILED = BlockStatus.OK, BlockStatus.FAILED


@given(st.lists(st.sampled_from(list(BlockStatus)), max_size=8))
def test_leading_ok_counts_the_ok_statuses_before_the_first_other(
    statuses: list[BlockStatus],
) -> None:
    n = leading_ok(statuses)
    assert all(s is _OK for s in statuses[:n])
    assert n == len(statuses) or statuses[n] is not _OK


def test_a_put_answered_in_full_is_complete() -> None:
    spec = plan_slices(4, 8, 4, 16, 128)[0]
    assert put_outcome(spec, 0.5, [_OK] * 4, None, total=False) == (
        SliceOutcome(0, 4, 4, 4, 0.5, "complete"),
        None,
        0,
    )


def test_a_put_short_of_a_block_counts_the_leading_run_and_the_strays_past_it() -> None:
    spec = plan_slices(4, 8, 4, 16, 128)[0]
    statuses = [_OK, BlockStatus.NO_SPACE, _OK, _OK]
    done, detail, strays = put_outcome(spec, 0.5, statuses, None, total=False)
    assert done == SliceOutcome(0, 4, 4, 1, 0.5, "incomplete")
    assert (detail, strays) == ("block 5: no_space", 2)


@pytest.mark.parametrize(("total", "status"), [(False, "slice_timeout"), (True, "total_timeout")])
def test_a_put_without_an_answer_ran_out_of_time(total: bool, status: SliceStatus) -> None:
    spec = plan_slices(0, 4, 4, 16, 64)[0]
    done, detail, strays = put_outcome(spec, 1.25, None, None, total)
    assert done == SliceOutcome(0, 0, 4, 0, 1.25, status)
    assert (detail, strays) == ("slice 0 ran out of time after 1.250 s", 0)


def test_a_put_that_raised_is_a_backend_error() -> None:
    spec = plan_slices(0, 4, 4, 16, 64)[0]
    done, detail, strays = put_outcome(spec, 0.5, None, "disk on fire", total=True)
    assert done == SliceOutcome(0, 0, 4, 0, 0.5, "backend_error")
    assert (detail, strays) == ("disk on fire", 0)
