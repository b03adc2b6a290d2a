"""Prometheus metrics: after a known workload the page holds exactly the known numbers.

Runs in virtual time (trio's MockClock), so the injected slice timeout costs nothing.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import trio.testing
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import kvpipe
from kvpipe.actors import ObservationKind
from tests.fakes import Act, CrashHooks, ScriptedStore
from tests.helpers import fill_random

BS = 16
LAYOUT = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=BS)
CONFIG = kvpipe.PipelineConfig(slice_block_num=4, slice_timeout=1.0, staging_bytes=1 << 20)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


def parse(page: bytes) -> Samples:
    """Every sample of a metrics page, by name and label set."""
    out: Samples = {}
    for family in text_string_to_metric_families(page.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample ``name`` with these labels (pipeline/backend of the test added)."""
    key = (name, frozenset({"pipeline": "test/0", "backend": "scripted", **labels}.items()))
    assert key in samples, f"no sample {name}{labels}"
    return samples[key]


def _series(samples: Samples) -> set[tuple[str, str, str]]:
    """(name, op, outcome) of every sample that has an op and an outcome."""
    out = set()
    for name, labels in samples:
        d = dict(labels)
        if "op" in d:
            out.add((name, d["op"], d["outcome"]))
    return out


def tokens(seed: int, blocks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, size=blocks * BS)


def _cache() -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, 128)
    fill_random(cache)
    return cache


async def test_counters_and_histograms_hold_the_known_numbers() -> None:
    # puts, in order: A 0-2, B 3-4, C 5 (hangs: slice timeout). D's first slice never
    # reaches the store: the writer crashes on it (injected).
    store = ScriptedStore(puts={5: Act(hang=True)})
    hooks = CrashHooks("writer", ["D"])
    a, b, c, d = tokens(1, 12), tokens(2, 8), tokens(3, 8), tokens(4, 4)
    async with kvpipe.open_pipeline(
        _cache(), store, config=CONFIG, namespace="test", hooks=hooks
    ) as pipe:
        metrics = kvpipe.PipelineMetrics(pipe)
        assert (await pipe.write(a, np.arange(12), request_id="A")).written == 12
        assert (await pipe.write(b, np.arange(12, 20), request_id="B")).written == 8
        again = await pipe.write(a, np.arange(12), request_id="A2")
        assert (again.skipped, again.written) == (12, 0)
        timed_out = await pipe.write(c, np.arange(20, 28), request_id="C")
        assert (timed_out.stop_reason, timed_out.written) == ("slice_timeout", 0)
        crashed = await pipe.write(d, np.arange(28, 32), request_id="D")
        assert crashed.stop_reason == "actor_crashed"
        assert (await pipe.read(a, np.arange(40, 52))).loaded == 12
        assert (await pipe.read(tokens(9, 2), np.arange(60, 62))).stop_reason == "not_stored"
        assert await pipe.lookup(b) == 8
        stats = pipe.statistics()
    s = parse(generate_latest(metrics.registry))
    nbytes = LAYOUT.block_nbytes
    assert value(s, "kvpipe_blocks_written_total") == 20
    assert value(s, "kvpipe_bytes_written_total") == 20 * nbytes
    assert value(s, "kvpipe_blocks_skipped_total") == 12
    assert value(s, "kvpipe_blocks_read_total") == 12
    assert value(s, "kvpipe_bytes_read_total") == 12 * nbytes
    for op, outcome, n in [
        ("write", "complete", 5),
        ("write", "slice_timeout", 1),
        ("write", "incomplete", 0),
        ("read", "complete", 3),
        ("read", "incomplete", 0),
    ]:
        assert value(s, "kvpipe_slices_total", op=op, outcome=outcome) == n
        if n:
            assert value(s, "kvpipe_slice_seconds_count", op=op, outcome=outcome) == n
        else:  # a histogram series exists only once observed
            assert ("kvpipe_slice_seconds_count", op, outcome) not in _series(s)
    assert value(s, "kvpipe_timeouts_total", op="write", outcome="slice_timeout") == 1
    assert value(s, "kvpipe_timeouts_total", op="write", outcome="total_timeout") == 0
    assert value(s, "kvpipe_timeouts_total", op="read", outcome="slice_timeout") == 0
    assert value(s, "kvpipe_restarts_total", actor="writer") == 1
    assert value(s, "kvpipe_restarts_total", actor="reader") == 0
    # The timed-out slice took exactly slice_timeout (virtual time).
    assert value(s, "kvpipe_slice_seconds_sum", op="write", outcome="slice_timeout") == 1.0
    requests = {
        ("write", "complete"): 3,
        ("write", "slice_timeout"): 1,
        ("write", "actor_crashed"): 1,
        ("read", "complete"): 1,
        ("read", "not_stored"): 1,
        ("lookup", "ok"): 1,
    }
    for (op, outcome), n in requests.items():
        assert value(s, "kvpipe_request_seconds_count", op=op, outcome=outcome) == n
    counted = {
        (dict(labels)["op"], dict(labels)["outcome"]): v
        for (name, labels), v in s.items()
        if name == "kvpipe_request_seconds_count"
    }
    assert counted == requests  # and nothing else
    # Gauges after the pipeline closed: nothing in flight, no staging held.
    assert value(s, "kvpipe_open") == 0
    assert value(s, "kvpipe_staging_in_use_bytes") == 0
    assert value(s, "kvpipe_staging_capacity_bytes") == stats.staging_capacity_bytes > 0
    assert value(s, "kvpipe_in_flight_requests", kind="write") == 0
    assert value(s, "kvpipe_queue_depth", actor="writer") == 0
    assert value(s, "kvpipe_queue_capacity") == CONFIG.queue_depth
    assert value(s, "kvpipe_slice_blocks") == 4


async def test_gauges_while_a_write_is_in_flight() -> None:
    store = ScriptedStore(puts={0: Act(delay=0.5)})
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG, namespace="test") as pipe:
        metrics = kvpipe.PipelineMetrics(pipe)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pipe.write, tokens(1, 8), np.arange(8))
            await store.wait_calls("put")
            s = parse(metrics.exposition()[0])
            assert value(s, "kvpipe_in_flight_requests", kind="write") == 1
            in_use = value(s, "kvpipe_staging_in_use_bytes")
            assert in_use == pipe.statistics().staging_in_use_bytes > 0
            assert value(s, "kvpipe_open") == 1
    s = parse(metrics.exposition()[0])
    assert value(s, "kvpipe_in_flight_requests", kind="write") == 0
    assert value(s, "kvpipe_blocks_written_total") == 8


async def test_one_registry_many_pipelines_and_removal() -> None:
    registry = CollectorRegistry()
    store = kvpipe.MemoryStore()
    async with (
        kvpipe.open_pipeline(
            _cache(), store, config=CONFIG, namespace="m", rank=0, world_size=2
        ) as p0,
        kvpipe.open_pipeline(
            _cache(), store, config=CONFIG, namespace="m", rank=1, world_size=2
        ) as p1,
    ):
        metrics = kvpipe.PipelineMetrics([p0, p1], registry=registry)
        with pytest.raises(ValueError):  # the names are taken in this registry
            kvpipe.PipelineMetrics(registry=registry)
        await p0.write(tokens(1, 4), np.arange(4))
        await p1.write(tokens(1, 8), np.arange(8))
        page = generate_latest(registry).decode()
        assert 'kvpipe_blocks_written_total{backend="memory",pipeline="m/0"} 4.0' in page
        assert 'kvpipe_blocks_written_total{backend="memory",pipeline="m/1"} 8.0' in page
        # the store's own statistics, as each pipeline sees it (one store, both ranks' blocks)
        assert 'statistic="blocks"} 12.0' in page
        metrics.remove(p1)
        await p1.write(tokens(2, 4), np.arange(4))  # no longer observed
        page = generate_latest(registry).decode()
        assert 'pipeline="m/1"' not in page and 'pipeline="m/0"' in page
        metrics.close()
        assert generate_latest(registry) == b""


class _Other:
    """Not a pipeline."""

    def __init__(self, pipe: kvpipe.Pipeline) -> None:
        self.pipe = pipe


async def test_labels_from_a_mapping_and_clashes() -> None:
    store = kvpipe.MemoryStore()
    async with (
        kvpipe.open_pipeline(_cache(), store, config=CONFIG) as p0,
        kvpipe.open_pipeline(_cache(), store, config=CONFIG) as p1,
    ):
        with pytest.raises(kvpipe.ConfigError, match="pipeline='default/0'"):
            kvpipe.PipelineMetrics([p0, p1])  # both default/0
        metrics = kvpipe.PipelineMetrics({"prefill": p0, "decode": p1})
        page = metrics.exposition()[0].decode()
        assert 'pipeline="prefill"' in page and 'pipeline="decode"' in page
        with pytest.raises(kvpipe.ConfigError):
            metrics.add(_Other(p0), label="x")  # type: ignore[arg-type]
        metrics.add(p0)  # already exported: nothing to do
        metrics.add(p0, label="prefill")
        with pytest.raises(kvpipe.ConfigError, match="already exported as pipeline='prefill'"):
            metrics.add(p0, label="renamed")  # was ignored: still exported as prefill


async def test_a_refused_constructor_leaves_nothing_registered_or_attached() -> None:
    # PipelineMetrics([p0, p1]) with a label clash on a shared registry: the half-built
    # collector stayed registered (the next PipelineMetrics on that registry was refused as
    # duplicated, and the page kept exporting p0) and p0 kept its observer.
    registry = CollectorRegistry()
    store = kvpipe.MemoryStore()
    async with (
        kvpipe.open_pipeline(_cache(), store, config=CONFIG) as p0,
        kvpipe.open_pipeline(_cache(), store, config=CONFIG) as p1,
    ):
        with pytest.raises(kvpipe.ConfigError, match="pipeline='default/0'"):
            kvpipe.PipelineMetrics([p0, p1], registry=registry)  # both default/0
        assert generate_latest(registry) == b""
        assert p0._runtime.observers.active == ()
        metrics = kvpipe.PipelineMetrics({"prefill": p0}, registry=registry)
        assert 'pipeline="prefill"' in metrics.exposition()[0].decode()
        assert len(p0._runtime.observers.active) == 1


async def test_observer_sees_every_call_and_its_errors_are_contained() -> None:
    seen: list[tuple[ObservationKind, str]] = []

    def observer(kind: ObservationKind, seconds: float, outcome: str) -> None:
        assert seconds >= 0
        seen.append((kind, outcome))

    def broken(kind: ObservationKind, seconds: float, outcome: str) -> None:
        raise RuntimeError("observer bug")

    async with kvpipe.open_pipeline(
        _cache(), kvpipe.MemoryStore(), config=CONFIG, observer=observer
    ) as pipe:
        pipe.add_observer(broken)
        t = tokens(1, 6)
        assert (await pipe.write(t, np.arange(6))).complete
        await pipe.flush_index(t)
        await pipe.locate(t)
        pipe.remove_observer(broken)
        assert (await pipe.read(t, np.arange(10, 16))).complete
        # the broken one raised for 2 write slices, the write, the flush and the locate
        assert pipe.statistics().counters["observer_errors"] == 5
    assert seen == [
        ("write_slice", "complete"),
        ("write_slice", "complete"),
        ("write", "complete"),
        ("flush", "ok"),
        ("locate", "ok"),
        ("read_slice", "complete"),
        ("read_slice", "complete"),
        ("read", "complete"),
    ]


async def test_a_closed_pipeline_keeps_its_statistics() -> None:
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), config=CONFIG) as pipe:
        await pipe.write(tokens(1, 4), np.arange(4))
    stats = pipe.statistics()
    assert not stats.open and stats.counters["blocks_written"] == 4
    assert stats.slices == {"complete": 1}


async def test_closing_twice_is_harmless() -> None:
    # The second close raised a bare KeyError from the registry (a shutdown path that
    # closes in a finally and again at exit).
    registry = CollectorRegistry()
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), config=CONFIG) as pipe:
        metrics = kvpipe.PipelineMetrics(pipe, registry=registry)
        metrics.close()
        metrics.close()
        assert generate_latest(registry) == b""
        assert pipe._runtime.observers.active == ()


async def test_closed_calls_are_observed_as_closed() -> None:
    seen: list[tuple[ObservationKind, str]] = []
    async with kvpipe.open_pipeline(
        _cache(),
        kvpipe.MemoryStore(),
        config=CONFIG,
        observer=lambda k, s, o: seen.append((k, o)),
    ) as pipe:
        pass
    with pytest.raises(kvpipe.PipelineClosed):
        await pipe.lookup(tokens(1, 1))
    assert seen == []  # refused before it was accepted: not a call that ran


def test_without_prometheus_client_it_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(kvpipe.Unsupported, match=r"kvpipe\[metrics\]"):
        kvpipe.PipelineMetrics()


def test_importing_kvpipe_does_not_import_prometheus_client() -> None:
    code = "import sys, kvpipe; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_a_scrape_while_the_pipeline_closes_reads_each_part_once() -> None:
    # An exporter thread scraping while the event loop closed the pipeline could read the
    # staging pool, the worker runner or the inboxes as present and, a moment later, as the
    # None that release() left: statistics() raised AttributeError ('NoneType' object has no
    # attribute 'stride'), and the whole /metrics page failed. Here every such attribute is
    # present at its first read and gone at any later one, as if release() ran in between.
    async with kvpipe.open_pipeline(_cache(), kvpipe.MemoryStore(), config=CONFIG) as pipe:
        metrics = kvpipe.PipelineMetrics(pipe)
        runtime = pipe._runtime
        live = {name: getattr(runtime, name) for name in ("_pool", "_runner", "_inboxes")}

        def released_after_first_read(name: str) -> property:
            def get(self: object) -> object:
                return live.pop(name, None)

            return property(get)

        real = type(runtime)
        runtime.__class__ = type(
            "Releasing", (real,), {n: released_after_first_read(n) for n in list(live)}
        )
        try:
            samples = parse(metrics.exposition()[0])
        finally:
            runtime.__class__ = real
        labels = frozenset({"pipeline": "default/0", "backend": "memory"}.items())
        assert samples[("kvpipe_staging_capacity_bytes", labels)] > 0
        assert samples[("kvpipe_staging_in_use_bytes", labels)] == 0
        metrics.close()


async def test_blocks_read_counts_what_the_reads_results_count() -> None:
    """A host read of two slices fetched at once: the second is placed in the cache while the
    first is still being fetched, then the first fails at its first block, so the read loads
    nothing (``loaded`` is a leading run). ``blocks_read`` counted the second slice's four
    blocks all the same: the metrics reported blocks read that no result counts."""
    store = ScriptedStore(gets={0: Act(delay=0.5, fail=[0])})
    seq = tokens(5, 8)
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        assert (await pipe.write(seq, np.arange(8))).written == 8
        r = await pipe.read(seq, np.arange(40, 48))
        assert (r.loaded, r.stop_reason) == (0, "failed_block")
        assert [c.first_block for c in store.calls_of("get")] == [0, 4]
        assert all(c.finished for c in store.calls_of("get"))  # both slices were fetched
        assert (await pipe.read(seq[: 4 * BS], np.arange(50, 54))).loaded == 4
        counters = pipe.statistics().counters
    assert counters["blocks_read"] == 4
    assert counters["bytes_read"] == 4 * LAYOUT.block_nbytes


async def test_a_block_that_fails_verification_once_is_counted_failed() -> None:
    """A block damaged in transit fails verification, is fetched again and then passes: the
    read loads it. ``blocks_failed_verify`` ("fetched blocks that failed verification", the
    counter the docs say to alert on) stayed 0: it counted only blocks still failing when
    loading stopped, so corruption on the way from the store never showed in it."""
    store = ScriptedStore(gets={0: Act(corrupt=[1])})
    seq = tokens(6, 4)
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG, namespace="test") as pipe:
        metrics = kvpipe.PipelineMetrics(pipe)
        assert (await pipe.write(seq, np.arange(4))).written == 4
        assert (await pipe.read(seq, np.arange(40, 44))).loaded == 4
        assert len(store.calls_of("get")) == 2  # fetched again from the damaged block on
        counters = pipe.statistics().counters
    assert counters["blocks_failed_verify"] == 1
    assert counters.get("corrupt_blocks_deleted", 0) == 0  # a good stored block: kept
    s = parse(metrics.exposition()[0])
    assert value(s, "kvpipe_blocks_failed_verify_total") == 1


async def test_a_block_that_fails_verification_then_is_gone_is_counted_failed() -> None:
    """A block fails verification and, fetched again, the store fails it: loading stops
    there. Its failed check was not counted (the count looked only at the second fetch,
    which had nothing to check)."""
    store = ScriptedStore(gets={0: Act(corrupt=[1]), 1: Act(fail=[0])})
    seq = tokens(7, 4)
    async with kvpipe.open_pipeline(_cache(), store, config=CONFIG) as pipe:
        assert (await pipe.write(seq, np.arange(4))).written == 4
        r = await pipe.read(seq, np.arange(40, 44))
        assert (r.loaded, r.stop_reason) == (1, "failed_block")
        counters = pipe.statistics().counters
    assert counters["blocks_failed_verify"] == 1
