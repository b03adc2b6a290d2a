"""``kvpipe demo``: offload → reload on a real-model-shaped layout, every byte verified.

Playing an inference server, it fills a source cache with seeded random bytes; every request
starts with the same system prompt (``--shared-prefix-blocks``, held once in the cache as a
prefix cache holds it) and every third one ends in a partial block. It writes them through
one pipeline, ``--concurrency`` at a time — the first alone, so the others find the prefix
stored and skip it (deduplication) — then, through a second pipeline over the same store,
reads each back into a fresh cache at shuffled block ids from a free list (zeroed when taken,
returned once verified), compares every byte, and prints a summary (``--json``: as JSON).
Exit code 1 when a block differs or any write or read stopped short. ``--metrics-port PORT``
serves the run's Prometheus metrics on 127.0.0.1 (pipelines ``write`` and ``read``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

import anyio
import numpy as np
from anyio.to_thread import run_sync
from rich.console import Console

import kvpipe

from .._blockformat import value_nbytes
from . import _console as ui
from . import _metrics_port
from ._demo_workload import (
    PRESETS,
    DemoRequest,
    IdArray,
    Workload,
    count_equal,
    plan_workload,
    random_fills,
)
from .mooncake_up import mooncake_store

__all__ = ("COMMAND", "PRESETS", "STORES", "DemoRequest", "Workload", "plan_workload")


#: ``--store`` choices. ``file`` (the embedded default) keeps blocks under ``--store-dir``;
#: ``mooncake`` starts a Mooncake Store on 127.0.0.1 for the run and stops it afterwards.
STORES: Final = ("file", "memory", "mooncake")
_SEGMENT_HELP: Final = (
    "mooncake: MiB its client contributes (default: the workload's distinct blocks twice over, "
    "as the master evicts above 90%% full, plus 64)"
)
#: Where the file store's default directories are made, in the working directory.
_DEFAULT_PARENT: Final = "kvpipe-data"


@asynccontextmanager
async def open_store(args: argparse.Namespace) -> AsyncIterator[kvpipe.StorageBackend]:
    """The store the demo runs on; a file store's directory is removed afterwards unless
    ``--keep-store`` (or it already existed), however the run ends (cancelled too); a
    Mooncake is started for the run and stopped."""
    if args.store == "memory":
        yield kvpipe.MemoryStore()
        return
    if args.store == "mooncake":
        async with mooncake_store((args.segment_mib or 1024) << 20) as mooncake:
            yield mooncake
        return
    # The directories above the store that the run makes (./kvpipe-data, a --store-dir's
    # missing parents) go with it; never one the user had.
    if args.store_dir:
        root = args.store_dir
        made = await run_sync(_missing_parents, root)
        existed = await anyio.Path(root).exists()
    else:
        # A directory of this run's own, never one a run killed before left behind (PIDs
        # repeat): its blocks would be found stored and verified in place of this run's.
        made = await run_sync(_missing_parents, os.path.join(_DEFAULT_PARENT, "demo"))
        root, existed = await run_sync(_fresh_root, _DEFAULT_PARENT), False
    try:
        async with kvpipe.FileStore(root, durability=args.durability or "data") as store:
            yield store
    finally:
        if not (existed or args.keep_store):
            with anyio.CancelScope(shield=True):  # a cancelled run (SIGTERM) cleans up too
                await run_sync(_remove, root, made)


def _missing_parents(path: str) -> list[str]:
    """The directories above ``path`` that do not exist, deepest first."""
    missing = []
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    return missing


def _remove(root: str, parents: Sequence[str]) -> None:
    """Remove the store ``root``, then those of ``parents`` (deepest first) left empty."""
    shutil.rmtree(root, ignore_errors=True)
    for parent in parents:
        try:
            os.rmdir(parent)
        except OSError:  # something else is in it now: it stays, and so do those above
            return


def _fresh_root(parent: str) -> str:
    """A new, empty directory ``parent/demo-PID-XXXXXXXX`` (``parent`` made if missing), as
    an absolute path.

    Raises:
        ui.UsageError: It cannot be made (no permission in the working directory, say).
    """
    made = not os.path.lexists(parent)
    try:
        os.makedirs(parent, exist_ok=True)
        return os.path.abspath(tempfile.mkdtemp(prefix=f"demo-{os.getpid()}-", dir=parent))
    except OSError as exc:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(parent)
        raise ui.UsageError(
            f"cannot make the demo's store under ./{parent}: {exc.strerror or exc}; "
            "run it where you can write, or give --store-dir"
        ) from exc


def _zero_blocks(cache: kvpipe.KVCache, ids: IdArray) -> None:
    for rows in cache.byte_rows:
        rows[ids] = 0


async def _each(
    requests: Sequence[DemoRequest],
    concurrency: int,
    fn: Callable[[DemoRequest], Awaitable[None]],
) -> None:
    """Run ``fn`` on every request, at most ``concurrency`` at a time."""
    limit = anyio.Semaphore(concurrency)

    async def one(req: DemoRequest) -> None:
        async with limit:
            await fn(req)

    async with anyio.create_task_group() as tg:
        for req in requests:
            tg.start_soon(one, req)


async def _write_all(pipe: kvpipe.Pipeline, work: Workload, phase: ui.PhaseTally, n: int) -> None:
    async def write(req: DemoRequest) -> None:
        res = await pipe.write(
            req.tokens, req.src_ids, include_partial=req.partial, request_id=f"w{req.index}"
        )
        phase.done(res, res.written)

    first, *rest = work.requests
    await write(first)  # it stores the system prompt; the rest find it stored
    await _each(rest, n, write)


async def _read_all(
    pipe: kvpipe.Pipeline,
    work: Workload,
    src: kvpipe.KVCache,
    phase: ui.PhaseTally,
    n: int,
    seed: int,
) -> None:
    dst = pipe.cache
    free = [int(b) for b in np.random.default_rng([seed, 2]).permutation(dst.num_blocks)]

    async def read(req: DemoRequest) -> None:
        # _each admits `n` requests at once, and the cache holds `n` of the largest
        ids = np.array(free[: len(req.src_ids)], dtype=np.int64)
        del free[: len(ids)]
        try:
            await run_sync(_zero_blocks, dst, ids)
            res = await pipe.read(
                req.tokens, ids, include_partial=req.partial, request_id=f"r{req.index}"
            )
            equal = await run_sync(count_equal, src, req.src_ids, dst, ids)
        finally:
            free.extend(int(b) for b in ids)
        phase.verified += equal  # not `+= await`: that reads `verified` before awaiting
        phase.done(res, res.loaded)

    await _each(work.requests, n, read)


async def _timed(
    phase: ui.PhaseTally, pipe: kvpipe.Pipeline, job: Awaitable[None]
) -> dict[str, Any]:
    started = time.perf_counter()
    await job
    phase.finish(time.perf_counter() - started)
    return phase.summary(pipe.statistics())  # before the pipeline closes


def _render(s: Mapping[str, Any], console: Console, *, kept: bool) -> None:
    w, r, n = s["writes"], s["reads"], s["blocks_requested"]
    rows = [
        ("requests", s["requests"], s["requests"]),
        ("blocks requested", n, n),
        ("blocks moved", f"{w['blocks']} written", f"{r['blocks']} loaded"),
        ("skipped by dedup", s["skipped"], "-"),
        ("verified byte for byte", "-", f"{s['verified']} / {n}"),
        *ui.phase_rows(w, r),
    ]
    title = f"kvpipe demo: {s['layout']}, {s['store']} store"
    console.print(ui.summary_table(title, ("", "write", "read"), rows))
    console.print(f"store: {ui.format_counts(s['store_statistics'])}", soft_wrap=True)
    if s["store_dir"] is not None and kept:
        console.print(f"store kept at {s['store_dir']}", highlight=False, soft_wrap=True)
    if s["ok"]:
        console.print(f"[green]OK[/]: all {n} blocks verified, {s['seconds']:.2f} s in all")
    else:
        console.print(
            f"[red]FAILED[/]: {s['mismatched']} of {n} blocks differ or did not load; "
            f"stopped writes: {ui.format_counts(w['stop_reasons'])}; "
            f"stopped reads: {ui.format_counts(r['stop_reasons'])}",
            highlight=False,
        )


#: The options that only one ``--store`` uses, and that store.
_STORE_OPTIONS: Final = {
    "store_dir": "file",
    "keep_store": "file",
    "durability": "file",
    "segment_mib": "mooncake",
}


def _check_store_options(args: argparse.Namespace) -> None:
    """Refuse an option that the chosen ``--store`` would ignore (``--store memory
    --store-dir /mnt/nvme/x`` would run on memory and say OK, the disk never touched).

    Raises:
        ui.UsageError: One was given for another store.
    """
    for name, store in _STORE_OPTIONS.items():
        if args.store != store and getattr(args, name) not in (None, False):
            option = "--" + name.replace("_", "-")
            raise ui.UsageError(f"{option} is for --store {store}, not --store {args.store}")


def _check_store_dir(path: str) -> None:
    """Refuse a ``--store-dir`` that cannot be a directory, or one this user could not make
    or write a store in, before the run starts.

    Raises:
        ui.UsageError: ``path``, or the nearest of its parents that exists, is not a
            directory, or this user may not write in it.
    """
    nearest = os.path.abspath(path)
    while not os.path.lexists(nearest):
        nearest = os.path.dirname(nearest)
    itself = nearest == os.path.abspath(path)
    if not os.path.isdir(nearest):
        where = "" if itself else f" ({nearest} is not one)"
        raise ui.UsageError(f"--store-dir {path}: not a directory{where}")
    if not os.access(nearest, os.W_OK | os.X_OK | (os.R_OK if itself else 0)):
        what = "read and write in it" if itself else f"write in {nearest}"
        raise ui.UsageError(f"--store-dir {path}: this user may not {what}")


async def run(args: argparse.Namespace, io: ui.CommandIO) -> int:
    """Run the demo (see the module docstring); 0 when every block verified, else 1."""
    started = time.perf_counter()
    _check_store_options(args)
    if args.segment_mib is not None and args.segment_mib < 1:
        raise ui.UsageError(f"--segment-mib must be >= 1, got {args.segment_mib}")
    if args.store == "file" and args.store_dir is not None:
        _check_store_dir(args.store_dir)
    preset = PRESETS[args.layout]
    layout = preset.layout()
    nbytes = layout.block_nbytes
    config = kvpipe.PipelineConfig.from_env(
        slice_block_num=args.slice_block_num, staging_bytes=args.staging_mib << 20
    )
    shared = args.shared_prefix_blocks
    work = plan_workload(
        layout,
        requests=args.requests,
        blocks_per_request=args.blocks_per_request or preset.blocks_per_request,
        shared_prefix_blocks=preset.shared_prefix_blocks if shared is None else shared,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    if not args.json:
        io.out.print(
            f"{args.layout}: {layout.describe()}\n{len(work.requests)} requests, "
            f"{work.blocks_requested} blocks of which {work.src_blocks} distinct "
            f"({ui.format_bytes(work.src_blocks * nbytes)}); {args.concurrency} at a time; "
            f"slices of {config.slice_block_num} blocks",
            highlight=False,
            soft_wrap=True,
        )
    if args.store == "mooncake" and args.segment_mib is None:  # see --segment-mib
        mib = 2 * work.src_blocks * value_nbytes(nbytes) // (1 << 20) + 64
        args = argparse.Namespace(**{**vars(args), "segment_mib": mib})
    src = kvpipe.create_kv_cache(layout, work.src_blocks)
    for step in random_fills(src, args.seed):  # not one thread: Ctrl-C stops it between steps
        await run_sync(step)
    dst = kvpipe.create_kv_cache(layout, work.dst_blocks)
    namespace, n = f"kvpipe-demo-{args.layout}", args.concurrency
    async with _metrics_port.metrics_page(args, io) as metrics, open_store(args) as store:
        return await _run_phases(
            args, io, layout, config, work, src, dst, store, namespace, n, started, metrics
        )


async def _run_phases(
    args: argparse.Namespace,
    io: ui.CommandIO,
    layout: kvpipe.CacheLayout,
    config: kvpipe.PipelineConfig,
    work: Workload,
    src: kvpipe.KVCache,
    dst: kvpipe.KVCache,
    store: kvpipe.StorageBackend,
    namespace: str,
    n: int,
    started: float,
    metrics: kvpipe.PipelineMetrics | None,
) -> int:
    nbytes = layout.block_nbytes
    with ui.block_progress(io.err, disable=args.json or not io.err.is_terminal) as progress:
        total = requested = work.blocks_requested
        wp = ui.PhaseTally(progress, progress.add_task("write", total=total, nbytes=0), nbytes)
        async with kvpipe.open_pipeline(src, store, config=config, namespace=namespace) as pipe:
            if metrics is not None:
                metrics.add(pipe, label="write")
            writes = await _timed(wp, pipe, _write_all(pipe, work, wp, n))
        rp = ui.PhaseTally(progress, progress.add_task("read", total=total, nbytes=0), nbytes)
        async with kvpipe.open_pipeline(dst, store, config=config, namespace=namespace) as pipe:
            if metrics is not None:
                metrics.add(pipe, label="read")
            reads = await _timed(rp, pipe, _read_all(pipe, work, src, rp, n, args.seed))
    summary = {
        "ok": rp.verified == requested and not writes["incomplete"] and not reads["incomplete"],
        "layout": args.layout,
        "layout_description": layout.describe(),
        "block_bytes": nbytes,
        "store": args.store,
        "store_dir": store.path if isinstance(store, kvpipe.FileStore) else None,
        "requests": len(work.requests),
        "partial_requests": sum(q.partial for q in work.requests),
        "shared_prefix_blocks": work.shared_prefix_blocks,
        "distinct_blocks": work.src_blocks,
        "blocks_requested": requested,
        "written": wp.moved,
        "skipped": sum(r.skipped for r in wp.results if isinstance(r, kvpipe.WriteResult)),
        "read": rp.moved,
        "verified": rp.verified,
        "mismatched": requested - rp.verified,
        "writes": writes,
        "reads": reads,
        "store_statistics": dict(store.statistics()),
        "seconds": round(time.perf_counter() - started, 3),
    }
    if args.json:
        print(json.dumps(summary, indent=2), file=io.out.file)
    else:
        _render(summary, io.out, kept=args.keep_store)
    return ui.EXIT_OK if summary["ok"] else ui.EXIT_FAILED


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvpipe demo``."""
    add = parser.add_argument
    add("--layout", choices=sorted(PRESETS), default="llama3-8b", help="model-shaped layout")
    add("--store", choices=STORES, default="file", help="where blocks are stored")
    add(
        "--store-dir",
        metavar="PATH",
        help="file store directory (default: a new ./kvpipe-data/demo-PID-XXXXXXXX, removed "
        "afterwards)",
    )
    add("--keep-store", action="store_true", help="keep the file store's directory")
    add(
        "--durability",
        choices=("none", "data", "full"),
        help="file store: fsync policy (default: data, each file before it is published)",
    )
    add("--segment-mib", type=int, metavar="MIB", help=_SEGMENT_HELP)
    add("--requests", type=int, default=24, metavar="N", help="requests to write and read")
    add(
        "--blocks-per-request",
        type=ui.block_range,
        metavar="LO-HI",
        help="blocks per request, the partial one included (default: per layout; 20-32)",
    )
    add(
        "--shared-prefix-blocks",
        type=int,
        metavar="N",
        help="blocks of system prompt every request starts with (default: per layout; 16)",
    )
    add("--concurrency", type=int, default=4, metavar="N", help="requests in flight at once")
    add("--slice-block-num", type=int, default=16, metavar="N", help="blocks per slice")
    add("--staging-mib", type=int, default=256, metavar="MIB", help="staging per pipeline")
    add("--seed", type=ui.seed, default=0, help="seed of the workload and of the cache contents")
    add("--json", action="store_true", help="print the summary as JSON, without progress bars")
    _metrics_port.add_arguments(parser)


COMMAND: Final = ui.Command(
    name="demo",
    help="offload KV blocks of a model-shaped layout to a store and reload them, verified",
    add_arguments=add_arguments,
    run=run,
)
