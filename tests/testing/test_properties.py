"""Random fault plans × random request shapes keep every invariant (hypothesis, virtual time).

Everything runs in the event loop here (the memory store and small copies never use threads),
so trio's MockClock makes hangs and timeouts free: a CI run of 40 examples takes seconds. For
a longer run: ``KVPIPE_HYPOTHESIS_EXAMPLES=2000 pytest tests/testing/test_properties.py``.
"""

from __future__ import annotations

import os

import pytest
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvpipe
from kvpipe.testing.faults import FaultPlan, FaultRule
from kvpipe.testing.scenarios import run_workload

EXAMPLES = int(os.environ.get("KVPIPE_HYPOTHESIS_EXAMPLES", "40"))


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


rules = st.builds(
    FaultRule,
    op=st.sampled_from(["put", "get", "exists", "*"]),
    kind=st.sampled_from(["latency", "hang", "error", "partial", "lie", "corrupt", "late"]),
    probability=st.floats(0.0, 0.4),
    blocks=st.floats(0.1, 1.0),
    latency=st.one_of(
        st.floats(0.0, 3.0), st.tuples(st.just("uniform"), st.just(0.0), st.floats(0.0, 3.0))
    ),
)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    plan_rules=st.lists(rules, max_size=4),
    seed=st.integers(0, 10_000),
    requests=st.integers(3, 14),
    concurrency=st.integers(1, 6),
    slice_blocks=st.integers(1, 6),
    slice_timeout=st.floats(0.5, 4.0),
    total_timeout=st.floats(1.0, 10.0),
)
async def test_random_faults_and_shapes_keep_every_invariant(
    anyio_backend: object,
    plan_rules: list[FaultRule],
    seed: int,
    requests: int,
    concurrency: int,
    slice_blocks: int,
    slice_timeout: float,
    total_timeout: float,
) -> None:
    config = kvpipe.PipelineConfig(
        slice_block_num=slice_blocks,
        slice_timeout=slice_timeout,
        total_timeout=total_timeout,
        lookup_timeout=total_timeout,
    )
    checker, _, _, _ = await run_workload(
        kvpipe.MemoryStore(),
        FaultPlan(seed, tuple(plan_rules)),
        config,
        requests=requests,
        concurrency=concurrency,
        seed=seed,
        slack=config.deadline_slack + 1e-6,
    )
    checker.check_deadlines()
    assert {v.name: v.details for v in checker.results() if not v.held} == {}
