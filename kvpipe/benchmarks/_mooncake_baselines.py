"""The Mooncake benchmark's baselines: the direct client (one put and one get of contiguous
values) and the hand loop, plus where a key's replica lives.

The hand loop is the least work a gathered offload must do, written by hand. The direct
client moves values that already lie contiguous; a server's blocks do not (a
layer-major cache holds each block as one row per layer and role). Any offload that keeps the
vendor's one-copy put must first gather each block into a registered buffer, and a reload
must scatter it back. This loop does just that with the vendor client, slice by slice in one
thread, with the same checksums as the pipeline (XXH3 of each block, verified on the way
back) and nothing else: no actors, no timeouts, no key chain, no trailer. The pipeline's
ratio to it is what kvpipe's machinery costs (or gains, by overlapping requests); its ratio
to the direct client is the price of the gather, the checksum and the scatter themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from .._cache import KVCache
from .._hostcopy import gather, scatter
from .._plan import copy_plan, layout_segments

__all__ = ("direct_put_get", "hand_loop", "holder_of")


def hand_loop(
    client: Any,
    src: KVCache,
    dst: KVCache,
    staging: npt.NDArray[np.uint8],
    keys: list[str],
    slice_blocks: int,
    *,
    checksums: bool,
) -> tuple[float, float]:
    """Write every block of ``src`` under ``keys``, then read them all into ``dst``.

    Per slice of ``slice_blocks`` blocks: gather into ``staging`` (``len(keys)`` rows of one
    value each, registered with ``client``), XXH3 each block, one ``batch_upsert_from``;
    then the rows are zeroed (untimed), and per slice one ``batch_get_into`` into the same
    rows, verify, scatter. Blocking.

    Returns:
        (write seconds, read seconds).

    Raises:
        RuntimeError: The client failed a key, or a block came back different.
    """
    n = len(keys)
    segments = layout_segments(src.layout)
    payload = src.layout.block_nbytes
    stride = staging.shape[1]
    base = staging.ctypes.data
    digests: list[int] = [0] * n
    started = time.perf_counter()
    for lo in range(0, n, slice_blocks):
        hi = min(n, lo + slice_blocks)
        gather(copy_plan(segments, range(lo, hi), range(lo, hi)), src.byte_rows, staging)
        if checksums:
            for i in range(lo, hi):
                digests[i] = xxhash.xxh3_64_intdigest(staging[i, :payload].data)
        codes = client.batch_upsert_from(
            keys[lo:hi], [base + i * stride for i in range(lo, hi)], [stride] * (hi - lo)
        )
        if any(c != 0 for c in codes):
            raise RuntimeError(f"hand loop: batch_upsert_from codes {sorted(set(codes))[:5]}")
    wrote = time.perf_counter()
    staging.fill(0)  # untimed: what the gets leave in the rows is what they moved
    reading = time.perf_counter()
    for lo in range(0, n, slice_blocks):
        hi = min(n, lo + slice_blocks)
        got = client.batch_get_into(
            keys[lo:hi], [base + i * stride for i in range(lo, hi)], [stride] * (hi - lo)
        )
        if any(g != stride for g in got):
            raise RuntimeError(f"hand loop: batch_get_into results {sorted(set(got))[:5]}")
        if checksums:
            for i in range(lo, hi):
                if xxhash.xxh3_64_intdigest(staging[i, :payload].data) != digests[i]:
                    raise RuntimeError(f"hand loop: block {i} came back different")
        scatter(copy_plan(segments, range(lo, hi), range(lo, hi)), staging, dst.byte_rows)
    return wrote - started, time.perf_counter() - reading


def direct_put_get(
    client: Any, put: Callable[..., Any], keys: list[str], src: list[int], dst: list[int], size: int
) -> tuple[float, float]:
    """One put of every value, then one get of them; (put, get) seconds. Blocking."""
    sizes = [size] * len(keys)
    started = time.perf_counter()
    codes = put(keys, src, sizes)
    put_done = time.perf_counter()
    got = client.batch_get_into(keys, dst, sizes)
    get_done = time.perf_counter()
    if any(c != 0 for c in codes) or any(g != size for g in got):
        bad = sorted({c for c in codes if c != 0} | {g for g in got if g != size})
        raise RuntimeError(f"direct client: {put.__name__}/batch_get_into codes {bad[:5]}")
    return put_done - started, get_done - put_done


def holder_of(client: Any, key: str) -> str:
    """The transport endpoint of the segment holding ``key``'s (first) replica."""
    (replica, *_) = client.get_replica_desc(key)
    return str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)
