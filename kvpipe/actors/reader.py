"""The backend reader: fetches a slice into staging and verifies every block.

A host cache's read comes to it whole and it runs the request's slices itself (small slices
from a store that keeps its values inline, others in tasks of their own, as staging allows);
a device cache's slices come one by one, leased by the slicer. Each slice runs in its own
cancel scope (``min(now + slice_timeout, request deadline)``); only the leading run of sound
blocks is placed in the cache. A block that failed verification is fetched once more, and
deleted from the store only when it fails again (corruption in transit must not cost a good
stored block). Once a slice stops short, later slices are cancelled and dropped.
"""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import anyio.lowlevel

from .._blockformat import check_blocks
from .._clock import current_time
from .._errors import BackendError
from .._hostcopy import check_and_scatter, gather
from .._plan import SliceSpec, copy_plan, leading, leading_run
from .._read_machine import FetchedSlice, fetch_failure
from .._workers import INLINE_COPY_BYTES, NotStarted
from .._write_machine import leading_ok
from ..backends._base import BlockStatus, GetBatch
from ._base import Actor, SliceJob, backend_call, block_statuses, shielded_copy, task
from ._rowsink import RowSink
from ._state import ReadState, describe_error

__all__ = ("Reader",)

log = logging.getLogger("kvpipe.reader")
# A store that keeps serving corrupt blocks fails every read alike: its failed-block,
# refetch and deletion lines are bounded per pipeline (``ActorContext.limits``); the
# metrics count all.

#: Blocks a deletion's log line names (the rest are counted).
_NAMED_BLOCKS = 4


class Reader(Actor[ReadState | SliceJob]):
    """Fetches and verifies read slices (see the module docstring)."""

    name = "reader"

    async def handle(self, msg: ReadState | SliceJob) -> None:
        if isinstance(msg, ReadState):
            await self._run_request(msg)
        else:
            await self._slice(msg)

    async def _run_request(self, state: ReadState) -> None:
        """A host cache's read: each slice leased in order, then fetched, verified and put in
        the cache, inline or in a task of its own."""
        slices = state.slices
        if slices and self._in_task(slices[0]):
            async with anyio.create_task_group() as tg:
                await self._run_slices(state, tg)
        else:  # every slice runs inline (the first one is the largest)
            await self._run_slices(state, None)

    def _in_task(self, spec: SliceSpec) -> bool:
        ctx = self.ctx
        return not ctx.keep_values or spec.count * ctx.payload_nbytes > INLINE_COPY_BYTES

    async def _run_slices(self, state: ReadState, tg: anyio.abc.TaskGroup | None) -> None:
        """The loop of :meth:`_run_request`; slices that run in tasks start in ``tg``. A slice
        past where loading stopped is resolved without being fetched. Blocks of inline slices
        that failed verification are deleted after the loop, once every slice is resolved:
        the read's result does not wait for that."""
        corrupt: list[tuple[int, str]] = []
        for spec in state.slices:
            if state.stopped_before(spec.first_block):
                state.resolve(spec.index, 0)
                continue
            lease = self.ctx.pool.try_acquire(spec.count)
            if lease is None:
                lease = await self.lease(state, spec)
                if lease is None:
                    state.time_out(spec, "deadline passed waiting for staging")
                    continue
            job = SliceJob(state, spec, lease)
            if tg is not None and self._in_task(spec):
                tg.start_soon(task, self._slice, job)
                # Let it start before the next: slices reach the store in planned order.
                await anyio.lowlevel.checkpoint()
            else:
                corrupt += await self._place(job)
        if corrupt:
            await self._delete_corrupt(state.request_id, corrupt)

    async def _slice(self, msg: SliceJob) -> None:
        """:meth:`_place` one slice, then delete its blocks that failed verification in a
        task of the actor's own: the deletion does not hold the read (its slice may wait in
        the swapper's inbox, where only the caller's side ends it at its deadline)."""
        corrupt = await self._place(msg)
        if corrupt:
            await self.detach(self._delete_corrupt, msg.state.request_id, corrupt)

    async def _place(self, msg: SliceJob) -> list[tuple[int, str]]:
        """Fetch, verify and place one slice; passes its staging on to the swapper or lets go
        of it. Returns the blocks (index, key) that failed verification twice (to delete)."""
        owned = True
        try:
            corrupt = await self._fetch(msg)
            if msg.valid:
                state, first = msg.state, msg.spec.first_block
                assert isinstance(state, ReadState)
                sent = await self.send_until(self.ctx.outboxes.swapper, msg, state, first)
                owned = sent is not True
                if owned:  # its deadline passed, the read ended, or loading stopped before it
                    state.time_out(msg.spec)
        finally:
            if owned:
                msg.release()
        return corrupt

    async def _fetch(self, job: SliceJob) -> list[tuple[int, str]]:
        """Fetch and verify; sets ``job.valid``; returns the blocks (index, key) that failed
        their checks twice."""
        ctx, spec, state = self.ctx, job.spec, job.state
        assert isinstance(state, ReadState)
        first = spec.first_block
        if state.stopped_before(first):
            state.resolve(spec.index, 0)
            return []
        deadline = min(current_time() + ctx.config.slice_timeout, state.deadline)
        batch = ctx.staged_batch(job, GetBatch)
        # Host caches: a store that takes the batch's sink places values while it runs, so
        # the claim on the cache is held from before its fetch until all is in place. A
        # fetch into staging writes nothing into the cache: the claim then comes after it
        # (:meth:`_get_and_place`), and an aborted read does not wait for the fetch.
        early = ctx.engine.name == "host" and ctx.backend.uses_sink
        claimed = early and state.scatter_begin()
        if early and not claimed:  # the read has ended
            state.resolve(spec.index, 0)
            return []
        try:
            got = await self._get_and_place(job, batch, deadline, claimed)
        finally:
            if claimed:
                state.scatter_end()
        if got is None:
            return []
        fetch, scattered, elapsed, elsewhere = got
        lo = fetch.refetch_from()
        if lo is not None:  # a block fetched fine failed verification: fetch it (and the rest)
            again = await self._refetch(job, lo, fetch.fetched, deadline)
            checks = None if again is None else await self._check_again(job, lo, again)
            if again is not None and checks is not None:
                fetch.refetched(lo, again, checks)
                ctx.metrics.counters["blocks_refetched"] += len(again)
        valid = fetch.valid
        corrupt = fetch.corrupt(batch.keys)
        short = fetch.short()
        if short is not None:
            self.ctx.limits.of(log).log(
                logging.DEBUG if short.gone else logging.WARNING,
                f"failed_block:{short.kind}",
                "read %s: block %d failed (%s); loading stops there",
                state.request_id,
                short.block,
                short.why,
            )
            state.stop_at(short.block, "failed_block", short.failed, short.detail)
        if fetch.failed_checks:
            ctx.metrics.counters["blocks_failed_verify"] += len(fetch.failed_checks)
        outcome = "complete" if valid == spec.count else "incomplete"
        ctx.metrics.slices[f"read_{outcome}"] += 1
        ctx.observe("read_slice", elapsed, outcome)
        if log.isEnabledFor(logging.DEBUG):
            self._debug(job, outcome, valid, elapsed, None)
        if scattered >= valid:  # every sound block is in the cache already: nothing to scatter
            job.valid = 0
            state.resolve(spec.index, valid)  # a no-op when already resolved
            return corrupt
        # Placed from the store's buffers: the swapper needs them in staging.
        if elsewhere and scattered and not await self._stage_back(job, scattered, elapsed):
            return corrupt  # loading stopped after the blocks in the cache already
        job.valid = valid  # the swapper scatters the leading sound run (again, for some)
        return corrupt

    async def _stage_back(self, job: SliceJob, count: int, elapsed: float) -> bool:
        """Copy the first ``count`` blocks of a slice from the cache (where they were placed)
        into their staging slots; ``False`` when the copy could not start by the read's
        deadline (then :meth:`_stop_late`)."""
        ctx, spec, state = self.ctx, job.spec, job.state
        assert isinstance(state, ReadState)
        first = spec.first_block
        blocks = state.block_ids[first : first + count]
        plan = copy_plan(ctx.segments, blocks, job.lease.slots[:count])
        rows, staging = ctx.cache.row_groups(ctx.segments), job.lease.pool.buffer
        try:
            await shielded_copy(
                ctx.run_copy(
                    plan.nbytes,
                    gather,
                    plan,
                    rows,
                    staging,
                    hold=job.lease,
                    start_by=state.deadline,
                    on_cache=True,
                )
            )
        except NotStarted:
            self._stop_late(state, job, count, elapsed)
            return False
        return True

    def _stop_late(self, state: ReadState, job: SliceJob, placed: int, elapsed: float) -> None:
        """A copy of the slice could not start by the read's deadline (the copy threads were
        busy): loading stops after its first ``placed`` blocks (in the cache already), as
        ``total_timeout``, and the slice is resolved with them. Counts no slice outcome: a
        slice is counted once, by its caller."""
        spec = job.spec
        detail = f"slice {spec.index}: deadline passed waiting for a copy thread"
        self._debug(job, "total_timeout", placed, elapsed, detail)
        at = spec.first_block + placed
        state.stop_at(at, "total_timeout", list(range(at, spec.end_block)), detail)
        state.resolve(spec.index, placed)

    async def _get_and_place(
        self, job: SliceJob, batch: GetBatch, deadline: float, claimed: bool
    ) -> tuple[FetchedSlice, int, float, bool] | None:
        """Fetch a slice and check its leading fetched blocks; for a host cache also put the
        leading sound ones in the cache, under the read's claim on it: held by the caller
        from before the fetch (``claimed``: for the store's sink), else taken here once the
        fetch has returned.
        Returns ``(what was fetched and how it checked, blocks now in the cache, seconds,
        whether staging lacks some fetched values)``, or ``None`` when the slice is
        settled already (the read stopped before it, or the fetch failed)."""
        ctx, spec, state = self.ctx, job.spec, job.state
        assert isinstance(state, ReadState)
        first = spec.first_block
        started = current_time()
        sink = RowSink(self.ctx, job) if claimed and ctx.backend.uses_sink else None
        batch.sink = sink
        statuses: list[BlockStatus] | None = None
        # The error's description, not the error: a local holding the exception would hold
        # this frame (and the job's staging) in a cycle through its traceback.
        error: str | None = None
        try:
            with state.bound(deadline, job, first):
                try:
                    statuses = await block_statuses(ctx.backend, "get_blocks", batch, spec.count)
                except BackendError as exc:  # the store's own errors too, translated
                    error = describe_error(exc)
        finally:
            # A store thread may still be placing a value (the fetch was cancelled): no
            # value goes into the cache from now on, and the claim lasts until it is out.
            # Waited for in kvpipe's own threads: the event loop library's may all be busy.
            if sink is not None and not sink.close():
                await shielded_copy(ctx.runner.run(sink.wait_idle, uses=ctx.cache))
        elapsed = current_time() - started
        if statuses is not None:
            job.lent = batch.lent() or None
        if state.stopped_before(first):
            state.resolve(spec.index, 0)
            return None
        if statuses is None:
            reason, detail = fetch_failure(spec.index, error, deadline >= state.deadline)
            ctx.metrics.slices[f"read_{reason}"] += 1
            ctx.observe("read_slice", elapsed, reason)
            self._debug(job, reason, 0, elapsed, detail)
            state.stop_at(first, reason, range(first, spec.end_block), detail)
            state.resolve(spec.index, 0)
            return None
        fetched = leading_ok(statuses)
        # Granted: the read has not stopped (above, and nothing awaited since).
        late = bool(fetched) and not claimed and ctx.engine.name == "host"
        claimed = claimed or (late and state.scatter_begin())
        scattered = 0
        try:
            if fetched and claimed:
                if sink is None or not any(sink.seen):  # none handed over: verify, scatter at once
                    checks = await self._verify_and_scatter(job, fetched)
                    scattered = leading(checks, None)
                else:  # those the store's threads did not check and place: in one call
                    await self._place_unseen(job, sink, fetched)
                    checks = sink.checks[:fetched]
                    scattered = leading_run(sink.placed[:fetched])
                if scattered == spec.count:
                    state.resolve(spec.index, scattered)
            else:
                checks = await self._verify(job, 0, fetched)
        except NotStarted:  # the copy threads were busy until the read's deadline
            placed = leading_run(sink.placed[:fetched]) if sink is not None else 0
            ctx.metrics.slices["read_total_timeout"] += 1  # its one count: none came before
            ctx.observe("read_slice", elapsed, "total_timeout")  # and its one report
            self._stop_late(state, job, placed, elapsed)
            return None
        finally:
            if late and claimed:
                state.scatter_end()
        fetch = FetchedSlice(first, statuses, checks)
        return fetch, scattered, elapsed, sink is not None and sink.elsewhere

    @staticmethod
    def _debug(job: SliceJob, outcome: str, valid: int, elapsed: float, detail: str | None) -> None:
        """The slice's one line, at DEBUG."""
        spec = job.spec
        log.debug(
            "read %s slice %d (blocks %d-%d): %s, %d of %d verified, fetched in %.4f s%s",
            job.state.request_id,
            spec.index,
            spec.first_block,
            spec.end_block - 1,
            outcome,
            valid,
            spec.count,
            elapsed,
            f" ({detail})" if detail else "",
        )

    async def _verify(self, job: SliceJob, lo: int, hi: int) -> list[str | None]:
        """Check slots ``[lo, hi)`` of a fetched slice (trailer, key, checksum); in a copy
        thread started by the read's deadline (else :class:`NotStarted`)."""
        ctx, spec, state = self.ctx, job.spec, job.state
        return await ctx.run_copy(
            (hi - lo) * ctx.payload_nbytes if ctx.config.verify_checksums else 0,
            check_blocks,
            job.sources(lo, hi),
            ctx.payload_nbytes,
            ctx.digests_of(state, spec)[lo:hi],
            ctx.config.verify_checksums,
            hold=job.lease,
            start_by=state.deadline,
        )

    async def _verify_and_scatter(self, job: SliceJob, fetched: int) -> list[str | None]:
        """Check the ``fetched`` leading blocks and copy the leading sound ones into the
        cache, in one call (inline when small, else in a worker thread, shielded); returns
        each block's check, ``None`` for a sound one.

        Raises:
            NotStarted: The read's deadline passed before the call started: nothing was
                checked or placed.
        """
        ctx, spec, state = self.ctx, job.spec, job.state
        first = spec.first_block
        sources = job.sources(0, fetched)
        digests = ctx.digests_of(state, spec)[:fetched]
        blocks = state.block_ids[first : first + fetched]
        payload, check_sums = ctx.payload_nbytes, ctx.config.verify_checksums
        segments, rows = ctx.segments, ctx.cache.row_groups(ctx.segments)
        staged = None if job.lent else (job.lease.pool.buffer, job.lease.slots[:fetched])

        def work() -> list[str | None]:
            return check_and_scatter(
                segments, sources, payload, digests, check_sums, blocks, rows, staged
            )

        nbytes = fetched * payload
        if nbytes <= INLINE_COPY_BYTES:  # inline (0 bytes: the reader's threshold decides)
            return await ctx.run_copy(0, work, hold=job.lease, start_by=state.deadline)
        return await shielded_copy(
            ctx.run_copy(nbytes, work, hold=job.lease, start_by=state.deadline, on_cache=True)
        )

    async def _place_unseen(self, job: SliceJob, sink: RowSink, fetched: int) -> None:
        """:meth:`RowSink.place_unseen` of the leading ``fetched`` blocks the store did not
        hand to ``sink``, in one shielded call."""
        unseen = [i for i in range(fetched) if not sink.seen[i]]
        if not unseen:
            return
        sources = [job.sources(i, i + 1)[0] for i in unseen]
        nbytes, deadline = len(unseen) * self.ctx.payload_nbytes, job.state.deadline
        await shielded_copy(
            self.ctx.run_copy(
                nbytes,
                sink.place_unseen,
                unseen,
                sources,
                hold=job.lease,
                start_by=deadline,
                on_cache=True,
            )
        )

    async def _check_again(
        self, job: SliceJob, lo: int, again: list[BlockStatus]
    ) -> list[str | None] | None:
        """Check the leading blocks fetched again from ``lo`` (:meth:`_refetch`); ``None``
        when the check could not start by the read's deadline (the copy threads were busy):
        loading then stops at block ``lo`` of the slice, as ``total_timeout``."""
        spec, state = job.spec, job.state
        assert isinstance(state, ReadState)
        try:
            return await self._verify(job, lo, lo + leading_ok(again))
        except NotStarted:
            first = spec.first_block + lo
            detail = f"slice {spec.index}: deadline passed waiting for a copy thread"
            state.stop_at(first, "total_timeout", range(first, spec.end_block), detail)
            return None

    async def _refetch(
        self, job: SliceJob, lo: int, hi: int, deadline: float
    ) -> list[BlockStatus] | None:
        """Fetch blocks ``[lo, hi)`` of a slice again into their own slots; ``None`` when
        that fails or runs out of time."""
        ctx, spec, state = self.ctx, job.spec, job.state
        batch = ctx.staged_batch(job, GetBatch, lo, hi)
        with state.bound(deadline, ("refetch", spec.index), spec.first_block + lo):
            try:
                statuses = await block_statuses(ctx.backend, "get_blocks", batch, hi - lo)
            except BackendError as exc:  # the block's first failure is what the read reports
                self.ctx.limits.of(log).log(
                    logging.WARNING,
                    "refetch:failed",
                    "read %s: fetching block %d again, after it failed verification, failed: %s",
                    state.request_id,
                    spec.first_block + lo,
                    str(exc),
                )
                return None
            # What was lent for these blocks before is replaced by what this fetch brought.
            lent = {i: v for i, v in (job.lent or {}).items() if not lo <= i < hi}
            lent.update({lo + i: v for i, v in batch.lent().items()})
            job.lent = lent or None
            return statuses
        return None

    async def _delete_corrupt(self, request_id: str, blocks: list[tuple[int, str]]) -> None:
        """Remove blocks (index, key) that failed verification twice (best effort, bounded);
        what was deleted, or why not, is logged in one line."""
        ctx = self.ctx
        limit = ctx.config.slice_timeout
        keys = [key for _, key in blocks]
        named = "; ".join(f"block {i} ({key})" for i, key in blocks[:_NAMED_BLOCKS])
        if len(blocks) > _NAMED_BLOCKS:
            named += f"; and {len(blocks) - _NAMED_BLOCKS} more"
        with anyio.move_on_after(limit) as bound:
            try:
                await backend_call(ctx.backend, "delete", ctx.backend.delete, keys)
                ctx.metrics.counters["corrupt_blocks_deleted"] += len(keys)
                self.ctx.limits.of(log).log(
                    logging.WARNING,
                    "delete:done",
                    "read %s: deleted %d block(s) that failed verification twice from the %s "
                    "store: %s",
                    request_id,
                    len(keys),
                    ctx.backend.name,
                    named,
                )
            except BackendError as exc:
                self.ctx.limits.of(log).log(
                    logging.WARNING,
                    "delete:failed",
                    "read %s: could not delete %d corrupt block(s) (%s): %s",
                    request_id,
                    len(keys),
                    named,
                    str(exc),
                )
        if bound.cancelled_caught:
            self.ctx.limits.of(log).log(
                logging.WARNING,
                "delete:timeout",
                "read %s: could not delete %d corrupt block(s) (%s) within %g s (slice_timeout)",
                request_id,
                len(keys),
                named,
                limit,
            )
