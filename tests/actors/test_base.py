"""The actor loop's hand-over of a job: exactly one side owns a job and its staging, also
when a send waiting for room is cancelled in the step a receiver takes the job."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from kvpipe._plan import SliceSpec
from kvpipe._runtime import Runtime
from kvpipe._staging import StagingPool
from kvpipe.actors._base import Actor
from kvpipe.actors._channels import SliceJob


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _job(pool: StagingPool) -> SliceJob:
    lease = pool.try_acquire(1)
    assert lease is not None
    return SliceJob(None, SliceSpec(0, 0, 1, 4), lease)  # type: ignore[arg-type]


async def _send(
    send: MemoryObjectSendStream[SliceJob],
    job: SliceJob,
    scope: anyio.CancelScope,
    results: list[object],
) -> None:
    """``Actor.send`` within ``scope``; records what it returned, or that it was cancelled."""
    with scope:
        try:
            results.append(await Actor.send(send, job))
        except anyio.get_cancelled_exc_class():
            results.append("cancelled")
            raise


class _Keeper(Actor[SliceJob]):
    """Takes jobs and keeps them (what it does with them is not the point)."""

    name = "keeper"

    def __init__(self, inbox: Any) -> None:
        super().__init__(None, inbox, 1)  # type: ignore[arg-type]
        self.kept: list[SliceJob] = []

    async def _dispatch(self, msg: SliceJob) -> None:  # no context: straight to handle
        await self.handle(msg)

    async def handle(self, msg: SliceJob) -> None:
        self.kept.append(msg)


async def test_a_job_taken_as_its_waiting_send_is_cancelled_counts_as_sent() -> None:
    """anyio hands the item over and still delivers the cancellation: the sender must not
    take the job back (it would release staging the receiver fetches into or scatters from,
    or release it a second time)."""
    pool = StagingPool(64, 2)
    send, recv = anyio.create_memory_object_stream[SliceJob](0)
    job = _job(pool)
    results: list[object] = []
    scope = anyio.CancelScope()

    async with send, recv, anyio.create_task_group() as tg:
        tg.start_soon(_send, send, job, scope, results)
        while not send.statistics().tasks_waiting_send:
            await anyio.lowlevel.checkpoint()
        scope.cancel()  # the sender's deadline, in the same step as ...
        taken = recv.receive_nowait()  # ... a receiver taking the job,
        taken.taken = True  # as an actor's loop marks it (next test)
    assert taken is job
    assert results == [True]


async def test_a_job_not_taken_when_its_send_is_cancelled_stays_the_senders() -> None:
    pool = StagingPool(64, 2)
    send, recv = anyio.create_memory_object_stream[SliceJob](0)
    job = _job(pool)
    job.taken = True  # taken by the actor before this one, which now sends it on
    async with send, recv:
        with anyio.move_on_after(0.01) as scope:
            await Actor.send(send, job)
        assert scope.cancelled_caught
        with pytest.raises(anyio.WouldBlock):
            recv.receive_nowait()


async def test_an_actor_marks_a_job_taken_in_the_step_it_receives_it() -> None:
    pool = StagingPool(64, 2)
    send, recv = anyio.create_memory_object_stream[SliceJob](0)
    keeper = _Keeper(recv)
    job = _job(pool)
    async with recv, anyio.create_task_group() as tg:
        tg.start_soon(keeper.run)
        async with send:
            await Actor.send(send, job)
            assert job.taken
    assert keeper.kept == [job]


async def test_a_job_moved_into_the_inbox_as_its_waiting_send_is_cancelled_stays_the_senders() -> (
    None
):
    """Every inbox holds at least one job (``queue_depth >= 1``), so a sender waits behind a
    full inbox, and a receiver taking the job at its head moves the waiting one in — also
    in the step the wait was cancelled in, which anyio still raises. The sender keeps the
    job (its staging is let go of there); the actor that receives it later must drop it,
    not handle it a second time (a twice-released lease, or staging reused under it)."""
    pool = StagingPool(64, 2)
    send, recv = anyio.create_memory_object_stream[SliceJob](1)
    head, job = _job(pool), _job(pool)
    send.send_nowait(head)  # the inbox is full
    results: list[object] = []
    scope = anyio.CancelScope()

    keeper = _Keeper(recv)
    async with recv, anyio.create_task_group() as tg:
        tg.start_soon(_send, send, job, scope, results)
        while not send.statistics().tasks_waiting_send:
            await anyio.lowlevel.checkpoint()
        scope.cancel()  # the sender's deadline, in the same step as ...
        assert recv.receive_nowait() is head  # ... a receiver taking the head: job moves in
        head.taken = True
        assert results == []
        tg.start_soon(keeper.run)  # the actor's loop receives what is left in the inbox
        async with send:
            while not results:
                await anyio.lowlevel.checkpoint()
    assert results == ["cancelled"]  # the sender owns the job ...
    assert keeper.kept == []  # ... and no actor handles it


async def test_a_job_drained_from_a_waiting_sender_as_its_wait_is_cancelled_is_released_once() -> (
    None
):
    """An escalation fails the requests (cancelling their senders' waits) and drains the
    escalated actor's inbox in one step, while the other actors still run. Draining moves
    a waiting sender's job in and lets go of it: the drain took it, so the sender, whose
    wait anyio still cancels, must not let go of it a second time ("staging lease released
    twice", the sending actor crashing; slots a worker thread holds handed back under it).
    With anyio 4.15 closing the inbox leaves the sender waiting, so this is what an
    escalation did."""
    pool = StagingPool(64, 2)
    send, recv = anyio.create_memory_object_stream[SliceJob](1)
    head, job = _job(pool), _job(pool)
    send.send_nowait(head)  # the inbox is full
    results: list[object] = []
    scope = anyio.CancelScope()

    async with send, recv, anyio.create_task_group() as tg:
        tg.start_soon(_send, send, job, scope, results)
        while not send.statistics().tasks_waiting_send:
            await anyio.lowlevel.checkpoint()
        scope.cancel()  # the request failed, in the same step as ...
        Runtime._drain(recv)  # ... the escalated actor's inbox drained
    assert head.lease.released and job.lease.released
    # The drain took it and let go of it: the sender (which lets go of a job it still owns,
    # one its send did not hand over) does not own it.
    assert results == [True] and not job.withdrawn
