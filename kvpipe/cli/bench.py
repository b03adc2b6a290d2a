"""``kvpipe bench``: throughput against the physical baseline, measured in the same run.

Scenarios (``--scenario``, repeatable): ``file`` — the pipeline over the file store versus raw
file writes/reads of the same bytes (one file per block, same fsync policy), for block sizes
of 256 KiB, 2 MiB and 8 MiB. Results: a table, ``--json PATH`` and ``--markdown PATH``.
Rounds are interleaved (pipeline, raw ×1, raw ×4, ...) after a warm-up; the ratio is the
median over rounds of pipeline / best raw of that round.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any, Final

import anyio
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..benchmarks.filestore import LAYOUTS, FileBenchConfig, run_filestore_bench
from . import _console as ui

__all__ = ("COMMAND", "markdown")

SCENARIOS: Final = ("file",)


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (for ``docs/performance.md``)."""
    lines = [
        f"Measured {results['when']} on {results['machine']}; "
        f"{results['rounds']} interleaved rounds after a warm-up, {results['mib']} MiB "
        "per round per contender.",
        "",
    ]
    for rec_kind in ("write", "read"):
        lines += [
            f"| block | durability | {rec_kind} | pipeline GB/s (median / best) | "
            "raw x1 GB/s | raw x4 GB/s | ratio (median) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in results.get("file", []):
            w = r[rec_kind]
            kind = rec_kind + (" (cold)" if rec_kind == "read" and r["cold_reads"] else "")
            lines.append(
                f"| {r['block_size']} | {r['durability']} | {kind} | "
                f"{w['gbps_median']} / {w['gbps_best']} | {w['raw1_gbps_median']} | "
                f"{w['raw4_gbps_median']} | **{w['ratio_median']}** |"
            )
        lines.append("")
    return "\n".join(lines)


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Run the chosen scenarios and report."""
    scenarios = args.scenario or list(SCENARIOS)
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "rounds": args.rounds,
        "mib": args.mib,
    }
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=io.err,
        disable=not io.err.is_terminal,
    ) as progress:
        task = progress.add_task("starting", total=None)

        def tick(what: str) -> None:
            progress.update(task, description=what)

        if "file" in scenarios:
            cfg = FileBenchConfig(
                sizes=tuple(args.sizes),
                total_bytes=args.mib << 20,
                rounds=args.rounds,
                durability=args.durability,
                directory=args.dir,
                cold_reads=not args.warm_reads,
            )
            results["file"] = await run_filestore_bench(cfg, tick)
    table = Table(title="kvpipe bench: pipeline over the file store vs raw files")
    for col in ("block", "op", "pipeline GB/s", "raw x1", "raw x4", "ratio"):
        table.add_column(col, justify="right")
    for r in results.get("file", []):
        for op in ("write", "read"):
            w = r[op]
            table.add_row(
                r["block_size"],
                op,
                f"{w['gbps_median']} / {w['gbps_best']}",
                str(w["raw1_gbps_median"]),
                str(w["raw4_gbps_median"]),
                str(w["ratio_median"]),
            )
    io.out.print(table)
    if args.json:
        await anyio.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        await anyio.Path(args.markdown).write_text(markdown(results) + "\n")
    return ui.EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe bench``."""
    add = parser.add_argument
    add("--scenario", action="append", choices=SCENARIOS, help="run only these (repeatable)")
    add("--sizes", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS), help="block sizes")
    add("--mib", type=int, default=256, help="MiB per round per contender")
    add("--rounds", type=int, default=7, help="recorded rounds (after one warm-up)")
    add("--durability", choices=("none", "data", "full"), default="data")
    add("--dir", default=".", help="directory on the disk to measure")
    add("--warm-reads", action="store_true", help="read from the page cache, not the disk")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--markdown", metavar="PATH", help="write the results as markdown tables")


COMMAND: Final = ui.Command(
    name="bench",
    help="measure pipeline throughput against raw I/O of the same bytes, in the same run",
    add_arguments=add_arguments,
    run=run,
)
