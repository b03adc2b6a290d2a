"""FileStore against a model: random sequences of puts, gets, probes, deletes, residency
records, closes and reopens (and a second store over the same root at once), checked after
every step.

The model is what the store promises (docs/backends.md, ``FileStore``): a block reported
``OK`` and not deleted or evicted reads back byte for byte; a block reported otherwise was
never made visible; ``exists`` agrees with the files; eviction (only with a capacity, only in
a put) takes prefix tails, least recently used first, never the batch's blocks or their
parent, and refuses a block only when nothing else can go; the catalog's bytes are the bytes
of the block files there are; and a closed store leaves no temporary file behind. Steps that
run several calls at once check what holds whatever their order: values read are whole
values put, and the catalog ends up counting the files there are.

Keys come in two layouts: small values, and values large enough to be written with direct
I/O (padded files), so deleted files are reused across sizes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvpipe._blockformat import value_nbytes
from kvpipe._keys import Scope, as_tokens, block_keys
from kvpipe._results import Residency, ResidencyEntry
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, GetBatch, KeyBatch, PutBatch
from kvpipe.backends.file import FileStore
from kvpipe.backends.file._format import HEADER_NBYTES, block_location, is_temp_name

pytestmark = pytest.mark.usefixtures("file_io")

OK, NO_SPACE, MISSING = BlockStatus.OK, BlockStatus.NO_SPACE, BlockStatus.MISSING


@dataclass(frozen=True)
class Layout:
    """Keys of one layout: their scope, value size and chains."""

    scope: Scope
    value_nbytes: int
    chains: tuple[tuple[str, ...], ...]


def _layout(scope: Scope, payload: int, *sequences: np.ndarray[Any, Any]) -> Layout:
    chains = tuple(block_keys(scope, as_tokens(t), 4, False) for t in sequences)
    return Layout(scope, value_nbytes(payload), chains)


_A = np.arange(0, 24)
LAYOUTS = (
    # Three sequences: the second shares its first two blocks with the first (a prefix
    # tree), the third is on its own.
    _layout(
        Scope("small", "0123456789abcdef"),
        4096 + 13,
        _A,
        np.concatenate([_A[:8], np.arange(1000, 1012)]),
        np.arange(5000, 5016),
    ),
    # Large enough (and page-aligned in staging) to be written with O_DIRECT, padded.
    _layout(Scope("large", "fedcba9876543210"), 64 << 10, np.arange(9000, 9012)),
)
CHAINS = [(layout, chain) for layout in LAYOUTS for chain in layout.chains]
LAYOUT_OF = {key: layout for layout, chain in CHAINS for key in chain}
UNIVERSE: tuple[str, ...] = tuple(LAYOUT_OF)
#: Each key's parent: the block before it in its sequence.
PARENT = {key: (chain[i - 1] if i else None) for _, chain in CHAINS for i, key in enumerate(chain)}
#: Each key's block index in its sequence.
POSITION = {key: i for _, chain in CHAINS for i, key in enumerate(chain)}
SMALL = LAYOUTS[0].value_nbytes + HEADER_NBYTES  # a small block's file


def value_of(key: str, variant: int) -> bytes:
    """The bytes a put of ``key`` stores (``variant``: another value for the same key)."""
    rng = np.random.default_rng([xxhash.xxh64_intdigest(key.encode()), variant])
    return rng.integers(0, 256, LAYOUT_OF[key].value_nbytes, dtype=np.uint8).tobytes()


def path_of(key: str) -> str:
    parts, name = block_location(key)
    return os.path.join(*parts, name)


def block_files(root: Path) -> dict[str, int]:
    """Every published block file under ``root`` (relative path: size)."""
    out: dict[str, int] = {}
    for dirpath, _, names in os.walk(root / "blocks"):
        for name in names:
            if name.endswith(".kvb") and not is_temp_name(name):
                p = Path(dirpath, name)
                out[str(p.relative_to(root))] = p.stat().st_size
    return out


def temp_files(root: Path) -> list[str]:
    """Temporary files (of writers, or spares) anywhere under ``root``."""
    return [n for _, _, names in os.walk(root) for n in names if is_temp_name(n)]


class Staging:
    """A staging pool per layout, and the batches over it."""

    def __init__(self, runner: ThreadRunner) -> None:
        self.runner = runner
        self.pools = {layout: StagingPool(layout.value_nbytes, 16) for layout in LAYOUTS}

    async def put(
        self, store: FileStore, keys: Sequence[str], values: Sequence[bytes], parent: str | None
    ) -> list[BlockStatus]:
        """Put consecutive blocks of one chain (``parent``: the block before them)."""
        layout = LAYOUT_OF[keys[0]]
        pool = self.pools[layout]
        lease = await pool.acquire(len(keys))
        try:
            for slot, value in zip(lease.slots, values, strict=False):
                pool.slot(slot)[:] = np.frombuffer(value, np.uint8)
            first = POSITION[keys[0]]
            batch = PutBatch(
                layout.scope,
                "model",
                keys,
                first,
                as_tokens(np.arange((first + len(keys)) * 4)),
                parent,
                lease=lease,
                value_nbytes=layout.value_nbytes,
                runner=self.runner,
                limiter=None,
            )
            return list(await store.put_blocks(batch))
        finally:
            lease.release()

    async def get(
        self, store: FileStore, keys: Sequence[str]
    ) -> tuple[list[BlockStatus], list[bytes]]:
        """Get keys of one layout into zeroed buffers: statuses and buffer bytes."""
        layout = LAYOUT_OF[keys[0]]
        pool = self.pools[layout]
        lease = await pool.acquire(len(keys))
        try:
            for slot in lease.slots:
                pool.slot(slot)[:] = 0
            batch = GetBatch(
                layout.scope,
                "model",
                keys,
                0,
                as_tokens(np.arange(len(keys) * 4)),
                lease=lease,
                value_nbytes=layout.value_nbytes,
                runner=self.runner,
                limiter=None,
            )
            statuses = list(await store.get_blocks(batch))
            return statuses, [pool.slot(s).tobytes() for s in lease.slots[: len(keys)]]
        finally:
            lease.release()

    async def get_any(
        self, store: FileStore, keys: Sequence[str]
    ) -> tuple[list[BlockStatus], list[bytes]]:
        """Get keys of any layouts (one batch per layout)."""
        statuses: dict[str, BlockStatus] = {}
        values: dict[str, bytes] = {}
        for layout in LAYOUTS:
            mine = [k for k in keys if LAYOUT_OF[k] is layout]
            if mine:
                got, vals = await self.get(store, mine)
                statuses.update(zip(mine, got, strict=True))
                values.update(zip(mine, vals, strict=True))
        return [statuses[k] for k in keys], [values[k] for k in keys]

    def in_use(self) -> int:
        return sum(pool.in_use for pool in self.pools.values())


class FileStoreModel(RuleBasedStateMachine):
    """A FileStore (or two over one root) and the model it must agree with."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="kvpipe-model-"))
        self.root = self.tmp / "store"
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal()
        )
        self.portal = self._portal_cm.__enter__()
        self._runner_cm = self.portal.wrap_async_context_manager(ThreadRunner())
        self.staging = Staging(self._runner_cm.__enter__())
        self.stores: list[FileStore] = []
        #: What each stored key holds, and its last use (a step number).
        self.model: dict[str, bytes] = {}
        self.used: dict[str, int] = {}
        self.residency: dict[tuple[str, str], tuple[Residency, float]] = {}
        self.step = 0
        self.capacity: int | None = None
        #: Calls at once left the store over its capacity (see :meth:`at_once`).
        self.over = False
        self.options: dict[str, Any] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _open(self, durability: str) -> FileStore:
        store = FileStore(self.root, durability=durability, **self.options)  # type: ignore[arg-type]
        self.portal.call(store.open)
        stats = store.statistics()
        for what in ("forgotten", "adopted", "quarantined", "temp_files_removed"):
            assert not stats.get(what), f"a sound store needed repairs at open: {stats}"
        return store

    def _store(self, which: int) -> FileStore:
        return self.stores[which % len(self.stores)]

    def _close(self, store: FileStore) -> None:
        self.portal.call(store.aclose)
        assert store.closed
        self.stores.remove(store)
        if not self.stores:
            left = temp_files(self.root)
            assert not left, f"temporary files left after close: {left}"

    def _present(self) -> set[str]:
        files = block_files(self.root)
        return {k for k in UNIVERSE if path_of(k) in files}

    def _forget(self, key: str) -> None:
        self.model.pop(key, None)
        self.used.pop(key, None)

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        durability=st.sampled_from(["none", "data"]),
        capacity_blocks=st.sampled_from([None, 2, 4, 8, 20]),
        spare=st.booleans(),
        threads=st.sampled_from([1, 3]),
    )
    def start(
        self, durability: str, capacity_blocks: int | None, spare: bool, threads: int
    ) -> None:
        self.capacity = None if capacity_blocks is None else capacity_blocks * SMALL
        self.options = {
            "capacity_bytes": self.capacity,
            "spare_bytes": 1 << 20 if spare else 0,
            "threads": threads,
        }
        self.stores.append(self._open(durability))

    @rule(
        which=st.integers(0, 1),
        chain=st.integers(0, len(CHAINS) - 1),
        start=st.integers(0, 5),
        length=st.integers(1, 4),
        variants=st.lists(st.integers(0, 1), min_size=4, max_size=4),
    )
    def put(self, which: int, chain: int, start: int, length: int, variants: list[int]) -> None:
        seq = CHAINS[chain][1]
        start = min(start, len(seq) - 1)
        keys = list(seq[start : start + length])
        parent = seq[start - 1] if start else None
        values = [value_of(k, v) for k, v in zip(keys, variants, strict=False)]
        before = dict(self.model)
        assert self._present() == set(before)
        self.step += 1
        statuses = self.portal.call(self.staging.put, self._store(which), keys, values, parent)
        assert len(statuses) == len(keys)
        if self.capacity is None:
            assert statuses == [OK] * len(keys), statuses
        else:
            n = statuses.count(OK)
            assert statuses == [OK] * n + [NO_SPACE] * (len(keys) - n), statuses
        for key, value, status in zip(keys, values, statuses, strict=True):
            if status is OK:
                self.model[key] = value
                self.used[key] = self.step
        present = self._present()
        stray = present - set(self.model)
        assert not stray, f"blocks visible though not reported OK: {stray}"
        evicted = set(self.model) - present
        protect = {*keys, parent}
        if evicted:
            assert self.capacity is not None, f"blocks gone without a capacity: {evicted}"
            assert not evicted & protect, f"evicted the batch's own blocks: {evicted & protect}"
            for key in evicted:
                children = [c for c in present if PARENT[c] == key]
                assert not children, f"evicted {key} from the middle: {children} stay"
            # Least recently used first: a tail that stays was used after every tail evicted.
            tails = {
                k for k in before if k not in protect and not any(PARENT[c] == k for c in before)
            }
            for t in tails - evicted:
                newer = [k for k in evicted & tails if self.used[k] > self.used[t]]
                assert not newer, f"evicted {newer} before the older tail {t}"
            for key in evicted:
                self._forget(key)
        if NO_SPACE in statuses:
            evictable = [
                k for k in present if k not in protect and not any(PARENT[c] == k for c in present)
            ]
            assert not evictable, f"refused a block though {evictable} could be evicted"

    @rule(
        which=st.integers(0, 1),
        keys=st.lists(st.sampled_from(UNIVERSE), unique=True, min_size=1, max_size=6),
    )
    def get(self, which: int, keys: list[str]) -> None:
        self.step += 1
        statuses, values = self.portal.call(self.staging.get_any, self._store(which), keys)
        for key, status, value in zip(keys, statuses, values, strict=True):
            if key in self.model:
                assert status is OK, (key, status)
                assert value == self.model[key], f"{key}: read back other bytes"
                if self.capacity is not None:
                    self.used[key] = self.step
            else:
                assert status is MISSING, (key, status)

    @rule(
        which=st.integers(0, 1),
        chain=st.integers(0, len(CHAINS) - 1),
        start=st.integers(0, 5),
        length=st.integers(1, 6),
    )
    def exists(self, which: int, chain: int, start: int, length: int) -> None:
        layout, seq = CHAINS[chain]
        keys = seq[min(start, len(seq) - 1) :][:length]
        batch = KeyBatch(layout.scope, "model", keys, 0, as_tokens(np.arange(4 * len(keys))))
        answers = list(self.portal.call(self._store(which).exists, batch))
        assert len(answers) == len(keys)
        for i, (key, found) in enumerate(zip(keys, answers, strict=True)):
            if key not in self.model:
                assert not found, f"{key} is not stored, exists says it is"
                # past the first missing key a store may answer False for the rest
                assert all(k in self.model for k, f in zip(keys[i:], answers[i:], strict=True) if f)
                break
            assert found, f"{key} is stored, exists says not"

    @rule(
        which=st.integers(0, 1),
        keys=st.lists(st.sampled_from(UNIVERSE), unique=True, max_size=4),
    )
    def delete(self, which: int, keys: list[str]) -> None:
        self.portal.call(self._store(which).delete, keys)
        for key in keys:
            self._forget(key)

    @rule(
        which=st.integers(0, 1),
        entries=st.lists(
            st.tuples(
                st.sampled_from(UNIVERSE[:4]),
                st.sampled_from(["n0", "n1"]),
                st.sampled_from(list(Residency)),
                st.integers(0, 10**6),
            ),
            min_size=1,
            max_size=4,
            unique_by=lambda e: (e[0], e[1]),
        ),
    )
    def put_residency(self, which: int, entries: list[tuple[str, str, Residency, int]]) -> None:
        records = [ResidencyEntry(k, n, r, float(t)) for k, n, r, t in entries]
        self.portal.call(self._store(which).put_residency, records)
        for e in records:
            self.residency[(e.key, e.node_id)] = (e.residency, e.updated_at)

    @rule(which=st.integers(0, 1), keys=st.lists(st.sampled_from(UNIVERSE[:5]), max_size=4))
    def get_residency(self, which: int, keys: list[str]) -> None:
        got = self.portal.call(self._store(which).get_residency, keys)
        assert len(got) == len(keys)
        for key, records in zip(keys, got, strict=True):
            mine = [(n, r.value, t) for (k, n), (r, t) in self.residency.items() if k == key]
            want = sorted(mine)
            assert sorted((e.node_id, e.residency.value, e.updated_at) for e in records) == want
            assert all(e.key == key for e in records)

    @rule(
        ops=st.lists(
            st.tuples(
                st.sampled_from(["put", "get", "delete"]),
                st.integers(0, 1),
                st.integers(0, len(CHAINS) - 1),
                st.integers(0, 5),
                st.integers(1, 4),
                st.integers(0, 1),
            ),
            min_size=2,
            max_size=4,
        )
    )
    def at_once(self, ops: list[tuple[str, int, int, int, int, int]]) -> None:
        """Several calls at once (over both stores when there are two): what a get returns
        is a whole value put; afterwards the stored keys hold one of the values put."""
        candidates: dict[str, set[bytes]] = {k: {v} for k, v in self.model.items()}
        reads: list[tuple[list[str], list[BlockStatus], list[bytes]]] = []

        async def one(
            kind: str, store: FileStore, keys: list[str], parent: str | None, v: int
        ) -> None:
            if kind == "put":
                await self.staging.put(store, keys, [value_of(k, v) for k in keys], parent)
            elif kind == "get":
                reads.append((keys, *await self.staging.get(store, keys)))
            else:
                await store.delete(keys)

        async def run() -> None:
            async with anyio.create_task_group() as tg:
                for kind, which, chain, start, length, variant in ops:
                    seq = CHAINS[chain][1]
                    start = min(start, len(seq) - 1)
                    keys = list(seq[start : start + length])
                    if kind == "put":
                        for k in keys:
                            candidates.setdefault(k, set()).add(value_of(k, variant))
                    parent = seq[start - 1] if start else None
                    tg.start_soon(one, kind, self._store(which), keys, parent, variant)

        self.portal.call(run)
        # Known and left alone: a put writing a stored key again needs no new room, and a
        # delete of that key (or another put of it settling first) can hand its room to a
        # third put meanwhile; the key then comes back over the capacity, until a later put
        # evicts.
        self.over = True
        for keys, statuses, values in reads:
            for key, status, value in zip(keys, statuses, values, strict=True):
                assert status in (OK, MISSING), (key, status)
                if status is OK:
                    assert value in candidates.get(key, ()), f"{key}: read bytes never put"
        # Settle the model from what is stored now (all read at once: one last use).
        self.step += 1
        present = sorted(self._present())
        self.model.clear()
        self.used.clear()
        if present:
            statuses, values = self.portal.call(self.staging.get_any, self.stores[0], present)
            for key, status, value in zip(present, statuses, values, strict=True):
                assert status is OK, (key, status)
                assert value in candidates.get(key, ()), f"{key}: holds bytes never put"
                self.model[key] = value
                self.used[key] = self.step

    @rule(which=st.integers(0, 1), durability=st.sampled_from(["none", "data"]))
    def reopen(self, which: int, durability: str) -> None:
        self._close(self._store(which))
        self.stores.append(self._open(durability))

    @precondition(lambda self: len(self.stores) == 1)
    @rule(durability=st.sampled_from(["none", "data"]))
    def open_second(self, durability: str) -> None:
        self.stores.append(self._open(durability))

    @precondition(lambda self: len(self.stores) == 2)
    @rule(which=st.integers(0, 1))
    def close_one(self, which: int) -> None:
        self._close(self._store(which))

    # -- after every step --------------------------------------------------------------------

    @invariant()
    def files_are_the_model(self) -> None:
        if self.stores:
            assert self._present() == set(self.model)
            assert set(block_files(self.root)) == {path_of(k) for k in self.model}

    @invariant()
    def catalog_counts_the_files(self) -> None:
        if not self.stores:
            return
        catalog = self.stores[0]._catalog
        assert catalog is not None
        stats = catalog.stats()
        files = block_files(self.root)
        assert stats.pending == 0, stats
        assert stats.blocks == len(files), (stats, len(files))
        assert stats.bytes == sum(files.values()), (stats, sum(files.values()))
        if self.capacity is not None:
            self.over = self.over and stats.bytes > self.capacity
            assert stats.bytes <= self.capacity or self.over, stats

    def teardown(self) -> None:
        try:
            for store in list(self.stores):
                self._close(store)
        finally:
            self._runner_cm.__exit__(None, None, None)
            self._portal_cm.__exit__(None, None, None)
            shutil.rmtree(self.tmp, ignore_errors=True)
        assert self.staging.in_use() == 0, "staging left leased"


def test_file_store_agrees_with_its_model() -> None:
    run_state_machine_as_test(
        FileStoreModel,
        settings=settings(
            max_examples=int(os.environ.get("KVPIPE_MODEL_EXAMPLES", "15")),
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
