"""The conformance suite's check that a value is never seen torn catches a store that
publishes a key before its bytes are in place, though every put reports ``OK`` and every
value reads back whole once its put has returned."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvpipe
from kvpipe.backends import BlockStatus, PutBatch
from kvpipe.testing import BackendConformance


class PublishesBeforeWriting(kvpipe.MemoryStore):
    """Publishes each key with zeros, yields, then stores the real values (shielded, so a
    cancelled put still ends whole and the cancelled-put check passes it): a reader during
    the put gets ``OK`` with zeros."""

    async def put_blocks(self, batch: PutBatch) -> Sequence[BlockStatus]:
        with anyio.CancelScope(shield=True):
            for key in batch.keys:
                self._data[key] = np.zeros(batch.value_nbytes, np.uint8)
            await anyio.lowlevel.checkpoint()
            return await super().put_blocks(batch)


# Every check of the suite passed this store: only the cancelled-put check read a value
# that a put had left in the middle, and a shielded put is never left in the middle.


async def test_a_value_published_before_its_bytes_fails_the_suite() -> None:
    suite = BackendConformance()
    with pytest.raises(AssertionError, match="not whole"):
        await suite.test_a_value_is_never_seen_torn(PublishesBeforeWriting())


async def test_it_passes_the_other_checks_it_breaks_none_of() -> None:
    """What the new check adds: the store passes the suite's other checks of values."""
    suite = BackendConformance()
    await suite.test_put_then_get_is_byte_exact(PublishesBeforeWriting())
    await suite.test_a_cancelled_put_leaves_the_backend_usable(PublishesBeforeWriting())
    await suite.test_a_published_block_stays_until_deleted(PublishesBeforeWriting())
