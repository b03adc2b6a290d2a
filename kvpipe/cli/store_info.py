"""``kvpipe store-info PATH``: what a file store holds, without changing it."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from dataclasses import asdict
from typing import Final

import anyio
from anyio.to_thread import run_sync
from rich.table import Table

from .._errors import BackendError
from ..backends.file import StoreReport, inspect_store, is_store
from . import _console as ui

__all__ = ("COMMAND",)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _render(report: StoreReport, io: ui.CommandIO) -> None:
    table = Table(title=f"kvpipe file store at {report.root}", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("blocks", f"{report.blocks:,}"),
        ("payload bytes", ui.format_bytes(report.payload_bytes)),
        ("bytes on disk", ui.format_bytes(report.disk_bytes)),
        (
            "namespaces",
            ", ".join(f"{k} ({v:,})" for k, v in sorted(report.namespaces.items())) or "-",
        ),
        ("oldest block", _when(report.oldest)),
        ("newest block", _when(report.newest)),
        (
            "corrupt files",
            f"{len(report.corrupt):,}"
            + ("" if report.verified else " (headers only; --verify reads payloads)"),
        ),
        ("temporary files", f"{report.temp_files:,} ({report.stale_temp_files:,} stale)"),
        ("quarantined files", f"{report.quarantined:,}"),
        (
            "catalog",
            f"unreadable ({report.catalog_error})"
            if report.catalog_error
            else f"{report.catalog_blocks:,} blocks, "
            f"{ui.format_bytes(report.catalog_bytes)}; {report.untracked:,} files untracked"
            + (f"; {report.catalog_pending:,} unsettled" if report.catalog_pending else ""),
        ),
        ("residency records", f"{report.residency_records:,}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    io.out.print(table)
    for line in report.corrupt[:20]:
        io.out.print(f"[red]corrupt[/]: {line}", highlight=False)
    if len(report.corrupt) > 20:
        io.out.print(f"... and {len(report.corrupt) - 20} more")


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Inspect the store; exit 1 when corrupt files were found, the catalog cannot be read
    or the tree cannot be walked, 2 when ``path`` is not a store's directory or this user
    may not list it."""
    if not await anyio.Path(args.path).is_dir():
        raise ui.UsageError(f"{args.path}: not a directory")
    # Before is_store, which cannot look inside a directory it may not list (a store's root
    # is made 0700): another user's store is not "not a store".
    if not await run_sync(os.access, args.path, os.R_OK | os.X_OK):
        raise ui.UsageError(f"{args.path}: permission denied (this user cannot list it)")
    if not await run_sync(is_store, args.path):
        raise ui.UsageError(
            f"{args.path}: not a kvpipe store (no catalog.sqlite3, no blocks/ directory)"
        )
    try:
        report = await run_sync(inspect_store, args.path, args.verify)
    except PermissionError as exc:  # a directory inside it this user may not list
        raise ui.UsageError(f"{args.path}: permission denied: {exc.filename or exc}") from exc
    except OSError as exc:
        raise BackendError("file", "inspect", f"{args.path}: {exc}") from exc
    if args.json:
        data = asdict(report)
        data["namespaces"] = dict(report.namespaces)
        print(json.dumps(data, indent=2), file=io.out.file)
    else:
        _render(report, io)
    return ui.EXIT_FAILED if report.corrupt or report.catalog_error else ui.EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe store-info``."""
    parser.add_argument("path", help="the file store's root directory")
    parser.add_argument(
        "--verify", action="store_true", help="read every payload and check its checksum"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


COMMAND: Final = ui.Command(
    name="store-info",
    help="show what a file store holds (blocks, bytes, namespaces, corrupt or stale files)",
    add_arguments=add_arguments,
    run=run,
)
