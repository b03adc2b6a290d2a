"""The invariants kvpipe promises under faults, as a reusable checker.

1. ``stored``: every block counted in a ``WriteResult`` is stored and reads back byte-exact
   (skipped blocks are checked too, unless the store lied about them in ``exists``); and
   each slice counts exactly the leading run of ``OK`` its put returned to the pipeline:
   nothing of a put that raised or was cancelled (even one that stores later), no more and
   no fewer of one that returned.
2. ``prefix``: no slice of a request is sent to the store after its first incomplete slice,
   and a request's slices go out in order.
3. ``deadline``: every call returns by its total deadline plus a small slack.
4. ``staging``: no staging buffer is reused while a store call that reads or writes it is
   still running (also one the caller abandoned: its bytes must not change under it).
5. ``idle``: staging in use returns to zero when idle, no request is left in flight, no
   worker thread outlives ``aclose``, channel depths stay within their bounds.
6. ``loaded``: a read never loads a block that is missing, stale or corrupt: every block it
   counts equals the block that was written.
7. ``crash``: an actor crash fails only the requests it held; the pipeline goes on; past the
   restart intensity it closes and releases every waiter.

Feed it what happened (:meth:`Checker.wrote`, :meth:`Checker.read`, :meth:`Checker.sample`)
and the :class:`~kvpipe.testing.faults.FaultyStore` call log, then ask for the verdicts.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, final

import numpy as np

from .._cache import KVCache
from .._keys import Scope, as_tokens, block_keys
from .._results import ActorCrash, PipelineStatistics, ReadResult, WriteResult
from ..backends._base import BlockStatus
from .faults import FaultyStore

__all__ = ("Checker", "Outcome", "Verdict")

NAMES = ("stored", "prefix", "deadline", "staging", "idle", "loaded", "crash")
#: How a put that returned nothing to the pipeline ended, in words (by its outcome).
_UNANSWERED = {"cancelled": "was cancelled", "error": "raised", "running": "never returned"}


@final
@dataclass
class Verdict:
    """One invariant over a run."""

    name: str
    held: bool = True
    checked: int = 0
    details: list[str] = field(default_factory=list)
    #: Violations recorded (``details`` keeps the first 10, and then says how many more).
    failures: int = 0

    def fail(self, detail: str) -> None:
        """Record a violation."""
        self.held = False
        self.failures += 1
        if len(self.details) < 10:
            self.details.append(detail)


@dataclass
class Outcome:
    """What one call returned (or raised), and how long it took against its limit."""

    kind: str
    request_id: str
    tokens: Any
    src_ids: Any
    include_partial: bool
    start_block: int
    elapsed: float
    limit: float
    result: WriteResult | ReadResult | None = None
    error: BaseException | None = None
    dst_ids: Any = None
    crash_expected: bool = False
    #: When the call was made (event-loop time, as :attr:`StoreCall.started`), or ``None``.
    started: float | None = None


@final
class Checker:
    """Collects a run's outcomes and judges the invariants (see the module docstring).

    Args:
        source: The cache blocks were written from.
        scope: The pipeline's key scope (``pipe.scope``).
        slack: Seconds a call may return past its limit (the deadline guard plus scheduling
            tolerance; 0 in virtual time is exact).
    """

    def __init__(self, source: KVCache, scope: Scope, slack: float) -> None:
        self.source = source
        self.scope = scope
        self.slack = slack
        self.outcomes: list[Outcome] = []
        self.samples: list[PipelineStatistics] = []
        self.verdicts = {name: Verdict(name) for name in NAMES}
        self.removed_after_verification = 0

    def wrote(self, outcome: Outcome) -> None:
        """Record a write."""
        self.outcomes.append(outcome)

    def read(self, outcome: Outcome) -> None:
        """Record a read."""
        self.outcomes.append(outcome)

    def sample(self, stats: PipelineStatistics) -> None:
        """Record a statistics snapshot taken during the run."""
        self.samples.append(stats)

    # -- the invariants ----------------------------------------------------------------------

    def _keys(self, o: Outcome) -> tuple[str, ...]:
        tokens = as_tokens(o.tokens)
        return block_keys(self.scope, tokens, self.source.layout.block_size, o.include_partial)

    def _payload(self, cache: KVCache, block: int) -> bytes:
        return b"".join(rows[block].tobytes() for rows in cache.byte_rows)

    def check_stored(self, store: FaultyStore, stored: dict[str, bytes]) -> None:
        """Invariant 1, given the inner store's values of the keys counted (``stored``)."""
        v = self.verdicts["stored"]
        # A write's skipped blocks are not checked where the store lied to that write's dedup
        # probe; a lie to a later read of the same request id excuses nothing.
        ended = {
            o.request_id: o.started + o.elapsed
            for o in self.outcomes
            if o.kind == "write" and o.started is not None
        }
        lied = {
            c.request_id
            for c in store.calls
            if c.op == "exists"
            and "lie" in c.injected
            and c.started <= ended.get(c.request_id, float("inf"))
        }
        # Blocks kvpipe itself deleted after they failed verification twice are gone by
        # design (never wrong bytes, a miss later): not a violation, but counted. The store
        # holds the right bytes (the faults corrupt a fetch, not the store), so a delete is
        # excused only for a key whose fetches the faults corrupted at least twice: kvpipe
        # deleting a block after a single failure (corruption in transit) loses a good one.
        removed = {k for c in store.calls if c.op == "delete" for k in c.keys}
        corrupted = Counter(k for c in store.calls if c.op == "get" for k in c.corrupted)
        payload = self.source.layout.block_nbytes
        for o in self.outcomes:
            if o.kind != "write" or not isinstance(o.result, WriteResult):
                continue
            keys = self._keys(o)
            first = o.start_block + (o.result.skipped if o.request_id in lied else 0)
            for b in range(first, o.start_block + o.result.skipped + o.result.written):
                v.checked += 1
                value = stored.get(keys[b])
                if value is None and keys[b] in removed and corrupted[keys[b]] >= 2:
                    self.removed_after_verification += 1
                elif value is None and keys[b] in removed:
                    v.fail(
                        f"{o.request_id}: block {b} deleted by kvpipe, though the faults "
                        f"corrupted {corrupted[keys[b]]} of its fetches (a good block lost)"
                    )
                elif value is None:
                    v.fail(f"{o.request_id}: block {b} counted but not stored")
                elif value[:payload] != self._payload(self.source, int(o.src_ids[b])):
                    v.fail(f"{o.request_id}: block {b} stored with other bytes")
        self._check_counts(store, v)

    def _check_counts(self, store: FaultyStore, v: Verdict) -> None:
        """Each write's slices against what their puts returned (the store's word at the
        time, not what is stored after the run: a late completion stores a put the pipeline
        gave up on, and must not have been counted)."""
        puts = {(c.request_id, c.first_block): c for c in store.calls if c.op == "put"}
        for o in self.outcomes:
            if o.kind != "write" or not isinstance(o.result, WriteResult):
                continue
            if sum(s.written for s in o.result.slices) != o.result.written:
                v.fail(f"{o.request_id}: written {o.result.written}, its slices say otherwise")
            for s in o.result.slices:
                call = puts.get((o.request_id, s.first_block))
                where = f"{o.request_id}: slice {s.index} (blocks from {s.first_block})"
                if call is None:
                    if s.written:
                        v.fail(f"{where} counted {s.written} blocks never sent to the store")
                    continue
                if call.statuses is None:
                    if s.written:
                        how = _UNANSWERED.get(call.outcome, call.outcome)
                        v.fail(f"{where} counted {s.written} blocks of a put that {how}")
                    continue
                run = next(
                    (i for i, st in enumerate(call.statuses) if st is not BlockStatus.OK),
                    len(call.statuses),
                )
                exact = s.outcome in ("complete", "incomplete")
                if s.written > run or (exact and s.written != run):
                    v.fail(f"{where} counted {s.written}; its put returned {run} leading OK")

    def counted_keys(self) -> list[str]:
        """Keys :meth:`check_stored` needs the stored values of."""
        out: list[str] = []
        for o in self.outcomes:
            if o.kind == "write" and isinstance(o.result, WriteResult):
                keys = self._keys(o)
                out += keys[o.start_block : o.start_block + o.result.skipped + o.result.written]
        return out

    def check_prefix(self, store: FaultyStore) -> None:
        """Invariant 2, from the store's call log."""
        v = self.verdicts["prefix"]
        by_request: dict[str, list[Any]] = defaultdict(list)
        for c in store.calls:
            if c.op == "put":
                by_request[c.request_id].append(c)
        for rid, calls in by_request.items():
            calls.sort(key=lambda c: c.started)
            v.checked += 1
            firsts = [c.first_block for c in calls]
            if firsts != sorted(firsts) or len(set(firsts)) != len(firsts):
                v.fail(f"{rid}: slices sent out of order {firsts}")
            bad = next((c for c in calls if c.outcome != "ok"), None)
            if bad is not None:
                later = [c.first_block for c in calls if c.started > bad.started]
                if later:
                    v.fail(
                        f"{rid}: slices {later} sent after the incomplete one at {bad.first_block}"
                    )

    def check_deadlines(self) -> tuple[float, float]:
        """Invariant 3; returns (max, p99) of the overrun past each call's limit (<= 0 is
        early)."""
        v = self.verdicts["deadline"]
        overruns = [o.elapsed - o.limit for o in self.outcomes]
        for o, over in zip(self.outcomes, overruns, strict=True):
            v.checked += 1
            if over > self.slack:
                v.fail(f"{o.request_id} ({o.kind}) returned {over:.3f} s past its deadline")
        if not overruns:
            return 0.0, 0.0
        return max(overruns), float(np.percentile(overruns, 99))

    def check_staging(self, store: FaultyStore) -> None:
        """Invariant 4: concurrent store calls never share staging; late ones see their
        bytes unchanged until they finish."""
        v = self.verdicts["staging"]
        calls = [c for c in store.calls if c.op in ("put", "get") and c.addresses]
        spans = []
        for c in calls:
            end = c.released if c.released is not None else c.finished
            spans.append((c.started, float("inf") if end is None else end, c))
        spans.sort(key=lambda s: s[0])
        for i, (_, end, c) in enumerate(spans):
            v.checked += 1
            mine = {(a, c.value_nbytes) for a in c.addresses}
            for start2, _, c2 in spans[i + 1 :]:
                if start2 >= end:
                    break
                if mine & {(a, c2.value_nbytes) for a in c2.addresses}:
                    v.fail(f"{c.op} #{c.call} and {c2.op} #{c2.call} used the same staging")
            if c.late_digests and c.late_digests != c.digests:
                v.fail(f"put #{c.call}: its staging changed while a late completion used it")

    def check_idle(self, after_close: PipelineStatistics, capacity: int) -> None:
        """Invariant 5, from samples taken during the run and statistics after close."""
        v = self.verdicts["idle"]
        for s in self.samples:
            v.checked += 1
            deep = {k: d for k, d in s.queue_depths.items() if d > capacity}
            if deep:
                v.fail(f"queue depths beyond {capacity}: {deep}")
        v.checked += 1
        if after_close.staging_in_use_bytes:
            v.fail(f"{after_close.staging_in_use_bytes} B of staging still leased when idle")
        if after_close.in_flight:
            v.fail(f"requests still in flight: {dict(after_close.in_flight)}")
        if after_close.threads_running:
            v.fail(f"{after_close.threads_running} worker threads outlived aclose()")

    def check_loaded(self, destinations: dict[str, KVCache]) -> None:
        """Invariant 6: every block a read counts equals the block written there."""
        v = self.verdicts["loaded"]
        for o in self.outcomes:
            if o.kind != "read" or not isinstance(o.result, ReadResult):
                continue
            dst = destinations[o.request_id]
            for b in range(o.start_block, o.start_block + o.result.loaded):
                v.checked += 1
                if self._payload(dst, int(o.dst_ids[b])) != self._payload(
                    self.source, int(o.src_ids[b])
                ):
                    v.fail(f"{o.request_id}: block {b} loaded with wrong bytes")

    def check_crashes(
        self,
        closed: bool | Mapping[str, bool],
        crashes: Sequence[ActorCrash] | Mapping[str, Sequence[ActorCrash]],
    ) -> None:
        """Invariant 7: a request fails with an actor crash only when the crashed actor held
        it; every request a crash was meant to hit failed; a closed pipeline released all.

        Args:
            closed: Whether the pipeline closed; or, per kind of call (``"write"``,
                ``"read"``), whether the pipeline that ran those calls did.
            crashes: The crashes; or, per kind of call, the crashes of the pipeline that ran
                those calls (a write and a read may share a request id: one pipeline's crash
                must not excuse the other's request).
        """
        from .._errors import PipelineClosed

        v = self.verdicts["crash"]
        held: dict[str, set[str]] = {}
        for o in self.outcomes:
            if o.kind in held:
                continue
            mine = crashes.get(o.kind, ()) if isinstance(crashes, Mapping) else crashes
            held[o.kind] = {rid for c in mine for rid in c.request_ids}
        for o in self.outcomes:
            v.checked += 1
            reason = getattr(o.result, "stop_reason", None)
            crashed = reason == "actor_crashed" or type(o.error).__name__ == "ActorCrashed"
            if crashed and o.request_id not in held[o.kind]:
                v.fail(f"{o.request_id} failed with a crash of an actor that did not hold it")
            if (
                o.crash_expected
                and o.kind == "write"
                and not (crashed or isinstance(o.error, PipelineClosed))
            ):
                v.fail(f"{o.request_id} should have been hit by an injected crash")
            was_closed = closed.get(o.kind, False) if isinstance(closed, Mapping) else closed
            if isinstance(o.error, PipelineClosed) and not was_closed:
                v.fail(f"{o.request_id} got PipelineClosed from an open pipeline")

    def results(self) -> list[Verdict]:
        """Every verdict, in invariant order."""
        return [self.verdicts[name] for name in NAMES]
