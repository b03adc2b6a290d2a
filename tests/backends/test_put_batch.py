"""``PutBatch`` with values in parts (sent in place from a host cache), and the file store's
``writev`` of many pieces."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvpipe._keys import Scope, as_tokens
from kvpipe._staging import StagingPool, ThreadRunner
from kvpipe.backends import PutBatch
from kvpipe.backends.file._sysio import write_all

SCOPE = Scope("t", "0123456789abcdef")


async def make(
    parts: list[list[memoryview]] | None,
    n: int = 3,
    offset: int = 0,
    addresses: list[list[int]] | None = None,
) -> PutBatch:
    pool = StagingPool(64, 8)
    lease = await pool.acquire(n + offset)
    return PutBatch(
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
        parts=parts,
        addresses=addresses,
    )


def pieces(buf: np.ndarray, n: int) -> list[list[memoryview]]:
    return [
        [buf[i * 100 : i * 100 + 40].data, buf[i * 100 + 50 : i * 100 + 74].data] for i in range(n)
    ]


async def test_contiguous_batch_has_one_part_per_value() -> None:
    batch = await make(None)
    assert not batch.in_parts
    assert [len(p) for p in batch.parts] == [1, 1, 1]
    assert [bytes(p[0]) for p in batch.parts] == [bytes(v) for v in batch.values]
    assert [a for ((a, n),) in batch.part_addresses()] == batch.buffer_addresses()


async def test_parts_batch_exposes_pieces_and_addresses_not_values() -> None:
    buf = np.arange(400, dtype=np.uint8)
    batch = await make(pieces(buf, 3))
    assert batch.in_parts
    with pytest.raises(RuntimeError, match="accepts_parts"):
        _ = batch.values
    assert [b"".join(bytes(p) for p in v) for v in batch.parts] == [
        buf[i * 100 : i * 100 + 40].tobytes() + buf[i * 100 + 50 : i * 100 + 74].tobytes()
        for i in range(3)
    ]
    base = buf.ctypes.data
    assert batch.part_addresses()[1] == [(base + 100, 40), (base + 150, 24)]
    assert len(batch.staging_views()) == 3


async def test_parts_follow_the_batch_offset() -> None:
    buf = np.arange(400, dtype=np.uint8)
    batch = await make(pieces(buf, 3), n=2, offset=1)
    assert batch.part_addresses()[0][0] == (buf.ctypes.data + 100, 40)


async def test_parts_must_add_up_to_the_value_size() -> None:
    buf = np.arange(400, dtype=np.uint8)
    bad = pieces(buf, 3)
    bad[2] = bad[2][:1]
    with pytest.raises(ValueError, match="value_nbytes"):
        await make(bad)
    with pytest.raises(ValueError, match="value_nbytes"):
        await make(pieces(buf, 2))


def test_write_all_handles_more_pieces_than_iov_max(tmp_path: Path) -> None:
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


async def test_given_addresses_are_used_and_checked() -> None:
    buf = np.arange(400, dtype=np.uint8)
    given = [[1000 + i, 2000 + i] for i in range(3)]
    batch = await make(pieces(buf, 3), n=2, offset=1, addresses=given)
    assert batch.part_addresses() == [[(1001, 40), (2001, 24)], [(1002, 40), (2002, 24)]]
    with pytest.raises(ValueError, match="one address per part"):
        await make(pieces(buf, 3), addresses=[[1], [2], [3]])
    with pytest.raises(ValueError, match="addresses come with parts"):
        await make(None, addresses=given)
