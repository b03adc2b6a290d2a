"""The Mooncake residency index over a fake vendor client (no Mooncake needed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import kvpipe
from kvpipe import Residency, ResidencyEntry
from kvpipe.backends._mooncake_index import FIRST_PREFIX, NODES_KEY, RES_PREFIX, ResidencyIndex


class FakeClient:
    """A key-value client whose ``get`` answers ``b""`` when it fails, as the vendor's does."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.failing_gets = 0

    def get(self, key: str) -> bytes:
        if self.failing_gets:
            self.failing_gets -= 1
            return b""
        return self.data.get(key, b"")

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(k in self.data) for k in keys]

    def upsert(self, key: str, value: bytes) -> int:
        self.data[key] = bytes(value)
        return 0

    def upsert_batch(self, keys: list[str], values: list[bytes]) -> int:
        self.data.update(zip(keys, map(bytes, values), strict=True))
        return 0

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [self.data.get(k, b"") for k in keys]


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _entry(node: str) -> ResidencyEntry:
    return ResidencyEntry("ns:k0", node, Residency.CPU, 1.0)


async def test_a_failed_registry_read_never_drops_other_nodes() -> None:
    client = FakeClient()
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    client.failing_gets = 100  # every read of it fails (one is read again)
    with pytest.raises(kvpipe.BackendError, match="node registry"):
        await index.put(client, [_entry("b")])
    assert client.data[NODES_KEY] == b"a"
    client.failing_gets = 0
    await index.put(client, [_entry("b")])  # the registry reads again: b joins a
    assert client.data[NODES_KEY] == b"a\nb"
    got = await index.get(client, ["ns:k0"])
    assert [e.node_id for e in got[0]] == ["a", "b"]


async def test_an_empty_registry_is_empty() -> None:
    client = FakeClient()
    index = ResidencyIndex("mooncake", _call)
    assert await index.get(client, ["ns:k0"]) == [()]
    await index.put(client, [_entry("a")])
    assert client.data[NODES_KEY] == b"a"


@pytest.mark.parametrize("prefix", [FIRST_PREFIX, RES_PREFIX])
@pytest.mark.parametrize("raw", [b"{not json", b'{"r": "nowhere", "t": 1}', b'{"t": 1}', b"[1]"])
async def test_a_record_this_index_did_not_write_is_a_backend_error(
    raw: bytes, prefix: str
) -> None:
    """A damaged (or foreign) record under a residency key raised ``JSONDecodeError`` /
    ``KeyError`` / ``ValueError`` out of ``locate``; it is the store's failure."""
    client = FakeClient()
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    client.data[f"{prefix}ns:k0@a"] = raw
    with pytest.raises(kvpipe.BackendError, match="residency record"):
        await index.get(client, ["ns:k0"])


class ContendedRegistry(FakeClient):
    """Another node rewrites the registry (without ours) right after each of our first
    ``lost`` writes of it: we lose that many races, then our write sticks."""

    def __init__(self, lost: int) -> None:
        super().__init__()
        self.lost = lost
        self.writes = 0

    def upsert(self, key: str, value: bytes) -> int:
        self.writes += 1
        super().upsert(key, value)
        if key == NODES_KEY and self.writes <= self.lost:
            self.data[NODES_KEY] = b"other"
        return 0


async def test_a_registration_whose_last_try_sticks_succeeds() -> None:
    """Each try is read back: one whose fifth write stuck is registered, not an error
    ("did not stick" was raised without reading the last write back)."""
    client = ContendedRegistry(lost=4)
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    assert client.writes == 5
    assert client.data[NODES_KEY] == b"a\nother"
    got = await index.get(client, ["ns:k0"])
    assert [e.node_id for e in got[0]] == ["a"]


async def test_a_registration_that_never_sticks_is_a_backend_error() -> None:
    client = ContendedRegistry(lost=10)
    index = ResidencyIndex("mooncake", _call)
    with pytest.raises(kvpipe.BackendError, match="did not stick"):
        await index.put(client, [_entry("a")])
    assert client.writes == 5


class RewrittenRegistry(FakeClient):
    """Another node's write of the registry is in progress for our first ``busy`` calls to
    it, as the vendor answers then (seen with two clients registering at once on a real
    master): our ``upsert`` of it returns -601, and our ``get`` answers ``b""`` though
    ``batch_is_exist`` finds it."""

    def __init__(self, busy: int, op: str) -> None:
        super().__init__()
        self.busy = busy
        self.op = op

    def _in_progress(self, op: str, key: str) -> bool:
        if key == NODES_KEY and op == self.op and self.busy:
            self.busy -= 1
            return True
        return False

    def get(self, key: str) -> bytes:
        return b"" if self._in_progress("get", key) else super().get(key)

    def upsert(self, key: str, value: bytes) -> int:
        return -601 if self._in_progress("upsert", key) else super().upsert(key, value)


@pytest.mark.parametrize("op", ["get", "upsert"])
async def test_another_nodes_registration_in_progress_is_waited_out(op: str) -> None:
    """Two nodes registering at once is the race the registration's tries are for: a
    registry being rewritten by the other is tried again, not a failed flush (nor a failed
    locate)."""
    client = RewrittenRegistry(busy=0, op=op)
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    client.busy = 2
    await index.put(client, [_entry("b")])
    assert client.data[NODES_KEY] == b"a\nb"
    client.busy = 2
    got = await index.get(client, ["ns:k0"])
    assert [e.node_id for e in got[0]] == ["a", "b"]


class EmptyExistClient(FakeClient):
    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return []


async def test_a_registry_lookup_answer_of_the_wrong_length_is_a_backend_error() -> None:
    """Not the unpacking's raw ``ValueError``."""
    with pytest.raises(kvpipe.BackendError, match="batch_is_exist"):
        await ResidencyIndex("mooncake", _call).get(EmptyExistClient(), ["ns:k0"])


@pytest.mark.parametrize("bad", ["a\nb", "a@b", "a b", ""])
async def test_a_node_id_that_cannot_name_a_record_is_refused_before_anything_is_written(
    bad: str,
) -> None:
    """The registry holds one node id a line and a record is named ``key@node``: a node id
    with a newline joined the registry as two nodes, one with ``@`` named another record."""
    client = FakeClient()
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    before = dict(client.data)
    with pytest.raises(kvpipe.RequestError, match="node id"):
        await index.put(client, [_entry("c"), _entry(bad)])
    assert client.data == before


@pytest.mark.parametrize(
    "bad",
    [
        ResidencyEntry("ns:k0", "c", "cpu", 1.0),  # type: ignore[arg-type]
        ResidencyEntry("ns:k0", "c", Residency.CPU, float("inf")),
        ResidencyEntry("ns:k0", "c", Residency.CPU, "1"),  # type: ignore[arg-type]
        ("ns:k0", "c", Residency.CPU, 1.0),
    ],
    ids=["residency as text", "time inf", "time as text", "a tuple"],
)
async def test_a_record_that_cannot_be_written_is_refused_before_anything_is_written(
    bad: Any,
) -> None:
    """As a bad node id: a residency given as text raised a bare ``AttributeError`` after
    the node had joined the registry; an infinite time was written (``Infinity``) and read
    back as a record no other store holds."""
    client = FakeClient()
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    before = dict(client.data)
    with pytest.raises(kvpipe.RequestError):
        await index.put(client, [_entry("b"), bad])
    assert client.data == before


class FailingSecondWrite(FakeClient):
    """A client whose ``upsert_batch`` of names under ``RES_PREFIX`` fails (returns -1)."""

    def upsert_batch(self, keys: list[str], values: list[bytes]) -> int:
        if any(k.startswith(RES_PREFIX) for k in keys):
            return -1
        return super().upsert_batch(keys, values)


async def test_a_flush_stopped_between_its_two_writes_shows_its_new_record() -> None:
    """Each record is written under two names, the first then the second; a reader takes the
    newer, and of two as new (``updated_at`` is wall-clock time), the first written: the
    second may still hold the record before the flush."""
    client = FakeClient()
    index = ResidencyIndex("mooncake", _call)
    await index.put(client, [_entry("a")])
    stopped = FailingSecondWrite()
    stopped.data = client.data
    new = ResidencyEntry("ns:k0", "a", Residency.EVICTED, 1.0)  # the old record's time
    with pytest.raises(kvpipe.BackendError, match="upsert_batch"):
        await index.put(stopped, [new])
    assert client.data[f"{FIRST_PREFIX}ns:k0@a"] != client.data[f"{RES_PREFIX}ns:k0@a"]
    assert await index.get(client, ["ns:k0"]) == [(new,)]
    # An earlier version of kvpipe on that node writes the second name alone: it is newer.
    client.data[f"{RES_PREFIX}ns:k0@a"] = b'{"r": "gpu", "t": 3.0}'
    later = ResidencyEntry("ns:k0", "a", Residency.GPU, 3.0)
    assert await index.get(client, ["ns:k0"]) == [(later,)]
