"""``PutBatch`` over its staging lease, and the file store's ``writev`` of many chunks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from kvpipe._keys import Scope, as_tokens
from kvpipe._staging import StagingPool, ThreadRunner
from kvpipe.backends import PutBatch
from kvpipe.backends.file._sysio import write_all

SCOPE = Scope("t", "0123456789abcdef")


async def make(n: int, offset: int) -> tuple[StagingPool, tuple[int, ...], PutBatch]:
    pool = StagingPool(64, 8)
    lease = await pool.acquire(n + offset)
    batch = PutBatch(
        SCOPE,
        "r",
        [f"k{i}" for i in range(n)],
        0,
        as_tokens(np.arange(4)),
        lease=lease,
        value_nbytes=64,
        runner=ThreadRunner(),
        limiter=None,
        offset=offset,
    )
    return pool, lease.slots, batch


async def test_values_are_read_only_views_of_the_batch_slots() -> None:
    pool, slots, batch = await make(n=2, offset=1)
    for s in range(8):
        pool.slot(s)[:] = s + 1
    assert [bytes(v) for v in batch.values] == [bytes([s + 1]) * 64 for s in slots[1:]]
    assert all(v.readonly for v in batch.values)
    base, stride = pool.buffer.ctypes.data, pool.stride
    assert batch.buffer_addresses() == [base + s * stride for s in slots[1:]]


def test_write_all_handles_more_chunks_than_iov_max(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    chunks = [
        rng.integers(0, 256, int(rng.integers(0, 40)), dtype=np.uint8).data for _ in range(3000)
    ]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        write_all(fd, chunks)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(bytes(c) for c in chunks)
