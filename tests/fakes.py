"""Test doubles: a scripted store that delays, hangs, fails or corrupts chosen calls.

All waits are ``anyio.sleep`` (in-loop), so under trio's ``MockClock`` they take no real time.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import anyio

import kvpipe
from kvpipe.backends import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend


@dataclass
class Act:
    """What the n-th call of an operation does before (or instead of) the real work.

    Attributes:
        delay: Seconds to sleep first.
        hang: Never return (until cancelled).
        error: Raise this.
        fail: Positions in the batch reported FAILED (and not stored / not fetched).
        ok_but_missing: put: positions reported OK but not stored (a lying store).
        corrupt: get: positions whose fetched bytes get one byte flipped.
    """

    delay: float = 0.0
    hang: bool = False
    error: Exception | None = None
    fail: Sequence[int] = ()
    ok_but_missing: Sequence[int] = ()
    corrupt: Sequence[int] = ()


@dataclass
class Call:
    op: str
    at: float
    keys: tuple[str, ...]
    first_block: int
    token_prefix_len: int
    parent_key: str | None = None
    finished: bool = False
    cancelled: bool = False


class ScriptedStore(StorageBackend):
    """A :class:`kvpipe.MemoryStore` whose calls follow a script, recording every call."""

    name = "scripted"

    def __init__(
        self,
        puts: Mapping[int, Act] | None = None,
        gets: Mapping[int, Act] | None = None,
        exists: Mapping[int, Act] | None = None,
        inner: kvpipe.MemoryStore | None = None,
    ) -> None:
        self.inner = inner if inner is not None else kvpipe.MemoryStore()
        self.scripts: dict[str, Mapping[int, Act]] = {
            "put": puts or {},
            "get": gets or {},
            "exists": exists or {},
        }
        self.calls: list[Call] = []
        self.counts: dict[str, int] = {"put": 0, "get": 0, "exists": 0}
        self.deleted: list[str] = []
        self._changed = anyio.Event()

    async def wait_calls(self, op: str, n: int = 1) -> None:
        """Wait until ``op`` has been called at least ``n`` times."""
        while self.counts[op] < n:
            await self._changed.wait()

    def calls_of(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    async def _enter(self, op: str, batch: KeyBatch) -> tuple[Act, Call]:
        n = self.counts[op]
        self.counts[op] += 1
        call = Call(
            op,
            anyio.current_time(),
            batch.keys,
            batch.first_block,
            len(batch.token_prefix),
            batch.parent_key,
        )
        self.calls.append(call)
        self._changed.set()
        self._changed = anyio.Event()
        act = self.scripts[op].get(n, Act())
        try:
            if act.delay:
                await anyio.sleep(act.delay)
            if act.hang:
                await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            call.cancelled = True
            raise
        if act.error is not None:
            raise act.error
        return act, call

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        act, call = await self._enter("put", batch)
        statuses = list(await self.inner.put_blocks(batch))
        drop = [i for i in (*act.fail, *act.ok_but_missing) if i < len(statuses)]
        await self.inner.delete([batch.keys[i] for i in drop])
        for i in act.fail:
            if i < len(statuses):
                statuses[i] = BlockStatus.FAILED
        call.finished = True
        return statuses

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        act, call = await self._enter("get", batch)
        statuses = list(await self.inner.get_blocks(batch))
        for i in act.fail:
            statuses[i] = BlockStatus.FAILED
        buffers = batch.buffers
        for i in act.corrupt:
            buffers[i][7] ^= 0xFF
        call.finished = True
        return statuses

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        await self._enter("exists", batch)
        return await self.inner.exists(batch)

    async def delete(self, keys: Sequence[str]) -> None:
        self.deleted.extend(keys)
        await self.inner.delete(keys)

    async def put_residency(self, entries: Sequence[kvpipe.ResidencyEntry]) -> None:
        await self.inner.put_residency(entries)

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[kvpipe.ResidencyEntry]]:
        return await self.inner.get_residency(keys)


@dataclass
class CrashHooks(kvpipe.PipelineHooks):
    """Raise in ``actor`` for the listed request ids (each as many times as listed)."""

    actor: str
    request_ids: list[str] = field(default_factory=list)

    def on_message(self, actor: str, request_id: str) -> None:
        if actor == self.actor and request_id in self.request_ids:
            self.request_ids.remove(request_id)
            raise RuntimeError(f"injected crash in {actor} for {request_id}")


class StuckInThreadStore(kvpipe.MemoryStore):
    """A store whose puts or gets (``op``) block in a worker thread until :attr:`go_on` is
    set (a vendor call stuck on staging), and then fail; notes whether one still ran when
    staging was unregistered."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.go_on = threading.Event()
        self.running = threading.Event()
        self.unregistered: list[bool] = []

    async def _stuck(self, batch: PutBatch | GetBatch) -> Sequence[BlockStatus]:
        def stuck() -> None:
            self.running.set()
            self.go_on.wait(30)
            self.running.clear()

        await batch.run_sync(stuck)
        return [BlockStatus.FAILED] * len(batch.keys)

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        if self.op == "put":
            return await self._stuck(batch)
        return await super().put_blocks(batch)

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        if self.op == "get":
            return await self._stuck(batch)
        return await super().get_blocks(batch)

    async def unregister_staging(self, buffer: memoryview) -> None:
        self.unregistered.append(self.running.is_set())
        await super().unregister_staging(buffer)
