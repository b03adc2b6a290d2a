"""The Mooncake benchmark's hand loop, against an in-memory stand-in for the vendor client
(the real client runs it in tests/cli/test_bench.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import kvpipe
from kvpipe.benchmarks._mooncake_baselines import hand_loop
from tests.helpers import LAYOUTS, fill_random


class BufferClient:
    """``batch_upsert_from`` / ``batch_get_into`` over a dict, copying from and into raw
    addresses as the vendor client does; ``flip`` corrupts one byte of a get."""

    def __init__(self, flip: int | None = None, fail_put: bool = False) -> None:
        self.values: dict[str, bytes] = {}
        self.flip = flip
        self.fail_put = fail_put

    def batch_upsert_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        if self.fail_put:
            return [-200] * len(keys)
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self.values[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        out = []
        for i, (key, ptr, size) in enumerate(zip(keys, ptrs, sizes, strict=True)):
            data = bytearray(self.values[key])
            if self.flip is not None and i == 0 and key.endswith(f"-{self.flip}"):
                data[3] ^= 0xFF
            ctypes.memmove(ptr, bytes(data), size)
            out.append(size)
        return out


def caches(n: int) -> tuple[kvpipe.KVCache, kvpipe.KVCache, np.ndarray, list[str]]:
    layout = LAYOUTS["gqa"]()
    src, dst = kvpipe.create_kv_cache(layout, n), kvpipe.create_kv_cache(layout, n)
    fill_random(src, seed=4)
    staging = np.zeros((n, layout.block_nbytes + 48), np.uint8)
    return src, dst, staging, [f"k-{i}" for i in range(n)]


@pytest.mark.parametrize("checksums", [True, False])
def test_round_trip_is_byte_exact(checksums: bool) -> None:
    src, dst, staging, keys = caches(7)
    w, r = hand_loop(BufferClient(), src, dst, staging, keys, 3, checksums=checksums)
    assert w >= 0 and r >= 0
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a, b)


def test_a_changed_block_is_caught() -> None:
    src, dst, staging, keys = caches(7)
    with pytest.raises(RuntimeError, match="block 3 came back different"):
        hand_loop(BufferClient(flip=3), src, dst, staging, keys, 3, checksums=True)


def test_a_failed_put_is_reported() -> None:
    src, dst, staging, keys = caches(4)
    with pytest.raises(RuntimeError, match="batch_upsert_from codes"):
        hand_loop(BufferClient(fail_put=True), src, dst, staging, keys, 2, checksums=True)


class GetMovesNothing(BufferClient):
    """Reports every get complete but writes nothing into the buffers."""

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(sizes)


@pytest.mark.parametrize("checksums", [True, False])
def test_a_get_that_moves_nothing_is_caught(checksums: bool) -> None:
    # The read goes into the staging rows the write gathered into: unless they are cleared
    # first, a get that moved nothing verifies and scatters the write's own bytes.
    src, dst, staging, keys = caches(5)
    if checksums:
        with pytest.raises(RuntimeError, match="block 0 came back different"):
            hand_loop(GetMovesNothing(), src, dst, staging, keys, 2, checksums=True)
        return
    hand_loop(GetMovesNothing(), src, dst, staging, keys, 2, checksums=False)
    # no checksum: the caller's check of ``dst`` must see that nothing came back
    assert not any(np.array_equal(a, b) for a, b in zip(src.byte_rows, dst.byte_rows, strict=True))
