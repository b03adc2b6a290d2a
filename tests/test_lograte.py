"""The log limiter: the first line of a kind at its level, then one per interval naming how
many were demoted to DEBUG meanwhile (an injected clock: no real time passes)."""

from __future__ import annotations

import logging

import pytest

from kvpipe._lograte import LogLimiter, reset_all


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_first_line_then_one_per_interval_with_the_count_demoted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    limiter = LogLimiter(logging.getLogger("kvpipe.test_lograte"), interval=10.0, clock=clock)
    caplog.set_level(logging.DEBUG, logger="kvpipe.test_lograte")
    for i in range(5):
        limiter.log(logging.WARNING, "down", "write %s failed", f"r{i}")
        clock.now += 1.0
    clock.now = 110.0
    limiter.log(logging.WARNING, "down", "write %s failed", "r5")
    assert _lines(caplog) == [
        (logging.WARNING, "write r0 failed"),
        (logging.DEBUG, "write r1 failed"),
        (logging.DEBUG, "write r2 failed"),
        (logging.DEBUG, "write r3 failed"),
        (logging.DEBUG, "write r4 failed"),
        (logging.WARNING, "write r5 failed [and 4 more like it in the last 10 s, at DEBUG]"),
    ]


def test_kinds_are_bounded_apart_and_a_reset_shows_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    limiter = LogLimiter(logging.getLogger("kvpipe.test_lograte"), clock=clock)
    caplog.set_level(logging.DEBUG, logger="kvpipe.test_lograte")
    limiter.log(logging.WARNING, "a", "a1")
    limiter.log(logging.ERROR, "b", "b1")
    limiter.log(logging.WARNING, "a", "a2")
    reset_all()
    limiter.log(logging.WARNING, "a", "a3")
    assert _lines(caplog) == [
        (logging.WARNING, "a1"),
        (logging.ERROR, "b1"),
        (logging.DEBUG, "a2"),
        (logging.WARNING, "a3"),
    ]


def test_demoted_lines_are_counted_with_debug_off(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    limiter = LogLimiter(logging.getLogger("kvpipe.test_lograte"), interval=5.0, clock=clock)
    caplog.set_level(logging.WARNING, logger="kvpipe.test_lograte")
    for _ in range(3):
        limiter.log(logging.WARNING, "k", "x")
    clock.now += 5.0
    limiter.log(logging.WARNING, "k", "x")
    assert _lines(caplog) == [
        (logging.WARNING, "x"),
        (logging.WARNING, "x [and 2 more like it in the last 5 s, at DEBUG]"),
    ]


def test_records_name_the_line_that_logged_not_the_limiter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    limiter = LogLimiter(logging.getLogger("kvpipe.test_lograte"), clock=_Clock())
    caplog.set_level(logging.DEBUG, logger="kvpipe.test_lograte")
    limiter.log(logging.WARNING, "k", "x")
    limiter.log(logging.WARNING, "k", "x")
    assert [(r.filename, r.funcName) for r in caplog.records] == [
        ("test_lograte.py", "test_records_name_the_line_that_logged_not_the_limiter")
    ] * 2


def test_a_logged_exception_is_kept_as_its_text_not_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A record a handler keeps (caplog, a queue, a memory handler) held the exception given
    as an argument, its traceback's frames and what they refer to: the FastDeploy adapters
    logged a failed call's error so, and kept the adapter, its pipeline and the caches in a
    reference cycle. The record holds the exception's repr and str only."""
    import gc
    import weakref

    limiter = LogLimiter(logging.getLogger("kvpipe.test_lograte"))
    caplog.set_level(logging.WARNING, logger="kvpipe.test_lograte")

    class Held:
        pass

    def fail(held: Held) -> None:
        raise OSError("injected")

    held = Held()
    ref = weakref.ref(held)
    try:
        fail(held)
    except OSError as exc:
        limiter.log(logging.WARNING, "k", "failed: %r / %s", exc, exc)
    del held
    gc.disable()
    try:
        assert ref() is None, "the record kept the exception's frames"
    finally:
        gc.enable()
    assert _lines(caplog) == [(logging.WARNING, "failed: OSError('injected') / injected")]
