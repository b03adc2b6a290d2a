"""The conformance suite's residency check catches a store where one node's record of a key
wipes the records other nodes flushed earlier (``put_residency`` replaces only that node's
previous record for the key)."""

from __future__ import annotations

from collections.abc import Sequence

import anyio.lowlevel
import pytest

import kvpipe
from kvpipe._results import ResidencyEntry
from kvpipe.testing import BackendConformance


class ReplacesEveryNode(kvpipe.MemoryStore):
    """Each call sets a key's records to that call's entries for it: a node flushing a key
    drops every other node's record of it (a value per key, not per key and node)."""

    async def put_residency(self, entries: Sequence[ResidencyEntry]) -> None:
        await anyio.lowlevel.checkpoint()
        fresh: dict[str, dict[str, ResidencyEntry]] = {}
        for e in entries:
            fresh.setdefault(e.key, {})[e.node_id] = e
        self._residency.update(fresh)


# The check's second call updated a key only node-a had a record of: this store passed it.


async def test_a_flush_that_drops_other_nodes_records_fails_the_suite() -> None:
    suite = BackendConformance()
    with pytest.raises(AssertionError):
        await suite.test_residency_index(ReplacesEveryNode())
