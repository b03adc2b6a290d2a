"""Scaling: the same workload at 1x, 4x and 16x the number of blocks. Time should grow
linearly and the pipeline's peak memory should not grow at all (staging is bounded).

Each size runs in **its own process** (``python -m kvpipe.benchmarks.scaling``), so each has
its own peak. What legitimately scales with the workload is kept out of that process's
memory:

- **the store** is a :class:`~kvpipe.FileStore` with ``durability="none"`` on a tmpfs
  (``/dev/shm`` when there is one): stored blocks live in the kernel's page cache, which is
  not part of the process's resident set;
- **the cache** has the same size in every process (the 1x workload's blocks): the k-th
  request's blocks wrap around it, as a server's fixed cache serves ever more sequences.

In the child: imports, the cache (random bytes, every page touched) and the store are set
up first; then ``rss_before`` is taken and the kernel's peak-RSS mark of the process is
reset (``5`` into ``/proc/self/clear_refs``); the pipeline opens, writes every block and reads
every block back into the cache, cleared in between (verified). **Pipeline peak** = the
kernel's peak (``VmHWM``) after the run minus ``rss_before``. A thread sampling the resident
set every 2 ms gives the same figure where ``clear_refs`` is not available. (``ru_maxrss``
cannot be used: Linux carries a parent's peak into a child across ``fork`` and ``exec``, so
every child would report the benchmark process's own peak.) The live Python allocations
(``sys.getallocatedblocks``) before and after show nothing accumulates per request.

Sizes run interleaved (1x 4x 16x 1x 4x 16x ...) after one warm-up of each; seconds, peaks
and ratios are medians over rounds. Linear time: ``seconds(kx) / (k * seconds(1x))`` = 1.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Final, final

import anyio

__all__ = ("FACTORS", "ScalingBenchConfig", "run_scaling_bench")

#: Multiples of the base workload.
FACTORS: Final = (1, 4, 16)


@final
@dataclass(frozen=True, slots=True)
class ScalingBenchConfig:
    """What to run.

    Attributes:
        base_blocks: Blocks of the 1x workload (2 MiB each), and of the cache.
        factors: Multiples of ``base_blocks`` to run.
        request_blocks: Blocks per request.
        slice_block_num: Blocks per slice.
        concurrency: Requests in flight.
        staging_bytes: The pipeline's staging (the bound).
        rounds: Recorded rounds (after one warm-up).
        directory: Where the file store lives (default: ``/dev/shm`` if present).
        warmup: Run the warm-up round (not recorded); smoke runs skip it.
    """

    base_blocks: int = 64
    factors: tuple[int, ...] = FACTORS
    request_blocks: int = 16
    slice_block_num: int = 4
    concurrency: int = 4
    staging_bytes: int = 64 << 20
    rounds: int = 5
    directory: str | None = None
    warmup: bool = True


def _tmpfs() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


async def _child_main(params: dict[str, Any]) -> dict[str, Any]:
    """One size, in this process (see the module docstring)."""
    from .._config import PipelineConfig
    from ..backends.file import FileStore
    from ..pipeline import open_pipeline
    from ._measure import THROUGHPUT_COPY_THREADS
    from ._workload import (
        model_layout,
        random_cache,
        rss_bytes,
        run_requests,
        same_bytes,
        scrub,
    )

    layout = model_layout("2MiB")
    cache = random_cache(layout, params["base_blocks"])
    reference = random_cache(layout, params["base_blocks"])
    blocks = params["base_blocks"] * params["factor"]
    config = PipelineConfig(
        slice_block_num=params["slice_block_num"],
        staging_bytes=params["staging_bytes"],
        copy_threads=THROUGHPUT_COPY_THREADS,
    )
    shape = {"per_request": params["request_blocks"], "concurrency": params["concurrency"]}
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            peak[0] = max(peak[0], rss_bytes())

    async with FileStore(params["root"], durability="none") as store:
        gc.collect()
        objects_before = sys.getallocatedblocks()
        before = rss_bytes()
        peak[0] = before
        hwm_reset = _reset_peak()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        async with open_pipeline(cache, store, config=config) as pipe:
            w = await run_requests(pipe, blocks=blocks, tag=1, write=True, **shape)
            # the read goes back into the same cache: clear it (untimed, no new pages), so
            # that the check below sees what the read moved
            scrub(cache)
            r = await run_requests(pipe, blocks=blocks, tag=1, write=False, **shape)
        stop.set()
        sampler.join()
    gc.collect()
    if not same_bytes(cache, reference):
        raise RuntimeError("scaling bench: read back different bytes")
    return {
        "factor": params["factor"],
        "blocks": blocks,
        "write_seconds": w.seconds,
        "read_seconds": r.seconds,
        "rss_before": before,
        "rss_peak": peak[0],
        "pipeline_peak": (_peak() if hwm_reset else peak[0]) - before,
        "sampled_peak": peak[0] - before,
        "peak_source": "VmHWM" if hwm_reset else "sampled",
        "python_blocks_growth": sys.getallocatedblocks() - objects_before,
    }


def _reset_peak() -> bool:
    """Reset this process's peak-RSS mark (Linux ``clear_refs``); whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak() -> int:
    """This process's peak resident set since the last reset (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def _run_child(params: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvpipe.benchmarks.scaling", json.dumps(params)]
    done = await anyio.run_process(cmd, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"scaling child (x{params['factor']}) failed: {done.stderr.decode()[-2000:]}"
        )
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


async def run_scaling_bench(
    cfg: ScalingBenchConfig, tick: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Every factor in its own process, interleaved over rounds; JSON-ready."""
    workdir = tempfile.mkdtemp(prefix="kvpipe-bench-scaling-", dir=cfg.directory or _tmpfs())
    params = asdict(cfg) | {"root": ""}
    for key in ("factors", "rounds", "directory", "warmup"):
        params.pop(key)
    runs: dict[int, list[dict[str, Any]]] = {f: [] for f in cfg.factors}
    try:
        for r in range(0 if cfg.warmup else 1, cfg.rounds + 1):
            for factor in cfg.factors:
                root = os.path.join(workdir, f"store-{r}-{factor}")
                tick(f"scaling: x{factor} (round {r})")
                result = await _run_child(params | {"factor": factor, "root": root})
                await anyio.to_thread.run_sync(shutil.rmtree, root, True)
                if r:
                    runs[factor].append(result)
    finally:
        await anyio.to_thread.run_sync(shutil.rmtree, workdir, True)
    base = runs[cfg.factors[0]]
    points = []
    for factor, results in runs.items():
        k = factor / cfg.factors[0]

        def med(key: str, rs: list[dict[str, Any]] = results) -> float:
            return float(statistics.median(x[key] for x in rs))

        linear = {
            op: round(
                statistics.median(
                    x[f"{op}_seconds"] / (k * b[f"{op}_seconds"])
                    for x, b in zip(results, base, strict=True)
                ),
                3,
            )
            for op in ("write", "read")
        }
        points.append(
            {
                "factor": factor,
                "blocks": results[0]["blocks"],
                "gib": round(results[0]["blocks"] * 2 / 1024, 3),
                "write_seconds": round(med("write_seconds"), 3),
                "read_seconds": round(med("read_seconds"), 3),
                "time_vs_linear": linear,
                "pipeline_peak_mib": round(med("pipeline_peak") / (1 << 20), 1),
                "rss_before_mib": round(med("rss_before") / (1 << 20), 1),
                "sampled_peak_mib": round(med("sampled_peak") / (1 << 20), 1),
                "peak_source": results[0]["peak_source"],
                "python_blocks_growth": int(med("python_blocks_growth")),
            }
        )
    first = points[0]["pipeline_peak_mib"]
    for p in points:
        p["peak_vs_1x"] = round(p["pipeline_peak_mib"] / first, 3) if first else None
    return {"config": asdict(cfg), "points": points, "rounds": cfg.rounds}


def _main() -> None:
    params = json.loads(sys.argv[1])
    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    result = anyio.run(_child_main, params, backend_options=options)
    print(json.dumps(result))


if __name__ == "__main__":
    _main()
