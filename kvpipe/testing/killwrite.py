"""The process-kill scenario for the file store: a writer killed with SIGKILL mid-write.

A child process (``python -m kvpipe.testing.killwrite ROOT SEED``) writes requests whose
blocks are derived from the seed; the parent kills it at random moments, reopens the store,
and checks that every block a lookup reports reads back byte-exact and that no temporary
file survives the reopen. Invariants judged: ``stored``, ``loaded`` and ``idle``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import numpy as np

from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from .._layout import CacheLayout
from ..backends.file import FileStore
from ..pipeline import open_pipeline
from .invariants import Verdict
from .scenarios import ScenarioResult

__all__ = ("run_kill_scenario",)

BLOCKS = 16
LAYOUT = CacheLayout.gqa(num_layers=4, num_kv_heads=4, head_dim=128, block_size=32)  # 256 KiB


def _tokens(seed: int, r: int) -> np.ndarray:
    return np.arange(BLOCKS * 32) + r * 10**6 + seed * 10**9


def _fill(cache: KVCache, seed: int, r: int) -> None:
    for b in range(BLOCKS):
        data = np.random.default_rng((seed, r, b)).integers(0, 256, LAYOUT.block_nbytes, np.uint8)
        at = 0
        for rows in cache.byte_rows:
            rows[b] = data[at : at + rows.shape[1]]
            at += rows.shape[1]


async def _child(root: str, seed: int) -> None:
    cache = create_kv_cache(LAYOUT, BLOCKS)
    async with (
        FileStore(root, durability="data") as store,
        open_pipeline(
            cache, store, config=PipelineConfig(slice_block_num=4), namespace="kill"
        ) as pipe,
    ):
        for r in range(10_000):
            _fill(cache, seed, r)
            print(f"start {r}", flush=True)
            await pipe.write(_tokens(seed, r), np.arange(BLOCKS))


async def run_kill_scenario(root: str, seed: int = 0, kills: int = 3) -> ScenarioResult:
    """Kill a writer ``kills`` times at random points; judge the store after each reopen."""
    started = time.monotonic()
    rng = random.Random(seed)
    stored, loaded, idle = Verdict("stored"), Verdict("loaded"), Verdict("idle")
    requests = written = read = 0
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for k in range(kills):
        child_seed = seed * 100 + k
        output = b""
        async with await anyio.open_process(
            [sys.executable, "-m", "kvpipe.testing.killwrite", root, str(child_seed)],
            stderr=subprocess.DEVNULL,
            env=env,
        ) as proc:
            assert proc.stdout is not None
            try:
                # "start 1": one request is stored whole, so every kill leaves something to
                # judge (killed during the first write, a run could check nothing and pass)
                while b"start 1\n" not in output:
                    output += await proc.stdout.receive()
                await anyio.sleep(rng.uniform(0.05, 0.4))
            finally:
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
            with anyio.move_on_after(5):
                async for chunk in proc.stdout:
                    output += chunk
        started_lines = output.decode().split()
        last = max([0, *(int(x) for x in started_lines if x.isdigit())])
        dst = create_kv_cache(LAYOUT, BLOCKS)
        src = create_kv_cache(LAYOUT, BLOCKS)
        async with (
            FileStore(root) as store,
            open_pipeline(
                dst, store, config=PipelineConfig(slice_block_num=4), namespace="kill"
            ) as pipe,
        ):
            temps = await anyio.to_thread.run_sync(
                lambda: [p for p in Path(root).rglob("*") if ".kvb.tmp." in p.name]
            )
            idle.checked += 1
            if temps:
                idle.fail(f"kill {k}: {len(temps)} temporary files survived the reopen")
            for r in range(last + 1):
                requests += 1
                n = await pipe.lookup(_tokens(child_seed, r))
                if n == 0:
                    continue
                result = await pipe.read(_tokens(child_seed, r)[: n * 32], np.arange(n))
                stored.checked += 1
                if result.loaded != n:
                    stored.fail(
                        f"kill {k} request {r}: lookup says {n}, read loaded {result.loaded}"
                    )
                _fill(src, child_seed, r)
                written += n
                read += result.loaded
                for b in range(result.loaded):
                    loaded.checked += 1
                    if any(
                        not np.array_equal(a[b], d[b])
                        for a, d in zip(src.byte_rows, dst.byte_rows, strict=True)
                    ):
                        loaded.fail(f"kill {k} request {r}: block {b} differs")
    verdicts = [
        stored,
        Verdict("prefix"),
        Verdict("deadline"),
        Verdict("staging"),
        idle,
        loaded,
        Verdict("crash"),
    ]
    return ScenarioResult(
        "kill_mid_write",
        "file",
        requests,
        written,
        read,
        verdicts,
        0.0,
        0.0,
        time.monotonic() - started,
    )


if __name__ == "__main__":
    anyio.run(_child, sys.argv[1], int(sys.argv[2]))
