"""The conformance suite's delete check catches a store whose ``delete`` gives up at the
first missing key (``StorageBackend.delete``: missing keys are ignored, the others removed)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio.lowlevel
import pytest

import kvpipe
from kvpipe.testing import BackendConformance


class StopsAtAMissingKey(kvpipe.MemoryStore):
    """Removes keys in order and returns at the first one it does not hold: the keys after
    it stay stored."""

    async def delete(self, keys: Sequence[str]) -> None:
        await anyio.lowlevel.checkpoint()
        for key in keys:
            if self._data.pop(key, None) is None:
                return


# The check deleted two stored keys and then the missing one, last: this store passed it.


async def test_a_delete_that_stops_at_a_missing_key_fails_the_suite() -> None:
    suite = BackendConformance()
    with pytest.raises(AssertionError):
        await suite.test_delete_removes_and_ignores_missing(StopsAtAMissingKey())
