"""Fault scenarios: a workload, a fault plan, and the invariant checker over one store.

Each scenario writes a few dozen requests — several sharing prompt prefixes (so dedup is
exercised), every third ending in a partial block — through a pipeline over a
:class:`~kvpipe.testing.faults.FaultyStore`, reads each back into other block ids, and judges
the seven invariants (:mod:`.invariants`). ``kvpipe faults`` runs them; the tests run them
too, and hypothesis draws random plans and shapes for :func:`run_workload`.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final, final

import anyio
import numpy as np

from .._blockformat import value_nbytes
from .._cache import KVCache, create_kv_cache
from .._config import PipelineConfig
from .._errors import KVPipeError
from .._layout import CacheLayout
from .._staging import StagingPool
from .._workers import ThreadRunner
from ..actors import PipelineHooks
from ..backends import GetBatch, StorageBackend
from ..pipeline import open_pipeline
from .faults import FaultPlan, FaultRule, FaultyStore
from .invariants import Checker, Outcome, Verdict

__all__ = ("SCENARIOS", "Scenario", "ScenarioResult", "Workload", "run_scenario", "run_workload")

BLOCK = 4


@final
@dataclass(frozen=True, slots=True)
class Scenario:
    """A named fault plan, pipeline settings and workload shape."""

    name: str
    about: str
    rules: tuple[FaultRule, ...] = ()
    config: Mapping[str, Any] = field(default_factory=dict)
    requests: int = 24
    concurrency: int = 6
    crash_actor: str | None = None
    crash_every: int = 0
    closes: bool = False


def _r(op: str, kind: str, **kw: Any) -> FaultRule:
    return FaultRule(op, kind, **kw)  # type: ignore[arg-type]


#: Timeouts in real seconds, short so that hangs cost little.
FAST: Final[Mapping[str, Any]] = {
    "slice_timeout": 0.25,
    "total_timeout": 1.0,
    "lookup_timeout": 1.0,
}

SCENARIOS: Final[tuple[Scenario, ...]] = (
    Scenario("baseline", "no faults"),
    Scenario(
        "latency", "every call 0-20 ms late", (_r("*", "latency", latency=("uniform", 0, 0.02)),)
    ),
    Scenario(
        "hang_slice",
        "puts #2, #9, #17 and gets #3, #11 hang until cancelled",
        (_r("put", "hang", calls=(2, 9, 17)), _r("get", "hang", calls=(3, 11))),
    ),
    Scenario(
        "slow_tight",
        "slow store (exp. 40 ms a call), tight deadlines",
        (_r("*", "latency", latency=("exp", 0.04)),),
        {"slice_timeout": 0.06, "total_timeout": 0.2},
    ),
    Scenario(
        "partial_puts",
        "30% of puts store only some blocks, leading or not",
        (_r("put", "partial", probability=0.3, blocks=0.3),),
    ),
    Scenario(
        "partial_gets",
        "30% of gets fail some blocks",
        (_r("get", "partial", probability=0.3, blocks=0.3),),
    ),
    Scenario("errors", "15% of all calls raise", (_r("*", "error", probability=0.15),)),
    Scenario(
        "lying_exists",
        "30% of exists calls say some missing keys are there",
        (_r("exists", "lie", probability=0.3, blocks=0.3),),
    ),
    Scenario(
        "corrupt_reads",
        "30% of gets flip a bit in some blocks",
        (_r("get", "corrupt", probability=0.3, blocks=0.3),),
    ),
    Scenario(
        "swapped_reads",
        "30% of gets return another block's value for some blocks",
        (_r("get", "swap", probability=0.3, blocks=0.3),),
    ),
    Scenario(
        "late",
        "30% of puts and gets finish 0.4 s later, after the caller gave up",
        (
            _r("put", "late", probability=0.3, latency=0.4),
            _r("get", "late", probability=0.3, latency=0.4),
        ),
    ),
    Scenario(
        "crash",
        "the writer crashes on every 5th request",
        crash_actor="writer",
        crash_every=5,
        config={"max_restarts": 10},
    ),
    Scenario(
        "crash_loop",
        "the scheduler crashes on every request",
        crash_actor="scheduler",
        crash_every=1,
        closes=True,
        config={"max_restarts": 2},
    ),
    Scenario(
        "mix",
        "latency, partial puts and gets, errors, lies, corruption, late, together",
        (
            _r("*", "latency", latency=("uniform", 0, 0.01)),
            _r("put", "partial", probability=0.1),
            _r("get", "partial", probability=0.1),
            _r("*", "error", probability=0.05),
            _r("exists", "lie", probability=0.1),
            _r("get", "corrupt", probability=0.1),
            _r("put", "late", probability=0.1, latency=0.3),
            _r("put", "hang", probability=0.03),
        ),
    ),
)


@final
@dataclass
class ScenarioResult:
    """One scenario's outcome on one store."""

    name: str
    store: str
    requests: int
    blocks_written: int
    blocks_read: int
    verdicts: list[Verdict]
    overrun_max: float
    overrun_p99: float
    seconds: float

    @property
    def held(self) -> bool:
        """Whether every invariant held."""
        return all(v.held for v in self.verdicts)


@dataclass
class Workload:
    """Requests over a shared source cache: prompts with shared prefixes, unique tails."""

    source: KVCache
    requests: list[tuple[str, Any, Any, bool]]  # id, tokens, source block ids, partial

    @classmethod
    def build(cls, layout: CacheLayout, n: int, rng: random.Random, longest: int = 12) -> Workload:
        prompts = [
            (
                np.arange(p * 10**6, p * 10**6 + longest * BLOCK),
                list(range(p * longest, (p + 1) * longest)),
            )
            for p in range(3)
        ]
        next_id = 3 * longest
        requests = []
        for i in range(n):
            p = rng.randrange(3)
            shared = rng.randrange(0, longest // 2)
            own = rng.randrange(1, longest - shared)
            partial = i % 3 == 2
            tail = np.arange(
                10**8 + i * 10**4, 10**8 + i * 10**4 + own * BLOCK - (2 if partial else 0)
            )
            tokens = np.concatenate([prompts[p][0][: shared * BLOCK], tail])
            ids = prompts[p][1][:shared] + list(range(next_id, next_id + own))
            next_id += own
            requests.append((f"req-{i}", tokens, np.array(ids), partial))
        source = create_kv_cache(layout, next_id)
        data = np.random.default_rng(rng.randrange(2**32))
        for rows in source.byte_rows:
            rows[:] = data.integers(0, 256, rows.shape, dtype=np.uint8)
        return cls(source, requests)


class _Crash(PipelineHooks):
    def __init__(self, actor: str, victims: set[str]) -> None:
        self.actor, self.victims = actor, victims

    def on_message(self, actor: str, request_id: str) -> None:
        if actor == self.actor and request_id in self.victims:
            raise RuntimeError(f"injected crash of {actor} on {request_id}")


async def fetch_values(
    store: StorageBackend, scope: Any, keys: Sequence[str], nbytes: int
) -> dict[str, bytes]:
    """Read ``keys`` straight from ``store`` (the truth behind a faulty store)."""
    out: dict[str, bytes] = {}
    pool = StagingPool(nbytes, 64)
    async with ThreadRunner() as runner:
        await store.register_staging(pool.buffer.data.cast("B"))
        try:
            for lo in range(0, len(keys), 64):
                chunk = list(dict.fromkeys(keys[lo : lo + 64]))
                lease = await pool.acquire(len(chunk))
                try:
                    batch = GetBatch(
                        scope,
                        "checker",
                        chunk,
                        0,
                        np.arange(BLOCK),
                        lease=lease,
                        value_nbytes=nbytes,
                        runner=runner,
                        limiter=None,
                    )
                    for key, status, i in zip(
                        chunk, await store.get_blocks(batch), range(len(chunk)), strict=True
                    ):
                        if status.value == "ok":
                            out[key] = pool.slot(lease.slots[i]).tobytes()
                finally:
                    lease.release()
        finally:
            await store.unregister_staging(pool.buffer.data.cast("B"))
    return out


async def run_workload(
    inner: StorageBackend,
    plan: FaultPlan,
    config: PipelineConfig,
    *,
    requests: int = 24,
    concurrency: int = 6,
    seed: int = 0,
    hooks: PipelineHooks | None = None,
    victims: frozenset[str] = frozenset(),
    slack: float | None = None,
    layout: CacheLayout | None = None,
) -> tuple[Checker, int, int, bool]:
    """Write then read every request under ``plan``; returns the judged checker, blocks
    written and read, and whether the pipeline closed."""
    layout = layout or CacheLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BLOCK)
    work = Workload.build(layout, requests, random.Random(seed))
    total = sum(len(ids) for _, _, ids, _ in work.requests)
    dest = create_kv_cache(layout, total)
    destinations: dict[str, KVCache] = {}
    checker_slack = config.deadline_slack + 0.15 if slack is None else slack
    written = read = 0
    async with FaultyStore(inner, plan) as store:
        # Writes come from the source cache; reads go into another cache, through a second
        # pipeline over the same store (as a decode instance would).
        async with (
            open_pipeline(work.source, store, config=config, hooks=hooks) as pipe,
            open_pipeline(dest, store, config=config, hooks=hooks) as reader,
        ):
            checker = Checker(work.source, pipe.scope, checker_slack)
            limiter = anyio.Semaphore(concurrency)
            offset = [0]

            async def one(rid: str, tokens: Any, ids: Any, partial: bool) -> None:
                nonlocal written, read
                async with limiter:
                    dst = np.arange(offset[0], offset[0] + len(ids))
                    offset[0] += len(ids)
                    for kind in ("write", "read"):
                        o = Outcome(
                            kind,
                            rid,
                            tokens,
                            ids,
                            partial,
                            0,
                            0.0,
                            config.total_timeout,
                            dst_ids=dst,
                            crash_expected=rid in victims,
                        )
                        t0 = o.started = anyio.current_time()
                        try:
                            if kind == "write":
                                o.result = await pipe.write(
                                    tokens, ids, include_partial=partial, request_id=rid
                                )
                                written += o.result.written
                            else:
                                o.result = await reader.read(
                                    tokens, dst, include_partial=partial, request_id=rid
                                )
                                read += o.result.loaded
                                destinations[rid] = dest
                        except KVPipeError as exc:
                            o.error = exc
                        o.elapsed = anyio.current_time() - t0
                        checker.outcomes.append(o)

            async def sampler() -> None:
                while True:
                    checker.sample(pipe.statistics())
                    checker.sample(reader.statistics())
                    await anyio.sleep(0.01)

            async with anyio.create_task_group() as tg:
                tg.start_soon(sampler)
                async with anyio.create_task_group() as work_tg:
                    for rid, tokens, ids, partial in work.requests:
                        work_tg.start_soon(one, rid, tokens, ids, partial)
                tg.cancel_scope.cancel()
            with anyio.move_on_after(10):
                while store.background:  # noqa: ASYNC110 (late completions, no event)
                    await anyio.sleep(0.01)
            closed_by = {"write": pipe.closed, "read": reader.closed}
            crashes = {"write": pipe.crashes(), "read": reader.crashes()}
            closed = pipe.closed or reader.closed
        after = pipe.statistics()
        after_reader = reader.statistics()
        stored = await fetch_values(
            inner, pipe.scope, checker.counted_keys(), value_nbytes(layout.block_nbytes)
        )
        checker.check_stored(store, stored)
        checker.check_prefix(store)
        checker.check_staging(store)
        checker.check_idle(after, config.queue_depth)
        checker.check_idle(after_reader, config.queue_depth)
        checker.check_loaded(destinations)
        checker.check_crashes(closed_by, crashes)
    return checker, written, read, closed


async def run_scenario(
    scenario: Scenario,
    make_store: Callable[[str], Any],
    store_name: str,
    seed: int = 0,
) -> ScenarioResult:
    """Run one scenario over a fresh store from ``make_store(scenario.name)`` (an async
    context manager yielding the inner store)."""
    started = anyio.current_time()
    config = PipelineConfig(**{**FAST, "slice_block_num": 4, **scenario.config})
    plan = FaultPlan(seed, scenario.rules)
    victims: frozenset[str] = frozenset()
    hooks = None
    if scenario.crash_actor:
        victims = frozenset(f"req-{i}" for i in range(0, scenario.requests, scenario.crash_every))
        hooks = _Crash(
            scenario.crash_actor,
            set(victims) if not scenario.closes else {f"req-{i}" for i in range(scenario.requests)},
        )
        if scenario.closes:
            victims = frozenset(f"req-{i}" for i in range(scenario.requests))
    async with make_store(scenario.name) as inner:
        checker, written, read, closed = await run_workload(
            inner,
            plan,
            config,
            requests=scenario.requests,
            concurrency=scenario.concurrency,
            seed=seed,
            hooks=hooks,
            victims=victims,
        )
    if scenario.closes and not closed:
        checker.verdicts["crash"].fail("the crash loop did not close the pipeline")
    overrun_max, overrun_p99 = checker.check_deadlines()
    return ScenarioResult(
        scenario.name,
        store_name,
        scenario.requests,
        written,
        read,
        checker.results(),
        overrun_max,
        overrun_p99,
        anyio.current_time() - started,
    )


@asynccontextmanager
async def memory_store(_: str) -> AsyncIterator[StorageBackend]:
    """A fresh :class:`~kvpipe.MemoryStore` per scenario."""
    from ..backends import MemoryStore

    yield MemoryStore()
