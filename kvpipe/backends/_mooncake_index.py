"""The residency index of :class:`kvpipe.MooncakeStore`, kept in Mooncake itself.

One JSON record per (block key, node), kept twice: under ``kvpipe-res-b@<key>@<node>``,
written first, and ``kvpipe-res@<key>@<node>``, written second (the one name of earlier
versions, which still read it); and a registry of node ids under ``kvpipe-res-nodes`` that
reads consult; see ``docs/backends.md``. Uses the vendor client it is handed, never imports
the vendor package.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, final

import anyio

from .._errors import BackendError
from .._results import Residency, ResidencyEntry
from ._base import validate_entry, validate_key

__all__ = ("FIRST_PREFIX", "NODES_KEY", "RES_PREFIX", "ResidencyIndex")

#: The name of a (key, node) record written second, the one name of earlier versions.
RES_PREFIX: Final = "kvpipe-res@"
#: The name of its copy written first: readable while the other is rewritten.
FIRST_PREFIX: Final = "kvpipe-res-b@"
NODES_KEY: Final = "kvpipe-res-nodes"
_REGISTER_TRIES: Final = 5


@final
class ResidencyIndex:
    """Residency records over a vendor client.

    Args:
        name: The store's name (for errors).
        call: Runs a blocking vendor function in a worker thread and translates its
            exceptions into :class:`kvpipe.BackendError` (the store's own call path).
    """

    def __init__(self, name: str, call: Callable[..., Awaitable[Any]]) -> None:
        self._name = name
        self._call = call

    async def put(self, client: Any, entries: Sequence[ResidencyEntry]) -> None:
        """Replace each (key, node) record; every node of ``entries`` joins the registry.

        The vendor's upsert of a stored name leaves it unreadable until the upsert ends, so
        each record is kept under two names written one after the other: while either is
        rewritten the other holds the old record or the new one, and a reader never finds
        none. A failed first write leaves the second name as it was.

        Raises:
            BackendError: A vendor call failed, or a node would not stay in the registry.
            RequestError: An entry :func:`~kvpipe.backends._base.validate_entry` refuses, before
                anything is written: a node id that is empty, not printable, or holds a
                space or ``@`` (the registry is one id a line; a record is named
                ``key@node``), a bad key, a residency that is no ``Residency``, a time that
                is no finite number (a ``ValueError``).
        """
        for e in entries:
            validate_entry(e)
        for node in {e.node_id for e in entries}:
            await self._register(client, node)
        # The last record of each (key, node): the vendor's upsert_batch of a name given more
        # than once keeps the first value.
        last = {f"{e.key}@{e.node_id}": e for e in entries}
        values = [
            json.dumps({"r": e.residency.value, "t": e.updated_at}).encode() for e in last.values()
        ]
        if not last:
            return
        for prefix in (FIRST_PREFIX, RES_PREFIX):  # never both unreadable at once
            names = [prefix + name for name in last]
            rc = await self._call(client.upsert_batch, names, values)
            if rc != 0:
                raise BackendError(self._name, "upsert_batch", f"returned {rc}")

    async def get(self, client: Any, keys: Sequence[str]) -> list[tuple[ResidencyEntry, ...]]:
        """Every registered node's record for each key (an empty tuple: none).

        Raises:
            BackendError: A vendor call failed or answered with the wrong number of values.
        """
        keys = [validate_key(k) for k in keys]
        nodes = sorted(await self._nodes(client))
        if not nodes or not keys:
            return [() for _ in keys]
        # Each name once: the vendor's get_batch fills only the last answer of a name asked
        # more than once, the others hold stale transfer-buffer bytes.
        distinct = list(dict.fromkeys(keys))
        names = [
            f"{prefix}{key}@{node}"
            for key in distinct
            for node in nodes
            for prefix in (FIRST_PREFIX, RES_PREFIX)
        ]
        raws = await self._call(client.get_batch, names)
        if len(raws) != len(names):
            raise BackendError(self._name, "get_batch", f"{len(raws)} values for {len(names)}")
        at = {key: i for i, key in enumerate(distinct)}
        out: list[tuple[ResidencyEntry, ...]] = []
        for key in keys:
            found = []
            for j, node in enumerate(nodes):
                i = 2 * (at[key] * len(nodes) + j)
                # b"" is a missing name (or one being rewritten, or a failed get: no record
                # is trusted); of two, the newer, and on a tie the one written first (a
                # flush between its two writes: the other is the old record).
                copies = [self._entry(key, node, bytes(raw)) for raw in raws[i : i + 2] if raw]
                if copies:
                    found.append(max(copies, key=lambda e: e.updated_at))
            out.append(tuple(found))
        return out

    def _entry(self, key: str, node: str, raw: bytes) -> ResidencyEntry:
        """The record ``raw`` of ``key`` on ``node``.

        Raises:
            BackendError: It is not a record this index wrote (damaged, or another writer's).
        """
        try:
            rec = json.loads(raw)
            return ResidencyEntry(key, node, Residency(rec["r"]), float(rec["t"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise BackendError(
                self._name, "get_batch", f"residency record of {key!r} on {node!r}: {exc!r}"
            ) from exc

    async def _register(self, client: Any, node: str) -> None:
        """Make sure ``node`` is in the registry, checked on every flush: there is no
        compare-and-set, so a concurrent registration or a restarted master may drop it.
        Up to :data:`_REGISTER_TRIES` writes, each read back; a write the vendor refuses
        (another node's write of the registry in progress answers -601) is a lost race too.
        """
        rc = 0
        for attempt in range(_REGISTER_TRIES + 1):
            nodes = await self._nodes(client)
            if node in nodes:
                return
            if attempt == _REGISTER_TRIES:
                break
            rc = await self._call(
                client.upsert, NODES_KEY, "\n".join(sorted({*nodes, node})).encode()
            )
            await anyio.sleep(0.005 * attempt)
        why = f"returned {rc}" if rc != 0 else f"{node!r} did not stick"
        raise BackendError(self._name, "upsert", f"node registry: {why}")

    async def _nodes(self, client: Any) -> set[str]:
        """The registered node ids.

        Raises:
            BackendError: The registry could not be read. The vendor's ``get`` answers
                ``b""`` for a missing key and for a failed get alike: an empty answer counts
                as an empty registry only where the key is not stored (else a flush would
                rewrite the registry with its own node alone, dropping every other node).
                One stored but not read (as while another node rewrites it) is read again,
                up to :data:`_REGISTER_TRIES` times.
        """
        for attempt in range(_REGISTER_TRIES):
            if attempt:
                await anyio.sleep(0.005 * attempt)
            raw = bytes(await self._call(client.get, NODES_KEY))
            if raw:
                return {n for n in raw.decode().split("\n") if n}
            answer = list(await self._call(client.batch_is_exist, [NODES_KEY]))
            if len(answer) != 1:
                raise BackendError(self._name, "batch_is_exist", f"{len(answer)} codes for 1")
            (code,) = answer
            if code == 0:
                return set()
            if code != 1:
                raise BackendError(self._name, "batch_is_exist", f"node registry: code {code}")
            # stored, not read: another node's write of it in progress, read again
        raise BackendError(self._name, "get", "node registry: stored, but not read")
