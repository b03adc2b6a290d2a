"""What every ``kvpipe`` subcommand shares: consoles, logging, progress bars, formatting.

A subcommand is a :class:`Command`: a name, a help line, a function that adds its arguments
to its parser, and an async ``run`` that returns the exit code. ``kvpipe.cli.main`` parses
the command line, sets up logging and runs the command on the event loop.
"""

from __future__ import annotations

import argparse
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, final

from rich.console import Console
from rich.filesize import decimal
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from .. import PipelineStatistics, ReadResult, WriteResult

__all__ = (
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "Command",
    "CommandIO",
    "HelpFormatter",
    "PhaseTally",
    "UsageError",
    "block_progress",
    "block_range",
    "format_bytes",
    "format_counts",
    "format_rate",
    "logging_to",
    "phase_rows",
    "summary_table",
)

#: Exit codes of every subcommand.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

_TIMEOUT_OUTCOMES: Final = ("slice_timeout", "total_timeout")


class UsageError(Exception):
    """A command-line argument is invalid in a way argparse alone cannot tell (exit 2)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` after an option's help, unless it has no meaningful default; a
    list default as it is typed (``256KiB 2MiB``), not as a Python list."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default:" in (action.help or ""):
            return action.help
        if isinstance(action.default, list | tuple):
            typed = " ".join(str(v) for v in action.default).replace("%", "%%")
            return f"{action.help or ''} (default: {typed})"
        return super()._get_help_string(action)


@final
@dataclass(frozen=True, slots=True)
class CommandIO:
    """Where a command writes.

    Attributes:
        out: Results (summaries, tables, JSON) — standard output.
        err: Progress bars and logs — standard error, so ``out`` stays clean to pipe.
    """

    out: Console
    err: Console


@final
@dataclass(frozen=True, slots=True)
class Command:
    """One ``kvpipe`` subcommand.

    Attributes:
        name: The subcommand's name on the command line.
        help: One line for ``kvpipe --help``.
        add_arguments: Adds the subcommand's options to its parser.
        run: Runs it on the event loop; returns the exit code. May raise
            :class:`UsageError` or a ``kvpipe.KVPipeError``; ``main`` turns those into a
            one-line message and an exit code.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, CommandIO], Awaitable[int]]


@contextmanager
def logging_to(console: Console, level: str) -> Iterator[None]:
    """Send the ``kvpipe`` logger's records at ``level`` and above to ``console``.

    On a terminal, rich's handler; otherwise (a file, a pipe, a log collector) one plain line
    per record, ``TIME LEVEL LOGGER: MESSAGE``, so that a record can be found with grep
    (rich wraps it at the console's width, 80 columns off a terminal, and pads each line).

    The logger's previous level, handlers and propagation are restored on exit, so running
    ``main`` in-process (tests, notebooks) leaves logging as it found it.
    """
    logger = logging.getLogger("kvpipe")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False, rich_tracebacks=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler(console.file)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.handlers = [handler]
    logger.setLevel(level)
    logger.propagate = False
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        logger.handlers = saved[1]
        logger.propagate = saved[2]
        handler.close()


def block_range(text: str) -> tuple[int, int]:
    """An argparse type: ``"20-32"`` or ``"24"`` → inclusive ``(lo, hi)``, ``1 <= lo <= hi``."""
    lo_s, sep, hi_s = text.partition("-")
    try:
        lo, hi = int(lo_s), int(hi_s if sep else lo_s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO-HI, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def seed(text: str) -> int:
    """An argparse type: a random seed, an int ``>= 0`` (numpy refuses negative seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {value}")
    return value


def format_counts(counts: Mapping[str, float]) -> str:
    """``{"complete": 3, "incomplete": 1}`` → ``"complete 3, incomplete 1"`` (``"-"`` if empty)."""
    return (
        ", ".join(
            f"{k} {v:,.0f}" if float(v).is_integer() else f"{k} {v:,.3g}" for k, v in counts.items()
        )
        or "-"
    )


def summary_table(title: str, columns: Iterable[str], rows: Iterable[Iterable[object]]) -> Table:
    """A table whose first column names each row and whose other columns are right-aligned."""
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    return table


@final
@dataclass(slots=True)
class PhaseTally:
    """Counts one phase of a run (writes or reads) and advances its progress bar.

    Attributes:
        progress: The progress display; ``task`` is this phase's bar in it.
        task: This phase's task in ``progress``.
        block_nbytes: Bytes of one block (``layout.block_nbytes``).
        results: The results of the requests done, in the order they finished.
        moved: Blocks written (writes) or loaded (reads).
        verified: Blocks the command verified (reads).
        seconds: Wall time of the phase, set by :meth:`finish`.
    """

    progress: Progress
    task: TaskID
    block_nbytes: int
    results: list[WriteResult | ReadResult] = field(default_factory=list)
    moved: int = 0
    verified: int = 0
    seconds: float = 0.0

    def done(self, result: WriteResult | ReadResult, moved: int) -> None:
        """Record a finished request that moved ``moved`` blocks."""
        self.results.append(result)
        self.moved += moved
        nbytes = self.moved * self.block_nbytes
        self.progress.update(self.task, advance=result.requested, nbytes=nbytes)

    def finish(self, seconds: float) -> None:
        """End the phase after ``seconds`` of wall time: its bar stops its clock, so the rate
        it shows stays the phase's own while later phases run."""
        self.seconds = seconds
        self.progress.stop_task(self.task)

    def summary(self, stats: PipelineStatistics) -> dict[str, Any]:
        """The phase as JSON-ready numbers (what :func:`phase_rows` shows), given the
        pipeline's statistics at the end of the phase."""
        slices = {k: v for k, v in sorted(stats.slices.items()) if v}
        reasons = Counter(r.stop_reason for r in self.results if r.stop_reason is not None)
        nbytes = self.moved * self.block_nbytes
        return {
            "blocks": self.moved,
            "bytes": nbytes,
            "seconds": round(self.seconds, 4),
            "gbps": round(nbytes / self.seconds / 1e9, 3) if self.seconds > 0 else 0.0,
            "slices": slices,
            "timeouts": sum(n for k, n in slices.items() if k.endswith(_TIMEOUT_OUTCOMES)),
            "restarts": sum(stats.restarts.values()),
            "incomplete": sum(not r.complete for r in self.results),
            "stop_reasons": dict(sorted(reasons.items())),
        }


def phase_rows(*phases: Mapping[str, Any]) -> list[tuple[object, ...]]:
    """Rows of :func:`summary_table` comparing phases (a column each) of a run.

    Each phase is a mapping with ``bytes``, ``seconds``, ``slices`` (by outcome),
    ``timeouts``, ``restarts`` and ``incomplete`` (requests that stopped short).
    """
    return [
        ("bytes moved", *(format_bytes(p["bytes"]) for p in phases)),
        ("wall time", *(f"{p['seconds']:.3f} s" for p in phases)),
        ("throughput", *(format_rate(p["bytes"], p["seconds"]) for p in phases)),
        ("slices", *(format_counts(p["slices"]) for p in phases)),
        ("timeouts", *(p["timeouts"] for p in phases)),
        ("actor restarts", *(p["restarts"] for p in phases)),
        ("incomplete requests", *(p["incomplete"] for p in phases)),
    ]


def format_bytes(nbytes: float) -> str:
    """``1234567`` → ``"1.2 MB"`` (decimal units, as rates are)."""
    return str(decimal(int(nbytes)))


def format_rate(nbytes: float, seconds: float) -> str:
    """Bytes over seconds as ``"1.23 GB/s"``, 3 significant digits (``"-"`` if not timed)."""
    if seconds <= 0:
        return "-"
    return f"{nbytes / seconds / 1e9:.3g} GB/s"


class _ByteRateColumn(ProgressColumn):
    """Average GB/s of a task since it started, from its ``nbytes`` field."""

    def render(self, task: Task) -> Text:
        nbytes = float(task.fields.get("nbytes", 0))
        return Text(format_rate(nbytes, task.elapsed or 0.0), style="progress.data.speed")


def block_progress(console: Console, *, disable: bool) -> Progress:
    """A progress display of blocks done / total with the GB/s actually moved.

    Tasks carry an ``nbytes`` field (bytes moved so far): ``progress.update(task,
    advance=blocks, nbytes=total_moved)``.

    Args:
        console: Where to draw (standard error).
        disable: Draw nothing — set it when the console is not a terminal, so logs and
            captured output are not filled with redraws.
    """
    return Progress(
        TextColumn("[bold]{task.description:<6}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("blocks"),
        _ByteRateColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=disable,
    )
