"""Real batches over real staging, built the way the pipeline builds them: what the
conformance suite (:mod:`.conformance`) and tests of a single store put and get with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from .._keys import Scope, Tokens, as_tokens, block_keys
from .._staging import StagingLease, StagingPool
from .._workers import ThreadRunner
from ..backends import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend
from ..backends._base import FetchSink

B = TypeVar("B", PutBatch, GetBatch)

__all__ = ("Batches", "random_values")

_SCOPE = Scope("conformance", "0123456789abcdef")
_BLOCK = 4


class Batches:
    """Builds real batches over real staging, the way the pipeline does.

    Keys come from :meth:`keys` (chained, as the pipeline makes them); a batch of them gets
    the first block index, token prefix and parent key a pipeline would give it, split into
    runs of consecutive blocks — so a token-indexed backend sees consistent batches.
    """

    def __init__(self, pool: StagingPool, runner: ThreadRunner) -> None:
        self.pool = pool
        self.runner = runner
        self._where: dict[str, tuple[Tokens, int, tuple[str, ...]]] = {}

    def keys(self, n: int, seed: int = 0, partial: bool = False) -> tuple[tuple[str, ...], Tokens]:
        """``n`` chained keys of one sequence (the last one partial if asked), its tokens."""
        tokens = as_tokens(np.arange(seed * 100_000, seed * 100_000 + n * _BLOCK - partial))
        keys = block_keys(_SCOPE, tokens, _BLOCK, partial)
        for i, key in enumerate(keys):
            self._where[key] = (tokens, i, keys)
        return keys, tokens

    def _runs(self, keys: Sequence[str]) -> list[tuple[list[int], int, Tokens, str | None]]:
        """Positions of ``keys`` cut into runs of consecutive blocks of one sequence, each
        with its first block index, token prefix and parent key."""
        runs: list[tuple[list[int], int, Tokens, str | None]] = []
        prev: tuple[Tokens, int, tuple[str, ...]] | None = None
        for pos, key in enumerate(keys):
            where = self._where.get(key)
            if (
                runs
                and where is not None
                and prev is not None
                and where[2] is prev[2]
                and where[1] == prev[1] + 1
            ):
                runs[-1][0].append(pos)
            else:
                if where is None:
                    runs.append(([pos], 0, as_tokens(np.arange(_BLOCK)), None))
                else:
                    tokens, index, seq = where
                    runs.append(([pos], index, tokens, seq[index - 1] if index else None))
            prev = where
        out = []
        for positions, first, tokens, parent in runs:
            end = min((first + len(positions)) * _BLOCK, len(tokens))
            out.append((positions, first, tokens[:end], parent))
        return out

    def key_batch(self, keys: Sequence[str]) -> KeyBatch:
        """A key-only batch (the keys should be consecutive blocks of one sequence)."""
        _, first, tokens, parent = self._runs(keys)[0]
        return KeyBatch(_SCOPE, "conformance", keys, first, tokens, parent)

    def _staged(
        self,
        kind: type[B],
        keys: list[str],
        first: int,
        tokens: Tokens,
        parent: str | None,
        lease: StagingLease,
    ) -> B:
        """A put or get batch over ``lease`` (one slot per key)."""
        return kind(
            _SCOPE,
            "conformance",
            keys,
            first,
            tokens,
            parent,
            lease=lease,
            value_nbytes=self.pool.slot_nbytes,
            runner=self.runner,
            limiter=None,
        )

    async def put(
        self,
        backend: StorageBackend,
        keys: Sequence[str],
        values: Sequence[bytes],
    ) -> list[BlockStatus]:
        """Put ``values`` (each ``pool.slot_nbytes`` long) under ``keys``."""
        statuses: list[BlockStatus] = [BlockStatus.FAILED] * len(keys)
        for positions, first, tokens, parent in self._runs(keys):
            lease = await self.pool.acquire(len(positions))
            try:
                for i, pos in enumerate(positions):
                    self.pool.slot(lease.slots[i])[:] = np.frombuffer(values[pos], np.uint8)
                batch = self._staged(
                    PutBatch, [keys[p] for p in positions], first, tokens, parent, lease
                )
                got = list(await backend.put_blocks(batch))
                assert len(got) == len(positions), "one status per key"
                for pos, status in zip(positions, got, strict=True):
                    statuses[pos] = status
            finally:
                lease.release()
        return statuses

    async def get(
        self, backend: StorageBackend, keys: Sequence[str], sink: FetchSink | None = None
    ) -> tuple[list[BlockStatus], list[bytes]]:
        """Get ``keys`` (offering ``sink`` to a store that uses one: the same sink for every
        batch, indexed within each); returns the statuses and each buffer's bytes."""
        statuses: list[BlockStatus] = [BlockStatus.FAILED] * len(keys)
        values: list[bytes] = [b""] * len(keys)
        for positions, first, tokens, parent in self._runs(keys):
            lease = await self.pool.acquire(len(positions))
            try:
                for slot in lease.slots:
                    self.pool.slot(slot)[:] = 0
                batch = self._staged(
                    GetBatch, [keys[p] for p in positions], first, tokens, parent, lease
                )
                batch.sink = sink
                got = list(await backend.get_blocks(batch))
                assert len(got) == len(positions), "one status per key"
                for i, (pos, status) in enumerate(zip(positions, got, strict=True)):
                    statuses[pos] = status
                    values[pos] = self.pool.slot(lease.slots[i]).tobytes()
            finally:
                lease.release()
        return statuses, values


def random_values(n: int, size: int, seed: int) -> list[bytes]:
    """``n`` values of ``size`` random bytes (the same for the same seed)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]
