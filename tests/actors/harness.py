"""Build one actor alone: a real context, in-memory channels, and a store double."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._engine import HostEngine
from kvpipe._keys import Scope, as_tokens, block_keys
from kvpipe._plan import layout_segments, plan_slices
from kvpipe._staging import StagingPool
from kvpipe._workers import Lane, ThreadRunner
from kvpipe.actors import ActorContext, PipelineHooks
from kvpipe.actors._channels import open_channels
from kvpipe.actors._state import ReadState, WriteState
from kvpipe.backends import StorageBackend
from tests.helpers import fill_random

STAGES = ("scheduler", "slicer", "swapper", "writer", "reader")
BLOCK = 4


def small_layout() -> kvpipe.CacheLayout:
    return kvpipe.CacheLayout.gqa(
        num_layers=2, num_kv_heads=1, head_dim=8, block_size=BLOCK, dtype="float16"
    )


@dataclass
class Harness:
    ctx: ActorContext
    inboxes: dict[str, MemoryObjectReceiveStream[Any]]
    sends: dict[str, MemoryObjectSendStream[Any]]

    def sent(self, stage: str) -> list[Any]:
        """Everything sent to ``stage`` so far (drains its channel)."""
        out = []
        while True:
            try:
                out.append(self.inboxes[stage].receive_nowait())
            except anyio.WouldBlock:
                return out

    def write_state(
        self, tokens: Any, ids: Any, *, start: int = 0, timeout: float = 30.0
    ) -> WriteState:
        now = anyio.current_time()
        toks = as_tokens(tokens)
        end = len(toks) // BLOCK
        state = WriteState(
            "w", now + timeout, now, toks, np.asarray(ids, np.int64), start, end, False
        )
        state.keys = block_keys(self.ctx.scope, toks, BLOCK, False)
        state.planned(0, plan_slices(start, end, self.ctx.slice_blocks, BLOCK, len(toks)))
        return state

    def read_state(self, tokens: Any, ids: Any, *, timeout: float = 30.0) -> ReadState:
        now = anyio.current_time()
        toks = as_tokens(tokens)
        end = len(toks) // BLOCK
        state = ReadState(
            "r",
            now + timeout,
            now,
            toks,
            np.asarray(ids, np.int64),
            0,
            end,
            False,
        )
        state.keys = block_keys(self.ctx.scope, toks, BLOCK, False)
        return state


@asynccontextmanager
async def harness(
    backend: StorageBackend,
    *,
    slice_blocks: int = 4,
    pool_slots: int = 64,
    config: kvpipe.PipelineConfig | None = None,
    cache: kvpipe.KVCache | None = None,
) -> AsyncIterator[Harness]:
    layout = cache.layout if cache is not None else small_layout()
    if cache is None:
        cache = kvpipe.create_kv_cache(layout, 64)
        fill_random(cache, seed=3)
    cfg = config or kvpipe.PipelineConfig(slice_block_num=slice_blocks)
    outboxes, inbox_bundle = open_channels(256)
    inboxes = inbox_bundle.by_name()
    sends: dict[str, MemoryObjectSendStream[Any]] = {
        f.name: getattr(outboxes, f.name) for f in dataclasses.fields(outboxes)
    }
    pool = StagingPool(value_nbytes(layout.block_nbytes), pool_slots)
    async with ThreadRunner() as runner:
        ctx = ActorContext(
            config=cfg,
            cache=cache,
            layout=layout,
            scope=Scope("t", layout.fingerprint),
            backend=backend,
            pool=pool,
            runner=runner,
            segments=layout_segments(layout),
            payload_nbytes=layout.block_nbytes,
            value_nbytes=pool.slot_nbytes,
            slice_blocks=slice_blocks,
            copy_limiter=Lane(2),
            io_limiter=Lane(4),
            hooks=PipelineHooks(),
            outboxes=outboxes,
            engine=HostEngine(cache, runner, Lane(2)),
        )
        try:
            yield Harness(ctx, inboxes, sends)
        finally:
            for s in (*sends.values(), *inboxes.values()):
                s.close()
