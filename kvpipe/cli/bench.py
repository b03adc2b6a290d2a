"""``kvpipe bench``: throughput against the physical baseline, measured in the same run.

Scenarios (``--scenario``, repeatable; default ``file``), each for block sizes of 256 KiB,
2 MiB and 8 MiB:

- ``file``: the pipeline over the file store versus raw file writes/reads of the same bytes
  (one file per block, same fsync policy). Rounds: pipeline, raw ×1, raw ×4, ...
- ``mooncake``: the pipeline over :class:`kvpipe.MooncakeStore` versus the direct Mooncake
  client (``batch_put_from`` / ``batch_upsert_from`` / ``batch_get_into`` on registered
  buffers of the same client, same value sizes), with the data in this process's segment
  and in another process's (``--placement``). It starts its own Mooncake on 127.0.0.1 and
  stops it (see :mod:`kvpipe.benchmarks.mooncake`).

Rounds are interleaved after a warm-up; the ratio is the median over rounds of pipeline /
best baseline of that round. Results: a table per scenario, ``--json PATH`` and
``--markdown PATH``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any, Final

import anyio
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..benchmarks.filestore import LAYOUTS, FileBenchConfig, run_filestore_bench
from ..benchmarks.mooncake import PLACEMENTS, MooncakeBenchConfig, run_mooncake_bench
from . import _console as ui

__all__ = ("COMMAND", "DEFAULT_ROUNDS", "SCENARIOS", "markdown")

SCENARIOS: Final = ("file", "mooncake")
#: Recorded rounds per scenario when ``--rounds`` is not given.
DEFAULT_ROUNDS: Final = {"file": 7, "mooncake": 9}
_WHERE: Final = {"local": "this process", "remote": "another process"}


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: per scenario, a line on how it was measured and a table per
    operation (for ``docs/performance.md``)."""
    lines: list[str] = []
    for scenario, tables in (("file", _file_markdown), ("mooncake", _mooncake_markdown)):
        records = results.get(scenario)
        if not records:
            continue
        lines += [
            f"Measured {results['when']} on {results['machine']}; "
            f"{records[0]['write']['rounds']} interleaved rounds after a warm-up, "
            f"{results['mib']} MiB per round per contender.",
            "",
            *tables(records),
        ]
    return "\n".join(lines)


def _file_markdown(records: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for rec_kind in ("write", "read"):
        lines += [
            f"| block | durability | {rec_kind} | pipeline GB/s (median / best) | "
            "raw x1 GB/s | raw x4 GB/s | ratio (median) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in records:
            w = r[rec_kind]
            kind = rec_kind + (" (cold)" if rec_kind == "read" and r["cold_reads"] else "")
            lines.append(
                f"| {r['block_size']} | {r['durability']} | {kind} | "
                f"{w['gbps_median']} / {w['gbps_best']} | {w['raw1_gbps_median']} | "
                f"{w['raw4_gbps_median']} | **{w['ratio_median']}** |"
            )
        lines.append("")
    return lines


def _mooncake_markdown(records: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| block | data in | write | pipeline GB/s (median / best) | put_from GB/s | "
        "upsert_from GB/s | ratio (median) | vs put_from | vs upsert_from |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        w = r["write"]
        lines.append(
            f"| {r['block_size']} | {_WHERE[r['placement']]} | write | "
            f"{w['gbps_median']} / {w['gbps_best']} | {w['put_from_gbps_median']} | "
            f"{w['upsert_from_gbps_median']} | **{w['ratio_median']}** | "
            f"{w['ratio_vs_put_from']} | {w['ratio_vs_upsert_from']} |"
        )
    lines += [
        "",
        "| block | data in | read | pipeline GB/s (median / best) | get_into GB/s | "
        "ratio (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        g = r["read"]
        lines.append(
            f"| {r['block_size']} | {_WHERE[r['placement']]} | read | "
            f"{g['gbps_median']} / {g['gbps_best']} | {g['get_into_gbps_median']} | "
            f"**{g['ratio_median']}** |"
        )
    return [*lines, "", _pipeline_line(records), ""]


def _pipeline_line(records: list[dict[str, Any]]) -> str:
    """How the pipeline of a Mooncake run was configured, in one sentence."""
    p = records[0]["pipeline"]
    blocks = {r["block_size"]: r["pipeline"]["slice_block_num"] for r in records}
    mib = max(r["pipeline"]["slice_block_num"] * r["value_bytes"] for r in records) / (1 << 20)
    per_size = ", ".join(f"{size}: {n} blocks" for size, n in blocks.items())
    slices = -(-p["request_blocks"] // p["slice_block_num"])
    return (
        f"Pipeline: {p['concurrency']} requests in flight, each of {slices} slices of "
        f"~{mib:.3g} MiB ({per_size}); io_threads={p['io_threads']}; checksums "
        f"{'on' if p['verify_checksums'] else 'off'}."
    )


def _file_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="kvpipe bench: pipeline over the file store vs raw files")
    for col in ("block", "op", "pipeline GB/s", "raw x1", "raw x4", "ratio"):
        table.add_column(col, justify="right")
    for r in records:
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
    return table


def _mooncake_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="kvpipe bench: pipeline over MooncakeStore vs the direct client")
    for col in ("block", "data in", "op", "pipeline GB/s", "direct GB/s", "ratio"):
        table.add_column(col, justify="right")
    for r in records:
        w, g = r["write"], r["read"]
        table.add_row(
            r["block_size"],
            _WHERE[r["placement"]],
            "write",
            f"{w['gbps_median']} / {w['gbps_best']}",
            f"put {w['put_from_gbps_median']}, upsert {w['upsert_from_gbps_median']}",
            str(w["ratio_median"]),
        )
        table.add_row(
            r["block_size"],
            _WHERE[r["placement"]],
            "read",
            f"{g['gbps_median']} / {g['gbps_best']}",
            f"get {g['get_into_gbps_median']}",
            str(g["ratio_median"]),
        )
    return table


async def _run_scenario(
    scenario: str, args: argparse.Namespace, tick: Callable[[str], None]
) -> list[dict[str, Any]]:
    rounds = args.rounds or DEFAULT_ROUNDS[scenario]
    if scenario == "file":
        fcfg = FileBenchConfig(
            sizes=tuple(args.sizes),
            total_bytes=args.mib << 20,
            rounds=rounds,
            durability=args.durability,
            directory=args.dir,
            cold_reads=not args.warm_reads,
        )
        return await run_filestore_bench(fcfg, tick)
    mcfg = MooncakeBenchConfig(
        sizes=tuple(args.sizes),
        placements=tuple(args.placement or PLACEMENTS),
        total_bytes=args.mib << 20,
        rounds=rounds,
        slice_bytes=args.slice_mib << 20,
        concurrency=args.concurrency,
        io_threads=args.io_threads,
        verify_checksums=not args.no_checksums,
    )
    return await run_mooncake_bench(mcfg, tick)


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Run the chosen scenarios and report."""
    scenarios = args.scenario or ["file"]
    for name in ("mib", "rounds", "slice_mib", "concurrency", "io_threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ui.UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
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

        for scenario in dict.fromkeys(scenarios):
            results[scenario] = await _run_scenario(scenario, args, tick)
    if results.get("file"):
        io.out.print(_file_table(results["file"]))
    if results.get("mooncake"):
        io.out.print(_mooncake_table(results["mooncake"]))
    if args.json:
        await anyio.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        await anyio.Path(args.markdown).write_text(markdown(results) + "\n")
    return ui.EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe bench``."""
    add = parser.add_argument
    add(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="scenarios to run (repeatable; default: file)",
    )
    add("--sizes", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS), help="block sizes")
    add("--mib", type=int, default=256, help="MiB per round per contender")
    add(
        "--rounds",
        type=int,
        help="recorded rounds after one warm-up (default: file 7, mooncake 9)",
    )
    add("--durability", choices=("none", "data", "full"), default="data", help="file: fsync")
    add("--dir", default=".", help="file: directory on the disk to measure")
    add("--warm-reads", action="store_true", help="file: read from the page cache, not the disk")
    add(
        "--placement",
        action="append",
        choices=PLACEMENTS,
        help="mooncake: where the data lands — local: this process's segment, remote: "
        "another process's (repeatable; default: both)",
    )
    add("--slice-mib", type=int, default=32, help="mooncake: MiB per pipeline slice")
    add("--concurrency", type=int, default=2, help="mooncake: pipeline requests in flight")
    add("--io-threads", type=int, default=2, help="mooncake: the pipeline's io_threads")
    add("--no-checksums", action="store_true", help="mooncake: pipeline without checksums")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--markdown", metavar="PATH", help="write the results as markdown tables")


COMMAND: Final = ui.Command(
    name="bench",
    help="measure pipeline throughput against its baseline (raw files, the direct Mooncake "
    "client), in the same run",
    add_arguments=add_arguments,
    run=run,
)
