"""The supervisor alone, in virtual time: one-for-one restarts and intensity."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest
import trio.testing

from kvpipe.actors import Actor, ChildSpec, Metrics, PipelineHooks, Supervisor
from kvpipe.actors._state import CallState, RequestState


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class Boom(Actor[RequestState]):
    """Crashes on every message whose id starts with 'crash'."""

    name = "boom"

    @staticmethod
    def state_of(msg: RequestState) -> RequestState:
        return msg

    async def handle(self, msg: RequestState) -> None:
        if msg.request_id.startswith("crash"):
            raise RuntimeError(msg.request_id)
        await anyio.sleep(1)
        msg.fail(KeyError("handled"))  # marks it done so the test can see it was handled


def _state(rid: str) -> RequestState:
    now = anyio.current_time()
    return CallState(rid, now + 100, now, "lookup", np.arange(4), False)


async def _run(
    max_restarts: int, window: float, messages: list[tuple[float, str]]
) -> tuple[list[RequestState], Metrics, list[str]]:
    send, recv = anyio.create_memory_object_stream[Any](16)
    metrics = Metrics()
    escalated: list[str] = []
    ctx = SimpleNamespace(hooks=PipelineHooks())
    sup = Supervisor(
        [ChildSpec("boom", lambda: Boom(ctx, recv))],  # type: ignore[arg-type]
        max_restarts=max_restarts,
        window=window,
        metrics=metrics,
        on_escalate=lambda name, exc: escalated.append(f"{name}:{exc}"),
    )
    states = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        for delay, rid in messages:
            await anyio.sleep(delay)
            st = _state(rid)
            states.append(st)
            await send.send(st)
        await anyio.sleep(5)
        send.close()
    recv.close()
    return states, metrics, escalated


async def test_a_crash_fails_the_held_requests_and_the_actor_goes_on() -> None:
    states, metrics, escalated = await _run(3, 60, [(0, "slow"), (0.1, "crash-1"), (0.1, "after")])
    slow, crash, after = states
    assert "crash-1" in str(crash.error) and crash.error.__class__.__name__ == "ActorCrashed"
    # 'slow' was in the actor's hands when it crashed: failed too, never left hanging
    assert slow.error is not None and slow.error.__class__.__name__ == "ActorCrashed"
    assert isinstance(after.error, KeyError)  # handled normally by the restarted actor
    assert metrics.restarts == {"boom": 1} and escalated == []


async def test_crashes_spread_over_more_than_the_window_do_not_escalate() -> None:
    msgs = [(0, "crash-a"), (40, "crash-b"), (40, "crash-c"), (40, "crash-d")]
    _, metrics, escalated = await _run(2, 60, msgs)
    assert metrics.restarts == {"boom": 4} and escalated == []


async def test_too_many_crashes_within_the_window_escalate() -> None:
    msgs = [(0, "crash-a"), (10, "crash-b"), (10, "crash-c")]
    _states, metrics, escalated = await _run(2, 60, msgs)
    assert len(escalated) == 1 and escalated[0].startswith("boom:")
    assert metrics.restarts == {"boom": 2}  # the third crash closes instead of restarting


async def test_a_crash_exactly_the_window_ago_still_counts() -> None:
    """Crashes older than the window are forgotten, one exactly the window ago is not
    (docs/architecture.md, Supervision), whatever the clock reads: here the crashes come at
    0.1 s and 60.1 s, where ``60.1 - 60`` rounds above 0.1 and the first crash was dropped."""
    _, metrics, escalated = await _run(1, 60, [(0.1, "crash-a"), (60, "crash-b")])
    assert len(escalated) == 1 and metrics.restarts == {"boom": 1}
