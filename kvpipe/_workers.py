"""kvpipe's own worker threads, at a lower CPU priority than the event loop's thread (so
copies on a machine with few cores do not delay the server's loop), and the runner that calls
into them holding staging until each call returns (:class:`ThreadRunner`).

They are not the event loop library's shared threads because a raised nice value cannot be
lowered again without privileges. Threads start on demand and leave after ``idle_timeout``
seconds without work, or when the pool shuts down. A new thread is started by the pool's
starter thread, never by the caller: ``threading.Thread.start`` waits until the new thread
runs, which on a machine whose processors are busy took the event loop's thread 5-60 ms
(docs/performance.md, "A new worker thread started from the event loop").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, final

import anyio
import anyio.from_thread
import anyio.lowlevel

try:  # anyio's own worker threads do this; not public API, so guarded
    from anyio._core._eventloop import claim_worker_thread
except ImportError:  # pragma: no cover - another anyio: from_thread then needs a token
    claim_worker_thread = None  # type: ignore[assignment]

from ._shield import DeferredCancel, shielded

if TYPE_CHECKING:
    from ._staging import StagingLease

T = TypeVar("T")

__all__ = (
    "INLINE_COPY_BYTES",
    "Abandoned",
    "Lane",
    "NotStarted",
    "ThreadRunner",
    "WorkerThreads",
    "in_thread",
    "in_thread_to_its_end",
    "unboxed",
    "lower_priority",
)

log = logging.getLogger("kvpipe.workers")

#: Copies up to this many bytes run on the event loop (cheaper than a thread hop); larger
#: ones in a worker thread, so that the loop keeps answering.
INLINE_COPY_BYTES = 256 * 1024

_warned = False


def lower_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by ``nice`` (at most to 19); whether it did."""
    global _warned
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("could not lower kvpipe's worker thread priority: %s", str(exc))
        return False
    return True


@final
class Lane:
    """A bound on how many calls of one kind run at once in the worker threads (a
    pipeline's copies; a store's blocking I/O).

    Calls past the bound wait in the lane, in order, not on the event loop: a thread that
    finishes a call of the lane takes the next one itself, with no round trip through the
    event loop between the two.

    Args:
        limit: Calls of the lane running at once (at least 1).
    """

    __slots__ = ("_queue", "_running", "limit")

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"a lane runs at least one call at once, not {limit}")
        self.limit = limit
        self._queue: deque[Callable[[], None]] = deque()
        self._running = 0

    @property
    def running(self) -> int:
        """Calls of the lane in a thread now."""
        return self._running

    @property
    def waiting(self) -> int:
        """Calls of the lane waiting for a thread."""
        return len(self._queue)


_Item = tuple[Callable[[], None], Lane | None] | None


@final
class WorkerThreads:
    """A pool of daemon threads that run submitted calls, one at a time each.

    Args:
        nice: How much lower than the process's own priority they run (0: the same).
        idle_timeout: Seconds an idle thread waits for work before it leaves.
    """

    def __init__(self, nice: int = 0, idle_timeout: float = 10.0) -> None:
        self.nice = nice
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[_Item]] = []
        self._threads = 0
        self._closed = False
        # Inboxes of threads to start (None: the starter leaves); the starter itself starts
        # with the first of them, from the caller's thread, once per pool.
        self._to_start: queue.SimpleQueue[queue.SimpleQueue[_Item] | None] = queue.SimpleQueue()
        self._starter: threading.Thread | None = None

    @property
    def threads(self) -> int:
        """Threads alive now."""
        return self._threads

    def submit(self, fn: Callable[[], None], lane: Lane | None = None) -> None:
        """Run ``fn()`` in a thread of the pool (an idle one, else a new one) — or, when
        ``lane`` already runs as many calls as it may, in the lane's next free thread, in
        order. ``fn`` must not raise: it reports its own outcome.

        Raises:
            RuntimeError: The pool is shut down, or its starter thread could not be started
                (``fn`` never runs; the next call tries again).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the worker threads are shut down")
            if lane is not None:
                if lane._running >= lane.limit:
                    lane._queue.append(fn)
                    return
                lane._running += 1
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self._threads += 1
                starter = self._starter is None
                if starter:
                    self._starter = threading.Thread(
                        target=self._start_threads, name="kvpipe-worker-starter", daemon=True
                    )
        if inbox is None:
            if starter:  # once per pool (raises like any thread start that fails)
                assert self._starter is not None
                try:
                    self._starter.start()
                except BaseException:
                    # As if never submitted: the next call starts a starter again, and the
                    # lane's slot is free for it.
                    with self._lock:
                        self._starter = None
                        self._threads -= 1
                        if lane is not None:
                            lane._running -= 1
                    raise
            inbox = queue.SimpleQueue()
            inbox.put((fn, lane))
            self._to_start.put(inbox)
        else:
            inbox.put((fn, lane))

    def shutdown(self) -> None:
        """Idle threads leave now; busy ones when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)
        self._to_start.put(None)

    def _start_threads(self) -> None:
        """The starter thread: start a worker for each inbox handed to it. Where a thread
        cannot be started (the system's limit), its call runs here instead: never lost."""
        while (inbox := self._to_start.get()) is not None:
            thread = threading.Thread(
                target=self._work, args=(inbox,), name="kvpipe-worker", daemon=True
            )
            try:
                thread.start()
            except Exception as exc:  # RuntimeError at the system's limit, MemoryError...
                log.error("could not start a worker thread (%s); running its call here", repr(exc))
                with self._lock:
                    self._threads -= 1
                item = inbox.get_nowait()
                assert item is not None  # a new thread's inbox holds just its first call
                self._run(*item)

    def _work(self, inbox: queue.SimpleQueue[_Item]) -> None:
        lower_priority(self.nice)
        try:
            while True:
                try:
                    item = inbox.get(timeout=self._idle_timeout)
                except queue.Empty:
                    with self._lock:
                        if inbox in self._idle and inbox.empty():
                            self._idle.remove(inbox)
                            return
                    continue  # handed work just as it timed out
                if item is None:
                    return
                self._run(*item)
                del item
                with self._lock:
                    if self._closed:
                        return
                    self._idle.append(inbox)
        finally:
            with self._lock:
                self._threads -= 1

    def _run(self, fn: Callable[[], None], lane: Lane | None) -> None:
        """Run ``fn``, then the calls queued in its ``lane`` meanwhile, in order."""
        while True:
            fn()
            del fn
            with self._lock:
                if lane is None or not lane._queue:
                    if lane is not None:
                        lane._running -= 1
                    return
                fn = lane._queue.popleft()  # the lane's next call, in this thread


class NotStarted(Exception):
    """A call given ``start_by`` was still waiting in its lane then: it never runs."""


class Abandoned(Exception):
    """A close stopped the caller's wait for a call (:meth:`ThreadRunner.abandon_waits`),
    shielded or not: one running runs on in its thread (holding its staging and what it
    uses until it returns); one not started never starts."""


@final
class _Call:
    """Who finishes a worker-thread call: its caller, or, when the caller stopped waiting
    while the thread ran, the thread itself (through the event loop). A call whose caller
    gave up before the thread started never starts."""

    __slots__ = ("abandoned", "left_at_close", "lock", "outcome", "started", "uses")

    def __init__(self, uses: object | None) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.abandoned = False
        #: The thread's outcome box (see :func:`unboxed`), once reported to a waiting caller.
        self.outcome: list[Any] | None = None
        #: The caller's memory the call reads or writes (a pipeline's cache), until it ends.
        self.uses = uses
        #: A close returned while it ran (set under ``lock``): its end is logged.
        self.left_at_close = False


@final
class ThreadRunner:
    """Runs blocking functions in worker threads, holding staging until they return.

    A caller waiting in :meth:`run` may be cancelled (a slice timeout); the thread cannot be,
    so the runner keeps its own reference on the lease and returns it when the thread ends,
    and on what of the caller's the call uses (``uses``: a pipeline's cache) likewise.
    Use as an async context manager; leaving it waits (bounded) for running threads.
    """

    def __init__(self, close_timeout: float = 10.0, *, nice: int = 0) -> None:
        self._threads = WorkerThreads(nice)
        self._open = False
        self._running = 0
        #: Calls given ``uses`` that have not finished (event-loop thread only).
        self._using: set[_Call] = set()
        #: The events the callers wait on (set by a call's report), and whether a close
        #: abandoned those waits (setting them: the call's outcome is then still ``None``).
        self._waits: set[anyio.Event] = set()
        self._abandoning = False
        self._idle = anyio.Event()
        self._idle.set()
        self._close_timeout = close_timeout
        self._deadline: float | None = None

    @property
    def running(self) -> int:
        """Threads running now (including ones whose caller gave up)."""
        return self._running

    async def __aenter__(self) -> ThreadRunner:
        self.open()
        return self

    def open(self) -> None:
        """Take calls from now on (what entering does), for a runner that is never left but
        :meth:`shutdown`, calls given up on running on."""
        self._open = True

    def shutdown(self) -> None:
        """Take no more calls; idle threads leave now, busy ones when their call returns
        (what leaving does once its wait for running threads is over)."""
        self._open = False
        self._threads.shutdown()

    def close_by(self, deadline: float) -> None:
        """Wait for running threads at exit until ``deadline`` (event-loop clock) rather than
        ``close_timeout`` from then: the pipeline's one close deadline (and its grace)."""
        self._deadline = deadline

    def abandon_waits(self) -> None:
        """Stop every caller's wait for its call, now and from now on, shielded waits
        included (a copy into the caller's cache): each raises :class:`Abandoned`, after the
        caller's own cancellation if it is visible there. A call running runs on in its
        thread, holding its staging and what it uses until it returns (a close that leaves
        it running names that at ERROR); one not started never starts. For a close whose
        bound has come: nothing waits for a thread past it."""
        self._abandoning = True
        for done in self._waits:
            done.set()

    async def __aexit__(self, *exc_info: Any) -> None:
        """Wait (until the close deadline) for running threads, then :meth:`shutdown`.

        Cancellation: shielded, from asyncio's own (``Task.cancel``) too: one received
        meanwhile is raised once the threads are shut down.
        """
        deadline = self._deadline
        if deadline is None:
            deadline = anyio.current_time() + self._close_timeout
        deferred = DeferredCancel()
        idle = await shielded(self._idle.wait, deadline, deferred)
        self.shutdown()
        if not idle and self._running:
            log.error(
                "%d worker thread(s) still running past the close deadline; abandoning them "
                "(their staging slots stay leased)%s",
                self._running,
                self._left_using(),
            )
        deferred.raise_if_received()

    def _left_using(self) -> str:
        """What of the caller's the calls left running at close still use, for the close's
        ERROR (empty when none does); each such call logs its end (:meth:`run`)."""
        used: dict[int, object] = {}
        for call in self._using:
            with call.lock:  # the thread clears ``uses`` as it ends
                if call.uses is not None:
                    call.left_at_close = True
                    used[id(call.uses)] = call.uses
        if not used:
            return ""
        return (
            f"; they may still read or write {', '.join(map(repr, used.values()))}: do not "
            "free or reuse its memory until they have ended (logged; kvpipe keeps it "
            "referenced until then)"
        )

    async def run(
        self,
        fn: Callable[..., T],
        *args: Any,
        hold: StagingLease | None = None,
        lane: Lane | None = None,
        start_by: float | None = None,
        uses: object | None = None,
    ) -> T:
        """Call ``fn(*args)`` in one of the runner's worker threads and return its result;
        with ``lane``, once fewer of the lane's calls run than it allows.

        Args:
            start_by: An event-loop time by which the call must have started: one still
                waiting in its lane then never starts (:class:`NotStarted`); one started
                runs to its end. For work that must not be cut off once begun (a copy into
                the caller's cache) but is of no more use after a deadline.
            uses: The caller's memory that ``fn`` reads or writes (a pipeline's cache): kept
                referenced until the thread returns; a close that abandons the call names it
                at ERROR, and the call's end is then logged at WARNING.

        Cancellation: cancelling the caller stops the wait at once. A call still waiting in
        its lane never starts (``hold`` is let go at once); a running one runs on, and
        ``hold`` stays leased until it returns. Exceptions from ``fn`` propagate. A caller
        shielded from cancellation is still stopped by :meth:`abandon_waits` (a close's
        bound), likewise.

        Raises:
            RuntimeError: The runner is not running.
            NotStarted: ``start_by`` passed before the call started.
            Abandoned: :meth:`abandon_waits` stopped the wait (or came before it).
        """
        if not self._open:
            raise RuntimeError("ThreadRunner is not running")
        if hold is not None:
            hold.retain()
        self._running += 1
        if self._running == 1:
            self._idle = anyio.Event()
        call = _Call(uses)
        if uses is not None:
            self._using.add(call)
        token = anyio.lowlevel.current_token()
        done = anyio.Event()
        # The thread takes the call out of this box: no argument (staging view) outlives it.
        box: list[Any] = [fn, args]

        def report(result: list[Any]) -> None:  # on the event loop's thread
            outcome = result[:]
            result.clear()  # the thread, however late it returns, holds none of it
            if call.abandoned:
                self._finish(hold, call)  # the caller gave up while the thread ran
            else:
                call.outcome = outcome
                done.set()

        def work() -> None:
            with call.lock:
                if call.abandoned:
                    return  # the caller gave up before it started: do nothing
                call.started = True
            f, a = box
            box.clear()
            result: list[Any] = []
            try:
                # anyio.from_thread works here without a token, as in anyio's own threads.
                with _as_loop_thread(token):
                    _boxed(result, f, a)
            except BaseException as exc:
                result[:] = [False, exc]
            del f, a
            if call.uses is not None:
                with call.lock:
                    used, call.uses = call.uses, None
                    late = call.left_at_close
                if late:
                    log.warning(  # named, not passed: a record would keep it
                        "a copy abandoned at close has ended: kvpipe no longer reads or writes %s",
                        repr(used),
                    )
                del used  # let go of it now, whether the event loop is still there or not
            try:
                _call_soon(token, report, result)
            except Exception as exc:  # the event loop is gone: nothing to release
                log.debug("worker thread ended after its event loop: %s", repr(exc))

        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            if self._abandoning:
                raise Abandoned("not started: the close abandoned the worker threads' calls")
            # Past already: an idle thread would take it before the wait below could look.
            if start_by is not None and anyio.current_time() >= start_by:
                raise NotStarted(f"not started by {start_by:.3f}")
            self._waits.add(done)
            self._threads.submit(work, lane)
            if start_by is not None:
                with anyio.move_on_at(start_by):
                    await done.wait()
                if not done.is_set():
                    with call.lock:  # in one step: it either started, or it never will
                        call.abandoned = late = not call.started
                    if late:
                        raise NotStarted(f"not started by {start_by:.3f}")
            await done.wait()
            if call.outcome is None:  # set by abandon_waits, not by the call's report
                await anyio.lowlevel.checkpoint_if_cancelled()  # a caller not shielded
                raise Abandoned("the close stopped waiting for a worker thread's call")
        except BaseException:
            with call.lock:
                started = call.started
                call.abandoned = True
            if not started:
                box.clear()  # queued in its lane: its arguments go now, not when it is taken
                call.uses = None
                self._finish(hold, call)  # it never ran, and now never will
            elif call.outcome is not None:  # its report came first (the wait was cut after)
                call.outcome = None
                self._finish(hold, call)
            raise  # else its report finishes the call when it returns
        finally:
            self._waits.discard(done)
        self._finish(hold, call)
        outcome, call.outcome = call.outcome, None
        assert outcome is not None
        return unboxed(outcome)  # type: ignore[no-any-return]

    def _finish(self, hold: StagingLease | None, call: _Call) -> None:
        if hold is not None:
            hold.release()
        self._using.discard(call)
        self._running -= 1
        if self._running == 0:
            self._idle.set()


@contextlib.contextmanager
def _as_loop_thread(token: anyio.lowlevel.EventLoopToken) -> Iterator[None]:
    """Claim the calling thread for ``token``'s loop as anyio's own worker threads are, so
    that ``anyio.from_thread`` finds the loop without a token.

    On trio anyio hands no token on to trio then, and trio looks in thread-locals of its own
    that only ``trio.to_thread`` sets (not public API, so guarded). They are set as for a
    thread whose caller may have stopped waiting (``abandon_on_cancel``): a call into the
    loop runs in trio's system nursery, not in the caller's task.
    """
    with (
        claim_worker_thread(token.backend_class, token.native_token)
        if claim_worker_thread is not None
        else contextlib.nullcontext()
    ):
        data: Any = None
        if token.backend_class.__module__.endswith("._trio"):
            try:
                import trio._threads

                data = trio._threads.PARENT_TASK_DATA
            except (ImportError, AttributeError):  # pragma: no cover - another trio
                pass  # from_thread then needs a token there
        if data is None:
            yield
            return
        data.token = token.native_token
        data.abandon_on_cancel = True
        data.cancel_register = [None]  # from_thread.check_cancelled: never cancelled
        data.task_register = [None]
        try:
            yield
        finally:
            del data.token, data.abandon_on_cancel, data.cancel_register, data.task_register


def _call_soon(token: anyio.lowlevel.EventLoopToken, fn: Callable[..., None], *args: Any) -> None:
    """Have the event loop of ``token`` call ``fn(*args)``, without waiting for it where the
    backend has ``run_sync_soon``."""
    soon = getattr(token.backend_class, "run_sync_soon", None)
    if soon is not None:
        soon(fn, args, token.native_token)
    else:  # pragma: no cover - anyio 4.15 (which pyproject allows) has none
        anyio.from_thread.run_sync(fn, *args, token=token)


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``anyio.to_thread.run_sync(fn, *args)``, with its error raised without a cycle.

    anyio hands an error raised in the worker thread back through frames that keep it
    (asyncio's future, trio's outcome, and the worker's frames, which the error's own
    traceback and context keep): raised as it is, the error, those frames and every frame
    it then passes (a store's ``open``, a pipeline's opening) stay in a reference cycle,
    freed only by the cyclic garbage collector. The thread leaves its outcome in a box
    instead, which is emptied here before the error is raised.

    Cancellation: as ``anyio.to_thread.run_sync`` (the call runs to its end).
    """
    box: list[Any] = []
    await anyio.to_thread.run_sync(_boxed, box, fn, args)
    return unboxed(box)  # type: ignore[no-any-return]


def _boxed(box: list[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """``box[:] = [True, fn(*args)]``, or ``[False, error]`` when it raised (a thread's
    outcome, handed back without the frames that raised it: :func:`unboxed`)."""
    try:
        box[:] = [True, fn(*args)]
    except BaseException as exc:
        box[:] = [False, exc]


def unboxed(box: list[Any]) -> Any:
    """The value in ``box`` (``[True, value]``, as :func:`_boxed` fills it), or its error
    (``[False, error]``) raised; the box is emptied first, and the error let go of on the
    way out: no frame keeps it in a cycle."""
    ok, value = box
    box.clear()
    if ok:
        return value
    try:
        raise value
    finally:
        value = None


async def in_thread_to_its_end(
    fn: Callable[..., T], *args: Any, deferred: DeferredCancel, deadline: float = math.inf
) -> T:
    """``fn(*args)`` in a thread of its own (none of the event loop library's shared ones,
    which a server may have all busy), waited for to its end (or ``deadline``) whatever
    cancels the task: closing work that must be over before its caller goes on. A
    cancellation that gets through anyio's shield (asyncio's own, ``Task.cancel``) is
    recorded in ``deferred``, for the caller to raise once closed; its error is raised
    without a cycle (:func:`in_thread`).

    Raises:
        RuntimeError: The thread could not be started (``fn`` never runs).
        TimeoutError: ``deadline`` passed first; the thread runs on to its end.
    """
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    box: list[Any] = []

    def call() -> None:
        _boxed(box, fn, args)
        try:
            _call_soon(token, done.set)
        except Exception as exc:  # the event loop is gone: nobody waits any more
            log.debug("closing thread ended after its event loop: %s", repr(exc))

    threading.Thread(target=call, name="kvpipe-close", daemon=True).start()
    if not await shielded(done.wait, deadline, deferred):
        raise TimeoutError(f"{getattr(fn, '__name__', fn)!s} still running at its deadline")
    return unboxed(box)  # type: ignore[no-any-return]
