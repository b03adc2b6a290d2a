"""An adversarial sweep over the public calls: each call's caller is cancelled after k event
loop checkpoints (or k store-call events), for every k up to one past where the call ends by
itself; the pipeline is closed k checkpoints into a call whose store call hangs; a block is
damaged in transit; the call's deadline falls at every half second of virtual time. After
each case:
the call ended (a result, a kvpipe error or the cancellation) within a bounded number of
checkpoints, staging is all free once the pipeline is idle, a read placed nothing after it
ended, what the store holds for the token chain is a sound contiguous prefix consistent with
any result returned, the same tokens then round-trip byte-exact, and the staging is freed by
reference counting when the block exits (cyclic GC disabled)."""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvpipe
from kvpipe._keys import as_tokens, block_keys
from tests.fakes import Act, ScriptedStore
from tests.helpers import fill_random

BOTH = pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])

BLOCK = 4
BLOCKS = 8  # 4 slices of 2
LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=2, num_kv_heads=1, head_dim=8, block_size=BLOCK, dtype="float16"
)
SRC = np.arange(BLOCKS)  # the blocks written from
DST = np.arange(BLOCKS, 2 * BLOCKS)  # the blocks read into
CHECK = np.arange(2 * BLOCKS, 3 * BLOCKS)  # the blocks the checks read into
#: Checkpoints a cancelled call may take to end (the caller's, counted by another task).
ENDS_WITHIN = 400
#: The most k tried for one call (the calls here end by themselves well before).
K_MAX = 120


def _cache() -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, 3 * BLOCKS)
    fill_random(cache, seed=3)
    return cache


def _config(**kw: Any) -> kvpipe.PipelineConfig:
    base: dict[str, Any] = {"slice_block_num": 2, "copy_threads": 1, "close_timeout": 5.0}
    base.update(kw)
    return kvpipe.PipelineConfig(**base)


def _tokens(case: int) -> np.ndarray:
    return np.arange(case * 1000, case * 1000 + BLOCKS * BLOCK)


def _same(cache: kvpipe.KVCache, a: np.ndarray, b: np.ndarray) -> bool:
    return all(np.array_equal(rows[a], rows[b]) for rows in cache.byte_rows)


def _snapshot(cache: kvpipe.KVCache, blocks: np.ndarray) -> list[np.ndarray]:
    return [rows[blocks].copy() for rows in cache.byte_rows]


async def _settle(pipe: kvpipe.Pipeline) -> None:
    """Until the pipeline is idle and every staging slot is free: a bounded number of
    checkpoints, with short sleeps while a worker thread runs (it cannot wake the loop)."""
    for _ in range(ENDS_WITHIN * 10):
        s = pipe.statistics()
        if not s.in_flight and not s.threads_running and not s.staging_in_use_bytes:
            break
        if s.threads_running:
            await anyio.sleep(0.001)
        else:
            await anyio.lowlevel.checkpoint()
    s = pipe.statistics()
    assert s.in_flight == {}, s
    assert s.threads_running == 0, s
    assert s.staging_in_use_bytes == 0, f"staging still leased once idle: {s}"
    assert s.staging_waiters == 0, s


Outcome = tuple[str, Any, int]


class Tripwire:
    """Counts a store's calls as they start and as they return (events); :meth:`arm` has
    the ``k``-th event from then cancel a scope (the caller's), at once, inside the store
    call's task. Deterministic where threads make checkpoints counts vary."""

    OPS = ("put_blocks", "get_blocks", "exists", "delete", "put_residency", "get_residency")

    def __init__(self, store: kvpipe.StorageBackend) -> None:
        self.events = 0
        self._at: int | None = None
        self._scope: anyio.CancelScope | None = None
        self.tripped: anyio.Event | None = None
        for name in self.OPS:
            setattr(store, name, self._wrap(getattr(store, name)))

    def _wrap(self, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapped(*args: Any) -> Any:
            self._event()
            try:
                return await method(*args)
            finally:
                self._event()

        return wrapped

    def arm(self, k: int, scope: anyio.CancelScope) -> anyio.Event:
        self._at, self._scope, self.tripped = self.events + k, scope, anyio.Event()
        if k == 0:
            self._event(count=False)
        return self.tripped

    def disarm(self) -> None:
        self._at = self._scope = self.tripped = None

    def _event(self, count: bool = True) -> None:
        self.events += count
        if self._at is not None and self.events >= self._at:
            assert self._scope is not None and self.tripped is not None
            self._scope.cancel()
            self.tripped.set()
            self._at = None


async def _cancel_after(
    k: int,
    call: Callable[[], Awaitable[Any]],
    trip: Tripwire | None = None,
    pipe: kvpipe.Pipeline | None = None,
) -> Outcome:
    """Run ``call()`` and cancel it after ``k`` checkpoints of another task (``trip``: at
    the ``k``-th store event instead). Returns ``("done", value)``, ``("error", the kvpipe
    error)`` or ``("cancelled", None)``, and how many checkpoints the call took to end after
    it was cancelled (0: not cancelled). A step of the killer while one of ``pipe``'s
    worker threads runs waits a millisecond for it (so k counts steps of the request)."""
    ended = False
    late = 0
    outcome: list[tuple[str, Any]] = []
    scope = anyio.CancelScope()
    tripped = trip.arm(k, scope) if trip is not None else None

    async def killer() -> None:
        nonlocal late
        if tripped is not None:
            await tripped.wait()
        else:
            for _ in range(k):
                if pipe is not None and pipe.statistics().threads_running:
                    await anyio.sleep(0.001)
                else:
                    await anyio.lowlevel.checkpoint()
                if ended:
                    return
            scope.cancel()
        while not ended:
            late += 1
            if late > ENDS_WITHIN * 10:
                return
            if late > ENDS_WITHIN:  # a thread may hold it (a shielded copy): let it run
                await anyio.sleep(0.001)
            else:
                await anyio.lowlevel.checkpoint()

    try:
        with anyio.fail_after(30):  # a hang guard only
            async with anyio.create_task_group() as tg:
                tg.start_soon(killer)
                with scope:
                    try:
                        outcome.append(("done", await call()))
                    except kvpipe.KVPipeError as exc:
                        outcome.append(("error", exc))
                ended = True
                tg.cancel_scope.cancel()  # the killer, when the trip never came
    finally:
        if trip is not None:
            trip.disarm()
    if not outcome:
        assert scope.cancel_called
        return ("cancelled", None, late)
    return (*outcome[0], late)


async def _check_store(
    pipe: kvpipe.Pipeline,
    cache: kvpipe.KVCache,
    tokens: np.ndarray,
    at_least: int,
    partial: bool = False,
) -> int:
    """What the store holds for ``tokens``: a leading run of at least ``at_least`` blocks
    that reads back whole and byte-exact; returns its length."""
    n = await pipe.lookup(tokens, include_partial=partial)
    assert n >= at_least, (n, at_least)
    r = await pipe.read(tokens, CHECK, include_partial=partial)
    assert r.loaded == n, f"lookup finds {n} blocks stored, a read loads {r}"
    assert _same(cache, SRC[:n], CHECK[:n])
    return n


async def _check_round_trip(
    pipe: kvpipe.Pipeline, cache: kvpipe.KVCache, tokens: Any, partial: bool = False
) -> None:
    w = await pipe.write(tokens, SRC, include_partial=partial)
    assert w.complete and w.skipped + w.written == BLOCKS, w
    r = await pipe.read(tokens, CHECK, require_all=True, include_partial=partial)
    assert r.loaded == BLOCKS
    assert _same(cache, SRC, CHECK)
    await _settle(pipe)


def _check_ended(kind: str, value: Any, late: int, threads: bool) -> None:
    if kind == "error":
        assert isinstance(value, kvpipe.KVPipeError), value
    if not threads:
        assert late <= ENDS_WITHIN, f"the call took {late} checkpoints to end once cancelled"


OPS = (
    "write",
    "write_partial",  # 7 blocks and a partial one
    "write_dedup",  # the first 3 blocks stored before
    "read",
    "read_part",  # the first 5 blocks stored
    "read_from",  # from block 3
    "read_all",  # require_all, the first 5 blocks stored
    "lookup",
    "locate",
    "flush",
)


def _op_tokens(op: str, case: int) -> np.ndarray:
    tokens = _tokens(case)
    return tokens[:-2] if op == "write_partial" else tokens


async def _prepare(pipe: kvpipe.Pipeline, op: str, tokens: np.ndarray) -> None:
    """What a call needs stored before it runs."""
    if op in ("read", "read_from", "lookup"):
        assert (await pipe.write(tokens, SRC)).complete
    elif op in ("read_part", "read_all"):  # the first 5 blocks only: the read stops at block 5
        assert (await pipe.write(tokens[: 5 * BLOCK], SRC[:5])).complete
    elif op == "write_dedup":
        assert (await pipe.write(tokens[: 3 * BLOCK], SRC[:3])).complete
    elif op == "locate":
        assert await pipe.flush_index(tokens) == BLOCKS


def _call(pipe: kvpipe.Pipeline, op: str, tokens: np.ndarray) -> Callable[[], Awaitable[Any]]:
    if op in ("write", "write_dedup"):
        return lambda: pipe.write(tokens, SRC)
    if op == "write_partial":
        return lambda: pipe.write(tokens, SRC, include_partial=True)
    if op in ("read", "read_part"):
        return lambda: pipe.read(tokens, DST)
    if op == "read_from":
        return lambda: pipe.read(tokens, DST, start_block=3)
    if op == "read_all":
        return lambda: pipe.read(tokens, DST, require_all=True)
    if op == "lookup":
        return lambda: pipe.lookup(tokens)
    if op == "locate":
        return lambda: pipe.locate(tokens)
    return lambda: pipe.flush_index(tokens)


async def _after(
    pipe: kvpipe.Pipeline,
    cache: kvpipe.KVCache,
    op: str,
    tokens: np.ndarray,
    outcome: Outcome,
    placed: list[np.ndarray] | None,
) -> None:
    """The checks after one case (the pipeline still open)."""
    kind, value, _ = outcome
    await _settle(pipe)
    if placed is not None:  # nothing was placed into the read's blocks after it ended
        after = _snapshot(cache, DST)
        assert all(np.array_equal(a, b) for a, b in zip(placed, after, strict=True)), (
            f"a read placed blocks after it ended ({outcome})"
        )
    partial = op == "write_partial"
    stored_before = {"read_part": 5, "read_all": 5, "write_dedup": 3}.get(op, 0)
    if op in ("read", "read_from", "lookup"):
        stored_before = BLOCKS
    at_least = stored_before
    if kind == "error" and op == "read_all":
        assert isinstance(value, kvpipe.IncompleteRead), value
        kind, value = "done", value.result
    if kind == "done":
        if op.startswith("write"):
            assert value.skipped + value.written <= BLOCKS, value
            assert value.skipped + value.written == BLOCKS or not value.complete, value
            at_least = value.skipped + value.written
        elif op.startswith("read"):
            first = 3 if op == "read_from" else 0
            n = value.loaded
            assert _same(cache, SRC[first : first + n], DST[first : first + n]), value
            assert first + n <= stored_before, value
            if value.complete or value.stop_reason == "not_stored":
                assert first + n == stored_before, value
        elif op == "lookup":
            assert value == BLOCKS
        elif op == "locate":
            assert len(value) == BLOCKS
        else:
            assert value == BLOCKS
    if op not in ("locate", "flush"):
        await _check_store(pipe, cache, tokens, at_least, partial)
    elif kind != "done":
        assert await pipe.flush_index(tokens) == BLOCKS
        assert len(await pipe.locate(tokens)) == BLOCKS
    await _check_round_trip(pipe, cache, tokens, partial)


async def _sweep(
    store: kvpipe.StorageBackend, op: str, by: str, **config: Any
) -> list[tuple[int, str]]:
    """Cancel ``op`` after k checkpoints (``by``: or store events) for k = 0 .. one past
    where it ends by itself."""
    trip = Tripwire(store) if by == "store_events" else None
    cache = _cache()
    seen: list[tuple[int, str]] = []
    async with kvpipe.open_pipeline(cache, store, config=_config(**config)) as pipe:
        staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
        for k in range(K_MAX):
            tokens = _op_tokens(op, len(seen) + 1)
            await _prepare(pipe, op, tokens)
            outcome = await _cancel_after(k, _call(pipe, op, tokens), trip, pipe)
            placed = _snapshot(cache, DST) if op.startswith("read") else None
            kind, value, late = outcome
            _check_ended(kind, value, late, isinstance(store, FileStore))
            seen.append((k, kind))
            await _after(pipe, cache, op, tokens, outcome, placed)
            if kind != "cancelled" and late == 0:
                break
        else:
            raise AssertionError(f"{op} never ended by itself in {K_MAX} checkpoints")
        del pipe
    assert staging() is None, "the staging outlived the pipeline"
    return seen


FileStore = kvpipe.FileStore


def _store(kind: str, tmp_path: Path) -> kvpipe.StorageBackend:
    if kind == "memory":
        return kvpipe.MemoryStore()
    return kvpipe.FileStore(tmp_path / "store", durability="none")


@BOTH
@pytest.mark.parametrize(
    ("op", "store_kind", "by"),
    [
        *[(op, "memory", "checkpoints") for op in OPS if op not in ("read_from", "locate")],
        ("read", "file", "store_events"),
    ],
)
async def test_cancel_after_k_steps(
    op: str, store_kind: str, by: str, tmp_path: Path, no_cyclic_gc: None
) -> None:
    store = _store(store_kind, tmp_path)
    try:
        seen = await _sweep(store, op, by)
    finally:
        await store.aclose()
    assert seen[0][1] == "cancelled" and seen[-1][1] != "cancelled", seen


_NO_SCRIPT: dict[str, dict[int, Act]] = {"put": {}, "get": {}, "exists": {}}


# -- the pipeline closes under calls in flight ----------------------------------------------


@BOTH
@pytest.mark.parametrize(
    ("op", "hang"), [("write", "put"), ("read", "get"), ("read_all", None), ("lookup", "exists")]
)
async def test_close_after_k_checkpoints_with_a_call_in_flight(
    op: str, hang: str | None, no_cyclic_gc: None
) -> None:
    """The block is left (the pipeline closes) k checkpoints after a call started — with
    the store's first put, get or exists of the call hanging, past the close deadline: the
    call ends with its result or PipelineClosed, close completes, staging is freed, and the
    store holds a sound prefix that a new pipeline reads back."""
    store = ScriptedStore()
    for k in range(K_MAX):
        tokens = _op_tokens(op, k + 1)
        cache = _cache()
        outcomes: list[tuple[str, Any]] = []
        config = _config(close_timeout=0.02)
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
            await _prepare(pipe, op, tokens)
            if hang is not None:
                store.scripts = {**_NO_SCRIPT, hang: {store.counts[hang]: Act(hang=True)}}
            call = _call(pipe, op, tokens)

            async def run(
                call: Callable[[], Awaitable[Any]] = call,
                outcomes: list[tuple[str, Any]] = outcomes,
            ) -> None:
                try:
                    outcomes.append(("done", await call()))
                except kvpipe.PipelineClosed as exc:
                    outcomes.append(("closed", exc))
                except kvpipe.IncompleteRead as exc:
                    outcomes.append(("error", exc))

            with anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run)
                    for _ in range(k):
                        if pipe.statistics().threads_running:
                            await anyio.sleep(0.001)
                        else:
                            await anyio.lowlevel.checkpoint()
                    reached = hang is None or store.counts[hang] > 0
                    await pipe.aclose()
                    placed = _snapshot(cache, DST)
            store.scripts = dict(_NO_SCRIPT)
            assert len(outcomes) == 1, outcomes
            stats = pipe.statistics()
            assert stats.in_flight == {} and stats.staging_in_use_bytes == 0, stats
            del pipe, call, run
        assert staging() is None, f"the staging outlived the pipeline (k={k}, {outcomes})"
        kind, value = outcomes[0]
        if op.startswith("read"):
            after = _snapshot(cache, DST)
            assert all(np.array_equal(a, b) for a, b in zip(placed, after, strict=True))
        async with kvpipe.open_pipeline(cache, store, config=_config()) as pipe:
            await _after(pipe, cache, op, tokens, (kind, value, 0), None)
        if kind != "closed" or (hang is not None and reached and k > 3):
            break
    else:
        raise AssertionError(f"{op} never ended by itself before close")


# -- a block fails verification ---------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("again", ["corrupt"])
@pytest.mark.parametrize("at", [1])
async def test_cancel_a_read_whose_block_fails_verification(
    at: int, again: str, no_cyclic_gc: None
) -> None:
    """Block 1 of the read's slice ``at`` comes back damaged; fetched again it is sound
    (corruption in transit), or damaged again (then deleted). The caller is cancelled after
    k checkpoints."""

    class Damaging(ScriptedStore):
        """Damages the fetched value of the key in :attr:`bad` (the first time only when
        ``again`` is sound)."""

        bad: str | None = None

        async def get_blocks(self, batch: Any) -> Any:
            statuses = await super().get_blocks(batch)
            if self.bad in batch.keys:
                batch.buffers[batch.keys.index(self.bad)][7] ^= 0xFF
                if again == "sound":
                    self.bad = None
            return statuses

    store = Damaging()
    cache = _cache()
    async with kvpipe.open_pipeline(cache, store, config=_config()) as pipe:
        staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
        for k in range(K_MAX):
            tokens = _tokens(k + 1)
            await _prepare(pipe, "read", tokens)
            store.bad = block_keys(pipe.scope, as_tokens(tokens), BLOCK, False)[2 * at + 1]
            outcome = await _cancel_after(k, _call(pipe, "read", tokens), None, pipe)
            store.bad = None
            placed = _snapshot(cache, DST)
            kind, value, late = outcome
            _check_ended(kind, value, late, False)
            await _settle(pipe)
            assert all(
                np.array_equal(a, b) for a, b in zip(placed, _snapshot(cache, DST), strict=True)
            )
            if kind == "done":
                n = value.loaded
                assert _same(cache, SRC[:n], DST[:n])
                if again == "sound":
                    assert n in (BLOCKS, 2 * at + 1) or value.stop_reason == "cancelled", value
                else:
                    assert n == 2 * at + 1, value
            n = await pipe.lookup(tokens)
            assert n in (BLOCKS, 2 * at + 1), n
            r = await pipe.read(tokens, CHECK)
            assert r.loaded == n and _same(cache, SRC[:n], CHECK[:n])
            await _check_round_trip(pipe, cache, tokens)
            if kind != "cancelled" and late == 0:
                break
        else:
            raise AssertionError(f"never ended by itself in {K_MAX} checkpoints")
        del pipe
    assert staging() is None, "the staging outlived the pipeline"


# -- deadlines in virtual time ----------------------------------------------------------------


def _mock_clock() -> object:
    import trio.testing

    return trio.testing.MockClock(autojump_threshold=0)


class _Slow(ScriptedStore):
    """Every put, get and exists takes 1 s (virtual time)."""

    async def _enter(self, name: str, batch: Any) -> tuple[Act, Any]:
        act, call = await super()._enter(name, batch)
        await anyio.sleep(1)
        return act, call


@pytest.mark.parametrize("anyio_backend", [("trio", {"clock": _mock_clock()})])
@pytest.mark.parametrize("how", ["caller_scope", "timeout"])
@pytest.mark.parametrize("op", ["write_partial", "read_all", "lookup"])
async def test_deadline_at_every_half_second(op: str, how: str, no_cyclic_gc: None) -> None:
    """Every store call takes 1 s (virtual time, trio's MockClock); the call's deadline —
    its caller's cancel scope, or its own ``timeout`` — falls at t = 0.5, 1, 1.5, ... up to
    past where the call ends by itself. The call ends by then exactly (its result or
    OperationTimeout for ``timeout``), the deadline guard never fires, and the checks after
    each case hold."""
    store = _Slow()
    cache = _cache()
    async with kvpipe.open_pipeline(cache, store, config=_config()) as pipe:
        staging = weakref.ref(pipe._runtime._pool.buffer.base)  # type: ignore[union-attr]
        for case in range(1, 80):
            t = case / 2
            tokens = _op_tokens(op, case)
            await _prepare(pipe, op, tokens)
            call = _call(pipe, op, tokens)
            if how == "timeout":
                call = _with_timeout(pipe, op, tokens, t)
            start = anyio.current_time()
            outcome: tuple[str, Any, int]
            with anyio.move_on_after(t if how == "caller_scope" else 1e6) as scope:
                try:
                    outcome = ("done", await call(), 0)
                except kvpipe.KVPipeError as exc:
                    outcome = ("error", exc, 0)
            took = anyio.current_time() - start
            if scope.cancelled_caught:
                outcome = ("cancelled", None, 0)
            assert took <= t, (took, t, outcome)
            kind, value, _ = outcome
            if kind == "error":
                assert isinstance(value, kvpipe.OperationTimeout | kvpipe.IncompleteRead), value
            placed = _snapshot(cache, DST) if op.startswith("read") else None
            assert pipe.statistics().counters.get("deadline_guard_expired", 0) == 0
            await _after(pipe, cache, op, tokens, outcome, placed)
            if took < t:
                break
        else:
            raise AssertionError("never ended by itself")
        del pipe
    assert staging() is None, "the staging outlived the pipeline"


def _with_timeout(
    pipe: kvpipe.Pipeline, op: str, tokens: np.ndarray, t: float
) -> Callable[[], Awaitable[Any]]:
    if op in ("write", "write_dedup"):
        return lambda: pipe.write(tokens, SRC, timeout=t)
    if op == "write_partial":
        return lambda: pipe.write(tokens, SRC, include_partial=True, timeout=t)
    if op in ("read", "read_part"):
        return lambda: pipe.read(tokens, DST, timeout=t)
    if op == "read_from":
        return lambda: pipe.read(tokens, DST, start_block=3, timeout=t)
    if op == "read_all":
        return lambda: pipe.read(tokens, DST, require_all=True, timeout=t)
    if op == "lookup":
        return lambda: pipe.lookup(tokens, timeout=t)
    if op == "locate":
        return lambda: pipe.locate(tokens, timeout=t)
    return lambda: pipe.flush_index(tokens, timeout=t)
