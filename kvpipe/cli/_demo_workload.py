"""The ``kvpipe demo`` workload: layout presets, and the requests a run writes and reads
(no I/O, no event loop), plus the byte helpers that fill and compare caches."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Final, final

import numpy as np
import numpy.typing as npt

import kvpipe

from . import _console as ui

__all__ = (
    "PRESETS",
    "DemoRequest",
    "IdArray",
    "Preset",
    "Workload",
    "count_equal",
    "fill_random",
    "plan_workload",
    "random_fills",
)

IdArray = npt.NDArray[np.int64]
_VOCAB: Final = 128_256  # Llama 3's vocabulary; token ids are drawn below it


@final
@dataclass(frozen=True, slots=True)
class Preset:
    """A layout (a :class:`kvpipe.CacheLayout` constructor and its arguments) and a default
    workload for it: blocks per request (inclusive range) and shared prefix blocks."""

    build: Callable[..., kvpipe.CacheLayout]
    params: Mapping[str, int]
    blocks_per_request: tuple[int, int]
    shared_prefix_blocks: int

    def layout(self) -> kvpipe.CacheLayout:
        """The layout (bfloat16 for GQA and MLA; DSA is uint8 by construction)."""
        return self.build(**self.params)


_L = kvpipe.CacheLayout
_LLAMA3_8B: Final = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
_TINY: Final = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 4}
_DEEPSEEK: Final = {"num_layers": 61, "kv_lora_rank": 512, "rope_dim": 64, "block_size": 64}
#: ``--layout`` choices. ``llama3-8b`` blocks are 2 MiB (32 layers x 8 kv heads x 16 tokens
#: x 128 x bf16 x key and value).
PRESETS: Final[Mapping[str, Preset]] = {
    "llama3-8b": Preset(_L.gqa, _LLAMA3_8B, (20, 32), 16),
    "deepseek-mla": Preset(_L.mla, _DEEPSEEK, (9, 14), 8),
    "deepseek-dsa": Preset(
        _L.dsa, _DEEPSEEK | {"index_head_dim": 128, "quant_block": 128}, (9, 14), 8
    ),
    "tiny": Preset(_L.gqa, _TINY, (6, 12), 4),
}


@final
@dataclass(frozen=True, slots=True)
class DemoRequest:
    """One request: its tokens, where its blocks sit in the source cache, partial or not."""

    index: int
    tokens: IdArray
    src_ids: IdArray
    partial: bool


@final
@dataclass(frozen=True, slots=True)
class Workload:
    """The requests, and the cache sizes they need."""

    requests: tuple[DemoRequest, ...]
    shared_prefix_blocks: int
    blocks_requested: int  # over all requests, partial blocks included
    src_blocks: int
    dst_blocks: int


def plan_workload(
    layout: kvpipe.CacheLayout,
    *,
    requests: int,
    blocks_per_request: tuple[int, int],
    shared_prefix_blocks: int,
    concurrency: int,
    seed: int,
) -> Workload:
    """Draw the requests (seeded): a shared prefix, then each request's own blocks.

    Args:
        layout: The cache layout (its block size sets the token counts).
        requests: Number of requests.
        blocks_per_request: Inclusive range of blocks per request, partial block included.
        shared_prefix_blocks: Full blocks every request starts with (the system prompt).
        concurrency: Requests in flight at once (sizes the destination cache).
        seed: Seed of the random draws.

    Raises:
        ui.UsageError: The numbers do not make a workload.
    """
    lo, hi = blocks_per_request
    shared = shared_prefix_blocks
    if requests < 1:
        raise ui.UsageError(f"--requests must be >= 1, got {requests}")
    if concurrency < 1:
        raise ui.UsageError(f"--concurrency must be >= 1, got {concurrency}")
    if not 0 <= shared < lo:
        raise ui.UsageError(
            f"--shared-prefix-blocks must be in [0, {lo}) so that every request has blocks "
            f"of its own (--blocks-per-request {lo}-{hi}), got {shared}"
        )
    bs = layout.block_size
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(lo, hi + 1, size=requests)]
    src_blocks = shared + sum(sizes) - requests * shared
    need = (2 * src_blocks + concurrency * hi) * layout.block_nbytes  # source, store, destination
    try:
        spare = 0.8 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX: do not guess
        spare = float("inf")
    if need > spare:
        raise ui.UsageError(
            f"this workload needs about {ui.format_bytes(need)} of host memory, more than this "
            "machine can spare; use fewer --requests or --blocks-per-request"
        )
    ids = rng.permutation(src_blocks).astype(np.int64)
    prefix = rng.integers(0, _VOCAB, size=shared * bs, dtype=np.int64)
    out, next_id = [], shared
    for i, size in enumerate(sizes):
        partial = bs > 1 and i % 3 == 1
        tail = int(rng.integers(1, bs)) if partial else 0
        suffix = rng.integers(0, _VOCAB, size=(size - partial - shared) * bs + tail, dtype=np.int64)
        suffix[0] = i  # no two requests share a block past the prefix, whatever the draws
        own = ids[next_id : next_id + size - shared]
        next_id += size - shared
        tokens = np.concatenate([prefix, suffix])
        out.append(DemoRequest(i, tokens, np.concatenate([ids[:shared], own]), partial))
    return Workload(tuple(out), shared, sum(sizes), src_blocks, concurrency * hi)


#: Bytes one step of :func:`random_fills` draws at most (a tensor's row is never split).
FILL_CHUNK_BYTES: Final = 64 << 20


def random_fills(
    cache: kvpipe.KVCache, seed: int, chunk_bytes: int = FILL_CHUNK_BYTES
) -> Iterator[Callable[[], None]]:
    """The steps that fill every block of every tensor with seeded random bytes, in order,
    each of at most ``chunk_bytes`` (one block row at least): a caller that runs each in a
    worker thread can stop between two (Ctrl-C) instead of after the whole cache."""
    rng = np.random.default_rng([seed, 1])

    def fill(rows: npt.NDArray[np.uint8]) -> Callable[[], None]:
        def step() -> None:
            rows[:] = np.frombuffer(rng.bytes(rows.size), np.uint8).reshape(rows.shape)

        return step

    for rows in cache.byte_rows:
        per_step = max(1, chunk_bytes // max(1, rows.shape[1]))
        for start in range(0, rows.shape[0], per_step):
            yield fill(rows[start : start + per_step])


def fill_random(cache: kvpipe.KVCache, seed: int) -> None:
    """Fill every block of every tensor with seeded random bytes (:func:`random_fills`)."""
    for step in random_fills(cache, seed):
        step()


def count_equal(a: kvpipe.KVCache, a_ids: IdArray, b: kvpipe.KVCache, b_ids: IdArray) -> int:
    """How many blocks ``b[b_ids[i]]`` equal ``a[a_ids[i]]`` byte for byte, in every tensor."""
    equal = np.ones(len(a_ids), dtype=bool)
    for rows_a, rows_b in zip(a.byte_rows, b.byte_rows, strict=True):
        equal &= (rows_a[a_ids] == rows_b[b_ids]).all(axis=1)
    return int(equal.sum())
