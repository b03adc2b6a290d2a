"""common_prefix: the prefix every tensor-parallel rank holds."""

from __future__ import annotations

import numpy as np
import pytest

import kvpipe


async def test_two_ranks_with_their_own_pipelines_and_the_common_prefix() -> None:
    layout = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=4)
    store = kvpipe.MemoryStore(capacity_bytes=10 * (layout.block_nbytes + 48))
    tokens = np.arange(4 * 8)
    results = []
    for rank in (0, 1):
        cache = kvpipe.create_kv_cache(layout, 8)
        async with kvpipe.open_pipeline(cache, store, rank=rank, world_size=2) as pipe:
            results.append(await pipe.write(tokens, np.arange(8)))
    # rank 0 stored 8 blocks, rank 1 found room for only 2: the group holds 2
    assert [r.written for r in results] == [8, 2]
    assert kvpipe.common_prefix(results) == 2
    assert kvpipe.common_prefix([8, 5, 7]) == 5


@pytest.mark.parametrize("bad", [[], [-1], [True], ["3"]])
def test_bad_values_are_request_errors(bad: list[object]) -> None:
    with pytest.raises(kvpipe.RequestError):
        kvpipe.common_prefix(bad)  # type: ignore[arg-type]


def test_counts_gathered_into_a_numpy_array_are_counts() -> None:
    """Ranks' lookup counts all-gathered into an array (numpy integers) were refused as
    "not a block count"."""
    import numpy as np

    got = kvpipe.common_prefix(np.array([8, 5, 7], dtype=np.int64))
    assert got == 5 and type(got) is int
    assert kvpipe.common_prefix([np.uint32(3), 4]) == 3
    with pytest.raises(kvpipe.RequestError):
        kvpipe.common_prefix(np.array([2, -1]))
    with pytest.raises(kvpipe.RequestError):
        kvpipe.common_prefix([np.bool_(True)])  # type: ignore[list-item]
