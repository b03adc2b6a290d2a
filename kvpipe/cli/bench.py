"""``kvpipe bench``: throughput against the physical baseline, measured in the same run.

Scenarios (``--scenario``, repeatable; default ``file``; ``all`` runs every one). The first
three compare the pipeline with its backend's baseline for block sizes of 256 KiB, 2 MiB and
8 MiB:

- ``file``: the pipeline over the file store versus raw file writes/reads of the same bytes
  (one file per block, same fsync policy) and a hand-written read-then-scatter, per
  durability (``data`` and ``none``), reads hot (page cache) and cold (evicted) apart.
  Rounds: pipeline, raw ×1 (and hand-written ×1, ×2), raw ×4, O_DIRECT ×4 (which reads cold
  only: an O_DIRECT read skips the page cache).
- ``mooncake``: the pipeline over :class:`kvpipe.MooncakeStore` versus the direct Mooncake
  client (``batch_put_from`` / ``batch_upsert_from`` / ``batch_get_into`` on registered
  buffers of the same client, same value sizes), with the data in this process's segment
  and in another process's (``--placement``). It starts its own Mooncake on 127.0.0.1 and
  stops it (see :mod:`kvpipe.benchmarks.mooncake`).

- ``memory``: the pipeline over :class:`kvpipe.MemoryStore` versus plain numpy doing the
  same data movement (gather + copy into fresh memory; copy out + scatter), one or two
  threads (see :mod:`kvpipe.benchmarks.memory`).

The others measure the pipeline itself (issue 7):

- ``sweeps``: throughput and request latency (p50/p99) against ``slice_block_num``, block
  size and concurrency (:mod:`kvpipe.benchmarks.sweeps`);
- ``scaling``: 1x, 4x, 16x the blocks, one process each: time and the pipeline's peak RSS
  (:mod:`kvpipe.benchmarks.scaling`);
- ``lag``: lateness of a 1 ms ticker on the pipeline's loop while it writes and reads at
  full speed (:mod:`kvpipe.benchmarks.lag`);
- ``overhead``: fixed cost per request, slice and block of the actors against the same calls
  in a plain loop, as % of a 2 MiB block's copy time (:mod:`kvpipe.benchmarks.overhead`);
- ``server``: an ASGI app on uvicorn answering a steady stream of small HTTP requests from
  another process while the same loop offloads and reloads 2 MiB blocks through kvpipe, then
  through a hand-written offload (numpy in worker threads): the server's p99 latency and the
  GB/s of each (:mod:`kvpipe.benchmarks.server`; needs the ``bench`` extra).

And the FastDeploy adapter's cost (issue 15):

- ``integration``: :class:`~kvpipe.integrations.fastdeploy.KVPipeAttentionStore` driven from 4
  threads vs the pipeline called directly on its own loop (4 tasks), file store, 2 MiB
  blocks, and the thread hop's latency p50 / p99 (:mod:`kvpipe.benchmarks.integration`;
  needs Paddle).

And the CUDA device path (needs a GPU; ``all`` includes it only where one is usable):

- ``device``: a GPU cache offloaded to :class:`kvpipe.MemoryStore` and reloaded, versus a
  hand-written loop (one DMA per tensor per slice, numpy on the host), and the PCIe link's
  own GB/s (:mod:`kvpipe.benchmarks.device`).

Rounds are interleaved after a warm-up; the ratio is the median over rounds of pipeline /
best baseline of that round. Results: a table per scenario, ``--json PATH``,
``--markdown PATH``, PNG plots with ``--plot DIR`` (the ``plots`` extra), and the generated
sections of ``docs/performance.md`` with ``--doc PATH``. ``--smoke`` shrinks every scenario
to a seconds-long run (CI).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Final

import anyio
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from ..benchmarks import report
from ..benchmarks._asgi import UvicornUnavailable, require_uvicorn
from ..benchmarks._workload import CpuWatch
from ..benchmarks.device import DeviceBenchConfig, run_device_bench
from ..benchmarks.filestore import LAYOUTS, FileBenchConfig, run_filestore_bench
from ..benchmarks.integration import IntegrationBenchConfig, run_integration_bench
from ..benchmarks.lag import LagBenchConfig, run_lag_bench
from ..benchmarks.memory import MemoryBenchConfig, run_memory_bench
from ..benchmarks.mooncake import PLACEMENTS, MooncakeBenchConfig, run_mooncake_bench
from ..benchmarks.overhead import OverheadBenchConfig, run_overhead_bench
from ..benchmarks.plots import PlotsUnavailable, plot_all, require_matplotlib
from ..benchmarks.scaling import ScalingBenchConfig, run_scaling_bench
from ..benchmarks.server import ServerBenchConfig, run_server_bench
from ..benchmarks.sweeps import SweepBenchConfig, run_sweep_bench
from ..cuda import probe_device
from . import _console as ui
from ._bench_tables import file_markdown, file_table, mooncake_markdown, mooncake_table

__all__ = ("COMMAND", "DEFAULT_ROUNDS", "SCENARIOS", "markdown")

SCENARIOS: Final = ("file", "mooncake", *report.NEW_SCENARIOS)
#: The server scenario's client rate when ``--server-rate`` is not given.
SERVER_RATE: Final = 500.0
#: Recorded rounds per scenario when ``--rounds`` is not given.
DEFAULT_ROUNDS: Final = {
    "file": 7,
    "mooncake": 9,
    "memory": 7,
    "sweeps": 3,
    "scaling": 5,
    "lag": 3,
    "overhead": 7,
    "integration": 5,
    "server": 7,
    "device": 5,
}


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown: per scenario, a line on how it was measured and a table per
    operation (for ``docs/performance.md``)."""
    lines: list[str] = []
    for scenario, tables in (("file", file_markdown), ("mooncake", mooncake_markdown)):
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
    for scenario in report.NEW_SCENARIOS:
        if results.get(scenario):
            lines += [f"## {scenario}", "", report.markdown(results, scenario)]
    return "\n".join(lines)


async def _run_new_scenario(
    scenario: str, args: argparse.Namespace, tick: Callable[[str], None]
) -> Any:
    rounds = args.rounds or (1 if args.smoke else DEFAULT_ROUNDS[scenario])
    if scenario == "memory":
        memory = MemoryBenchConfig(sizes=tuple(args.sizes), total_bytes=args.mib << 20)
        return await run_memory_bench(replace(memory, rounds=rounds), tick)
    if scenario == "sweeps":
        sweeps = SweepBenchConfig(rounds=rounds)
        if args.smoke:
            sweeps = replace(sweeps, total_bytes=8 << 20, cache_bytes=8 << 20, concurrency_max=4)
        return await run_sweep_bench(sweeps, tick)
    if scenario == "scaling":
        scaling = ScalingBenchConfig(rounds=rounds, directory=args.scaling_dir)
        if args.smoke:
            scaling = replace(scaling, base_blocks=4, request_blocks=2, warmup=False)
        return await run_scaling_bench(scaling, tick)
    if scenario == "lag":
        copy, io, store = args.lag_threads or (None, None, None)
        lag = LagBenchConfig(
            rounds=rounds,
            directory=args.dir,
            copy_threads=copy,
            io_threads=io,
            store_threads=store,
        )
        if args.smoke:
            lag = replace(lag, memory_bytes=16 << 20, file_bytes=16 << 20, idle_seconds=0.05)
        return await run_lag_bench(lag, tick)
    if scenario == "integration":
        integration = IntegrationBenchConfig(
            rounds=rounds, total_bytes=args.mib << 20, directory=args.dir
        )
        if args.smoke:
            integration = replace(integration, layers=2, request_blocks=2, hops=20)
        return await run_integration_bench(integration, tick)
    if scenario == "server":
        server = ServerBenchConfig(
            stores=tuple(dict.fromkeys(args.server_store or ["memory"])),
            rounds=rounds,
            rate=args.server_rate,
            directory=args.dir,
        )
        if args.smoke:
            server = replace(server, cache_bytes=16 << 20, passes=1, idle_seconds=0.1)
        return await run_server_bench(server, tick)
    if scenario == "device":
        device = DeviceBenchConfig(rounds=rounds, verify_checksums=not args.no_checksums)
        if args.device_threads is not None:
            device = replace(device, threads=args.device_threads, concurrency=args.device_threads)
        if args.smoke:
            device = replace(device, size="256KiB", total_bytes=4 << 20, request_bytes=1 << 20)
        return await run_device_bench(device, tick)
    overhead = OverheadBenchConfig(rounds=rounds)
    if args.smoke:
        overhead = replace(overhead, requests=(4, 2, 8))
    return await run_overhead_bench(overhead, tick)


async def _run_scenario(
    scenario: str, args: argparse.Namespace, tick: Callable[[str], None]
) -> Any:
    if scenario in report.NEW_SCENARIOS:
        return await _run_new_scenario(scenario, args, tick)
    rounds = args.rounds or DEFAULT_ROUNDS[scenario]
    if scenario == "file":
        fcfg = FileBenchConfig(
            sizes=tuple(args.sizes),
            total_bytes=args.mib << 20,
            rounds=rounds,
            durabilities=tuple(dict.fromkeys(args.durability or ("data", "none"))),
            directory=args.dir,
            **({"store_threads": args.store_threads} if args.store_threads else {}),
            **({"slice_mib": args.slice_mib} if args.slice_mib else {}),
            cached_writes=args.cached_writes,
        )
        return await run_filestore_bench(fcfg, tick)
    mcfg = MooncakeBenchConfig(
        sizes=tuple(args.sizes),
        placements=tuple(args.placement or PLACEMENTS),
        total_bytes=args.mib << 20,
        rounds=rounds,
        slice_bytes=(args.slice_mib or 32) << 20,
        concurrency=args.concurrency,
        io_threads=args.io_threads,
        verify_checksums=not args.no_checksums,
    )
    return await run_mooncake_bench(mcfg, tick)


def _options(args: argparse.Namespace) -> str:
    """The options that change what a new scenario measures, as on the command line."""
    out = f" --rounds {args.rounds}" if args.rounds else ""
    if args.sizes != list(LAYOUTS) or args.mib != 256:
        out += f" --sizes {' '.join(args.sizes)} --mib {args.mib}"
    if args.lag_threads:
        out += " --lag-threads " + ",".join(str(n) for n in args.lag_threads)
    for store in args.server_store or ():
        out += f" --server-store {store}"
    if args.server_rate != SERVER_RATE:
        out += f" --server-rate {args.server_rate:g}"
    return out + (" --smoke" if args.smoke else "")


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Run the chosen scenarios and report."""
    scenarios = args.scenario or ["file"]
    probe = probe_device() if "all" in scenarios or "device" in scenarios else None
    if "all" in scenarios:
        scenarios = [s for s in SCENARIOS if s != "device" or (probe and probe.available)]
    if "device" in scenarios and probe is not None and not probe.available:
        raise ui.UsageError(f"the device scenario needs a CUDA GPU: {probe.note}")
    if "server" in scenarios:
        try:
            require_uvicorn()
        except UvicornUnavailable as exc:
            raise ui.UsageError(str(exc)) from None
    if not (math.isfinite(args.server_rate) and args.server_rate > 0):  # nan passed `<= 0`
        raise ui.UsageError(f"--server-rate must be a finite number > 0, got {args.server_rate}")
    if args.plot:
        try:
            require_matplotlib()
        except PlotsUnavailable as exc:
            raise ui.UsageError(str(exc)) from None
    for name in (
        "mib",
        "rounds",
        "slice_mib",
        "concurrency",
        "io_threads",
        "store_threads",
        "device_threads",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ui.UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    _check_paths(args)
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {platform.system()} {platform.release()}",
        "rounds": args.rounds,
        "mib": args.mib,
        "command": "kvpipe bench",
        "seconds": {},
        "others_cpu_pct": {},
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
            started, watch = time.perf_counter(), CpuWatch()
            results[scenario] = await _run_scenario(scenario, args, tick)
            results["seconds"][scenario] = round(time.perf_counter() - started, 1)
            results["others_cpu_pct"][scenario] = watch.others_pct()
    results["command"] = "kvpipe bench " + " ".join(f"--scenario {s}" for s in scenarios)
    results["command"] += _options(args)
    if results.get("file"):
        io.out.print(file_table(results["file"]))
    if results.get("mooncake"):
        io.out.print(mooncake_table(results["mooncake"]))
    for scenario in report.NEW_SCENARIOS:
        if results.get(scenario):
            for table in report.tables(results, scenario):
                io.out.print(table)
    if args.plot:
        results["plots"] = await anyio.to_thread.run_sync(plot_all, results, args.plot)
    if args.json:
        await anyio.Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        await anyio.Path(args.markdown).write_text(markdown(results) + "\n")
    if args.doc:
        text, missing = report.update_doc(await anyio.Path(args.doc).read_text(), results)
        await anyio.Path(args.doc).write_text(text)
        for scenario in missing:
            io.err.print(f"{args.doc}: no <!-- kvpipe-bench:{scenario} --> section; not written")
    return ui.EXIT_OK


def _check_paths(args: argparse.Namespace) -> None:
    """Refuse, before the run, the paths it would fail on only after its last round.

    Raises:
        ui.UsageError: ``--dir`` or ``--scaling-dir`` is not a directory, ``--json`` or
            ``--markdown`` is in a directory that does not exist, ``--doc`` is not a file.
    """
    for option, directory in (("--dir", args.dir), ("--scaling-dir", args.scaling_dir)):
        if directory is not None and not os.path.isdir(directory):
            raise ui.UsageError(f"{option} {directory}: not a directory")
    for option, path in (("--json", args.json), ("--markdown", args.markdown)):
        parent = os.path.dirname(path or "") or "."
        if path is not None and not os.path.isdir(parent):
            raise ui.UsageError(f"{option} {path}: no directory {parent}")
    if args.doc is not None and not os.path.isfile(args.doc):
        raise ui.UsageError(f"--doc {args.doc}: not a file")


def _three_ints(text: str) -> tuple[int, int, int]:
    """An argparse type: ``"1,1,1"`` -> ``(1, 1, 1)``, each >= 1."""
    try:
        a, b, c = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected COPY,IO,STORE, got {text!r}") from None
    if min(a, b, c) < 1:
        raise argparse.ArgumentTypeError(f"thread counts must be >= 1, got {text!r}")
    return a, b, c


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe bench``."""
    add = parser.add_argument
    add(
        "--scenario",
        action="append",
        choices=(*SCENARIOS, "all"),
        help="scenarios to run (repeatable; default: file; all: every one)",
    )
    add("--sizes", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS), help="block sizes")
    add("--mib", type=int, default=256, help="MiB per round per contender")
    add(
        "--rounds",
        type=int,
        help="recorded rounds after one warm-up (default: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_ROUNDS.items())
        + "; 1 with --smoke)",
    )
    add(
        "--durability",
        choices=("none", "data", "full"),
        action="append",
        help="file: the store's and the contenders' fsync policy (repeatable; default: data "
        "and none)",
    )
    add("--dir", default=".", help="file, integration: directory on the disk to measure")
    add("--store-threads", type=int, default=None, help="file: the file store's threads")
    add(
        "--cached-writes",
        action="store_true",
        help="file: the file store writes through the page cache (FileStore(cached_writes=True))",
    )
    add(
        "--placement",
        action="append",
        choices=PLACEMENTS,
        help="mooncake: where the data lands — local: this process's segment, remote: "
        "another process's (repeatable; default: both)",
    )
    add(
        "--slice-mib",
        type=int,
        default=None,
        help="MiB per pipeline slice (file: at least, and at least 8 blocks; default 8; "
        "mooncake: default 32)",
    )
    add("--concurrency", type=int, default=2, help="mooncake: pipeline requests in flight")
    add("--io-threads", type=int, default=2, help="mooncake: the pipeline's io_threads")
    add(
        "--no-checksums",
        action="store_true",
        help="mooncake, device: pipeline without checksums",
    )
    add(
        "--device-threads",
        type=int,
        default=None,
        help="device: the pipeline's copy threads and requests in flight, and the plain "
        "loop's threads (default 4)",
    )
    add(
        "--scaling-dir",
        metavar="DIR",
        help="scaling: where the file store lives (default: /dev/shm, a tmpfs, if present)",
    )
    add(
        "--lag-threads",
        type=_three_ints,
        metavar="COPY,IO,STORE",
        help="lag: the pipelines' copy_threads and io_threads and the file store's threads "
        "(default: 2,8,4, the defaults)",
    )
    add(
        "--server-store",
        action="append",
        choices=("memory", "file"),
        help="server: the store offloaded to (repeatable; default: memory; file: under --dir)",
    )
    add(
        "--server-rate",
        type=float,
        default=SERVER_RATE,
        help="server: HTTP requests per second from the client process",
    )
    add("--smoke", action="store_true", help="memory..server: a seconds-long run (CI)")
    add("--json", metavar="PATH", help="write the results as JSON")
    add("--markdown", metavar="PATH", help="write the results as markdown tables")
    add("--plot", metavar="DIR", help="write PNG plots there (needs the 'plots' extra)")
    add(
        "--doc",
        metavar="PATH",
        help="replace the generated sections (<!-- kvpipe-bench:NAME -->) of this markdown "
        "file, e.g. docs/performance.md",
    )


COMMAND: Final = ui.Command(
    name="bench",
    help="measure pipeline throughput against its baseline (raw files, the direct Mooncake "
    "client), in the same run",
    add_arguments=add_arguments,
    run=run,
)
