"""The supervisor alone, in virtual time: one-for-one restarts and intensity."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest
import trio.testing

from kvpipe._errors import ActorCrashed
from kvpipe.actors import Actor, ChildSpec, Metrics, PipelineHooks, Supervisor
from kvpipe.actors._state import CallState, RequestState


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, object]]:
    return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})


class Boom(Actor[RequestState]):
    """Crashes on every message whose id starts with 'crash'."""

    name = "boom"

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


class _Gated(Actor[RequestState]):
    """Holds each message until ``ctx.go`` is set, then crashes on those whose id starts with
    'crash' and holds the others for good."""

    name = "gated"

    async def handle(self, msg: RequestState) -> None:
        await self.ctx.go.wait()  # type: ignore[attr-defined]
        if msg.request_id.startswith("crash"):
            raise RuntimeError(msg.request_id)
        await anyio.sleep_forever()


class _Counted(CallState):
    """A lookup that records every ending it is given (the first one wins)."""

    def __init__(self, rid: str, endings: dict[str, list[BaseException]]) -> None:
        now = anyio.current_time()
        super().__init__(rid, now + 100, now, "lookup", np.arange(4), False)
        self._endings = endings

    def fail(self, error: BaseException) -> None:
        self._endings.setdefault(self.request_id, []).append(error)
        super().fail(error)


async def test_two_actors_crashing_in_the_same_step_each_fail_their_own_requests() -> None:
    """Actors ``a`` and ``b`` crash in the same step of the loop, each holding two requests:
    each request is failed once, naming its own actor, each actor is restarted once (its own
    budget), and nothing escalates."""
    go = anyio.Event()
    ctx = SimpleNamespace(hooks=PipelineHooks(), go=go)
    send_a, recv_a = anyio.create_memory_object_stream[Any](4)
    send_b, recv_b = anyio.create_memory_object_stream[Any](4)
    metrics, escalated = Metrics(), []
    sup = Supervisor(
        [
            ChildSpec("a", lambda: _Gated(ctx, recv_a)),  # type: ignore[arg-type]
            ChildSpec("b", lambda: _Gated(ctx, recv_b)),  # type: ignore[arg-type]
        ],
        max_restarts=1,
        window=60,
        metrics=metrics,
        on_escalate=lambda name, exc: escalated.append(name),
    )
    endings: dict[str, list[BaseException]] = {}
    states = [_Counted(rid, endings) for rid in ("held-a", "crash-a", "held-b", "crash-b")]
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        for st in states:
            await (send_a if st.request_id.endswith("a") else send_b).send(st)
        await anyio.sleep(1)  # both actors hold both of their requests
        go.set()  # both crash in the same step
        await anyio.sleep(1)
        assert metrics.restarts == {"a": 1, "b": 1} and escalated == []
        send_a.close()
        send_b.close()
    recv_a.close()
    recv_b.close()
    for st in states:
        (error,) = endings[st.request_id]
        assert isinstance(error, ActorCrashed) and error.actor == st.request_id[-1]
    assert sorted((c.actor, c.request_ids) for c in metrics.crashes) == [
        ("a", ("held-a", "crash-a")),
        ("b", ("held-b", "crash-b")),
    ]


async def test_the_restart_budget_is_each_actors_own_over_its_own_window() -> None:
    """Crashes spread over two actors and over time: ``a`` crashing at 0 and 50 s and ``b``
    at 10 s and 40 s (four crashes within 60 s in all) escalate nothing with two restarts
    allowed each; ``a`` crashing a third time at 55 s (three within its window) escalates
    ``a`` alone; ``b``, crashing at 71 s (its crash at 10 s forgotten), is restarted."""
    ctx = SimpleNamespace(hooks=PipelineHooks())
    send_a, recv_a = anyio.create_memory_object_stream[Any](4)
    send_b, recv_b = anyio.create_memory_object_stream[Any](4)
    metrics, escalated = Metrics(), []
    sup = Supervisor(
        [
            ChildSpec("a", lambda: Boom(ctx, recv_a)),  # type: ignore[arg-type]
            ChildSpec("b", lambda: Boom(ctx, recv_b)),  # type: ignore[arg-type]
        ],
        max_restarts=2,
        window=60,
        metrics=metrics,
        on_escalate=lambda name, exc: escalated.append(name),
    )
    plan = [(0, "a"), (10, "b"), (40, "b"), (50, "a")]
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        start = anyio.current_time()
        for at, who in plan:
            await anyio.sleep_until(start + at)
            await (send_a if who == "a" else send_b).send(_state(f"crash-{who}{at}"))
        await anyio.sleep_until(start + 52)
        assert metrics.restarts == {"a": 2, "b": 2} and escalated == []
        await send_a.send(_state("crash-a55"))
        await anyio.sleep_until(start + 56)
        assert escalated == ["a"] and metrics.restarts == {"a": 2, "b": 2}
        await anyio.sleep_until(start + 71)
        await send_b.send(_state("crash-b71"))  # b's crash at 10 s has left its window
        await anyio.sleep(1)
        assert escalated == ["a"] and metrics.restarts == {"a": 2, "b": 3}
        send_a.close()
        send_b.close()
    recv_a.close()
    recv_b.close()


async def test_an_actor_crashing_once_closed_lets_go_of_its_inbox_and_is_not_restarted() -> None:
    """Once the pipeline has closed (:meth:`Supervisor.close`), a crash restarts nothing and
    escalates nothing (``max_restarts`` is 1 and the actor crashes twice); what waits in the
    inbox is discarded (its staging let go of), not handled and not left there."""
    discarded: list[str] = []

    class Discarding(Boom):
        def discard(self, msg: RequestState) -> None:
            discarded.append(msg.request_id)

    ctx = SimpleNamespace(hooks=PipelineHooks())
    send, recv = anyio.create_memory_object_stream[Any](8)
    metrics, escalated = Metrics(), []
    sup = Supervisor(
        [ChildSpec("boom", lambda: Discarding(ctx, recv))],  # type: ignore[arg-type]
        max_restarts=1,
        window=60,
        metrics=metrics,
        on_escalate=lambda name, exc: escalated.append(name),
    )
    states = [_state(rid) for rid in ("crash-a", "crash-b", "queued")]
    async with anyio.create_task_group() as tg:
        tg.start_soon(sup.run)
        await send.send(states[0])
        await anyio.sleep(1)
        assert metrics.restarts == {"boom": 1}
        sup.close()
        for st in states[1:]:
            send.send_nowait(st)
        send.close()
    recv.close()
    assert metrics.restarts == {"boom": 1} and escalated == []
    assert [c.restarted for c in metrics.crashes] == [True, False]
    assert discarded == ["queued"] and not states[2].done
