"""FaultyStore and FaultPlan: faults as data, deterministic for a seed, recorded per call."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe.backends import BlockStatus
from kvpipe.testing import BackendConformance
from kvpipe.testing.faults import FaultPlan, FaultRule, FaultyStore


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def test_plans_load_from_json_and_toml_alike() -> None:
    as_json = json.dumps(
        {
            "seed": 7,
            "rules": [
                {"op": "put", "kind": "hang", "calls": [2, 5]},
                {
                    "op": "*",
                    "kind": "latency",
                    "latency": ["uniform", 0.0, 0.1],
                    "probability": 0.5,
                },
            ],
        }
    )
    as_toml = """
seed = 7
[[rules]]
op = "put"
kind = "hang"
calls = [2, 5]
[[rules]]
op = "*"
kind = "latency"
latency = ["uniform", 0.0, 0.1]
probability = 0.5
"""
    assert FaultPlan.load(as_json) == FaultPlan.load(as_toml, "toml")
    assert FaultPlan.load(as_json).rules[0].calls == (2, 5)


@pytest.mark.parametrize(
    "bad",
    [
        {"op": "put", "kind": "explode"},
        {"op": "nope", "kind": "hang"},
        {"op": "put", "kind": "latency", "latency": ["gauss", 1]},
        {"op": "put", "kind": "latency", "latency": -1},
        {"op": "put", "kind": "error", "error": "SystemExit"},
        {"op": "put", "kind": "partial", "probability": 2},
    ],
)
def test_bad_rules_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        FaultPlan.from_data({"rules": [bad]})


def test_the_same_seed_hits_the_same_calls() -> None:
    rule = FaultRule("put", "error", probability=0.3)
    for seed in (1, 2):
        plan = FaultPlan(seed, (rule,))
        first = [rule.hits("put", n, plan.rng("put", n)) for n in range(200)]
        again = [rule.hits("put", n, plan.rng("put", n)) for n in range(200)]
        assert first == again and 30 < sum(first) < 90
    a = [rule.hits("put", n, FaultPlan(1).rng("put", n)) for n in range(200)]
    b = [rule.hits("put", n, FaultPlan(2).rng("put", n)) for n in range(200)]
    assert a != b


class TestFaultyStoreWithoutFaultsConforms(BackendConformance):
    """With an empty plan the wrapper must be a faithful backend."""

    @pytest.fixture
    async def backend(self):  # type: ignore[no-untyped-def]
        async with FaultyStore(kvpipe.MemoryStore(), FaultPlan()) as store:
            yield store


async def test_partial_puts_never_delete_what_was_already_stored() -> None:
    suite = BackendConformance()
    inner = kvpipe.MemoryStore()
    plan = FaultPlan(3, (FaultRule("put", "partial", calls=(1,), blocks=1.0),))
    async with FaultyStore(inner, plan) as store, suite._batches(store) as b:
        keys, _ = b.keys(4)
        values = [bytes([i]) * b.pool.slot_nbytes for i in range(4)]
        assert await b.put(store, keys[:2], values[:2]) == [BlockStatus.OK] * 2
        statuses = await b.put(store, keys, values)  # call #1: every block "fails"
        assert statuses == [BlockStatus.FAILED] * 4
        assert sorted(inner.keys()) == sorted(keys[:2])  # the two stored before stay
        assert store.calls[1].outcome == "incomplete"


async def test_late_completion_keeps_the_staging_until_it_is_done() -> None:
    suite = BackendConformance()
    inner = kvpipe.MemoryStore()
    plan = FaultPlan(0, (FaultRule("put", "late", calls=(0,), latency=5.0),))
    async with FaultyStore(inner, plan) as store, suite._batches(store) as b:
        keys, _ = b.keys(2)
        values = [b"\x01" * b.pool.slot_nbytes, b"\x02" * b.pool.slot_nbytes]
        with anyio.move_on_after(1):
            await b.put(store, keys, values)
        assert b.pool.in_use == 2 and store.background == 1 and inner.keys() == []
        await anyio.sleep(10)
        assert b.pool.in_use == 0 and store.background == 0
        assert sorted(inner.keys()) == sorted(keys)  # it completed after the caller left
        call = store.calls[0]
        assert call.outcome == "cancelled" and call.late_digests == call.digests
        assert call.released == pytest.approx(5.0, abs=0.01)


async def test_corrupt_gets_flip_bytes_and_lies_invent_keys() -> None:
    suite = BackendConformance()
    plan = FaultPlan(
        0,
        (
            FaultRule("get", "corrupt", calls=(0,), blocks=1.0),
            FaultRule("exists", "lie", calls=(0,), blocks=1.0),
        ),
    )
    async with FaultyStore(kvpipe.MemoryStore(), plan) as store, suite._batches(store) as b:
        keys, _ = b.keys(3)
        values = [
            bytes(range(256)) * (b.pool.slot_nbytes // 256) + b"\0" * (b.pool.slot_nbytes % 256)
        ] * 3
        assert list(await store.exists(b.key_batch(keys))) == [True, True, True]  # a lie
        await b.put(store, keys, values)
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK] * 3
        assert all(g != v for g, v in zip(got, values, strict=True))
        assert [c.injected for c in store.calls if c.op == "get"] == [["corrupt"]]
    assert np.sum(np.frombuffer(got[0], np.uint8) != np.frombuffer(values[0], np.uint8)) == 1


async def test_swapped_gets_return_another_block_s_intact_value() -> None:
    suite = BackendConformance()
    plan = FaultPlan(0, (FaultRule("get", "swap", calls=(0,), blocks=1.0),))
    async with FaultyStore(kvpipe.MemoryStore(), plan) as store, suite._batches(store) as b:
        keys, _ = b.keys(3)
        values = [bytes([i + 1]) * b.pool.slot_nbytes for i in range(3)]
        await b.put(store, keys, values)
        statuses, got = await b.get(store, keys)
        assert statuses == [BlockStatus.OK] * 3
        for i, value in enumerate(got):  # each one whole, and another block's
            assert value in values and value != values[i]
        (call,) = (c for c in store.calls if c.op == "get")
        assert call.injected == ["swap"] and sorted(call.corrupted) == sorted(keys)
        # One block: nothing to swap with, so it comes back as stored.
        statuses, got = await b.get(store, keys[:1])
        assert statuses == [BlockStatus.OK] and got == values[:1]


# Real time: nothing here waits on a clock, and under trio's mock clock the loop spins while
# it waits for the file store's threads, which then crawl (25-31 s a run instead of ~1 s).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("inner", ["memory", "file"])
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_partial_puts_keep_the_visibility_contract(
    inner: str, seed: int, tmp_path: Path
) -> None:
    """With half of its puts partial the wrapper still publishes exactly what it reports
    OK and never takes a block back (the conformance suite's two visibility checks; the file
    store's worker threads leave other tasks room to look while a put is in flight)."""
    suite = BackendConformance()
    plan = FaultPlan(seed, (FaultRule("put", "partial", probability=0.5, blocks=0.4),))
    async with (
        kvpipe.MemoryStore() if inner == "memory" else kvpipe.FileStore(tmp_path) as truth,
        FaultyStore(truth, plan) as store,
    ):
        await suite.test_a_block_not_reported_ok_is_never_visible(store)
        await suite.test_a_published_block_stays_until_deleted(store)
        assert any(c.outcome == "incomplete" for c in store.calls if c.op == "put")


async def test_a_late_partial_put_stores_only_what_it_reports_ok() -> None:
    suite = BackendConformance()
    inner = kvpipe.MemoryStore()
    plan = FaultPlan(
        0,
        (
            FaultRule("put", "partial", calls=(0,), blocks=0.3),  # seed 0: block 2 of 4
            FaultRule("put", "late", calls=(0,), latency=5.0),
        ),
    )
    async with FaultyStore(inner, plan) as store, suite._batches(store) as b:
        keys, _ = b.keys(4)
        values = [bytes([i]) * b.pool.slot_nbytes for i in range(4)]
        with anyio.move_on_after(1):
            await b.put(store, keys, values)
        assert inner.keys() == [] and b.pool.in_use == 4
        await anyio.sleep(10)  # the late put finished after its caller left
        assert sorted(inner.keys()) == sorted([keys[0], keys[1], keys[3]])
        assert b.pool.in_use == 0 and store.calls[0].outcome == "cancelled"
        statuses = await b.put(store, keys, values)  # call #1: no fault
        assert statuses == [BlockStatus.OK] * 4
