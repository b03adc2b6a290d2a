"""``kvpipe faults``: fault-injection runs against a store, with a table of invariants.

Each scenario (``--scenario NAME``, repeatable, or ``--all``) runs a workload of writes and
reads through a :class:`kvpipe.testing.FaultyStore` over the chosen store and judges the seven
invariants of :mod:`kvpipe.testing.invariants`. With ``--store file`` the process-kill
scenario (a writer SIGKILLed mid-write, then the store reopened) runs too. Exit code 1 when an
invariant broke.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final

import anyio
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

import kvpipe

from ..testing.scenarios import SCENARIOS, ScenarioResult, memory_store, run_scenario
from . import _console as ui

__all__ = ("COMMAND",)

STORES: Final = ("memory", "file", "mooncake")
#: The scenario that is a process kill rather than a fault plan (file store only).
KILL: Final = ("kill_mid_write", "a writer process killed with SIGKILL mid-write (file store)")


@asynccontextmanager
async def _stores(kind: str, root: str) -> AsyncIterator[Any]:
    """A factory of fresh inner stores, one per scenario."""
    if kind == "memory":
        yield memory_store
        return
    if kind == "file":

        @asynccontextmanager
        async def file_store(name: str) -> AsyncIterator[kvpipe.StorageBackend]:
            async with kvpipe.FileStore(f"{root}/{name}", durability="none") as store:
                yield store

        yield file_store
        return
    # Started as mooncake-up and the demo start it: one that does not start is a one-line
    # UsageError ending with its log, and the stop is shielded.
    from .mooncake_up import running_mooncake

    async with running_mooncake() as server:

        @asynccontextmanager
        async def mooncake_store(name: str) -> AsyncIterator[kvpipe.StorageBackend]:
            async with kvpipe.MooncakeStore(
                server.master_address, server.metadata_url, global_segment_size=256 << 20
            ) as store:
                yield store

        yield mooncake_store


def _row(r: ScenarioResult) -> dict[str, Any]:
    broken = [v.name for v in r.verdicts if not v.held]
    checked = [v for v in r.verdicts if v.checked]
    return {
        "scenario": r.name,
        "store": r.store,
        "requests": r.requests,
        "blocks_written": r.blocks_written,
        "blocks_read": r.blocks_read,
        "invariants_checked": len(checked),
        "broken": broken,
        "details": {v.name: v.details for v in r.verdicts if not v.held},
        "failures": {v.name: v.failures for v in r.verdicts if not v.held},
        "overrun_max_s": round(r.overrun_max, 4),
        "overrun_p99_s": round(r.overrun_p99, 4),
        "seconds": round(r.seconds, 2),
    }


def _check_dir(directory: str | None) -> None:
    """Refuse a ``--dir`` the stores cannot be made in.

    Raises:
        ui.UsageError: ``directory`` is not a directory this process can write in.
    """
    if directory is not None and not (
        os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
    ):
        raise ui.UsageError(f"--dir {directory}: not a directory this process can write in")


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Run the scenarios (or list them); 0 when every invariant held, else 1."""
    if args.list:
        for name, about in [(s.name, s.about) for s in SCENARIOS] + [KILL]:
            print(f"{name:<16} {about}", file=io.out.file)
        return ui.EXIT_OK
    if args.dir is not None and args.store != "file":  # as kvpipe demo's store options
        raise ui.UsageError(f"--dir is for --store file, not --store {args.store}")
    _check_dir(args.dir)
    chosen = [s for s in SCENARIOS if args.all or not args.scenario or s.name in args.scenario]
    unknown = set(args.scenario or ()) - {s.name for s in SCENARIOS} - {KILL[0]}
    if unknown:
        raise ui.UsageError(f"unknown scenario(s) {sorted(unknown)}; see --list")
    if args.store != "file" and KILL[0] in (args.scenario or ()):
        raise ui.UsageError(f"{KILL[0]} runs on the file store only (--store file)")
    kill = args.store == "file" and (args.all or not args.scenario or KILL[0] in args.scenario)
    root = tempfile.mkdtemp(prefix="kvpipe-faults-", dir=args.dir)
    rows: list[dict[str, Any]] = []
    try:
        with Progress(
            SpinnerColumn(),
            TextColumn("{task.description:<16}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=io.err,
            disable=args.json or not io.err.is_terminal,
        ) as progress:
            task = progress.add_task("faults", total=len(chosen) + kill)
            async with _stores(args.store, root) as make_store:
                for scenario in chosen:
                    progress.update(task, description=scenario.name)
                    result = await run_scenario(scenario, make_store, args.store, args.seed)
                    rows.append(_row(result))
                    progress.advance(task)
            if kill:
                from ..testing.killwrite import run_kill_scenario

                progress.update(task, description=KILL[0])
                rows.append(_row(await run_kill_scenario(f"{root}/kill", args.seed)))
                progress.advance(task)
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled run (SIGTERM) cleans up too
            await anyio.to_thread.run_sync(shutil.rmtree, root, True)
    ok = all(not r["broken"] for r in rows)
    if args.json:
        print(
            json.dumps({"ok": ok, "seed": args.seed, "scenarios": rows}, indent=2), file=io.out.file
        )
        return ui.EXIT_OK if ok else ui.EXIT_FAILED
    table = Table(title=f"kvpipe faults: {args.store} store, seed {args.seed}")
    for col in ("scenario", "requests", "written", "read", "invariants", "overrun max", "p99", "s"):
        table.add_column(col, justify="left" if col in ("scenario", "invariants") else "right")
    for r in rows:
        held = r["invariants_checked"] - len(r["broken"])
        verdict = (
            f"[green]{held}/{r['invariants_checked']} held[/]"
            if not r["broken"]
            else f"[red]broken: {', '.join(r['broken'])}[/]"
        )
        table.add_row(
            r["scenario"],
            str(r["requests"]),
            str(r["blocks_written"]),
            str(r["blocks_read"]),
            verdict,
            f"{r['overrun_max_s']:+.3f}",
            f"{r['overrun_p99_s']:+.3f}",
            f"{r['seconds']:.1f}",
        )
    io.out.print(table)
    for r in rows:
        for name, details in r["details"].items():
            for d in details:
                io.out.print(f"[red]{r['scenario']} {name}[/]: {d}", highlight=False)
            if (more := r["failures"][name] - len(details)) > 0:
                io.out.print(
                    f"[red]{r['scenario']} {name}[/]: ... and {more} more", highlight=False
                )
    io.out.print(
        "overrun: seconds past each call's deadline (negative: early); allowed: the deadline "
        "guard's slack plus 0.15 s of scheduling tolerance"
    )
    return ui.EXIT_OK if ok else ui.EXIT_FAILED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe faults``."""
    add = parser.add_argument
    add("--list", action="store_true", help="list the scenarios, one line each, and exit")
    add("--store", choices=STORES, default="memory", help="the store under the faults")
    add("--scenario", action="append", metavar="NAME", help="run these (repeatable; see --list)")
    add("--all", action="store_true", help="run every scenario (the default with no --scenario)")
    add("--seed", type=ui.seed, default=0, help="seed of the fault plans and workloads")
    add(
        "--dir",
        default=None,
        help="--store file: where its stores go (default: a temporary directory)",
    )
    add("--json", action="store_true", help="print the results as JSON")


COMMAND: Final = ui.Command(
    name="faults",
    help="fault-injection runs: every scenario against a store, invariants checked",
    add_arguments=add_arguments,
    run=run,
)
