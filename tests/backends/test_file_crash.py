"""FileStore crash consistency, for real: a writer process is SIGKILLed mid-write, repeatedly.

A worker (``tests/backends/file_worker.py crash``) writes 16-block requests of 1 MiB blocks
with ``durability="data"`` to a shared root in a loop; the test kills it at a random point
after it started writing, five times on the same root, each run writing new requests. After
each kill the store is inspected as the crash left it, then reopened (which must clean up),
and every request any run started is looked up and read back: what a lookup reports must read
back completely and byte-exact, and no corrupt block file or temporary file may be left.

A second test picks its kill points differently: the moment the writer has a temporary file
on disk, so the cleanup at reopen is exercised on every run.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np
import pytest

import kvpipe
from kvpipe.backends.file import inspect_store
from tests.backends.file_worker import (
    NAMESPACE,
    Worker,
    block_bytes,
    block_matches,
    crash_layout,
    request_tokens,
    start_worker,
)

# Real time: worker processes killed (SIGKILL) at random points.
pytestmark = pytest.mark.slow

SEED = 20240611
RUNS = 5
BLOCKS = 16  # per request, 1 MiB each
FIRST_OF_RUN = 1000  # run k writes requests k*1000, k*1000+1, ...


@dataclass
class Run:
    """What one killed worker run left."""

    delay: float | None  # seconds after the first write started; None: at the first temp file
    started: list[int] = field(default_factory=list)
    done: dict[int, str] = field(default_factory=dict)  # request -> the worker's "done" line
    temp_before: int = 0
    stored: dict[int, int] = field(default_factory=dict)  # request -> blocks a lookup reports
    unreachable: int = 0  # block files this run left past a gap in their request


def temp_files(root: Path) -> list[str]:
    """Every temporary block file anywhere under the root."""
    return [
        os.path.join(d, name)
        for d, _, names in os.walk(root)
        for name in names
        if ".kvb.tmp." in name
    ]


def parse_output(run: Run, lines: list[str]) -> None:
    for line in lines:
        words = line.split()
        if words[:1] == ["start"]:
            run.started.append(int(words[1]))
        elif words[:1] == ["done"]:
            run.done[int(words[1])] = line


async def wait_for_temp_file(root: Path, worker: Worker) -> None:
    """Return as soon as the worker has a temporary block file on disk (it is mid-write)."""
    mine = f".{worker.process.pid}."
    while not any(mine in path for path in temp_files(root)):
        assert worker.process.returncode is None, f"worker exited; stderr:\n{worker.errors}"
        await anyio.sleep(0.0005)


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` has stopped (a SIGSTOP has taken effect)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return all(state in "tT" for state in states)


async def stop_mid_write(root: Path, worker: Worker) -> None:
    """Freeze the worker (SIGSTOP) at a moment it has a temporary block file on disk. A
    file seen on disk may be renamed before the stop takes effect (a loaded machine runs the
    worker on meanwhile): then it is let go on (SIGCONT) and caught at its next one."""
    pid, mine = worker.process.pid, f".{worker.process.pid}."
    while True:
        await wait_for_temp_file(root, worker)
        os.kill(pid, signal.SIGSTOP)
        while not _stopped(pid):  # noqa: ASYNC110 (polling /proc: no event to wait on)
            await anyio.sleep(0.0005)
        if any(mine in path for path in temp_files(root)):
            return
        os.kill(pid, signal.SIGCONT)


async def kill_during_writes(root: Path, k: int, delay: float | None) -> Run:
    """Start a writer, wait for its first write, then SIGKILL it after ``delay`` s (or, for
    ``None``, frozen while it has a temporary file on disk: :func:`stop_mid_write`), and
    reap it."""
    run = Run(delay)
    args = ("crash", str(root), "--seed", str(SEED), "--first", str(k * FIRST_OF_RUN))
    async with start_worker(*args, "--blocks", str(BLOCKS), "--max-seconds", "20") as worker:
        first = await worker.readline()
        assert first.startswith("start "), f"worker said {first!r}; stderr:\n{worker.errors}"
        if delay is None:
            await stop_mid_write(root, worker)
        else:
            await anyio.sleep(delay)
        assert worker.process.returncode is None, f"worker exited; stderr:\n{worker.errors}"
        worker.process.kill()
        code = await worker.process.wait()
        lines = [first, *await worker.rest()]
    assert code == -signal.SIGKILL, f"worker exited with {code}; stderr:\n{worker.errors}"
    parse_output(run, lines)
    return run


async def check_store(root: Path, runs: list[Run]) -> None:
    """Reopen the store and read back every request any run started."""
    layout = crash_layout()
    cache = kvpipe.create_kv_cache(layout, BLOCKS)
    dst = np.random.default_rng(SEED).permutation(BLOCKS)  # not the writer's block order
    config = kvpipe.PipelineConfig(slice_block_num=8, staging_bytes=64 << 20)
    async with kvpipe.FileStore(root, durability="data") as store:
        await store.open()  # recovery: removes the dead writer's temporary files
        assert temp_files(root) == [], "temporary files survived the reopen"
        assert store.statistics().get("temp_files_removed", 0) == runs[-1].temp_before
        async with kvpipe.open_pipeline(cache, store, config=config, namespace=NAMESPACE) as pipe:
            for k, run in enumerate(runs):
                latest = k == len(runs) - 1
                unstarted = (max(run.started) if run.started else k * FIRST_OF_RUN - 1) + 1
                for r in [*run.started, unstarted]:
                    tokens = request_tokens(SEED, r, BLOCKS * layout.block_size)
                    n = await pipe.lookup(tokens)
                    if r == unstarted:
                        assert n == 0, f"request {r} was never started but {n} blocks are stored"
                        continue
                    if r in run.done:
                        # a write the worker saw return must have stored everything
                        assert run.done[r].split()[2:4] == [str(BLOCKS), "1"], run.done[r]
                        assert n == BLOCKS, f"request {r} was written completely, lookup says {n}"
                    if latest:
                        run.stored[r] = n
                    else:
                        assert n == run.stored[r], f"request {r}: {run.stored[r]} blocks -> {n}"
                    for rows in cache.byte_rows:
                        rows[:] = 0
                    got = await pipe.read(tokens, dst, require_all=False)
                    # the blocks a lookup reports all load; the first one after them is
                    # reported as not stored
                    want = (n, (n,), "not_stored") if n < BLOCKS else (n, (), None)
                    assert (got.loaded, got.failed_blocks, got.stop_reason) == want, (r, got)
                    for i in range(n):
                        expected = block_bytes(layout, SEED, r, i)
                        assert block_matches(cache, int(dst[i]), expected), f"request {r} block {i}"
    after = inspect_store(str(root), verify=True)
    assert after.corrupt == [] and after.quarantined == 0
    assert after.temp_files == 0
    # a killed write may have published blocks past its first unpublished one (a batch is
    # written by several threads): sound files, just not reachable by a lookup
    reachable = sum(sum(run.stored.values()) for run in runs)
    assert after.blocks >= reachable
    runs[-1].unreachable = after.blocks - reachable - sum(run.unreachable for run in runs[:-1])


async def crash_repeatedly(root: Path, delays: list[float | None]) -> list[Run]:
    """One killed writer per delay, all on ``root``; after each kill the store is inspected
    as the crash left it, then reopened and read back (see :func:`check_store`)."""
    runs: list[Run] = []
    for k, delay in enumerate(delays):
        run = await kill_during_writes(root, k, delay)
        runs.append(run)
        assert run.started, "the worker never started a write"
        # as the crash left it: temporary files may remain, but no torn block under a final name
        run.temp_before = len(temp_files(root))
        before = inspect_store(str(root), verify=True)
        assert before.corrupt == [], before.corrupt
        assert before.temp_files == run.temp_before
        await check_store(root, runs)
        when = "at its first temp file" if delay is None else f"{delay * 1000:.0f} ms in"
        print(
            f"run {k}: killed {when}; requests started {len(run.started)}, "
            f"completed {len(run.done)}; blocks stored {sorted(run.stored.items())}; "
            f"unreachable blocks past a gap {run.unreachable}; "
            f"temporary files before reopen {run.temp_before}"
        )
    return runs


async def test_sigkill_at_random_points_leaves_only_whole_blocks(tmp_path: Path) -> None:
    delays = [float(d) for d in np.random.default_rng(SEED).uniform(0.0, 0.3, RUNS)]
    with anyio.fail_after(120):
        await crash_repeatedly(tmp_path / "store", list(delays))


async def test_sigkill_mid_file_write_is_cleaned_up_at_reopen(tmp_path: Path) -> None:
    """Kill points chosen so the writer surely has a temporary file on disk."""
    with anyio.fail_after(60):
        runs = await crash_repeatedly(tmp_path / "store", [None, None])
    assert all(run.temp_before > 0 for run in runs)
