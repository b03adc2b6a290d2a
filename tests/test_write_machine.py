"""The write state machine, without an event loop: random event orders, checked against the
invariants it alone is responsible for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe._plan import plan_slices
from kvpipe._results import SliceOutcome, SliceStatus
from kvpipe._write_machine import WriteMachine, slice_deadline

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
    m.planned(skipped, slices, now=0.5)
    settled = m.result
    expected_written = 0
    stopped = False
    now = 1.0
    for _ in range(data.draw(st.integers(0, 3 * len(slices) + 3))):
        now += 1
        event = data.draw(st.sampled_from(["slice", "slice", "slice", "end", "fail", "wrong"]))
        was_ended = m.ended
        if event == "slice" and m.turn < len(slices):
            spec = slices[m.turn]
            kind = data.draw(st.sampled_from(["ok", "ok", "short", *_FAILURES]))
            out = _outcome(
                spec.index, spec.first_block, spec.count, data.draw(st.integers(0, 8)), kind
            )
            m.slice_done(out, "detail", now)
            if not was_ended and not stopped:
                expected_written += out.written
                stopped = out.outcome != "complete"
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
            m.end(
                data.draw(st.sampled_from(["total_timeout", "cancelled", "actor_crashed"])),
                "x",
                now,
            )
        elif event == "fail":
            m.fail(RuntimeError("closing"))
        # exactly once: whatever came first stays
        if settled is not None or (was_ended and m.error is not None):
            assert m.result is settled
        settled = m.result
        assert not (m.result is not None and m.error is not None)
        if m.ended:
            assert not m.may_send() and not any(m.is_turn(i) for i in range(len(slices)))
    if m.result is not None:
        r = m.result
        assert r.written == expected_written == m.written
        assert r.skipped == skipped and r.requested == blocks
        assert r.complete == (r.skipped + r.written == blocks)
        # the contiguous prefix: every slice before the last recorded one is complete
        assert all(o.outcome == "complete" for o in r.slices[:-1])
        assert [o.index for o in r.slices] == list(range(len(r.slices)))
        assert (r.stop_reason is None) == r.complete
        if not r.complete and r.slices and r.slices[-1].outcome == "incomplete":
            assert r.stop_reason == "incomplete_slice"


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


@given(st.floats(0, 1e6), st.floats(0.001, 100), st.floats(0, 1e6))
def test_a_slice_deadline_never_extends_the_total_one(now: float, per: float, total: float) -> None:
    d = slice_deadline(now, per, total)
    assert d <= total and d <= now + per and d in (total, now + per)
