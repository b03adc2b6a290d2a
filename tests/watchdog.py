"""A watchdog for the test suite: a test still running after ``KVPIPE_TEST_WATCHDOG`` seconds
(default 240) gets every thread's stack and every running event loop's task stacks written to
the real standard error (past pytest's capture), once — so a hang in CI leaves a trail."""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ("keep_stderr", "watch")

_out: list[object] = []


def keep_stderr() -> None:
    """Keep a copy of standard error as it is now (call before pytest captures it)."""
    if not _out:
        _out.append(os.fdopen(os.dup(2), "w", buffering=1))


def _stream() -> object:
    return _out[0] if _out else sys.__stderr__


def _dump_tasks(loop: asyncio.AbstractEventLoop) -> None:
    out: Any = _stream()
    if out is None:
        return
    for task in asyncio.all_tasks(loop):
        print(f"--- {task.get_name()}", file=out)
        coro: Any = task.get_coro()
        while coro is not None:  # the whole await chain, outermost first
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                code = frame.f_code
                print(f"    {code.co_filename}:{frame.f_lineno} in {code.co_name}", file=out)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    out.flush()


def _dump(name: str, seconds: float) -> None:
    out: Any = _stream()
    if out is None:
        return
    print(f"\n=== watchdog: {name} still running after {seconds:.0f} s ===", file=out)
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    for loop in loops:
        if loop.is_running():
            print(f"=== tasks of {loop!r} ===", file=out)
            out.flush()
            loop.call_soon_threadsafe(_dump_tasks, loop)


def _rearm_faulthandler() -> None:
    """Once Paddle is imported, put faulthandler back on top of its fatal-signal handlers,
    writing to the real standard error. Paddle's own handler (installed at import) writes to
    standard error, which pytest captures: a segmentation fault then killed the run with no
    trace at all (once, in a CI run, 2026-11-29)."""
    if "paddle" in sys.modules and _out and not _rearmed:
        faulthandler.disable()  # enable() alone keeps the handlers it installed before
        faulthandler.enable(file=_out[0], all_threads=True)  # type: ignore[arg-type]
        _rearmed.append(True)


_rearmed: list[bool] = []


@contextmanager
def watch(name: str) -> Iterator[None]:
    """Arm the watchdog around one test (and faulthandler past Paddle's handlers)."""
    _rearm_faulthandler()
    seconds = float(os.environ.get("KVPIPE_TEST_WATCHDOG", "240"))
    timer = threading.Timer(seconds, _dump, (name, seconds))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
