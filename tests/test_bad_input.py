"""Bad input at every public entry point gets a typed error that says what was wrong.

The cases here are the table in docs/reliability.md (keep them in step).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.testing.faults import FaultPlan

L = kvpipe.CacheLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
CACHE = kvpipe.create_kv_cache(L, 8)
TOK = np.arange(16)

SYNC: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    (
        "config: slice_block_num=0",
        lambda: kvpipe.PipelineConfig(slice_block_num=0),
        kvpipe.ConfigError,
        "slice_block_num",
    ),
    (
        "config: slice_timeout=inf",
        lambda: kvpipe.PipelineConfig(slice_timeout=float("inf")),
        kvpipe.ConfigError,
        "slice_timeout",
    ),
    (
        "config: total_timeout=-1",
        lambda: kvpipe.PipelineConfig(total_timeout=-1),
        kvpipe.ConfigError,
        "total_timeout",
    ),
    (
        "config: staging_bytes=0",
        lambda: kvpipe.PipelineConfig(staging_bytes=0),
        kvpipe.ConfigError,
        "staging_bytes",
    ),
    (
        "config: staging_bytes=2**60 (above physical memory)",
        lambda: kvpipe.PipelineConfig(staging_bytes=1 << 60),
        kvpipe.ConfigError,
        "physical memory",
    ),
    (
        "config: node_id=''",
        lambda: kvpipe.PipelineConfig(node_id=""),
        kvpipe.ConfigError,
        "node_id",
    ),
    (
        "env: KVPIPE_SLICE_TIMEOUT=abc",
        lambda: kvpipe.PipelineConfig.from_env({"KVPIPE_SLICE_TIMEOUT": "abc"}),
        kvpipe.ConfigError,
        "KVPIPE_SLICE_TIMEOUT",
    ),
    (
        "env: AS_WRITE_SLICE_BLOCK_NUM=0",
        lambda: kvpipe.PipelineConfig.from_env({"AS_WRITE_SLICE_BLOCK_NUM": "0"}),
        kvpipe.ConfigError,
        "AS_WRITE_SLICE_BLOCK_NUM",
    ),
    (
        "env: KVPIPE_VERIFY_CHECKSUMS=maybe",
        lambda: kvpipe.PipelineConfig.from_env({"KVPIPE_VERIFY_CHECKSUMS": "maybe"}),
        kvpipe.ConfigError,
        "KVPIPE_VERIFY_CHECKSUMS",
    ),
    (
        "layout: num_layers=0",
        lambda: kvpipe.CacheLayout.gqa(num_layers=0, num_kv_heads=1, head_dim=8, block_size=4),
        kvpipe.LayoutError,
        "num_layers",
    ),
    (
        "layout: dtype='float64'",
        lambda: kvpipe.CacheLayout.mla(
            num_layers=1, kv_lora_rank=8, rope_dim=8, block_size=4, dtype="float64"
        ),
        kvpipe.LayoutError,
        "float64",
    ),
    ("cache: num_blocks=0", lambda: kvpipe.create_kv_cache(L, 0), kvpipe.LayoutError, "num_blocks"),
    (
        "cache: framework='torch'",
        lambda: kvpipe.create_kv_cache(L, 4, framework="torch"),  # type: ignore[arg-type]
        kvpipe.LayoutError,
        "framework",
    ),
    (
        "tensors: wrong dtype",
        lambda: kvpipe.KVCache.from_tensors(L, [np.zeros((4, 1, 4, 8), np.float32)] * 2),
        kvpipe.LayoutError,
        "dtype",
    ),
    (
        "tensors: wrong shape",
        lambda: kvpipe.KVCache.from_tensors(
            L, [np.zeros((4, 1, 4, 9), CACHE.tensors()[0].dtype)] * 2
        ),
        kvpipe.LayoutError,
        "shape",
    ),
    (
        "tensors: missing role",
        lambda: kvpipe.KVCache.from_tensors(L, CACHE.tensors()[:1]),
        kvpipe.LayoutError,
        "expected 2",
    ),
    (
        "tensors: not a sequence",
        lambda: kvpipe.KVCache.from_tensors(L, 5),  # type: ignore[arg-type]
        kvpipe.LayoutError,
        "got int",
    ),
    (
        "tensors: not a layout",
        lambda: kvpipe.KVCache.from_tensors(None, CACHE.tensors()),  # type: ignore[arg-type]
        kvpipe.LayoutError,
        "CacheLayout",
    ),
    (
        "tensors: one tensor for key and value",
        lambda: kvpipe.KVCache.from_tensors(L, [CACHE.tensors()[0]] * 2),
        kvpipe.LayoutError,
        "key[0] and value[0] share memory",
    ),
    (
        "pipeline: namespace '../../etc'",
        lambda: kvpipe.Pipeline(CACHE, kvpipe.MemoryStore(), namespace="../../etc"),
        kvpipe.ConfigError,
        "namespace",
    ),
    (
        "pipeline: rank >= world_size",
        lambda: kvpipe.Pipeline(CACHE, kvpipe.MemoryStore(), rank=2, world_size=2),
        kvpipe.ConfigError,
        "rank",
    ),
    (
        "pipeline: staging smaller than a block",
        lambda: kvpipe.Pipeline(
            CACHE, kvpipe.MemoryStore(), config=kvpipe.PipelineConfig(staging_bytes=64)
        ),
        kvpipe.ConfigError,
        "staging_bytes",
    ),
    (
        "pipeline: not a store",
        lambda: kvpipe.Pipeline(CACHE, object()),  # type: ignore[arg-type]
        kvpipe.ConfigError,
        "store",
    ),
    (
        "file store: durability='sometimes'",
        lambda: kvpipe.FileStore("/tmp/x", durability="sometimes"),  # type: ignore[arg-type]
        kvpipe.ConfigError,
        "durability",
    ),
    (
        "file store: stale_temp_after=-1",
        lambda: kvpipe.FileStore("/tmp/x", stale_temp_after=-1),
        kvpipe.ConfigError,
        "stale_temp_after",
    ),
    (
        "file store: stale_temp_after=nan",
        lambda: kvpipe.FileStore("/tmp/x", stale_temp_after=float("nan")),
        kvpipe.ConfigError,
        "stale_temp_after",
    ),
    (
        "memory store: capacity_bytes=0",
        lambda: kvpipe.MemoryStore(capacity_bytes=0),
        kvpipe.ConfigError,
        "capacity_bytes",
    ),
    (
        "fault plan: unknown kind",
        lambda: FaultPlan.from_data({"rules": [{"op": "put", "kind": "explode"}]}),
        ValueError,
        "explode",
    ),
]


@pytest.mark.parametrize(("case", "call", "error", "says"), SYNC, ids=[c[0] for c in SYNC])
def test_construction(
    case: str, call: Callable[[], Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error) as info:
        call()
    assert says in str(info.value), str(info.value)
    if isinstance(info.value, kvpipe.ConfigError):
        assert info.value.field in (says, case.split(": ")[1].split("=")[0])


REQUESTS: list[tuple[str, str, tuple[Any, ...], dict[str, Any], str]] = [
    ("write: 2-D token ids", "write", (TOK.reshape(4, 4), np.arange(4)), {}, "1-D"),
    ("write: ragged token ids", "write", ([[0, 1], [2]], np.arange(4)), {}, "token_ids"),
    ("read: ragged block ids", "read", (TOK, [[0], [1, 2], [3]]), {}, "block_ids"),
    ("lookup: ragged token ids", "lookup", ([[0, 1], [2]],), {}, "token_ids"),
    ("write: no tokens", "write", ([], []), {}, "empty"),
    ("write: float token ids", "write", (TOK.astype(float), np.arange(4)), {}, "integers"),
    ("write: negative token id", "write", (-TOK, np.arange(4)), {}, "negative"),
    ("write: too few block ids", "write", (TOK, np.arange(3)), {}, "block_ids"),
    ("write: block id out of range", "write", (TOK, np.arange(4) + 5), {}, "outside"),
    (
        "write: uint64 block id above the int64 range",
        "write",
        (TOK, np.array([0, 1, 2, 2**63 + 1], dtype=np.uint64)),
        {},
        "block id 9223372036854775809 is outside",
    ),
    (
        "write: big-endian uint64 token id above the int64 range",
        "write",
        (np.array([2**64 - 1] * 16, dtype=">u8"), np.arange(4)),
        {},
        "above the int64 range",
    ),
    ("write: repeated block id", "write", (TOK, [0, 1, 1, 2]), {}, "repeats"),
    (
        "write: start_block past the end",
        "write",
        (TOK, np.arange(4)),
        {"start_block": 5},
        "start_block",
    ),
    ("write: timeout=0", "write", (TOK, np.arange(4)), {"timeout": 0}, "timeout"),
    ("read: timeout=nan", "read", (TOK, np.arange(4)), {"timeout": float("nan")}, "timeout"),
    (
        "read: include_partial='yes'",
        "read",
        (TOK, np.arange(4)),
        {"include_partial": "yes"},
        "include_partial",
    ),
    (
        "read: require_all='no'",
        "read",
        (TOK, np.arange(4)),
        {"require_all": "no"},
        "require_all must be a bool",
    ),
    ("lookup: timeout=10**400", "lookup", (TOK,), {"timeout": 10**400}, "timeout"),
    ("lookup: 2-D token ids", "lookup", (TOK.reshape(2, 8),), {}, "1-D"),
    (
        "lookup: include_partial='no'",
        "lookup",
        (TOK,),
        {"include_partial": "no"},
        "include_partial",
    ),
    ("locate: include_partial=1", "locate", (TOK,), {"include_partial": 1}, "include_partial"),
    (
        "flush_index: include_partial='no'",
        "flush_index",
        (TOK,),
        {"include_partial": "no"},
        "include_partial",
    ),
    ("flush_index: residency 'gpu'", "flush_index", (TOK,), {"residency": "gpu"}, "Residency"),
    ("flush_index: start_block=-1", "flush_index", (TOK,), {"start_block": -1}, "start_block"),
    (
        "flush_index: start_block=True",
        "flush_index",
        (TOK,),
        {"start_block": True},
        "start_block must be an int",
    ),
    (
        "flush_index: start_block=np.int64(5)",
        "flush_index",
        (TOK,),
        {"start_block": np.int64(5)},
        "start_block 5 is outside [0, 4]",
    ),
]


async def test_flush_index_takes_a_numpy_start_block_as_write_does() -> None:
    # np.int64(1) was refused as "start_block np.int64(1) is outside [0, 4]".
    async with kvpipe.open_pipeline(CACHE, kvpipe.MemoryStore()) as pipe:
        assert (await pipe.write(TOK, np.arange(4), start_block=np.int64(1))).written == 3
        assert await pipe.flush_index(TOK, start_block=np.int64(1)) == 3
        assert await pipe.flush_index(TOK, start_block=np.uint8(4)) == 0


async def test_numpy_timeouts_are_taken_as_numpy_start_blocks_are() -> None:
    # timeout=np.int64(2) or np.float32(2.0) was refused as "timeout must be a number".
    async with kvpipe.open_pipeline(CACHE, kvpipe.MemoryStore()) as pipe:
        assert (await pipe.write(TOK, np.arange(4), timeout=np.float32(2.0))).written == 4
        assert (await pipe.read(TOK, np.arange(4, 8), timeout=np.int64(2))).loaded == 4
        assert await pipe.lookup(TOK, timeout=np.uint16(2)) == 4


@pytest.mark.parametrize(
    ("case", "method", "args", "kwargs", "says"), REQUESTS, ids=[c[0] for c in REQUESTS]
)
async def test_requests(
    case: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], says: str
) -> None:
    async with kvpipe.open_pipeline(CACHE, kvpipe.MemoryStore()) as pipe:
        with pytest.raises(kvpipe.RequestError) as info:
            await getattr(pipe, method)(*args, **kwargs)
        assert says in str(info.value)
        assert pipe.statistics().in_flight == {}


async def test_a_file_store_root_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(kvpipe.BackendError, match="open"):
        await kvpipe.FileStore(tmp_path / "f").open()


async def test_a_closed_file_store_is_refused_at_open(tmp_path: Path) -> None:
    store = kvpipe.FileStore(tmp_path / "s")
    await store.open()
    await store.aclose()
    assert store.closed
    with pytest.raises(kvpipe.ConfigError, match="closed") as info:
        async with kvpipe.open_pipeline(CACHE, store):
            pass
    assert info.value.field == "store"


async def test_a_mooncake_master_that_is_not_there() -> None:
    from kvpipe.backends.mooncake_local import free_port

    port = free_port()
    with pytest.raises(kvpipe.BackendError, match="unreachable"):
        await kvpipe.MooncakeStore(f"127.0.0.1:{port}", "http://127.0.0.1:1/metadata").open()


@pytest.mark.parametrize("kind", ["memory", "file"])
async def test_a_raw_key_with_a_path_in_it(kind: str, tmp_path: Path) -> None:
    """A store's own refusal of a key is a kvpipe error (``RequestError``, still a
    ``ValueError``): it was a bare ``ValueError``, outside the one hierarchy."""
    store: kvpipe.StorageBackend = (
        kvpipe.MemoryStore() if kind == "memory" else kvpipe.FileStore(tmp_path / "s")
    )
    async with store:
        with pytest.raises(kvpipe.RequestError, match="invalid block key"):
            await store.delete(["../../etc/passwd"])
        with pytest.raises(kvpipe.RequestError, match="invalid block key"):
            await store.get_residency(["a b"])


async def test_a_value_client_refuses_bad_arguments_with_kvpipe_errors() -> None:
    """``ValueClient`` (public): a bad key or value is a ``RequestError``, a bad ``slots`` a
    ``ConfigError`` (both still ``ValueError``); they were bare ``ValueError``."""
    with pytest.raises(kvpipe.ConfigError, match="slots") as info:
        kvpipe.ValueClient(kvpipe.MemoryStore(), slots=0)
    assert info.value.field == "slots"
    async with kvpipe.MemoryStore() as store, kvpipe.ValueClient(store) as client:
        with pytest.raises(kvpipe.RequestError, match="invalid block key"):
            await client.put(["../x"], [b"x"])
        with pytest.raises(kvpipe.RequestError, match="one value per key"):
            await client.put(["a", "b"], [b"x"])
        with pytest.raises(kvpipe.RequestError, match="empty value"):
            await client.put(["a"], [b""])
        with pytest.raises(kvpipe.RequestError, match="one positive size per key"):
            await client.get(["a"], [0])
        with pytest.raises(kvpipe.RequestError, match="invalid block key"):
            await client.exists(["a b"])
        with pytest.raises(kvpipe.RequestError, match="invalid block key"):
            await client.delete(["a b"])


_KEY = "m@0123456789abcdef@0-1@" + "ab" * 16
_BAD_ENTRIES: list[tuple[str, Any, str]] = [
    ("residency as text", kvpipe.ResidencyEntry(_KEY, "n", "gpu", 1.0), "residency"),  # type: ignore[arg-type]
    ("node id with '@'", kvpipe.ResidencyEntry(_KEY, "a@b", kvpipe.Residency.GPU, 1.0), "node id"),
    ("empty node id", kvpipe.ResidencyEntry(_KEY, "", kvpipe.Residency.GPU, 1.0), "node id"),
    (
        "time NaN",
        kvpipe.ResidencyEntry(_KEY, "n", kvpipe.Residency.GPU, float("nan")),
        "updated_at",
    ),
    ("time as text", kvpipe.ResidencyEntry(_KEY, "n", kvpipe.Residency.GPU, "1"), "updated_at"),  # type: ignore[arg-type]
    ("a tuple", (_KEY, "n", kvpipe.Residency.GPU, 1.0), "ResidencyEntry"),
]


@pytest.mark.parametrize("kind", ["memory", "file"])
@pytest.mark.parametrize(("name", "bad", "match"), _BAD_ENTRIES, ids=[c[0] for c in _BAD_ENTRIES])
async def test_a_residency_record_no_store_could_name_or_read_back_is_refused(
    kind: str, name: str, bad: Any, match: str, tmp_path: Path
) -> None:
    """``put_residency`` (public) checks each entry as it checks each key: a
    ``RequestError`` before anything is recorded. The memory store recorded a residency
    given as text (every later ``locate`` over that block then failed, for every node), an
    empty node id or one with ``@``, a NaN or textual time; the file store raised a bare
    ``AttributeError`` for the text residency, a ``BackendError`` (a store failure) for the
    NaN, and recorded the rest."""
    store: kvpipe.StorageBackend = (
        kvpipe.MemoryStore() if kind == "memory" else kvpipe.FileStore(tmp_path / "s")
    )
    good = kvpipe.ResidencyEntry(_KEY, "good", kvpipe.Residency.CPU, 1.0)
    async with store:
        with pytest.raises(kvpipe.RequestError, match=match):
            await store.put_residency([good, bad])
        assert [tuple(r) for r in await store.get_residency([_KEY])] == [()]
