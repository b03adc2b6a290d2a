"""A separate process writing to a shared :class:`kvpipe.FileStore` root, for the real-process
file store tests (``test_file_crash.py``, ``test_file_two_process.py``).

Run as ``python -m tests.backends.file_worker MODE ROOT ...`` with the repository as the
working directory. Everything a block holds is derived from a seed, so the test process can
recompute the expected bytes of any block without talking to the worker:

- sequence block ``i`` of request ``r`` holds ``np.random.default_rng((seed, r, i))``'s first
  ``layout.block_nbytes`` bytes, split over the cache's tensors in contract order;
- request ``r``'s tokens are ``r * 10**6 + arange(n)`` offset by the seed, so no two requests
  share a prefix (every block of every request has its own key).

Modes:

``crash ROOT --seed S --first R --blocks B``
    Writes requests ``R, R+1, ...`` of ``B`` full blocks each (``durability="data"``) until
    it is killed (or ``--max-seconds`` pass). Prints ``start r`` before each write and
    ``done r <written> <complete 0/1> <stop reason> <error>`` after it.

``prefill ROOT --seed S --requests N``
    Writes ``N`` requests with a partial last block (``include_partial=True``); prints
    ``ready r`` after each write returned complete, then ``end``. An incomplete write prints
    ``failed r <reason>`` and exits 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
import anyio.abc
import numpy as np
import numpy.typing as npt
from anyio.streams.buffered import BufferedByteReceiveStream

import kvpipe

Bytes = npt.NDArray[np.uint8]

#: Namespace both sides use.
NAMESPACE = "crashtest"
REPO = Path(__file__).resolve().parents[2]


def crash_layout() -> kvpipe.CacheLayout:
    """1 MiB blocks: 8 layers x (key, value) x [4 heads, 64 tokens, 128] bfloat16."""
    return kvpipe.CacheLayout.gqa(
        num_layers=8, num_kv_heads=4, head_dim=128, block_size=64, dtype="bfloat16"
    )


def prefill_layout() -> kvpipe.CacheLayout:
    """256 KiB blocks: 4 layers x (key, value) x [2 heads, 32 tokens, 128] bfloat16."""
    return kvpipe.CacheLayout.gqa(
        num_layers=4, num_kv_heads=2, head_dim=128, block_size=32, dtype="bfloat16"
    )


def request_tokens(seed: int, request: int, n_tokens: int) -> npt.NDArray[np.int64]:
    """The token ids of request ``request`` (unique per seed and request)."""
    base = seed * 10**9 + request * 10**6
    return np.arange(base, base + n_tokens, dtype=np.int64)


def block_bytes(layout: kvpipe.CacheLayout, seed: int, request: int, block: int) -> Bytes:
    """The expected payload of sequence block ``block`` of request ``request``."""
    raw = np.random.default_rng((seed, request, block)).bytes(layout.block_nbytes)
    return np.frombuffer(raw, dtype=np.uint8)


def fill_block(cache: kvpipe.KVCache, cache_block: int, data: Bytes) -> None:
    """Write ``data`` into one cache block, tensor by tensor in contract order."""
    at = 0
    for rows in cache.byte_rows:
        width = rows.shape[1]
        rows[cache_block] = data[at : at + width]
        at += width
    assert at == len(data)


def block_matches(cache: kvpipe.KVCache, cache_block: int, data: Bytes) -> bool:
    """Whether one cache block holds exactly ``data``."""
    at = 0
    for rows in cache.byte_rows:
        width = rows.shape[1]
        if not np.array_equal(rows[cache_block], data[at : at + width]):
            return False
        at += width
    return at == len(data)


def prefill_shape(request: int, block_size: int) -> tuple[int, int]:
    """``(full blocks, tokens of the partial last block)`` of a prefill request."""
    return 2 + request % 4, 1 + (request * 7) % (block_size - 1)


class Worker:
    """A running worker process seen from the test: its stdout lines, its stderr so far."""

    def __init__(self, process: anyio.abc.Process) -> None:
        assert process.stdout is not None
        self.process = process
        self.stderr = bytearray()
        self._out = BufferedByteReceiveStream(process.stdout)

    async def readline(self) -> str:
        """The next line the worker printed (without its newline); ``""`` at the end."""
        try:
            return (await self._out.receive_until(b"\n", 1 << 16)).decode()
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.ClosedResourceError):
            return ""

    async def rest(self) -> list[str]:
        """Every line still to come, until the worker's stdout closes."""
        lines = []
        while line := await self.readline():
            lines.append(line)
        return lines

    @property
    def errors(self) -> str:
        """What the worker wrote to stderr so far."""
        return self.stderr.decode(errors="replace")

    async def _drain_stderr(self) -> None:
        assert self.process.stderr is not None
        async for chunk in self.process.stderr:
            self.stderr += chunk


@asynccontextmanager
async def start_worker(*args: str) -> AsyncIterator[Worker]:
    """Run ``python -m tests.backends.file_worker *args``; killed and reaped on exit."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}
    cmd = [sys.executable, "-m", "tests.backends.file_worker", *args]
    async with await anyio.open_process(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL) as proc:
        worker = Worker(proc)
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


def fill_request(
    cache: kvpipe.KVCache, ids: npt.NDArray[np.int64], seed: int, request: int
) -> None:
    """Put request ``request``'s sequence blocks into cache blocks ``ids``."""
    for i, b in enumerate(ids):
        fill_block(cache, int(b), block_bytes(cache.layout, seed, request, i))


async def crash(root: str, seed: int, first: int, blocks: int, max_seconds: float) -> None:
    layout = crash_layout()
    # two halves: request r+1 is generated (in a thread) while request r is being written, so
    # the process spends nearly all its time writing and a kill lands mid-write
    cache = kvpipe.create_kv_cache(layout, 2 * blocks)
    halves = [np.arange(blocks), np.arange(blocks, 2 * blocks)]
    config = kvpipe.PipelineConfig(slice_block_num=8, staging_bytes=64 << 20)
    stop_at = time.monotonic() + max_seconds
    parent = os.getppid()
    async with (
        kvpipe.FileStore(root, durability="data") as store,
        kvpipe.open_pipeline(cache, store, config=config, namespace=NAMESPACE) as pipe,
    ):
        r = first
        fill_request(cache, halves[0], seed, r)
        # an orphan (its test gone) stops soon rather than filling the disk
        while time.monotonic() < stop_at and os.getppid() == parent:
            tokens = request_tokens(seed, r, blocks * layout.block_size)
            ids = halves[r % 2]
            _say(f"start {r}")
            async with anyio.create_task_group() as tg:
                tg.start_soon(
                    anyio.to_thread.run_sync, fill_request, cache, halves[(r + 1) % 2], seed, r + 1
                )
                result = await pipe.write(tokens, ids)
            outcome = f"{int(result.complete)} {result.stop_reason} {result.error}"
            _say(f"done {r} {result.written} {outcome}")
            r += 1


async def prefill(root: str, seed: int, requests: int) -> int:
    layout = prefill_layout()
    bs = layout.block_size
    cache = kvpipe.create_kv_cache(layout, 16)
    config = kvpipe.PipelineConfig(slice_block_num=2, staging_bytes=16 << 20)
    async with (
        kvpipe.FileStore(root, durability="data") as store,
        kvpipe.open_pipeline(cache, store, config=config, namespace=NAMESPACE) as pipe,
    ):
        for r in range(requests):
            full, extra = prefill_shape(r, bs)
            ids = np.random.default_rng((seed, r, 10**6)).permutation(16)[: full + 1]
            fill_request(cache, ids, seed, r)
            tokens = request_tokens(seed, r, full * bs + extra)
            result = await pipe.write(tokens, ids, include_partial=True)
            if not (result.complete and result.written == full + 1):
                _say(f"failed {r} {result.stop_reason} {result.error}")
                return 1
            _say(f"ready {r}")
    _say("end")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="file_worker")
    parser.add_argument("mode", choices=("crash", "prefill"))
    parser.add_argument("root")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.mode == "crash":
        anyio.run(crash, args.root, args.seed, args.first, args.blocks, args.max_seconds)
        return 0
    code: int = anyio.run(prefill, args.root, args.seed, args.requests)
    return code


if __name__ == "__main__":
    sys.exit(main())
