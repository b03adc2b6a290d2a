"""A partial put of the fault tool never makes a FAILED block visible, nor takes one back.

Two writes of the same prefix, the first one's put partial (block 2 of 4 reported FAILED).
A gated store under the :class:`FaultyStore` holds the window open with events, so the
interleaving that once raised a false ``counted but not stored`` is forced every time:

- skip path: the second write probes while the first one's put is in flight, and counts as
  skipped whatever it finds stored;
- write path: the second write stores the same keys itself while the first one's put is in
  flight, and counts them written.

Either way, every block a write counts must be in the store afterwards.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import anyio
import numpy as np

import kvpipe
from kvpipe import PipelineConfig, WriteResult
from kvpipe.backends import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend
from kvpipe.testing.faults import FaultPlan, FaultRule, FaultyStore
from tests.helpers import fill_random

BLOCK = 4
#: Seed 0 makes put call #0 report exactly block 2 of 4 FAILED (asserted below).
PARTIAL = FaultPlan(0, (FaultRule("put", "partial", calls=(0,), blocks=0.3),))


class Gated(StorageBackend):
    """A memory store whose calls for a request can be held at set points.

    ``hold_before[rid]`` / ``hold_after[rid]``: the request's first put waits for this event
    before storing / after storing (before returning). ``stored[rid]`` is set once that put
    has stored, ``probed[rid]`` once an ``exists`` of the request has answered.
    """

    def __init__(self) -> None:
        self.inner = kvpipe.MemoryStore()
        self.hold_before: dict[str, anyio.Event] = {}
        self.hold_after: dict[str, anyio.Event] = {}
        self.stored: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)
        self.probed: defaultdict[str, anyio.Event] = defaultdict(anyio.Event)

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        rid = batch.request_id
        if rid in self.hold_before:
            await self.hold_before.pop(rid).wait()
        statuses = await self.inner.put_blocks(batch)
        self.stored[rid].set()
        if rid in self.hold_after:
            await self.hold_after.pop(rid).wait()
        return statuses

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        flags = await self.inner.exists(batch)
        self.probed[batch.request_id].set()
        return flags

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        return await self.inner.get_blocks(batch)

    async def delete(self, keys: Sequence[str]) -> None:
        await self.inner.delete(keys)

    async def put_residency(self, entries: Sequence[kvpipe.ResidencyEntry]) -> None:
        await self.inner.put_residency(entries)

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[kvpipe.ResidencyEntry]]:
        return await self.inner.get_residency(keys)


async def _race(gated: Gated, path: str) -> tuple[WriteResult, WriteResult, list[str]]:
    """Writes ``a`` (partial put) and ``b`` of the same four blocks, interleaved for
    ``path``; returns both results and the keys of the four blocks."""
    layout = kvpipe.CacheLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK)
    cache = kvpipe.create_kv_cache(layout, 8)
    fill_random(cache, seed=1)
    tokens = np.arange(4 * BLOCK)
    config = PipelineConfig(slice_block_num=4, staging_bytes=1 << 20)
    results: dict[str, WriteResult] = {}
    a_done = anyio.Event()
    if path == "skip":
        # a's put stores, then waits until b (probing meanwhile) has finished.
        b_done = anyio.Event()
        gated.hold_after["a"] = b_done
    else:
        # b probes before a's put stores (so it finds nothing and writes all four); b's put
        # stores after a's did, while a's put is still in flight, and returns only once a
        # has finished.
        gated.hold_before["a"] = gated.probed["b"]
        gated.hold_after["a"] = gated.stored["b"]
        gated.hold_before["b"] = gated.stored["a"]
        gated.hold_after["b"] = a_done
    async with (
        FaultyStore(gated, PARTIAL) as store,
        kvpipe.open_pipeline(cache, store, config=config) as pipe,
    ):

        async def write(rid: str, done: anyio.Event) -> None:
            results[rid] = await pipe.write(tokens, np.arange(4), request_id=rid)
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(write, "a", a_done)
            if path == "skip":
                await gated.stored["a"].wait()
                tg.start_soon(write, "b", b_done)
            else:
                tg.start_soon(write, "b", anyio.Event())
        keys = [k for c in store.calls if c.op == "put" and c.request_id == "a" for k in c.keys]
        assert [c.outcome for c in store.calls if c.op == "put" and c.request_id == "a"] == [
            "incomplete"
        ]
    return results["a"], results["b"], keys


def _counted(result: WriteResult, keys: list[str]) -> list[str]:
    return keys[: result.skipped + result.written]


async def test_the_skip_path_never_counts_a_block_the_partial_put_takes_back() -> None:
    gated = Gated()
    a, b, keys = await _race(gated, "skip")
    assert (a.skipped, a.written, a.stop_reason) == (0, 2, "incomplete_slice")
    assert b.skipped >= 2, b  # found a's leading blocks stored
    stored = set(gated.inner.keys())
    assert set(_counted(b, keys)) <= stored, f"b counted blocks not stored: {b}"
    assert set(_counted(a, keys)) <= stored


async def test_the_write_path_never_counts_a_block_the_partial_put_takes_back() -> None:
    gated = Gated()
    a, b, keys = await _race(gated, "write")
    assert (a.skipped, a.written, a.stop_reason) == (0, 2, "incomplete_slice")
    assert (b.skipped, b.written) == (0, 4), b  # probed before anything was stored
    stored = set(gated.inner.keys())
    assert set(_counted(b, keys)) <= stored, f"b counted blocks not stored: {b}"
