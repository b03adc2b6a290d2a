"""End to end on the host: write → read into other block ids → bytes equal, all layouts."""

from __future__ import annotations

import numpy as np
import pytest

import kvpipe
from tests.helpers import fill_random


def _equal_blocks(
    a: kvpipe.KVCache, a_ids: np.ndarray, b: kvpipe.KVCache, b_ids: np.ndarray
) -> bool:
    return all(
        np.array_equal(ra[a_ids], rb[b_ids])
        for ra, rb in zip(a.byte_rows, b.byte_rows, strict=True)
    )


@pytest.mark.parametrize("framework", ["numpy", "paddle"])
async def test_roundtrip_every_layout(any_layout: kvpipe.CacheLayout, framework: str) -> None:
    src = kvpipe.create_kv_cache(any_layout, 48, framework=framework)  # type: ignore[arg-type]
    dst = kvpipe.create_kv_cache(any_layout, 48, framework=framework)  # type: ignore[arg-type]
    fill_random(src, seed=1)
    store = kvpipe.MemoryStore()
    tokens = np.arange(16 * 20 + 7)  # 20 full blocks and a partial one
    src_ids = np.random.default_rng(2).permutation(48)[:21]
    dst_ids = np.random.default_rng(3).permutation(48)[:21]
    config = kvpipe.PipelineConfig(slice_block_num=6)
    async with kvpipe.open_pipeline(src, store, config=config, namespace="m") as pipe:
        w = await pipe.write(tokens, src_ids, include_partial=True)
        assert (w.requested, w.skipped, w.written, w.complete) == (21, 0, 21, True)
        assert [s.blocks for s in w.slices] == [6, 6, 6, 3]
        assert await pipe.lookup(tokens) == 20
        assert await pipe.lookup(tokens, include_partial=True) == 21
    async with kvpipe.open_pipeline(dst, store, config=config, namespace="m") as pipe:
        r = await pipe.read(tokens, dst_ids, include_partial=True, require_all=True)
        assert (r.requested, r.loaded, r.complete, r.failed_blocks) == (21, 21, True, ())
    assert _equal_blocks(src, src_ids, dst, dst_ids)
