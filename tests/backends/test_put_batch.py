"""``PutBatch`` over its staging lease, and the file store's ``writev`` of many chunks."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvpipe._keys import Scope, as_tokens
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
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


async def test_a_sub_batch_is_a_run_of_blocks_over_the_same_staging() -> None:
    pool = StagingPool(64, 8)
    lease = await pool.acquire(6)
    for i, slot in enumerate(lease.slots):
        pool.slot(slot)[:] = i
    keys = ["k0", "k1", "k2", "k3", "k4:partial:3"]
    # Blocks 2..6 of a sequence (block size 4), the last one partial: 6 * 4 + 3 tokens.
    batch = PutBatch(
        SCOPE,
        "r",
        keys,
        2,
        as_tokens(np.arange(27)),
        "k-1",
        lease=lease,
        value_nbytes=64,
        runner=ThreadRunner(),
        limiter=None,
        offset=1,
        may_keep=True,
    )
    sub = batch.sub_batch(1, 3)
    assert (sub.keys, sub.first_block, sub.parent_key) == (("k1", "k2"), 3, "k0")
    assert len(sub.token_prefix) == 5 * 4  # through block 4
    assert [bytes(v)[0] for v in sub.values] == [2, 3]  # slots 2 and 3 of the lease
    assert sub.buffer_addresses() == batch.buffer_addresses()[1:3]
    assert sub.may_keep
    head = batch.sub_batch(0, 1)
    assert (head.parent_key, len(head.token_prefix)) == ("k-1", 3 * 4)
    tail = batch.sub_batch(3, 5)
    assert tail.keys == ("k3", "k4:partial:3") and len(tail.token_prefix) == 27
    for start, stop in ((2, 2), (-1, 2), (0, 6)):
        with pytest.raises(ValueError, match="not a run"):
            batch.sub_batch(start, stop)


async def test_a_sub_batch_refuses_a_prefix_that_does_not_fit_the_keys() -> None:
    _, _, batch = await make(n=3, offset=0)  # 3 blocks from 0 over 4 tokens: not kvpipe's
    assert len(batch.sub_batch(0, 3).token_prefix) == 4  # the whole batch: kept as is
    with pytest.raises(ValueError, match="does not fit"):
        batch.sub_batch(0, 2)
