"""``kvpipe mooncake-up``: a Mooncake Store on this machine, for trying kvpipe out.

Starts ``mooncake_http_metadata_server`` and ``mooncake_master`` on free ports of 127.0.0.1
(:class:`kvpipe.backends.mooncake_local.LocalMooncake`), prints the master's address, the
metadata URL, the environment every client needs and a line of Python that opens a
:class:`kvpipe.MooncakeStore` on it, then runs until Ctrl-C or SIGTERM and stops both
processes by PID. If either process exits by itself, the command stops the other and exits
with 1. ``--once`` starts, prints the same as JSON, stops and exits 0 (for tests and
scripts that only check the installation); its ``log_dir`` is ``null`` unless ``--log-dir``
kept the logs (the temporary one is gone by the time the command exits).

The store's state lives in the master's memory: stopping it loses every key.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import anyio
from anyio.to_thread import run_sync

from ..backends.mooncake import MooncakeStore
from ..backends.mooncake_local import LocalMooncake
from . import _console as ui

__all__ = ("COMMAND", "describe", "mooncake_store", "running_mooncake")

#: Clients on one machine must advertise the loopback address (else their external one).
CLIENT_ENV: Final = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
_WATCH_EVERY: Final = 0.5


_LOGS: Final = ("mooncake_master", "mooncake_http_metadata_server")


def _log_sizes(log_dir: str) -> dict[str, int]:
    """How long each process's log in ``log_dir`` is now (0: none yet); the processes
    append, so what a run writes starts there."""
    sizes = {}
    for name in _LOGS:
        try:
            sizes[name] = os.path.getsize(os.path.join(log_dir, f"{name}.log"))
        except OSError:
            sizes[name] = 0
    return sizes


def _log_tail(log_dir: str, name: str, start: int = 0, lines: int = 5) -> str:
    """The last ``lines`` lines of a process's log written past byte ``start``, joined."""
    try:
        with open(os.path.join(log_dir, f"{name}.log"), "rb") as log:
            log.seek(start)
            text = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


@asynccontextmanager
async def running_mooncake(
    master_args: Sequence[str] = (), *, log_dir: str | None = None
) -> AsyncIterator[LocalMooncake]:
    """A :class:`LocalMooncake` started for the ``async with`` block and stopped after it,
    whatever happens (the stop is shielded from cancellation).

    Args:
        master_args: Extra ``mooncake_master`` flags.
        log_dir: Keep the processes' logs there (default: a temporary directory, removed).

    Raises:
        kvpipe.Unsupported: Mooncake is not installed.
        ui.UsageError: ``log_dir`` cannot be made, or a process did not start (e.g. a flag
            the master rejects; the message ends with the end of its log).
    """
    own_dir = log_dir is None
    if log_dir is None:
        logs = tempfile.mkdtemp(prefix="kvpipe-mooncake-")
    else:
        logs = log_dir
        try:
            os.makedirs(logs, exist_ok=True)
        except OSError as exc:  # a file there, no permission
            raise ui.UsageError(f"--log-dir {logs}: {exc.strerror or exc}") from exc
    server = LocalMooncake(master_args, log_dir=logs)
    try:
        # A --log-dir may hold an earlier run's logs: quote only what this run appends.
        sizes = await run_sync(_log_sizes, logs)
        try:
            await run_sync(server.start)  # stops what it started when it fails
        except (RuntimeError, TimeoutError) as exc:
            tail = next(filter(None, (_log_tail(logs, n, sizes[n]) for n in _LOGS)), "")
            raise ui.UsageError(f"Mooncake did not start: {exc}; log: {tail or '-'}") from exc
        yield server
    finally:
        with anyio.CancelScope(shield=True):
            await run_sync(server.stop)
            if own_dir:
                await run_sync(shutil.rmtree, logs, True)


@asynccontextmanager
async def mooncake_store(segment_bytes: int) -> AsyncIterator[MooncakeStore]:
    """An open :class:`kvpipe.MooncakeStore` on a Mooncake started for the ``async with``
    block (see :func:`running_mooncake`); its client contributes ``segment_bytes``.

    The client is closed, then both processes are stopped, whatever happens.
    """
    async with running_mooncake() as server:
        store = MooncakeStore(
            server.master_address, server.metadata_url, global_segment_size=segment_bytes
        )
        async with store:
            yield store


def describe(server: LocalMooncake) -> dict[str, Any]:
    """What a user needs to reach ``server``, as JSON-ready data."""
    python = (
        f"import kvpipe; store = kvpipe.MooncakeStore({server.master_address!r}, "
        f"{server.metadata_url!r})"
    )
    return {
        "master_address": server.master_address,
        "metadata_url": server.metadata_url,
        "env": dict(CLIENT_ENV),
        "python": python,
        "pids": {
            "metadata": server.metadata.pid if server.metadata else None,
            "master": server.master.pid if server.master else None,
        },
        "log_dir": server.log_dir,
    }


def _render(info: dict[str, Any], io: ui.CommandIO, *, logs_kept: bool) -> None:
    pids = info["pids"]
    env = " ".join(f"{k}={v}" for k, v in info["env"].items())
    logs = info["log_dir"] + ("" if logs_kept else " (removed on stop)")
    lines = [
        f"Mooncake Store on 127.0.0.1 (metadata server pid {pids['metadata']}, "
        f"master pid {pids['master']})",
        f"  master:   {info['master_address']}",
        f"  metadata: {info['metadata_url']}",
        f"  logs:     {logs}",
        "",
        "Every client process needs (else it advertises its external address):",
        f"  export {env}",
        "",
        "Python:",
        f"  {info['python']}",
        "",
        "Ctrl-C or SIGTERM stops it (every key is lost).",
    ]
    io.out.print("\n".join(lines), highlight=False, soft_wrap=True, markup=False)


def _exited(server: LocalMooncake) -> str | None:
    """Which process of ``server`` has exited, if any (``"mooncake_master exited with 1"``)."""
    for name, proc in (("mooncake_master", server.master), ("metadata server", server.metadata)):
        if proc is None or proc.poll() is not None:
            return f"{name} exited with {proc.returncode if proc else '?'}"
    return None


async def _wait(server: LocalMooncake, signals: AsyncIterator[signal.Signals]) -> tuple[bool, str]:
    """Wait for a signal (``(True, "SIGINT")``) or a process to exit (``(False, why)``)."""
    outcome = (False, "")
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            nonlocal outcome
            async for signum in signals:
                outcome = (True, signum.name)
                tg.cancel_scope.cancel()
                return

        async def watch() -> None:
            nonlocal outcome
            while True:  # polled: a Popen offers nothing to await
                await anyio.sleep(_WATCH_EVERY)
                why = _exited(server)
                if why is not None:
                    outcome = (False, why)
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(on_signal)
        tg.start_soon(watch)
    return outcome


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Start, print, wait for Ctrl-C / SIGTERM (or only print with ``--once``), stop."""
    # Signals are caught before anything starts, so neither can kill the command between
    # starting the processes and stopping them.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with running_mooncake(args.master_arg or (), log_dir=args.log_dir) as server:
            info = describe(server)
            if args.once and args.log_dir is None:
                info["log_dir"] = None  # a temporary directory, removed as --once stops
            if args.once or args.json:
                print(json.dumps(info), file=io.out.file)
            else:
                _render(info, io, logs_kept=args.log_dir is not None)
            io.out.file.flush()
            if args.once:
                return ui.EXIT_OK
            by_signal, why = await _wait(server, signals)
            io.err.print(f"kvpipe mooncake-up: {why}; stopping", highlight=False)
        io.err.print("kvpipe mooncake-up: stopped", highlight=False)
    return ui.EXIT_OK if by_signal else ui.EXIT_FAILED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe mooncake-up``."""
    add = parser.add_argument
    add(
        "--master-arg",
        action="append",
        metavar="FLAG",
        help="a flag for mooncake_master, e.g. --master-arg=--client_ttl=5 (repeatable)",
    )
    add("--log-dir", metavar="PATH", help="keep the processes' logs in PATH")
    add("--json", action="store_true", help="print the addresses as one line of JSON")
    add("--once", action="store_true", help="start, print as JSON, stop and exit (for tests)")


COMMAND: Final = ui.Command(
    name="mooncake-up",
    help="run a Mooncake Store (metadata server + master) on 127.0.0.1 until Ctrl-C",
    add_arguments=add_arguments,
    run=run,
)
