"""The overhead scenario's own checks, never a wall time."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest

from kvpipe._config import PipelineConfig
from kvpipe._workers import ThreadRunner
from kvpipe.backends.memory import MemoryStore
from kvpipe.benchmarks._workload import random_cache
from kvpipe.benchmarks.overhead import SHAPES, PlainLoop, tiny_layout
from kvpipe.pipeline import open_pipeline


def counting(store: MemoryStore, calls: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Count ``store``'s calls of each kind in ``calls``."""
    for name in ("exists", "put_blocks", "get_blocks"):
        real = getattr(store, name)

        async def call(batch: Any, _name: str = name, _real: Any = real) -> Any:
            calls[_name] += 1
            return await _real(batch)

        monkeypatch.setattr(store, name, call)


@pytest.mark.parametrize(("shape", "blocks", "slice_blocks"), SHAPES, ids=[s[0] for s in SHAPES])
async def test_the_plain_loop_makes_the_pipelines_store_calls(
    monkeypatch: pytest.MonkeyPatch, shape: str, blocks: int, slice_blocks: int
) -> None:
    # ``actors`` = pipeline - plain loop per request, slice and block: the plain loop must
    # make the same store calls, or its extra calls are subtracted from the actors' cost.
    cache = random_cache(tiny_layout(), 64)
    ids = np.arange(blocks, dtype=np.int64)
    tokens = np.arange(blocks, dtype=np.int64) + 1000
    seen: dict[str, Counter[str]] = {}
    for who in ("pipeline", "plain"):
        store, calls = MemoryStore(), Counter[str]()
        counting(store, calls, monkeypatch)
        config = PipelineConfig(slice_block_num=slice_blocks, staging_bytes=4 << 20)
        async with ThreadRunner() as runner, open_pipeline(cache, store, config=config) as pipe:
            for write in (True, False):
                if who == "pipeline":
                    res = await (pipe.write(tokens, ids) if write else pipe.read(tokens, ids))
                    assert res.complete
                else:
                    await PlainLoop(cache, store, slice_blocks, runner).request(tokens, ids, write)
                seen[f"{who} {'write' if write else 'read'}"] = calls.copy()
                calls.clear()
    assert seen["plain write"] == seen["pipeline write"]
    assert seen["plain read"] == seen["pipeline read"]
