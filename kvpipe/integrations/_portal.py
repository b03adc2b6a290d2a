"""A background event-loop thread for synchronous callers, and the store URL parser.

:class:`LoopThread` owns one event loop in one thread (anyio's ``BlockingPortal``; uvloop when
installed) and runs coroutines there for any number of caller threads, never holding a caller
past its deadline plus :data:`HOP_SLACK`.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import traceback
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from .. import (
    ConfigError,
    FileStore,
    MemoryStore,
    MooncakeStore,
    PipelineClosed,
    StorageBackend,
    WrongEventLoop,
)
from .._workers import unboxed

__all__ = ("HOP_SLACK", "LoopThread", "default_store_dir", "store_from_url")

log = logging.getLogger("kvpipe.integrations")

T = TypeVar("T")

#: Seconds a caller may wait past its own deadline for the loop thread to hand the result
#: back; past it the call is cancelled and the caller returns "nothing known".
HOP_SLACK: Final = 1.0


# Boxed errors: an error raised in the loop is handed to the calling thread in a box
# (``[False, error]``, emptied by :func:`~kvpipe._workers.unboxed`), not through the portal's
# future: anyio's portal task keeps the error it sets there in a local of its frame, which is
# on the error's traceback, and the future kept it too, held by frames on its traceback in
# the waiting thread. Those reference cycles kept every frame the error passed, and what
# they refer to (an adapter, its pipeline and store, the caller's caches), until the cyclic
# garbage collector ran. So with an exit's error (``_Held.run`` returns it boxed).


class LoopThread:
    """One event loop in one daemon thread; synchronous calls hop onto it.

    Args:
        name: For the thread's name and logs.
        close_timeout: Seconds :meth:`close` waits for the loop's resources to close.
        holds: The caller's memory that work in the loop reads or writes (its caches), for
            the ERROR of a :meth:`close` that returns while that work may still run.

    Closing: :meth:`close` (idempotent) runs the registered closers in the loop (in reverse
    order, bounded by ``close_timeout``), then stops the loop and joins the thread. It also
    runs at interpreter exit for instances still open. A :meth:`call` or :meth:`enter` made
    after it began, or cut off by it, raises :class:`kvpipe.PipelineClosed`; whatever an
    :meth:`enter` racing it had entered is exited.
    """

    def __init__(self, name: str, close_timeout: float = 10.0, holds: str | None = None) -> None:
        self.name = name
        self.close_timeout = close_timeout
        self.holds = holds
        self._lock = threading.Lock()
        self._closed = False
        self._joiner: threading.Thread | None = None  # joins the loop thread, once closing
        self._ended = False  # the loop thread has ended (under _lock)
        self._left_running = False  # close returned before it had (under _lock)
        self._stopping = False  # close stopped the loop: what it cuts off ends cancelled
        self._closers: list[Callable[[], object]] = []
        self._leaving: set[concurrent.futures.Future[list[Any]]] = set()  # exits in progress
        self._stack = contextlib.ExitStack()
        options: dict[str, Any] = {}
        with contextlib.suppress(ImportError):
            import uvloop  # noqa: F401

            options = {"use_uvloop": True}
        self.portal = self._stack.enter_context(
            anyio.from_thread.start_blocking_portal("asyncio", options, name=name)
        )
        ref = weakref.ref(self)

        def at_exit() -> None:
            lt = ref()
            if lt is not None:
                lt.close()

        self._atexit = at_exit
        atexit.register(at_exit)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has begun."""
        return self._closed

    def check_caller(self) -> None:
        """Raise if called from inside a running event loop (the call would block it)."""
        try:
            anyio.lowlevel.current_token()
        except anyio.NoEventLoopError:
            return
        raise WrongEventLoop(
            f"{self.name}: synchronous call made from inside a running event loop; "
            "call it from a plain thread (e.g. loop.run_in_executor / "
            "anyio.to_thread.run_sync), or use kvpipe's async Pipeline directly"
        )

    def enter(self, cm: Any, *, wait: float | None = None) -> tuple[Any, Callable[[], None]]:
        """Enter an async context manager in the loop; it is exited at :meth:`close`, or
        earlier by calling the function returned beside its value: that starts the exit in
        the loop and returns at once (idempotent; :meth:`close` waits for exits started so).

        Args:
            cm: The async context manager.
            wait: Seconds the caller waits for it to be entered (``None``: no limit). Past
                them entering is cancelled in the loop (its cleanup goes on there, and
                :meth:`close` waits for it; what was entered just then is exited, an error
                of that exit logged) and :class:`TimeoutError` raised in the caller.
                Entered as :meth:`close` began, it is exited, waited for until then (plus
                :data:`HOP_SLACK`) at most.

        Raises:
            TimeoutError: Not entered within ``wait``.
            kvpipe.PipelineClosed: :meth:`close` began before it was entered (what was
                entered is exited).
            Exception: Whatever entering raised.
        """
        self.check_caller()
        deadline = None if wait is None else time.monotonic() + max(0.0, wait)
        held = _Held(cm)
        task = self._start(held.run)
        try:
            waited: tuple[concurrent.futures.Future[Any], ...] = (held.entered, task)
            done, _ = concurrent.futures.wait(
                waited,
                timeout=None if wait is None else max(0.0, wait),
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
            if held.entered not in done and task not in done:
                raise TimeoutError(f"{self.name}: not entered within {wait:.3f} s")
            if not held.entered.done():  # the task ended unentered: the loop stopped
                raise self._closed_error()
            try:
                value = unboxed(held.entered.result())
            except BaseException:
                if self._closed:  # cancelled by the loop stopping, not the caller's error
                    raise self._closed_error() from None
                raise
        except BaseException:
            # Entering is cancelled, or what was entered just now is exited, in the task's
            # own scope (not by cancelling its future, which would drop an exit's error):
            # waited for by close(), and _left logs how it ends.
            with self._lock:
                self._leaving.add(task)
            task.add_done_callback(self._left)
            with contextlib.suppress(RuntimeError):  # the loop stopped: it ended cancelled
                self.portal.start_task_soon(held.give_up)
            raise

        def leave() -> None:
            assert held.leave is not None  # set before entering
            with contextlib.suppress(RuntimeError):  # the loop stopped: exited by then
                self.portal.call(held.leave.set)
            unboxed(task.result())

        with self._lock:
            closing = self._closed
            if not closing:
                self._closers.append(leave)
            else:
                self._leaving.add(task)
        if closing:  # close() took its closers before this one: exit it here
            self._start_leaving(held, task)
            # waited for, but not past the caller's deadline plus HOP_SLACK: it goes on in
            # the loop, close() waits for it, and _left logs how it ends
            timeout = None if deadline is None else deadline + HOP_SLACK - time.monotonic()
            concurrent.futures.wait((task,), None if timeout is None else max(0.0, timeout))
            raise self._closed_error()

        def leave_soon() -> None:
            with self._lock:
                if self._closed or leave not in self._closers:
                    return  # close() exits it, or it is leaving already
                self._closers.remove(leave)
                self._leaving.add(task)
            self._start_leaving(held, task)

        return value, leave_soon

    def _start_leaving(self, held: _Held, task: concurrent.futures.Future[list[Any]]) -> None:
        """Start the exit of what ``held`` entered (its ``task``, in :attr:`_leaving`) and
        return: :meth:`_left` logs how it ends."""
        assert held.leave is not None
        task.add_done_callback(self._left)
        with contextlib.suppress(RuntimeError):  # the loop stopped: exited by then
            self.portal.start_task_soon(held.leave.set)

    def _closed_error(self) -> PipelineClosed:
        return PipelineClosed(f"{self.name} is closed")

    def _start(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """``fn(*args)`` started in the loop; :class:`PipelineClosed` once closing began."""
        if self._closed:
            raise self._closed_error()
        try:
            return self.portal.start_task_soon(fn, *args)
        except RuntimeError:  # the portal stopped (close ran meanwhile)
            raise self._closed_error() from None

    def call(
        self, fn: Callable[..., Awaitable[T]], *args: Any, wait: float, settle: float = 0.0
    ) -> T:
        """Run ``await fn(*args)`` in the loop and return its result.

        Args:
            wait: Seconds to wait for it; past them the call is cancelled in the loop and
                :class:`TimeoutError` raised in the caller.
            settle: Seconds more to wait, once cancelled, for it to have ended in the loop
                before raising (0: raise at once). For a call whose work touches the
                caller's memory until it ends (a copy into its caches that cancelling
                does not interrupt): raised sooner, the caller would reuse memory still
                being written. Past them it raises all the same (logged as an error).

        Raises:
            WrongEventLoop: Called from inside a running event loop (a ``RuntimeError``).
            kvpipe.PipelineClosed: Called after :meth:`close` began, or cut off by the loop
                stopping.
            TimeoutError: No result within ``wait`` seconds.
            Exception: Whatever ``fn`` raised.
        """
        self.check_caller()
        ended = threading.Event()

        async def tracked() -> list[Any]:
            try:
                return [True, await fn(*args)]
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # boxed: see "Boxed errors" above LoopThread
                return [False, exc]  # SystemExit too: the caller's, never the loop's end
            finally:
                ended.set()

        fut = self._start(tracked)
        # Waited for apart from taking the result: a TimeoutError ``fn`` raised itself
        # (``OperationTimeout``, say) is its outcome, not this wait running out.
        done, _ = concurrent.futures.wait((fut,), timeout=max(0.0, wait))
        if not done:
            fut.cancel()
            if settle > 0 and not ended.wait(settle):
                log.error(
                    "%s: a call given up after %.3f s had not ended %.1f s after it was "
                    "cancelled; it may still use its caller's memory",
                    self.name,
                    wait,
                    settle,
                )
            raise TimeoutError(f"{self.name}: no result within {wait:.3f} s")
        try:
            box = fut.result()
        except concurrent.futures.CancelledError:  # only the loop stopping cancels it
            raise self._closed_error() from None
        return unboxed(box)  # type: ignore[no-any-return]

    def close(self, ended_late: Callable[[], None] | None = None) -> bool:
        """Close what was entered (bounded by ``close_timeout``), stop the loop and join it
        (for :data:`HOP_SLACK` at most: a task shielded from cancellation finishes on its own
        in the loop thread, logged at ERROR, naming :attr:`holds` as possibly still in use;
        its end is logged too).

        Args:
            ended_late: Called (in a helper thread) once the loop thread has ended, when
                this call returned ``False``: what the caller keeps for the loop's work
                until then may go.

        Returns:
            Whether the loop thread has ended (a later call: by now). ``False``: work in it
            did not end when cancelled, and may still use what it was given (:attr:`holds`);
            a call made while another closes returns ``False`` at once.
        """
        with self._lock:
            if self._closed:
                return self._ended
            self._closed = True
            closers, self._closers = self._closers[::-1], []
        atexit.unregister(self._atexit)

        def close_all() -> None:
            for closer in closers:
                self._run_closer(closer)
            # then wait for the exits started early (leave_soon) too: _left logs how they end
            concurrent.futures.wait(list(self._leaving))

        # In a helper thread, so that a stuck closer cannot hold the caller past close_timeout.
        helper = threading.Thread(target=close_all, name=f"{self.name}-close", daemon=True)
        helper.start()
        helper.join(self.close_timeout + HOP_SLACK)
        if helper.is_alive():
            log.error("%s: close did not finish within %.1f s", self.name, self.close_timeout)
        self._stopping = True
        try:
            self.portal.call(self.portal.stop, True)
        except Exception as exc:  # its text: see _run_closer
            log.error("%s: stopping the loop failed\n%s", self.name, _text(exc))

        def join_loop() -> None:
            with contextlib.suppress(Exception):
                self._stack.close()
            with self._lock:
                self._ended = True
                late = self._left_running
            if late:
                log.warning("%s: the loop thread has ended%s", self.name, self._no_longer())
                if ended_late is not None:
                    try:
                        ended_late()
                    except Exception as exc:  # its text: see _run_closer
                        log.error(
                            "%s: error after the loop thread ended\n%s", self.name, _text(exc)
                        )

        # The loop thread ends once its last task has, and a closer shielded from
        # cancellation (a store's own bounded close, a copy into the caller's caches) may
        # outlast close_timeout: joined in a helper thread, so that it never holds the
        # caller more than HOP_SLACK longer.
        joiner = threading.Thread(target=join_loop, name=f"{self.name}-join", daemon=True)
        self._joiner = joiner
        joiner.start()
        joiner.join(HOP_SLACK)
        with self._lock:  # decided with the joiner's end: logged before "has ended", if so
            if self._ended:
                return True
            self._left_running = True
            log.error(
                "%s: the loop thread still runs a task that ignores cancellation; left to "
                "finish on its own%s",
                self.name,
                self._in_use(),
            )
        return False

    def _left(self, task: concurrent.futures.Future[list[Any]]) -> None:
        """An exit started early (``leave_soon``) has ended: logged as a closer's outcome,
        which nothing else reads."""
        self._leaving.discard(task)
        self._run_closer(lambda: unboxed(task.result()))

    def _run_closer(self, closer: Callable[[], object]) -> None:
        """Run ``closer`` (an exit, waited for), logging what it raised at ERROR. An exit
        that the loop's stop cut off ends cancelled (``concurrent.futures.CancelledError``,
        raised when it ends, maybe long after :meth:`close` returned): that is no error in
        closing (what it shields from cancellation ran to its end; an error it raised comes
        as itself): DEBUG. Close itself logs at ERROR a closer that outlasted
        ``close_timeout``, and returning while the loop thread still runs.

        The error is logged as its text, its traceback included: a record that a handler
        keeps (a ``MemoryHandler``, pytest's capture) must not hold the error, its
        traceback's frames and what they refer to (the exited pipeline, the caller's
        caches, this loop thread)."""
        try:
            closer()
        except concurrent.futures.CancelledError as exc:
            if not self._stopping:  # nothing else cancels an exit: say so, loudly
                log.error("%s: error while closing\n%s", self.name, _text(exc))
            else:
                log.debug("%s: an exit was cut off by the loop stopping", self.name)
        except BaseException as exc:  # SystemExit too: an exit's error, no end of closing
            log.error("%s: error while closing\n%s", self.name, _text(exc))

    def _in_use(self) -> str:
        if self.holds is None:
            return ""
        return (
            f"; it may still read or write {self.holds}: do not free or reuse them until "
            "it has ended (logged)"
        )

    def _no_longer(self) -> str:
        return "" if self.holds is None else f": nothing uses {self.holds} any more"


def _text(exc: BaseException) -> str:
    """``exc`` with its traceback, as ``logging`` shows an exception."""
    return "".join(traceback.format_exception(exc)).rstrip("\n")


class _Held:
    """Runs an async context manager in one loop task: entered, then held until
    :attr:`leave` is set (or the caller gives up, or the task is cancelled), then exited."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm
        #: ``[True, value]`` once entered, ``[False, error]`` when entering raised: a box
        #: that :func:`~kvpipe._workers.unboxed` empties; never set when entering was cancelled.
        self.entered: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        self.leave: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None  # run's, while it runs
        self._given_up = False

    def give_up(self) -> None:
        """(In the loop.) The caller stopped waiting for entering: cancel it, or exit what
        was entered, and let :meth:`run` return the exit's outcome all the same."""
        self._given_up = True
        if self._scope is not None:
            self._scope.cancel()

    async def run(self) -> list[Any]:
        """Enter, hold, exit: the exit's outcome, boxed (``[True, None]`` or ``[False, error]``;
        see "Boxed errors" above LoopThread); ``[True, None]`` when entering raised, or was
        cancelled by :meth:`give_up`."""
        self.leave = anyio.Event()
        try:
            with anyio.CancelScope() as self._scope:
                if self._given_up:
                    self._scope.cancel()
                return await self._hold()
        finally:
            self._scope = None
        return [True, None]  # given up while entering (or exited, what was entered)

    async def _hold(self) -> list[Any]:
        assert self.leave is not None
        try:
            value = await self.cm.__aenter__()
        except anyio.get_cancelled_exc_class():
            # A cancellation (the caller gave up waiting, the loop stopping) is not handed
            # over: kept by the future, it would hold this frame, and the context manager.
            raise
        except BaseException as exc:  # boxed: see "Boxed errors" above LoopThread
            # KeyboardInterrupt, SystemExit too: handed over to the caller, who raises it;
            # let through into the loop, it ended the loop thread under every other user
            self.entered.set_result([False, exc])
            return [True, None]  # nothing to exit
        self.entered.set_result([True, value])
        try:
            await self.leave.wait()
        except BaseException:  # cancelled (given up, the loop stopping): exited all the same
            try:
                await self.cm.__aexit__(None, None, None)
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:  # comes as itself, in place of the cancellation
                return [False, exc]
            raise
        try:
            await self.cm.__aexit__(None, None, None)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as exc:  # SystemExit too: let through, it ended the loop thread
            return [False, exc]
        return [True, None]


def default_store_dir() -> Path:
    """``$XDG_CACHE_HOME/kvpipe/fastdeploy`` (``~/.cache/kvpipe/fastdeploy``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kvpipe" / "fastdeploy"


def store_from_url(url: str) -> StorageBackend:
    """A store from a URL: ``file:///abs/path``, ``memory://`` or
    ``mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata``.

    Raises:
        ConfigError: ``KVPIPE_STORE`` (its ``field``; a ``ValueError``): an unknown scheme, a
            relative or empty file path, or a Mooncake URL without host, port or
            ``metadata``.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError("KVPIPE_STORE", f"expected a store URL, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ConfigError(
                "KVPIPE_STORE", f"{url!r}: a file URL needs an absolute path (file:///x)"
            )
        return FileStore(urllib.parse.unquote(parts.path))
    if parts.scheme == "memory":
        if parts.netloc or parts.path not in ("", "/"):
            raise ConfigError("KVPIPE_STORE", f"{url!r}: a memory URL takes no path (memory://)")
        return MemoryStore()
    if parts.scheme == "mooncake":
        query = urllib.parse.parse_qs(parts.query)
        metadata = query.get("metadata", [""])[0]
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or not metadata:
            raise ConfigError(
                "KVPIPE_STORE",
                f"{url!r}: expected mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata",
            )
        return MooncakeStore(f"{parts.hostname}:{port}", metadata)
    raise ConfigError(
        "KVPIPE_STORE",
        f"{url!r}: unknown scheme {parts.scheme!r} (file://, memory://, mooncake://)",
    )
