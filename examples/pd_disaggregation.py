"""Prefill/decode disaggregation through shared storage, with kvpipe.

Two processes share one store:

- the **prefill** process (a child) computes each request's KV cache — here, blocks of
  seeded random bytes — and writes the whole of it, the partial last block included
  (``pipe.write(..., include_partial=True)``); when a write has returned complete it sends
  the request id to the decode process over a local pipe;
- the **decode** process (this one) reads each announced request into its own cache, at
  other block ids (``pipe.read(..., include_partial=True, require_all=True)``, which either
  loads every block or raises :class:`kvpipe.IncompleteRead`), verifies every byte, and
  prints a table.

The store is a Mooncake Store (started here on 127.0.0.1 unless ``--master`` and
``--metadata`` name a running one) or, with ``--store file``, a directory both processes
use (``--dir``, or a temporary one).

With Mooncake, a block lives in the memory of the client that stored it: the prefill process
stays up until the decode process has read everything, and then exits.

Run::

    python examples/pd_disaggregation.py --requests 20
    python examples/pd_disaggregation.py --store file --dir /tmp/kv-shared
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import tempfile
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

import kvpipe

#: Cache blocks of the prefill process; the decode process reads into ids above them.
PREFILL_BLOCKS = 16
#: Blocks of the longest request (full blocks plus the partial one).
MAX_BLOCKS = 7


@dataclass(frozen=True)
class Setup:
    """What both processes need to agree on (sent to the prefill process)."""

    store: str  # "mooncake" or "file"
    master: str
    metadata: str
    directory: str
    requests: int
    seed: int
    namespace: str


def layout() -> kvpipe.CacheLayout:
    """A small GQA model: 4 layers x (key, value) x [2 heads, 32 tokens, 128] bfloat16."""
    return kvpipe.CacheLayout.gqa(
        num_layers=4, num_kv_heads=2, head_dim=128, block_size=32, dtype="bfloat16"
    )


def config() -> kvpipe.PipelineConfig:
    return kvpipe.PipelineConfig(
        slice_block_num=4, staging_bytes=32 << 20, slice_timeout=5.0, total_timeout=15.0
    )


def request_tokens(seed: int, request: int, block_size: int) -> npt.NDArray[np.int64]:
    """A request's prompt: 2-6 full blocks and a partial block of 1..block_size-1 tokens."""
    rng = np.random.default_rng((seed, request))
    full = int(rng.integers(2, MAX_BLOCKS))
    extra = int(rng.integers(1, block_size))
    base = seed * 10**9 + request * 10**6  # no two requests share a prefix
    return np.arange(base, base + full * block_size + extra, dtype=np.int64)


def block_content(seed: int, request: int, block: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """What "prefill" computes for one block: seeded bytes the decode side can recompute."""
    raw = np.random.default_rng((seed, request, block)).bytes(nbytes)
    return np.frombuffer(raw, dtype=np.uint8)


def put_block(cache: kvpipe.KVCache, cache_block: int, data: npt.NDArray[np.uint8]) -> None:
    """Write one block's bytes into a cache block, tensor by tensor (contract order)."""
    at = 0
    for rows in cache.byte_rows:
        rows[cache_block] = data[at : at + rows.shape[1]]
        at += rows.shape[1]


def block_equals(cache: kvpipe.KVCache, cache_block: int, data: npt.NDArray[np.uint8]) -> bool:
    """Whether a cache block holds exactly ``data``."""
    at = 0
    for rows in cache.byte_rows:
        if not np.array_equal(rows[cache_block], data[at : at + rows.shape[1]]):
            return False
        at += rows.shape[1]
    return at == len(data)


def open_store(setup: Setup, role: str) -> kvpipe.StorageBackend:
    """The shared store, as seen by one side."""
    if setup.store == "file":
        return kvpipe.FileStore(setup.directory)
    # The prefill side holds the data (256 MiB of memory); decode contributes a little.
    segment = 256 << 20 if role == "prefill" else 32 << 20
    return kvpipe.MooncakeStore(setup.master, setup.metadata, global_segment_size=segment)


async def receive(conn: Connection) -> Any:
    """The next message from the other process (``("gone",)`` if it went away)."""
    try:
        return await anyio.to_thread.run_sync(conn.recv)
    except EOFError:
        return ("gone",)


# -- prefill ---------------------------------------------------------------------------------


async def prefill(setup: Setup, conn: Connection) -> None:
    cache = kvpipe.create_kv_cache(layout(), PREFILL_BLOCKS)
    bs = cache.layout.block_size
    async with (
        open_store(setup, "prefill") as store,
        kvpipe.open_pipeline(cache, store, config=config(), namespace=setup.namespace) as pipe,
    ):
        for r in range(setup.requests):
            tokens = request_tokens(setup.seed, r, bs)
            n = -(-len(tokens) // bs)
            ids = np.random.default_rng((setup.seed, r, 10**6)).permutation(PREFILL_BLOCKS)[:n]
            for i, b in enumerate(ids):
                put_block(cache, int(b), block_content(setup.seed, r, i, cache.layout.block_nbytes))
            result = await pipe.write(tokens, ids, include_partial=True)
            if result.complete:
                conn.send(("ready", r, round(result.elapsed * 1000, 2)))
            else:
                conn.send(("failed", r, f"{result.stop_reason}: {result.error}"))
        conn.send(("end",))
        # Keep serving until decode is done: with Mooncake the blocks live in this process.
        await receive(conn)


def prefill_process(setup: Setup, conn: Connection) -> None:
    """Entry point of the prefill process."""
    try:
        anyio.run(prefill, setup, conn)
    except BaseException as exc:
        with suppress(OSError):
            conn.send(("error", repr(exc)))
        raise
    finally:
        conn.close()


# -- decode ----------------------------------------------------------------------------------


@dataclass
class Row:
    request: int
    blocks: int
    partial_tokens: int
    loaded: int
    verified: bool
    write_ms: float
    read_ms: float
    note: str = ""


async def decode(setup: Setup, conn: Connection) -> list[Row]:
    cache = kvpipe.create_kv_cache(layout(), PREFILL_BLOCKS + MAX_BLOCKS)
    bs = cache.layout.block_size
    nbytes = cache.layout.block_nbytes
    rows: list[Row] = []
    async with (
        open_store(setup, "decode") as store,
        kvpipe.open_pipeline(cache, store, config=config(), namespace=setup.namespace) as pipe,
    ):
        while (msg := await receive(conn))[0] in ("ready", "failed"):
            r = int(msg[1])
            tokens = request_tokens(setup.seed, r, bs)
            n = -(-len(tokens) // bs)
            partial = len(tokens) % bs
            if msg[0] == "failed":
                rows.append(Row(r, n, partial, 0, False, 0.0, 0.0, f"prefill: {msg[2]}"))
                continue
            # other block ids than the prefill side used
            ids = (
                PREFILL_BLOCKS
                + np.random.default_rng((setup.seed, r, 2 * 10**6)).permutation(MAX_BLOCKS)[:n]
            )
            for tensor_rows in cache.byte_rows:
                tensor_rows[ids] = 0
            started = anyio.current_time()
            note = ""
            try:
                result = await pipe.read(tokens, ids, include_partial=True, require_all=True)
                loaded = result.loaded
            except kvpipe.IncompleteRead as exc:
                loaded = exc.result.loaded if isinstance(exc.result, kvpipe.ReadResult) else 0
                note = f"failed blocks {list(exc.failed_blocks)}"
            read_ms = (anyio.current_time() - started) * 1000
            verified = loaded == n and all(
                block_equals(cache, int(ids[i]), block_content(setup.seed, r, i, nbytes))
                for i in range(n)
            )
            rows.append(Row(r, n, partial, loaded, verified, float(msg[2]), read_ms, note))
        if msg[0] != "end":
            raise RuntimeError(f"the prefill process failed: {msg}")
        conn.send(("exit",))  # everything is read: the prefill process may go
    return rows


def table(rows: list[Row], setup: Setup) -> Table:
    """The per-request table: blocks (the partial one included), loaded, verified, times."""
    out = Table(title=f"prefill -> decode via {setup.store}")
    for name in ("request", "blocks", "partial tok", "loaded", "verified", "write ms", "read ms"):
        out.add_column(name, justify="left" if name == "verified" else "right")
    if any(row.note for row in rows):
        out.add_column("note")
    for row in rows:
        out.add_row(
            str(row.request),
            str(row.blocks),
            str(row.partial_tokens),
            str(row.loaded),
            "[green]yes[/]" if row.verified else "[red]NO[/]",
            f"{row.write_ms:.1f}",
            f"{row.read_ms:.1f}",
            *([row.note] if any(r.note for r in rows) else []),
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--store", choices=("mooncake", "file"), default="mooncake")
    parser.add_argument("--dir", help="shared file-store directory (--store file)")
    parser.add_argument("--master", help="mooncake_master host:port (default: start one)")
    parser.add_argument("--metadata", help="metadata server URL (with --master)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--namespace", default="pd-example")
    args = parser.parse_args(argv)
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    if bool(args.master) != bool(args.metadata):
        parser.error("--master and --metadata go together")
    # Mooncake clients must advertise the loopback address on a one-machine setup.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    console = Console()
    with ExitStack() as stack:
        master, metadata, directory = args.master or "", args.metadata or "", args.dir or ""
        if args.store == "mooncake" and not master:
            from kvpipe.backends.mooncake_local import LocalMooncake

            server = stack.enter_context(LocalMooncake())
            master, metadata = server.master_address, server.metadata_url
            console.print(f"started Mooncake: master {master}, metadata {metadata}", soft_wrap=True)
        if args.store == "file" and not directory:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpipe-pd-"))
        setup = Setup(
            args.store, master, metadata, directory, args.requests, args.seed, args.namespace
        )
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        child = context.Process(target=prefill_process, args=(setup, theirs), name="prefill")
        child.start()
        theirs.close()
        try:
            rows = anyio.run(decode, setup, ours)
        finally:
            ours.close()
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
                child.join()
    console.print(table(rows, setup))
    verified = sum(row.verified for row in rows)
    ok = verified == args.requests and child.exitcode == 0
    console.print(
        f"{'all' if ok else 'NOT all'} requests verified: {verified}/{args.requests} "
        f"byte-exact (prefill exit code {child.exitcode})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
