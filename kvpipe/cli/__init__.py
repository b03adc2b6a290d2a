"""The ``kvpipe`` command line.

``kvpipe [--log-level LEVEL] COMMAND ...`` (``--log-level`` may also follow ``COMMAND``).
Each subcommand lives in a sibling module that exposes a :class:`~kvpipe.cli._console.Command`
named ``COMMAND``; adding one (``store-info``, ``bench``, ``faults``) is an import and an entry
in :data:`COMMANDS`.

Exit codes: 0 success, 1 the command ran and failed (e.g. the demo's verification), 2 a
usage or configuration error (reported in one line, without a traceback), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM). Either signal cancels the command, so that it cleans up
what it made (a store directory, the Mooncake processes it started) before it exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from rich.console import Console

from .. import ConfigError, KVPipeError, LayoutError, RequestError, Unsupported, __version__
from ._console import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    CommandIO,
    HelpFormatter,
    UsageError,
    logging_to,
)
from .bench import COMMAND as BENCH
from .demo import COMMAND as DEMO
from .faults import COMMAND as FAULTS
from .mooncake_up import COMMAND as MOONCAKE_UP
from .store_info import COMMAND as STORE_INFO

__all__ = ("COMMANDS", "build_parser", "main")

#: Every subcommand, in ``--help`` order.
COMMANDS: tuple[Command, ...] = (DEMO, STORE_INFO, BENCH, FAULTS, MOONCAKE_UP)

_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: Errors that mean "you asked for something invalid", not "it ran and failed".
_USAGE_ERRORS = (UsageError, ConfigError, RequestError, LayoutError, Unsupported)
_EXIT_INTERRUPTED = 130
_EXIT_TERMINATED = 128 + signal.SIGTERM


class _Terminated(Exception):
    """The command was cancelled by SIGTERM."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvpipe`` with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvpipe",
        description="Move LLM KV-cache blocks between an inference server's cache and storage.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvpipe {__version__}")
    _add_log_level(parser, "WARNING")
    # The same option after the subcommand; SUPPRESS: it sets nothing unless given, so it
    # neither overrides one given before the subcommand nor shows a default of its own.
    common = argparse.ArgumentParser(add_help=False)
    _add_log_level(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            formatter_class=HelpFormatter,
            parents=[common],
        )
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.upper,
        choices=_LEVELS,
        help="level of kvpipe's log messages, written to stderr",
    )


def _backend_options() -> dict[str, Any]:
    """Run on uvloop when it is installed, else on asyncio's own loop."""
    try:
        importlib.import_module("uvloop")
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (possibly nested) exception groups, depth first."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _reportable(exc: BaseException) -> Exception | None:
    """The error to report in one line, when every leaf of ``exc`` is one of ours."""
    leaves = _leaves(exc)
    if all(isinstance(e, KVPipeError | UsageError) for e in leaves):
        first = leaves[0]
        assert isinstance(first, Exception)
        return first
    return None


async def _until_sigterm(
    run: Callable[[argparse.Namespace, CommandIO], Awaitable[int]],
    args: argparse.Namespace,
    io: CommandIO,
) -> int:
    """Run a command; SIGTERM cancels it, as Ctrl-C does (its clean-up runs), rather than
    killing the process on the spot (Python's default), which left what it had made behind.

    A command may take SIGTERM itself meanwhile (``mooncake-up`` stops on it and exits 0).
    Off the main thread (``main`` called from a worker thread) signals cannot be handled:
    the command just runs.

    Raises:
        _Terminated: SIGTERM cancelled the command.
    """
    if threading.current_thread() is not threading.main_thread():
        return await run(args, io)
    loop = asyncio.get_running_loop()
    with anyio.CancelScope() as scope:
        loop.add_signal_handler(signal.SIGTERM, scope.cancel)
        try:
            return await run(args, io)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
    raise _Terminated


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kvpipe`` command line.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        The exit code: 0 ok, 1 failed, 2 usage or configuration error, 130 interrupted,
        143 terminated.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or an argparse usage error
        return (
            exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
        )
    io = CommandIO(out=Console(), err=Console(stderr=True))
    prog = f"kvpipe {args.command}"
    try:
        with logging_to(io.err, args.log_level):
            code: int = anyio.run(
                _until_sigterm,
                args.run,
                args,
                io,
                backend="asyncio",
                backend_options=_backend_options(),
            )
        return code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED
    except _Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return _EXIT_TERMINATED
    except BrokenPipeError:  # `kvpipe demo | head`: the reader left; say nothing more
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except Exception as exc:
        error = _reportable(exc)
        if error is None:
            raise
        kind = "error" if isinstance(error, _USAGE_ERRORS) else "failed"
        print(f"{prog}: {kind}: {error}", file=sys.stderr)
        return EXIT_USAGE if isinstance(error, _USAGE_ERRORS) else EXIT_FAILED
