"""The conformance suite's two visibility checks catch a store that breaks either promise for
a single schedule point, wherever that point falls in the put."""

from __future__ import annotations

from collections.abc import Sequence

import anyio.lowlevel
import pytest

import kvpipe
from kvpipe.backends import BlockStatus, KeyBatch, PutBatch
from kvpipe.testing import BackendConformance


class TakesBackAFailedBlock(kvpipe.MemoryStore):
    """Publishes every block of a put, yields once, then takes block 0 back and reports it
    ``FAILED``: it was visible during the call (the first promise broken)."""

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        await anyio.lowlevel.checkpoint()  # some work of its own first
        statuses = list(await super().put_blocks(batch))
        await anyio.lowlevel.checkpoint()
        self._data.pop(batch.keys[0], None)
        statuses[0] = BlockStatus.FAILED
        return statuses


class HidesWhileReplacing(kvpipe.MemoryStore):
    """Replacing a stored value removes its key for a schedule point first (block 2 of a
    batch): a published block goes missing for a moment (the second promise broken)."""

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        await anyio.lowlevel.checkpoint()
        if len(batch) > 2 and self._data.pop(batch.keys[2], None) is not None:
            await anyio.lowlevel.checkpoint()
        return await super().put_blocks(batch)


# Each put of these stores went past the suite's single probing task (it asked about the keys
# in turn, one per schedule point, and was elsewhere at that moment): both passed, every time.


async def test_a_block_visible_then_reported_failed_fails_the_suite() -> None:
    suite = BackendConformance()
    with pytest.raises(AssertionError, match="seen"):
        await suite.test_a_block_not_reported_ok_is_never_visible(TakesBackAFailedBlock())


async def test_a_published_block_missing_for_a_moment_fails_the_suite() -> None:
    suite = BackendConformance()
    with pytest.raises(AssertionError, match="published blocks disappeared"):
        await suite.test_a_published_block_stays_until_deleted(HidesWhileReplacing())


async def test_an_exists_that_never_yields_does_not_stall_the_watch() -> None:
    """The probing tasks pace themselves when ``exists`` does not yield (else they spin and
    the body of the check never runs: here, many calls in a row with no put between fail)."""

    class Eager(kvpipe.MemoryStore):
        in_a_row = 0

        async def exists(self, batch: KeyBatch) -> Sequence[bool]:
            self.in_a_row += 1
            assert self.in_a_row < 10_000, "the probes ran on and on, and the puts never did"
            return [k in self._data for k in batch.keys]

        async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
            self.in_a_row = 0
            return await super().put_blocks(batch)

    suite = BackendConformance()
    await suite.test_a_block_not_reported_ok_is_never_visible(Eager())
    await suite.test_a_published_block_stays_until_deleted(Eager())


class ClaimsEveryKey(kvpipe.MemoryStore):
    """Declares exists_answers_every_key (inherited from MemoryStore) while its exists stops
    at the first missing key, as a file store's may."""

    async def exists(self, batch: KeyBatch) -> Sequence[bool]:
        flags = list(await super().exists(batch))
        lead = next((j for j, ok in enumerate(flags) if not ok), len(flags))
        return flags[: lead + 1] + [False] * (len(flags) - lead - 1)


async def test_a_store_that_claims_to_answer_every_key_and_stops_at_a_miss_fails() -> None:
    """A ValueClient trusts such a store's answers past a miss (it does not probe those keys
    again), so a store that declares it and stops at the first miss would make stored
    blocks look missing: the suite's delete check catches it, and passes it undeclared."""
    suite = BackendConformance()
    async with ClaimsEveryKey() as store:
        with pytest.raises(AssertionError):
            await suite.test_delete_removes_and_ignores_missing(store)
    async with ClaimsEveryKey() as store:
        store.exists_answers_every_key = False
        await suite.test_delete_removes_and_ignores_missing(store)
