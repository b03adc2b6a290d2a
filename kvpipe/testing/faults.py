"""Fault injection: :class:`FaultyStore` wraps any backend and misbehaves on a seeded schedule.

A :class:`FaultPlan` is data (a dict, JSON or TOML): a seed and a list of rules. Each rule
names an operation (``put``, ``get``, ``exists``, ``delete``, ``put_residency``,
``get_residency``, ``*``), a kind of fault, which calls it hits
(explicit call numbers, or a probability per call) and its parameters. For the same seed and
the same sequence of calls the same faults happen — deterministic in virtual time, where the
order of calls is deterministic too.

Kinds:

``latency``   sleep first (``latency``: seconds, or ``["uniform", lo, hi]`` / ``["exp", mean]``)
``hang``      never answer (until the caller's cancel scope ends the call)
``error``     raise (``error``: ``"OSError"``, ``"RuntimeError"``, ``"TimeoutError"``,
              ``"ValueError"``)
``partial``   put: some blocks — leading or not — are reported ``FAILED`` and never stored
              (only the runs of the others reach the inner store);
              get: some blocks reported ``FAILED``
``lie``       exists: some missing keys reported present
``corrupt``   get: some fetched blocks get a byte flipped, reported ``OK``
``swap``      get: some fetched blocks come back holding another block's intact value of the
              same call (a store that mixed up its keys), reported ``OK``
``late``      the call finishes ``latency`` seconds later even if the caller gave up: a put
              still stores its blocks, a get still writes into its buffers (the staging stays
              leased until it is done)

Every call is recorded (:attr:`FaultyStore.calls`): operation, request, blocks, times, what
was injected, and the outcome — the input of the invariant checker (:mod:`.invariants`).
"""

from __future__ import annotations

import functools
import json
import random
import tomllib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, final

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import xxhash

from .._results import ResidencyEntry
from ..backends._base import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend

__all__ = ("FaultPlan", "FaultRule", "FaultyStore", "StoreCall")

Op = Literal["put", "get", "exists", "delete", "put_residency", "get_residency", "*"]
Kind = Literal["latency", "hang", "error", "partial", "lie", "corrupt", "swap", "late"]
_KINDS = ("latency", "hang", "error", "partial", "lie", "corrupt", "swap", "late")
_OPS = ("put", "get", "exists", "delete", "put_residency", "get_residency", "*")
_ERRORS: dict[str, type[Exception]] = {
    "OSError": OSError,
    "RuntimeError": RuntimeError,
    "TimeoutError": TimeoutError,
    "ValueError": ValueError,
}


@final
@dataclass(frozen=True, slots=True)
class FaultRule:
    """One kind of misbehaviour for one operation.

    Attributes:
        op: The operation it applies to (``*``: every one).
        kind: What happens (see the module docstring).
        calls: The call numbers (per operation, from 0) it hits; ``None``: any call, with
            ``probability``.
        probability: Chance that a call is hit (when ``calls`` is ``None``).
        blocks: Chance that each block of a hit call is affected (partial, lie, corrupt,
            swap).
        latency: Seconds, or ``["uniform", lo, hi]`` or ``["exp", mean]``.
        error: Name of the exception raised by ``error``.
    """

    op: Op
    kind: Kind
    calls: tuple[int, ...] | None = None
    probability: float = 1.0
    blocks: float = 0.5
    latency: float | tuple[Any, ...] = 0.0
    error: str = "OSError"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"unknown operation {self.op!r}; expected one of {_OPS}")
        if self.kind not in _KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {_KINDS}")
        if not 0.0 <= self.probability <= 1.0 or not 0.0 <= self.blocks <= 1.0:
            raise ValueError("probability and blocks must be within [0, 1]")
        if self.error not in _ERRORS:
            raise ValueError(f"unknown error {self.error!r}; expected one of {sorted(_ERRORS)}")
        self.delay(random.Random(0))  # validates the latency spec

    def hits(self, op: str, call: int, rng: random.Random) -> bool:
        """Whether the ``call``-th call of ``op`` is hit."""
        if self.op not in ("*", op):
            return False
        if self.calls is not None:
            return call in self.calls
        return rng.random() < self.probability

    def delay(self, rng: random.Random) -> float:
        """Seconds of latency drawn for one call."""
        spec = self.latency
        if isinstance(spec, int | float):
            if spec < 0:
                raise ValueError("latency must be >= 0")
            return float(spec)
        kind, *args = spec
        if kind == "uniform" and len(args) == 2:
            return rng.uniform(float(args[0]), float(args[1]))
        if kind == "exp" and len(args) == 1:
            return rng.expovariate(1.0 / float(args[0]))
        raise ValueError(f"bad latency spec {spec!r}: a number, ['uniform', lo, hi], ['exp', mean]")

    def picked(self, n: int, rng: random.Random) -> list[int]:
        """Which of ``n`` blocks a partial / lie / corrupt / swap fault affects (at least
        one)."""
        chosen = [i for i in range(n) if rng.random() < self.blocks]
        return chosen or ([rng.randrange(n)] if n else [])


@final
@dataclass(frozen=True, slots=True)
class FaultPlan:
    """A seed and the rules; build from data with :meth:`from_data` / :meth:`load`."""

    seed: int = 0
    rules: tuple[FaultRule, ...] = ()

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> FaultPlan:
        """From a mapping ``{"seed": 1, "rules": [{"op": "put", "kind": "hang", ...}]}``."""
        rules = []
        for raw in data.get("rules", []):
            rule = dict(raw)
            if "calls" in rule and rule["calls"] is not None:
                rule["calls"] = tuple(int(c) for c in rule["calls"])
            if isinstance(rule.get("latency"), list):
                rule["latency"] = tuple(rule["latency"])
            rules.append(FaultRule(**rule))
        return cls(int(data.get("seed", 0)), tuple(rules))

    @classmethod
    def load(cls, text: str, fmt: Literal["json", "toml"] = "json") -> FaultPlan:
        """From JSON or TOML text (TOML: ``seed = 1`` and ``[[rules]]`` tables)."""
        return cls.from_data(json.loads(text) if fmt == "json" else tomllib.loads(text))

    def rng(self, op: str, call: int) -> random.Random:
        """The random source of one call: a function of the seed, the operation and the call
        number only (not of timing)."""
        return random.Random(zlib.crc32(f"{self.seed}:{op}:{call}".encode()))


@dataclass(eq=False)
class StoreCall:
    """One call to the faulty store, as it happened."""

    op: str
    call: int
    request_id: str
    first_block: int
    keys: tuple[str, ...]
    started: float
    injected: list[str] = field(default_factory=list)
    finished: float | None = None
    outcome: str = "running"  # ok | incomplete | error | cancelled | running
    addresses: tuple[int, ...] = ()
    value_nbytes: int = 0
    digests: tuple[int, ...] = ()
    late_digests: tuple[int, ...] = ()
    released: float | None = None
    #: What a put or get returned to its caller (``None``: it returned nothing, having
    #: raised or been cancelled; a late completion's statuses reach nobody).
    statuses: tuple[BlockStatus, ...] | None = None
    #: Keys whose fetched bytes a ``corrupt`` or ``swap`` fault of this get changed.
    corrupted: tuple[str, ...] = ()


@final
class FaultyStore(StorageBackend):
    """Wraps ``inner`` and injects the faults of ``plan`` (see the module docstring).

    ``inner`` holds the truth: what is really stored. Background work (late completions)
    runs in a task group opened with ``async with FaultyStore(...)``.
    """

    name = "faulty"

    def __init__(self, inner: StorageBackend, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.calls: list[StoreCall] = []
        self._counts: dict[str, int] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self.background = 0

    async def open(self) -> None:
        """Open the inner store (no fault applies)."""
        await self.inner.open()

    async def __aenter__(self) -> FaultyStore:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._tg is not None
        tg, self._tg = self._tg, None
        await tg.__aexit__(None, None, None)
        await self.inner.aclose()

    def _begin(
        self, op: str, batch: KeyBatch | None, keys: Sequence[str]
    ) -> tuple[StoreCall, random.Random, list[FaultRule]]:
        n = self._counts.get(op, 0)
        self._counts[op] = n + 1
        rng = self.plan.rng(op, n)
        rules = [r for r in self.plan.rules if r.hits(op, n, rng)]
        call = StoreCall(
            op,
            n,
            batch.request_id if batch else "",
            batch.first_block if batch else 0,
            tuple(keys),
            anyio.current_time(),
            [r.kind for r in rules],
        )
        self.calls.append(call)
        return call, rng, rules

    async def _prelude(self, call: StoreCall, rng: random.Random, rules: list[FaultRule]) -> None:
        for rule in rules:
            if rule.kind == "latency":
                await anyio.sleep(rule.delay(rng))
            elif rule.kind == "hang":
                await anyio.sleep_forever()
            elif rule.kind == "error":
                raise _ERRORS[rule.error](f"injected {rule.error} in {call.op} #{call.call}")

    async def _run(self, call: StoreCall, work: Any) -> Any:
        try:
            result = await work
        except anyio.get_cancelled_exc_class():
            call.outcome, call.finished = "cancelled", anyio.current_time()
            raise
        except Exception:
            call.outcome, call.finished = "error", anyio.current_time()
            raise
        call.finished = anyio.current_time()
        if call.outcome == "running":
            call.outcome = "ok"
        return result

    @staticmethod
    def _digests(views: Sequence[memoryview]) -> tuple[int, ...]:
        return tuple(xxhash.xxh3_64_intdigest(v) for v in views)

    # -- blocks ------------------------------------------------------------------------------

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        """The inner put, with the faults of the plan."""
        call, rng, rules = self._begin("put", batch, batch.keys)
        call.addresses = tuple(batch.buffer_addresses())
        call.value_nbytes = batch.value_nbytes
        call.digests = self._digests(batch.values)
        statuses: list[BlockStatus] = await self._run(call, self._put(batch, call, rng, rules))
        call.statuses = tuple(statuses)
        return statuses

    async def _put(
        self, batch: PutBatch, call: StoreCall, rng: random.Random, rules: list[FaultRule]
    ) -> list[BlockStatus]:
        await self._prelude(call, rng, rules)
        hit = {i for r in rules if r.kind == "partial" for i in r.picked(len(batch), rng)}
        late = next((r for r in rules if r.kind == "late"), None)
        if late is not None:
            statuses = await self._late(
                call, late.delay(rng), batch, functools.partial(self._put_runs, hit=hit)
            )
        else:
            statuses = await self._put_runs(batch, hit)
        if any(s is not BlockStatus.OK for s in statuses):
            call.outcome = "incomplete"
        return statuses

    async def _put_runs(self, batch: PutBatch, hit: set[int]) -> list[BlockStatus]:
        """Store only the runs of blocks not in ``hit`` (each a sub-batch over the same
        staging); the blocks in ``hit`` are reported ``FAILED`` and never reach the inner
        store, so no reader ever sees them (and nothing already stored is taken back)."""
        statuses = [BlockStatus.FAILED] * len(batch)
        if len(hit) >= len(batch):  # nothing to put: still a checkpoint (StorageBackend)
            await anyio.lowlevel.checkpoint()
        start = 0
        while start < len(batch):
            if start in hit:
                start += 1
                continue
            stop = start
            while stop < len(batch) and stop not in hit:
                stop += 1
            run = batch if stop - start == len(batch) else batch.sub_batch(start, stop)
            statuses[start:stop] = await self.inner.put_blocks(run)
            start = stop
        return statuses

    async def _late(
        self, call: StoreCall, delay: float, batch: PutBatch | GetBatch, fn: Any
    ) -> list[BlockStatus]:
        """Run ``fn(batch)`` after ``delay`` in the background; the caller may give up
        waiting, the work finishes anyway (with the staging still leased)."""
        assert self._tg is not None, "use `async with FaultyStore(...)` for late completions"
        release = batch.hold()
        done = anyio.Event()
        box: list[Any] = []
        self.background += 1

        async def finish() -> None:
            try:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(delay)
                    box.append(list(await fn(batch)))
                    if isinstance(batch, PutBatch):
                        call.late_digests = self._digests(batch.values)
            except Exception as exc:
                box.append(exc)
            finally:
                release()
                call.released = anyio.current_time()
                self.background -= 1
                done.set()

        self._tg.start_soon(finish)
        await done.wait()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]  # type: ignore[no-any-return]

    async def get_blocks(self, batch: GetBatch) -> Sequence[BlockStatus]:
        """The inner get, with the faults of the plan."""
        call, rng, rules = self._begin("get", batch, batch.keys)
        call.addresses = tuple(batch.buffer_addresses())
        call.value_nbytes = batch.value_nbytes
        statuses: list[BlockStatus] = await self._run(call, self._get(batch, call, rng, rules))
        call.statuses = tuple(statuses)
        return statuses

    async def _get(
        self, batch: GetBatch, call: StoreCall, rng: random.Random, rules: list[FaultRule]
    ) -> list[BlockStatus]:
        await self._prelude(call, rng, rules)
        late = next((r for r in rules if r.kind == "late"), None)
        if late is not None:
            statuses = await self._late(call, late.delay(rng), batch, self.inner.get_blocks)
        else:
            statuses = list(await self.inner.get_blocks(batch))
        buffers = batch.buffers
        for rule in rules:
            if rule.kind == "partial":
                for i in rule.picked(len(batch), rng):
                    statuses[i] = BlockStatus.FAILED
            elif rule.kind == "corrupt":
                for i in rule.picked(len(batch), rng):
                    if statuses[i] is BlockStatus.OK:
                        view = np.frombuffer(buffers[i], np.uint8)
                        view[rng.randrange(len(view))] ^= 1 << rng.randrange(8)
                        call.corrupted += (batch.keys[i],)
            elif rule.kind == "swap":
                whole = [i for i, st in enumerate(statuses) if st is BlockStatus.OK]
                # The values as fetched: one swapped already is never handed on.
                fetched = {k: bytes(buffers[k]) for k in whole} if len(whole) > 1 else {}
                for i in rule.picked(len(batch), rng) if fetched else ():
                    if i in fetched:
                        theirs = fetched[rng.choice([k for k in whole if k != i])]
                        mine = np.frombuffer(buffers[i], np.uint8)
                        n = min(len(mine), len(theirs))
                        mine[:n] = np.frombuffer(theirs, np.uint8)[:n]
                        call.corrupted += (batch.keys[i],)
        if any(s is not BlockStatus.OK for s in statuses):
            call.outcome = "incomplete"
        return statuses

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        """The inner exists; a ``lie`` reports some missing keys present."""
        call, rng, rules = self._begin("exists", batch, batch.keys)

        async def work() -> list[bool]:
            await self._prelude(call, rng, rules)
            flags = list(await self.inner.exists(batch))
            for rule in rules:
                if rule.kind == "lie":
                    for i in rule.picked(len(flags), rng):
                        flags[i] = True
            return flags

        return await self._run(call, work())  # type: ignore[no-any-return]

    async def delete(self, keys: Sequence[str]) -> None:
        """The inner delete (latency / hang / error apply)."""
        call, rng, rules = self._begin("delete", None, keys)

        async def work() -> None:
            await self._prelude(call, rng, rules)
            await self.inner.delete(keys)

        await self._run(call, work())

    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        """The inner put_residency (latency / hang / error apply)."""
        call, rng, rules = self._begin("put_residency", None, [e.key for e in entries])

        async def work() -> None:
            await self._prelude(call, rng, rules)
            await self.inner.put_residency(entries)

        await self._run(call, work())

    async def get_residency(self, keys: Sequence[str]) -> Sequence[Sequence[ResidencyEntry]]:
        """The inner get_residency (latency / hang / error apply)."""
        call, rng, rules = self._begin("get_residency", None, keys)

        async def work() -> Sequence[Sequence[ResidencyEntry]]:
            await self._prelude(call, rng, rules)
            return await self.inner.get_residency(keys)

        return await self._run(call, work())  # type: ignore[no-any-return]

    async def register_staging(self, buffer: memoryview) -> None:
        """Passed to the inner store."""
        await self.inner.register_staging(buffer)

    async def unregister_staging(self, buffer: memoryview) -> None:
        """Passed to the inner store."""
        await self.inner.unregister_staging(buffer)

    def statistics(self) -> Mapping[str, float]:
        """Calls by operation and injected faults by kind, plus the inner store's counters."""
        out: dict[str, float] = {f"calls_{k}": v for k, v in self._counts.items()}
        for c in self.calls:
            for kind in c.injected:
                out[f"injected_{kind}"] = out.get(f"injected_{kind}", 0) + 1
        return {**out, **{f"inner_{k}": v for k, v in self.inner.statistics().items()}}
