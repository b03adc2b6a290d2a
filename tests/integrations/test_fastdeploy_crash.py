"""KVPipeStorage crash consistency, for real: a process writing through it (as FastDeploy's
cache transfer manager does: ``batch_set`` of keys and host-buffer pointers) is SIGKILLed
mid-``batch_set``, three times on the same store directory, each run writing new keys.

After each kill the store is inspected as the crash left it (no torn file under a final
name), then a new ``KVPipeStorage`` on the same directory reads back every key any run
started: every key ``exists`` reports stored reads back complete and byte-exact, every other
key reads as -1 and leaves the caller's buffer untouched, and a batch the writer saw succeed
is stored whole. (FastDeploy's own file store writes with ``paddle.save`` into the final
file name: a kill there leaves a torn file under it.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvpipe.backends.file import inspect_store
from kvpipe.integrations.fastdeploy import KVPipeStorage

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEYS = 16  # per batch_set
SIZE = 256 << 10  # bytes per key
FIRST_OF_RUN = 1000  # run k writes batches k*1000, k*1000+1, ...

WRITER = """
import sys, numpy as np
from kvpipe.integrations.fastdeploy import KVPipeStorage

root, first, keys, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
host = np.empty(keys * size, np.uint8)  # the manager's pinned host buffer
store = KVPipeStorage(file_path=root, namespace="model")
b = first
while True:
    for i in range(keys):
        host[i * size : (i + 1) * size] = np.random.default_rng(b * 1000 + i).integers(
            0, 256, size, np.uint8
        )
    names = [f"model_{b}_{i}_key" for i in range(keys)]
    print("start", b, flush=True)
    codes = store.batch_set(names, [host.ctypes.data + i * size for i in range(keys)],
                            [size] * keys)
    print("done", b, *codes, "end", flush=True)
    b += 1
"""


def value(batch: int, i: int) -> bytes:
    return np.random.default_rng(batch * 1000 + i).integers(0, 256, SIZE, np.uint8).tobytes()


def names(batch: int) -> list[str]:
    return [f"model_{batch}_{i}_key" for i in range(KEYS)]


def temp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".kvb.tmp." in p.name]


@dataclass
class Run:
    started: list[int] = field(default_factory=list)
    done: dict[int, list[int]] = field(default_factory=dict)  # batch -> its codes
    stored: dict[int, int] = field(default_factory=dict)  # batch -> keys reported stored


def kill_during_batch_set(root: Path, k: int, delay: float | None) -> Run:
    """Start a writer, wait for its first ``batch_set``, then SIGKILL it after ``delay`` s
    (``None``: as soon as it has a temporary file on disk) and reap it."""
    args = [str(root), str(k * FIRST_OF_RUN), str(KEYS), str(SIZE)]
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("start "), f"writer said {first!r}"
        if delay is None:
            deadline = time.monotonic() + 30
            while not temp_files(root):
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.0005)
        else:
            time.sleep(delay)
        assert proc.poll() is None, "the writer exited before the kill"
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    run = Run()
    for line in [first, *out.splitlines()]:
        words = line.split()
        if words[:1] == ["start"]:
            run.started.append(int(words[1]))
        elif words[:1] == ["done"] and words[-1:] == ["end"]:  # not a line the kill cut
            run.done[int(words[1])] = [int(c) for c in words[2:-1]]
    return run


def check_store(root: Path, runs: list[Run]) -> None:
    """A new instance reads back every key of every batch any run started."""
    out = np.full(SIZE, 0xAA, np.uint8)
    with KVPipeStorage(file_path=str(root), namespace="model") as store:
        for k, run in enumerate(runs):
            unstarted = max(run.started) + 1
            for b in [*run.started, unstarted]:
                present = store.exists(names(b))
                if b == unstarted:
                    assert not any(present.values()), f"batch {b} was never started"
                    continue
                if b in run.done:
                    assert run.done[b] == [0] * KEYS, run.done[b]
                    assert all(present.values()), f"batch {b} returned 0s but is not all stored"
                stored = sum(present.values())
                if k < len(runs) - 1:
                    assert stored == run.stored[b], f"batch {b}: {run.stored[b]} -> {stored}"
                run.stored[b] = stored
                for i, key in enumerate(names(b)):
                    out[:] = 0xAA
                    got = store.get(key, out.ctypes.data, SIZE)
                    if present[key]:
                        assert got == SIZE and out.tobytes() == value(b, i), (b, i, got)
                    else:
                        assert got == -1, (b, i, got)
                        assert not (out != 0xAA).any(), f"batch {b} key {i}: buffer written"
    report = inspect_store(str(root / "model"), verify=True)
    assert report.corrupt == [] and report.quarantined == 0
    assert report.temp_files == 0, "the dead writer's temporary files survived the reopen"


@pytest.mark.parametrize(
    "delays", [[0.05, 0.15, 0.3], [None, None]], ids=["random-points", "at-a-temp-file"]
)
def test_sigkill_mid_batch_set_leaves_only_whole_values(
    tmp_path: Path, delays: list[float | None]
) -> None:
    root = tmp_path / "store"
    runs: list[Run] = []
    for k, delay in enumerate(delays):
        run = kill_during_batch_set(root, k, delay)
        runs.append(run)
        before = inspect_store(str(root / "model"), verify=True)
        assert before.corrupt == [], before.corrupt  # as the crash left it: no torn block
        check_store(root, runs)
        print(
            f"run {k}: killed {'at a temp file' if delay is None else f'{delay * 1000:.0f} ms in'}"
            f"; batches started {len(run.started)}, completed {len(run.done)}; "
            f"keys stored per batch {sorted(run.stored.items())}; temp files {before.temp_files}"
        )
    assert os.path.isdir(root / "model")
