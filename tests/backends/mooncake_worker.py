"""A separate process with its own Mooncake client, for the real-process Mooncake tests
(``test_mooncake_failures.py``, ``test_mooncake_pd.py``).

Run as ``python -m tests.backends.mooncake_worker MODE --master HOST:PORT --metadata URL ...``
with the repository as the working directory. Block contents come from a seed, as in
``file_worker.py``: sequence block ``i`` of request ``r`` holds
``np.random.default_rng((seed, r, i))``'s first ``layout.block_nbytes`` bytes, so the test
process recomputes what any block must hold without talking to the worker. Request ``r`` has
``prefill_shape(r)`` = 2–5 full blocks and a partial last block of 1–31 tokens.

The worker's client contributes a segment (``--segment-mib``): what it puts lives in its own
memory, so its data disappears with it.

Modes:

``prefill``
    Opens a :class:`kvpipe.MooncakeStore` and a pipeline, prints ``open``, then obeys
    commands read from stdin, one a line:

    - ``write FIRST COUNT CONCURRENCY PAUSE``: writes requests ``FIRST ..`` with their partial
      last block (``include_partial=True``), ``CONCURRENCY`` at a time, each writer task
      pausing ``PAUSE`` seconds before each request (prefill compute). After each write it
      prints ``done r requested skipped written complete stop_reason elapsed`` (``elapsed``
      measured around the call with ``anyio.current_time()``), then ``batch-end FIRST``.
    - ``exit`` (or end of input): closes the pipeline and the store and prints
      ``closed <pipeline close s> <store close s>``.

``closerace``
    A pipeline with ``close_timeout=1.0`` writes request 0 (prints ``written 1``), waits for
    a line on stdin (the test kills the master meanwhile), then writes requests 1, 2, ...
    (printing ``done r written stop_reason``) until one stops on its slice timeout: its put
    blocks ~4.4 s in the vendor (only a client's first call after the kill fails at once) and
    is abandoned. It then leaves the pipeline (which gives up on the running thread after
    1 s, printing ``pipeline-closed``) and closes the store, printing ``closed``. A crash of
    the vendor client at close shows as a signal exit code.

The worker's client and the test's both set ``MC_TCP_BIND_ADDRESS=127.0.0.1``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import anyio
import numpy as np
import numpy.typing as npt

import kvpipe
from tests.backends.file_worker import (
    REPO,
    Worker,
    block_bytes,
    block_matches,
    fill_request,
    prefill_layout,
    prefill_shape,
    request_tokens,
)

Ids = npt.NDArray[np.int64]

#: Namespace both sides use.
NAMESPACE = "mooncake-pd"
#: Cache blocks each concurrent prefill writer owns (a request has at most 6 blocks).
SLOT = 8
#: Most concurrent writer tasks of one ``write`` command.
MAX_CONCURRENCY = 8
#: A call returns by its own timeout plus this (``deadline_slack`` 0.25 s plus scheduling).
SLACK = 1.0
#: How a write may honestly stop when the master is gone (``-900`` per key: "incomplete").
WRITE_STOPS = frozenset({"incomplete_slice", "slice_timeout", "total_timeout", "backend_error"})
#: How a read may honestly stop when the master or the data's owner is gone.
READ_STOPS = frozenset({"failed_block", "slice_timeout", "total_timeout", "backend_error"})


def zero(cache: kvpipe.KVCache, ids: Ids) -> None:
    """Clear cache blocks, so a check after a read sees only what the read put there."""
    for rows in cache.byte_rows:
        rows[ids] = 0


def bytes_exact(cache: kvpipe.KVCache, ids: Ids, seed: int, request: int, count: int) -> bool:
    """Whether cache blocks ``ids[:count]`` hold sequence blocks ``0 .. count`` of ``request``."""
    return all(
        block_matches(cache, int(ids[i]), block_bytes(cache.layout, seed, request, i))
        for i in range(count)
    )


def pd_request(seed: int, request: int) -> tuple[npt.NDArray[np.int64], int]:
    """Token ids of prefill request ``request`` and its block count, partial included."""
    bs = prefill_layout().block_size
    full, extra = prefill_shape(request, bs)
    return request_tokens(seed, request, full * bs + extra), full + 1


@dataclass(frozen=True)
class Done:
    """One ``done`` line of the ``prefill`` mode: a write's result as the worker saw it."""

    request: int
    requested: int
    skipped: int
    written: int
    complete: bool
    stop_reason: str | None
    elapsed: float

    @property
    def claimed(self) -> int:
        """Blocks the result says are stored, from block 0."""
        return self.skipped + self.written

    @classmethod
    def parse(cls, line: str) -> Done:
        """Parse ``done r requested skipped written complete stop_reason elapsed``.

        Raises:
            ValueError: It is not such a line.
        """
        parts = line.split()
        if len(parts) != 8 or parts[0] != "done":
            raise ValueError(f"not a done line: {line!r}")
        r, requested, skipped, written, complete = (int(v) for v in parts[1:6])
        reason = None if parts[6] == "None" else parts[6]
        return cls(r, requested, skipped, written, bool(complete), reason, float(parts[7]))


class MooncakeWorker(Worker):
    """A running worker seen from the test: stdout lines, stderr so far, and its stdin."""

    async def send(self, line: str) -> None:
        """Write one command line to the worker's stdin."""
        assert self.process.stdin is not None
        await self.process.stdin.send((line + "\n").encode())

    @property
    def pid(self) -> int:
        """The worker's process id."""
        return self.process.pid


@asynccontextmanager
async def start_mooncake_worker(*args: str) -> AsyncIterator[MooncakeWorker]:
    """Run ``python -m tests.backends.mooncake_worker *args`` with a stdin pipe; the worker is
    killed (if still running) and reaped on exit."""
    path = os.environ.get("PYTHONPATH")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])]),
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    cmd = [sys.executable, "-m", "tests.backends.mooncake_worker", *args]
    async with await anyio.open_process(cmd, cwd=REPO, env=env, stdin=subprocess.PIPE) as proc:
        worker = MooncakeWorker(proc)
        async with anyio.create_task_group() as tg:
            tg.start_soon(worker._drain_stderr)
            try:
                yield worker
            finally:
                with anyio.CancelScope(shield=True):
                    if proc.returncode is None:
                        with suppress(ProcessLookupError):
                            proc.kill()
                    await proc.wait()


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def _write_batch(
    pipe: kvpipe.Pipeline,
    cache: kvpipe.KVCache,
    seed: int,
    first: int,
    count: int,
    concurrency: int,
    pause: float,
) -> None:
    async def writer(task: int) -> None:
        for r in range(first + task, first + count, concurrency):
            await anyio.sleep(pause)
            tokens, n = pd_request(seed, r)
            ids = task * SLOT + np.random.default_rng((seed, r, 10**6)).permutation(SLOT)[:n]
            fill_request(cache, ids, seed, r)
            started = anyio.current_time()
            result = await pipe.write(tokens, ids, include_partial=True)
            elapsed = anyio.current_time() - started
            _say(
                f"done {r} {result.requested} {result.skipped} {result.written} "
                f"{int(result.complete)} {result.stop_reason} {elapsed:.4f}"
            )

    async with anyio.create_task_group() as tg:
        for task in range(concurrency):
            tg.start_soon(writer, task)


async def prefill(args: argparse.Namespace) -> int:
    layout = prefill_layout()
    cache = kvpipe.create_kv_cache(layout, SLOT * MAX_CONCURRENCY)
    config = kvpipe.PipelineConfig(
        slice_block_num=2,
        staging_bytes=16 << 20,
        slice_timeout=args.slice_timeout,
        total_timeout=args.total_timeout,
        lookup_timeout=args.slice_timeout,
    )
    stdin = anyio.wrap_file(sys.stdin)
    store = kvpipe.MooncakeStore(
        args.master, args.metadata, global_segment_size=args.segment_mib << 20
    )
    async with store:
        async with kvpipe.open_pipeline(cache, store, config=config, namespace=NAMESPACE) as pipe:
            _say("open")
            while True:
                line = (await stdin.readline()).split()
                if not line or line[0] == "exit":
                    break
                if line[0] != "write" or len(line) != 5:
                    _say(f"bad-command {' '.join(line)}")
                    return 2
                first, count, concurrency = (int(v) for v in line[1:4])
                concurrency = max(1, min(concurrency, MAX_CONCURRENCY))
                await _write_batch(
                    pipe, cache, args.seed, first, count, concurrency, float(line[4])
                )
                _say(f"batch-end {first}")
            closing = anyio.current_time()
        pipe_closed = anyio.current_time()
    store_closed = anyio.current_time()
    _say(f"closed {pipe_closed - closing:.3f} {store_closed - pipe_closed:.3f}")
    return 0


async def closerace(args: argparse.Namespace) -> int:
    layout = prefill_layout()
    cache = kvpipe.create_kv_cache(layout, SLOT)
    config = kvpipe.PipelineConfig(
        slice_block_num=2,
        staging_bytes=16 << 20,
        slice_timeout=0.5,
        total_timeout=1.5,
        close_timeout=1.0,
    )
    stdin = anyio.wrap_file(sys.stdin)
    store = kvpipe.MooncakeStore(
        args.master, args.metadata, global_segment_size=args.segment_mib << 20
    )
    async with store:
        async with kvpipe.open_pipeline(cache, store, config=config, namespace=NAMESPACE) as pipe:
            for r in range(6):
                tokens, n = pd_request(args.seed, r)
                ids = np.arange(n)
                fill_request(cache, ids, args.seed, r)
                result = await pipe.write(tokens, ids, include_partial=True)
                if r == 0:
                    _say(f"written {int(result.complete)}")
                    await stdin.readline()
                    continue
                _say(f"done {r} {result.written} {result.stop_reason}")
                if result.stop_reason == "slice_timeout":
                    break  # a put abandoned in the vendor: leave while it runs
        _say("pipeline-closed")
    _say("closed")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake_worker")
    parser.add_argument("mode", choices=("prefill", "closerace"))
    parser.add_argument("--master", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--segment-mib", type=int, default=256)
    parser.add_argument("--slice-timeout", type=float, default=1.0)
    parser.add_argument("--total-timeout", type=float, default=2.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    run = prefill if args.mode == "prefill" else closerace
    code: int = anyio.run(run, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
