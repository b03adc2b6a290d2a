"""Several processes sharing one FileStore root, as an inference server's tensor-parallel
ranks do (one cache-transfer process per rank, each with its own store over one directory).

Each test runs its processes with ``multiprocessing``'s spawn context and coordinates them
with barriers and queues, never sleeps.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
from pathlib import Path

import pytest

from kvpipe.backends.file._catalog import Catalog

# Real time: processes started afresh.
pytestmark = pytest.mark.slow

_spawn = multiprocessing.get_context("spawn")

#: Processes opening each new catalog at once, and how many new catalogs they open: two
#: connections turning a new database to WAL together failed about once in 25 tries here,
#: so 300 tries leave no room for luck.
OPENERS = 2
CATALOGS = 300


def _open_new_catalogs(
    base: str, count: int, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue
) -> None:
    """Open (then close) catalogs ``base/0 ... base/count-1`` in step with the other openers;
    put the errors met, as text, on ``out``."""
    errors = []
    for i in range(count):
        start.wait()
        try:
            Catalog(os.path.join(base, f"{i}.sqlite3"), f"opener:{os.getpid()}").close()
        except Exception as exc:
            errors.append(f"catalog {i}: {type(exc).__name__}: {exc}")
    out.put(errors)


def test_processes_opening_a_new_store_at_once_all_open_its_catalog(tmp_path: Path) -> None:
    # The ranks of a server start together on a new root: every one must open the catalog.
    start = _spawn.Barrier(OPENERS)
    out: multiprocessing.Queue = _spawn.Queue()
    procs = [
        _spawn.Process(target=_open_new_catalogs, args=(str(tmp_path), CATALOGS, start, out))
        for _ in range(OPENERS)
    ]
    for p in procs:
        p.start()
    try:
        errors = [e for _ in procs for e in out.get(timeout=60)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert errors == []
