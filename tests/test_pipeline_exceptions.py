"""What leaves ``async with open_pipeline(...)`` is what was raised in the block, as it was
raised — not wrapped in an ExceptionGroup by the actors' task group (issue 17, point 4)."""

from __future__ import annotations

import numpy as np
import pytest

import kvpipe

LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_users_own_error_comes_out_as_it_was_raised() -> None:
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=8)
    with pytest.raises(KeyError) as info:
        async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()):
            raise KeyError("mine")
    assert info.value.args == ("mine",)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_kvpipe_errors_raised_in_the_block_are_caught_by_their_class() -> None:
    cache = kvpipe.create_kv_cache(LAYOUT, num_blocks=8)
    tokens = np.arange(16 * 4)
    caught: list[BaseException] = []
    try:
        async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
            await pipe.write(tokens, [0, 0, 1, 2])  # a repeated block id
    except kvpipe.RequestError as exc:
        caught.append(exc)
    try:
        async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
            await pipe.read(tokens, np.arange(4), require_all=True)
    except kvpipe.IncompleteRead as exc:
        caught.append(exc)
    assert [type(e) for e in caught] == [kvpipe.RequestError, kvpipe.IncompleteRead]
