"""The scheduler: admission, keys, deduplication, and the small index calls.

A write's keys are computed, its leading stored blocks skipped and the rest cut into slices;
a read's leading stored blocks are counted (to the first miss) and sliced. Either goes on to
the writer or reader (host cache) or the slicer (device cache). ``lookup``, ``locate`` and
``flush_index`` are answered here.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from .._errors import BackendError, OperationTimeout
from .._keys import Tokens, block_keys
from .._plan import SliceSpec, leading_run, plan_slices
from .._results import BlockLocation, Holder, ReadStopReason, Residency, ResidencyEntry
from ..backends._base import KeyBatch
from ._base import Actor, ActorContext, backend_call
from ._state import CallState, ReadState, RequestState, WriteState, describe_error

__all__ = ("Scheduler", "probe_leading")

log = logging.getLogger("kvpipe.scheduler")
# A store that is down fails every write's probe: its lines are bounded per pipeline
# (``ActorContext.limits``).

#: Sequences longer than this have their keys hashed in a worker thread.
_THREAD_KEYS_TOKENS = 32768
#: Keys per ``exists`` call at least (more when slices are larger): asking about a few keys
#: past a miss costs less than another call.
PROBE_CHUNK_MIN = 64


async def probe_leading(
    ctx: ActorContext,
    request_id: str,
    keys: Sequence[str],
    first: int,
    tokens: Tokens,
    on_error: Callable[[BackendError | OperationTimeout], None] | None = None,
) -> int:
    """How many of ``keys`` (blocks ``first``...) are stored, counting from the first one.

    Asks the backend a chunk at a time (``slice_blocks`` keys, at least
    :data:`PROBE_CHUNK_MIN`) and stops at the first chunk with a miss. Each call gets at most
    ``slice_timeout``.

    Args:
        on_error: Given, a failed call is handed to it and the blocks the calls before found
            stored are returned (a write's dedup: what is known stored need not be written
            again); else the error is raised.

    Raises:
        BackendError: The backend failed an ``exists`` call.
        OperationTimeout: An ``exists`` call took longer than ``slice_timeout``.
    """
    found = 0
    step = max(ctx.slice_blocks, PROBE_CHUNK_MIN)
    for lo in range(0, len(keys), step):
        chunk = keys[lo : lo + step]
        try:
            run = await _probe_chunk(ctx, ctx.key_batch(request_id, chunk, first + lo, tokens))
        except (BackendError, OperationTimeout) as exc:
            if on_error is None:
                raise
            on_error(exc)
            return found
        found += run
        if run < len(chunk):
            break
    return found


async def _probe_chunk(ctx: ActorContext, batch: KeyBatch) -> int:
    """The leading run of stored keys of one ``exists`` call, bounded by ``slice_timeout``."""
    with anyio.move_on_after(ctx.config.slice_timeout) as call:
        flags = await backend_call(ctx.backend, "exists", ctx.backend.exists, batch)
    if call.cancelled_caught:
        raise OperationTimeout(
            f"exists on {len(batch.keys)} keys took longer than slice_timeout "
            f"({ctx.config.slice_timeout} s)"
        )
    try:
        answers = list(flags)
    except TypeError:  # a store's slip (``None``, a count): not a crash of the scheduler
        raise BackendError(
            ctx.backend.name,
            "exists",
            f"answered {type(flags).__name__}, not one flag per key ({len(batch.keys)} keys)",
        ) from None
    if len(answers) != len(batch.keys):
        raise BackendError(
            ctx.backend.name, "exists", f"{len(answers)} answers for {len(batch.keys)} keys"
        )
    return leading_run(answers)


class Scheduler(Actor[RequestState]):
    """Admission and planning (see the module docstring)."""

    name = "scheduler"

    async def handle(self, msg: RequestState) -> None:
        if msg.done:
            return
        assert isinstance(msg, WriteState | ReadState | CallState)
        with msg.bound(msg.deadline, "keys"):  # a long sequence's may wait for a copy thread
            msg.keys = await self._keys(msg.tokens, msg.include_partial)
        if msg.keys is None:  # the deadline passed (then it ends here), or the request ended
            msg.end("total_timeout", "deadline passed hashing its tokens into keys")
            return
        if isinstance(msg, WriteState):
            await self._write(msg)
        elif isinstance(msg, ReadState):
            await self._read(msg)
        else:
            await self._call(msg)

    async def _keys(self, tokens: Tokens, include_partial: bool) -> tuple[str, ...]:
        ctx = self.ctx
        args = (ctx.scope, tokens, ctx.layout.block_size, include_partial)
        if len(tokens) <= _THREAD_KEYS_TOKENS:
            return block_keys(*args)
        return await ctx.runner.run(block_keys, *args, lane=ctx.copy_limiter)

    def _slices(self, state: WriteState | ReadState, first: int, end: int) -> tuple[SliceSpec, ...]:
        ctx = self.ctx
        return plan_slices(first, end, ctx.slice_blocks, ctx.layout.block_size, len(state.tokens))

    async def _write(self, state: WriteState) -> None:
        ctx = self.ctx
        assert state.keys is not None
        keys = state.keys[state.start_block : state.end_block]

        def failed(exc: BackendError | OperationTimeout) -> None:
            # Deduplication is an optimisation: without it the blocks are rewritten.
            ctx.metrics.counters["probe_errors"] += 1
            ctx.limits.of(log).log(
                logging.WARNING,
                "dedup_probe",
                "write %s: dedup probe failed, writing the blocks not found stored before: %s",
                state.request_id,
                str(exc),
            )

        with state.bound(state.deadline) as scope:
            skipped = await probe_leading(
                ctx, state.request_id, keys, state.start_block, state.tokens, failed
            )
            state.planned(
                skipped, self._slices(state, state.start_block + skipped, state.end_block)
            )
            # What the result reports skipped: nothing when the write ended during the probe
            # (an exists call that ran on past it answered after).
            ctx.metrics.counters["blocks_skipped"] += state.machine.skipped
            if state.done:
                return
            await self.send(ctx.outboxes.writer if ctx.host_copies else ctx.outboxes.slicer, state)
        if scope.cancelled_caught:  # the deadline, or the request ended (then a no-op)
            state.end("total_timeout", "deadline passed before the first slice was sent")

    async def _read(self, state: ReadState) -> None:
        ctx = self.ctx
        assert state.keys is not None
        keys = state.keys[state.start_block : state.end_block]
        with state.bound(state.deadline) as scope:
            try:
                available = await probe_leading(
                    ctx, state.request_id, keys, state.start_block, state.tokens
                )
            except (BackendError, OperationTimeout) as exc:
                ctx.metrics.counters["probe_errors"] += 1
                reason: ReadStopReason = (
                    "backend_error" if isinstance(exc, BackendError) else "slice_timeout"
                )
                state.stop_at(state.start_block, reason, [], describe_error(exc))
                state.plan(())
                return
            if available < state.requested:
                first_missing = state.start_block + available
                state.stop_at(first_missing, "not_stored", [first_missing])
            state.plan(self._slices(state, state.start_block, state.start_block + available))
            if state.slices:
                outbox = ctx.outboxes.reader if ctx.host_copies else ctx.outboxes.slicer
                await self.send(outbox, state)
        if scope.cancelled_caught:
            state.end("total_timeout", "deadline passed before the first slice was fetched")

    async def _call(self, state: CallState) -> None:
        assert state.keys is not None
        with state.bound(state.deadline) as scope:
            try:
                if state.op == "lookup":
                    start = int(state.params["start_block"])
                    keys = state.keys[start:]
                    state.succeed(
                        await probe_leading(self.ctx, state.request_id, keys, start, state.tokens)
                    )
                elif state.op == "flush":
                    state.succeed(await self._flush(state))
                else:
                    state.succeed(await self._locate(state))
            except (BackendError, OperationTimeout) as exc:
                # The frames below have returned: their locals (batches, staging) need not
                # live as long as the error the caller gets. This one's entry goes: its frame
                # holds the request, which keeps the error (a reference cycle).
                traceback.clear_frames(exc.__traceback__)
                tb = exc.__traceback__
                state.fail(exc.with_traceback(tb.tb_next if tb is not None else None))
                del tb
        if scope.cancelled_caught:
            state.end("total_timeout", "deadline passed waiting for the store")

    async def _flush(self, state: CallState) -> int:
        ctx = self.ctx
        assert state.keys is not None
        residency: Residency = state.params["residency"]
        start = int(state.params["start_block"])
        now = time.time()
        keys = state.keys[start:]
        for lo in range(0, len(keys), ctx.slice_blocks):
            entries = [
                ResidencyEntry(k, ctx.config.node_id, residency, now)
                for k in keys[lo : lo + ctx.slice_blocks]
            ]
            await backend_call(ctx.backend, "put_residency", ctx.backend.put_residency, entries)
        ctx.metrics.counters["blocks_flushed"] += len(keys)
        return len(keys)

    async def _locate(self, state: CallState) -> list[BlockLocation]:
        ctx = self.ctx
        assert state.keys is not None
        keys = state.keys
        out: list[BlockLocation] = []
        for lo in range(0, len(keys), ctx.slice_blocks):
            chunk = keys[lo : lo + ctx.slice_blocks]
            answer = await backend_call(
                ctx.backend, "get_residency", ctx.backend.get_residency, chunk
            )
            records = _records_per_key(ctx.backend.name, answer, lo)
            if len(records) != len(chunk):
                raise BackendError(
                    ctx.backend.name,
                    "get_residency",
                    f"{len(records)} answers for {len(chunk)} keys",
                )
            for i, (key, entries) in enumerate(zip(chunk, records, strict=True)):
                if not entries:
                    return out
                if not all(
                    type(e) is ResidencyEntry and isinstance(e.residency, Residency)
                    for e in entries
                ):
                    raise BackendError(
                        ctx.backend.name,
                        "get_residency",
                        f"answered block {lo + i} with records that are not ResidencyEntry "
                        "of a Residency",
                    )
                if any(e.key != key for e in entries):
                    raise BackendError(
                        ctx.backend.name,
                        "get_residency",
                        f"answered block {lo + i} for another key",
                    )
                holders = tuple(
                    Holder(e.node_id, e.residency, e.updated_at)
                    for e in sorted(entries, key=lambda e: e.node_id)
                )
                out.append(BlockLocation(lo + i, key, holders))
        return out


def _records_per_key(store: str, answer: Any, first: int) -> list[tuple[Any, ...]]:
    """A ``get_residency`` answer for the keys of blocks ``first``... as one tuple of
    records per key (an empty answer for a key, ``None`` too, as none).

    Raises:
        BackendError: It is not a sequence of sequences (``None``, a count, a bare record for
            a key: a store's slip): a failure of the call, never a crash of the scheduler.
    """
    try:
        answers = list(answer)
    except TypeError:
        raise BackendError(
            store, "get_residency", f"answered {type(answer).__name__}, not records per key"
        ) from None
    out: list[tuple[Any, ...]] = []
    for i, entries in enumerate(answers):
        try:
            out.append(tuple(entries) if entries else ())
        except TypeError:
            raise BackendError(
                store,
                "get_residency",
                f"answered block {first + i} with {type(entries).__name__}, not records",
            ) from None
    return out
