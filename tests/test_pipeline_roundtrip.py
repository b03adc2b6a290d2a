"""End to end on the host: write → read into other block ids → bytes equal, all layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvpipe
import kvpipe._blockformat as blockformat
from tests.helpers import fill_random, needs_native_digests


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


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("store_kind", ["memory", "file"])
async def test_roundtrip_whichever_way_a_write_is_gathered_and_sealed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    native: bool,
    checksums: bool,
    store_kind: str,
) -> None:
    """A host write's gather and seal in one native pass, or a gather then a seal (no
    extension, or no checksums): what the reader loads back is the same, from either store,
    and a reader that verifies checksums accepts what a write that recorded them stored."""
    if native:
        needs_native_digests()
    if not native:
        monkeypatch.setattr(blockformat, "native", None)
    layout = kvpipe.CacheLayout.gqa(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
    )  # 32 KiB blocks: slices of 12 go to the copy threads, the last one of 3 stays inline
    src, dst = kvpipe.create_kv_cache(layout, 40), kvpipe.create_kv_cache(layout, 40)
    fill_random(src, seed=5)
    tokens = np.arange(16 * 27)
    src_ids, dst_ids = np.arange(27), np.arange(40)[::-1][:27].copy()
    config = kvpipe.PipelineConfig(slice_block_num=12, verify_checksums=checksums)
    reader = kvpipe.PipelineConfig(slice_block_num=12, verify_checksums=True)
    store: kvpipe.StorageBackend = (
        kvpipe.MemoryStore() if store_kind == "memory" else kvpipe.FileStore(tmp_path / "s")
    )
    async with store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="g") as pipe:
            assert (await pipe.write(tokens, src_ids)).written == 27
        async with kvpipe.open_pipeline(dst, store, config=reader, namespace="g") as pipe:
            assert (await pipe.read(tokens, dst_ids, require_all=True)).loaded == 27
    assert _equal_blocks(src, src_ids, dst, dst_ids)
