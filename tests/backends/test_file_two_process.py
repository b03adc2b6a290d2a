"""Two processes share one FileStore root: prefill writes, decode looks up and reads.

The prefill side is a worker process (``tests/backends/file_worker.py prefill``) writing
requests with a partial last block through its own pipeline and announcing each request once
its write returned complete. The decode side is this test: for each announcement, while the
prefill keeps writing the next requests, it looks the request up and reads it into its own
cache at other block ids, and checks every byte against the content recomputed from the seed,
the partial last block included.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import numpy as np
import pytest

import kvpipe
from tests.backends.file_worker import (
    NAMESPACE,
    block_bytes,
    block_matches,
    prefill_layout,
    prefill_shape,
    request_tokens,
    start_worker,
)

# Real time: a prefill worker process and this one.
pytestmark = pytest.mark.slow

SEED = 7331
REQUESTS = 12
WRITER_BLOCKS = 16  # the prefill cache's size: its block ids are all below this


async def test_decode_process_reads_what_prefill_process_wrote(tmp_path: Path) -> None:
    root = tmp_path / "store"
    layout = prefill_layout()
    bs = layout.block_size
    cache = kvpipe.create_kv_cache(layout, 2 * WRITER_BLOCKS)
    config = kvpipe.PipelineConfig(slice_block_num=2, staging_bytes=16 << 20)
    checked: list[int] = []
    overlapped = 0  # requests read while the prefill process was still running
    args = ("prefill", str(root), "--seed", str(SEED), "--requests", str(REQUESTS))
    with anyio.fail_after(60):
        async with start_worker(*args) as prefill, kvpipe.FileStore(root) as store:
            async with kvpipe.open_pipeline(
                cache, store, config=config, namespace=NAMESPACE
            ) as pipe:
                while (line := await prefill.readline()) != "end":
                    assert line.startswith("ready "), f"prefill said {line!r}:\n{prefill.errors}"
                    r = int(line.split()[1])
                    if not checked:
                        await store.open()  # recovery runs while the prefill process writes
                    full, extra = prefill_shape(r, bs)
                    tokens = request_tokens(SEED, r, full * bs + extra)
                    assert await pipe.lookup(tokens, include_partial=True) == full + 1
                    assert await pipe.lookup(tokens) == full
                    # other block ids than the writer's (its are all below WRITER_BLOCKS)
                    dst = (
                        WRITER_BLOCKS
                        + np.random.default_rng((SEED, r)).permutation(WRITER_BLOCKS)[: full + 1]
                    )
                    for rows in cache.byte_rows:
                        rows[:] = 0
                    got = await pipe.read(tokens, dst, include_partial=True, require_all=True)
                    assert (got.requested, got.loaded, got.complete) == (full + 1, full + 1, True)
                    assert got.failed_blocks == () and got.stop_reason is None
                    for i in range(full + 1):
                        expected = block_bytes(layout, SEED, r, i)
                        assert block_matches(cache, int(dst[i]), expected), f"request {r} block {i}"
                    overlapped += prefill.process.returncode is None
                    checked.append(r)
            code = await prefill.process.wait()
    assert code == 0, prefill.errors
    assert checked == list(range(REQUESTS))
    print(f"{overlapped} of {REQUESTS} requests were read while the prefill process was running")
