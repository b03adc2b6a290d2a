"""kvpipe.integrations.fastdeploy, driven as FastDeploy's cache transfer manager drives its
storage backend: synchronously, from a pool of worker threads, with per-layer Paddle CPU
tensors (``attention_store``) or host buffers addressed by pointer (``file`` / ``mooncake``)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest
import trio.testing

import kvpipe
from kvpipe.integrations.fastdeploy import KVPipeAttentionStore, KVPipeStorage, _namespace

paddle = pytest.importorskip("paddle")
paddle.set_device("cpu")

LAYERS, BLOCKS, BS = 2, 32, 4
ROOT = Path(__file__).resolve().parents[2]


def _gqa(fill: bool, dtype: str = "bfloat16") -> tuple[list, list]:
    def one() -> object:
        if not fill:
            return paddle.zeros([BLOCKS, 2, BS, 8], dtype=dtype)
        if dtype == "uint8":
            return paddle.randint(0, 255, [BLOCKS, 2, BS, 8]).astype("uint8")
        return paddle.randn([BLOCKS, 2, BS, 8]).astype(dtype)

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def _bytes(t: object) -> bytes:
    return np.ascontiguousarray(t.numpy()).tobytes()  # type: ignore[attr-defined]


def _rows(tensors: Sequence[object], ids: Sequence[int]) -> list[bytes]:
    return [_bytes(t[i]) for t in tensors for i in ids]  # type: ignore[index]


def _store(**kw: object) -> KVPipeAttentionStore:
    return KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore(), **kw
    )


# -- attention_store ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["gqa-bf16", "gqa-fp8", "gqa-fp8-float16-scales", "gqa-fp8-float32-scales", "mla"]
)
def test_attention_store_round_trip_from_8_threads(kind: str) -> None:
    """8 threads write 8 sequences and read them back into other blocks: byte-exact; the
    counts are FastDeploy's (blocks from the start index); a second write counts the
    already-stored blocks (dedup) and a query the leading stored run."""
    scales_src = scales_dst = None
    if kind == "mla":
        src_k = [paddle.randn([BLOCKS, 1, BS, 72]).astype("bfloat16") for _ in range(LAYERS)]
        dst_k = [paddle.zeros([BLOCKS, 1, BS, 72], dtype="bfloat16") for _ in range(LAYERS)]
        src_v: list = []
        dst_v: list = []
    elif kind.startswith("gqa-fp8"):
        # FastDeploy's scales are of paddle's default dtype: float32, or the model's
        sd = kind.split("-")[2] if kind.endswith("-scales") else "bfloat16"
        src_k, src_v = _gqa(True, "uint8")
        dst_k, dst_v = _gqa(False, "uint8")
        scales_src = [paddle.randn([BLOCKS, 2, BS]).astype(sd) for _ in range(2 * LAYERS)]
        scales_dst = [paddle.zeros([BLOCKS, 2, BS], dtype=sd) for _ in range(2 * LAYERS)]
    else:
        src_k, src_v = _gqa(True)
        dst_k, dst_v = _gqa(False)
    with _store(cache_sets=2) as store:  # source and destination caches, both in use

        def one(i: int) -> tuple[int, int, int, int]:
            tokens = list(range(i * 1000, i * 1000 + 3 * BS + 1))  # 3 full blocks + 1 token
            ids = [3 * i, 3 * i + 1, 3 * i + 2]
            w = store.write(f"t{i}", src_k, src_v, tokens, ids, 0, 10.0, scale_cache=scales_src)
            again = store.write(
                f"t{i}", src_k, src_v, tokens, ids[1:], 1, 10.0, scale_cache=scales_src
            )
            q = store.query(f"t{i}", tokens, 1)
            dst = [BLOCKS - 1 - 3 * i - j for j in range(3)]
            r = store.read(f"t{i}", dst_k, dst_v, tokens, dst, 0, 10.0, scale_cache=scales_dst)
            return w, again, q, r

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        assert results == [(3, 2, 2, 3)] * 8
        assert len(store._pipes) == 2  # one KVCache wrapping per set of tensors, not per call
    for i in range(8):
        src_ids, dst_ids = [3 * i + j for j in range(3)], [BLOCKS - 1 - 3 * i - j for j in range(3)]
        assert _rows(dst_k + dst_v, dst_ids) == _rows(src_k + src_v, src_ids)
        if scales_src:
            assert _rows(scales_dst, dst_ids) == _rows(scales_src, src_ids)
    assert not [t for t in threading.enumerate() if t.name.startswith("kvpipe-fastdeploy")]


def test_model_versions_never_share_blocks() -> None:
    store = kvpipe.MemoryStore()
    k, v = _gqa(True)
    tokens = list(range(2 * BS))
    with (
        KVPipeAttentionStore(
            layer_num=LAYERS, block_token_size=BS, store=store, model_version="v1"
        ) as a,
        KVPipeAttentionStore(
            layer_num=LAYERS, block_token_size=BS, store=store, model_version="v2"
        ) as b,
    ):
        assert a.write("t", k, v, tokens, [0, 1], 0) == 2
        b.write("t", k, v, tokens[:BS], [0], 0)  # binds b's caches
        assert b.query("t", tokens, 0) == 1
        assert a.query("t", tokens, 0) == 2


def test_namespace_and_model_version_never_run_together() -> None:
    # ("ernie", "4.5") and ("ernie.4", "5") joined with "." were one kvpipe namespace: a
    # model version read another's blocks (same layout, so nothing caught it)
    store = kvpipe.MemoryStore()
    k, v = _gqa(True)
    tokens = list(range(2 * BS))
    with (
        KVPipeAttentionStore(
            layer_num=LAYERS,
            block_token_size=BS,
            store=store,
            namespace="ernie",
            model_version="4.5",
        ) as a,
        KVPipeAttentionStore(
            layer_num=LAYERS,
            block_token_size=BS,
            store=store,
            namespace="ernie.4",
            model_version="5",
        ) as b,
    ):
        assert a.write("t", k, v, tokens, [0, 1], 0) == 2
        b.write("t", k, v, tokens[:BS], [0], 0)  # binds b's caches
        assert b.query("t", tokens, 0) == 1  # b's block 0 only, none of a's


@pytest.mark.parametrize(
    ("one", "other"),
    [
        (("a.b", "c"), ("a", "b.c")),  # both of namespace characters
        (("a b", "c.d"), ("a b.c", "d")),  # both cleaned and hashed
        (("a", "b"), ("a.b", "")),
    ],
)
def test_distinct_namespace_and_version_pairs_give_distinct_namespaces(
    one: tuple[str, str], other: tuple[str, str]
) -> None:
    assert _namespace(*one) != _namespace(*other)


def _instance(store: kvpipe.MemoryStore, role: str, pd: bool) -> KVPipeAttentionStore:
    """An attention store of ``role`` over ``store``, with or without PD via storage."""
    return KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=store, splitwise_role=role, pd_via_storage=pd
    )


def _fastdeploy_read(store: KVPipeAttentionStore, k: list, v: list, tokens: list, ids: list) -> int:
    """cache_transfer_manager.read_storage_task's order for ``attention_store``: a query,
    then a read of only what it matched (none at all on 0); the blocks loaded."""
    matched = store.query("r", tokens, 0, 10.0)
    if matched <= 0:
        return 0
    return store.read("r", k, v, tokens[: matched * BS], ids[:matched], 0, 10.0)


@pytest.mark.parametrize("pd", [False, True])
def test_a_fresh_decode_instance_reads_in_fastdeploys_order(pd: bool) -> None:
    """A decode instance that has written nothing (a fresh one, the decode side of PD via
    storage) has no caches bound, so its query can look nothing up. It answered 0, and
    FastDeploy, which reads only what a query matched, never read: the decode side never
    loaded a block its prefill side wrote. It answers every block asked about instead; the
    read binds the caches and loads what is stored."""
    shared = kvpipe.MemoryStore()
    k, v = _gqa(True)
    tokens = list(range(3 * BS + (1 if pd else 0)))  # PD: the partial last block too
    n = 4 if pd else 3

    with _instance(shared, "prefill", pd) as prefill:
        assert prefill.write("w", k, v, tokens, list(range(n)), 0, 10.0) == n
    dk, dv = _gqa(False)
    with _instance(shared, "decode", pd) as decode:
        dst = [20, 21, 22, 23][:n]
        assert _fastdeploy_read(decode, dk, dv, tokens, dst) == n
        assert _rows(dk + dv, dst) == _rows(k + v, list(range(n)))
        assert decode.query("again", tokens, 0) == n  # bound now: looked up
        assert decode.query("other", list(range(500, 500 + 2 * BS)), 0) == 0
    with _store() as mixed:  # not a decode instance: 0 until the caches are bound
        assert mixed.query("q", tokens, 0) == 0


def test_block_ids_begin_at_the_start_index_as_fastdeploy_passes_them() -> None:
    """FastDeploy's write-back queries the stored run ``m``, then calls ``write(...,
    gpu_block_ids[m:], m)`` (cache_transfer_manager.write_back_storage_task; its own
    AttentionStore.write maps ``gpu_block_ids[i]`` to block ``start + i``), and reads use
    the returned count as ``gpu_block_ids[:n]``. The blocks after the stored run are stored
    from the blocks FastDeploy named, and read back into the blocks it named."""
    k, v = _gqa(True)
    tokens = list(range(4 * BS))
    src = [5, 6, 7, 8]
    with _store() as store:
        assert store.write("t1", k, v, tokens[: 2 * BS], src[:2], 0) == 2
        m = store.query("t2", tokens, 0)
        assert m == 2
        assert store.write("t2", k, v, tokens, src[m:], m) == 2
        assert store.query("t3", tokens, 0) == 4
        dk, dv = _gqa(False)
        assert store.read("t4", dk, dv, tokens, [20, 21], 2) == 2
        assert _rows(dk + dv, [20, 21]) == _rows(k + v, [7, 8])
        assert store.read("t5", dk, dv, tokens, [10, 11, 12, 13], 0) == 4
        assert _rows(dk + dv, [10, 11, 12, 13]) == _rows(k + v, src)


def test_a_read_from_a_start_index_loads_the_blocks_fastdeploys_tokens_cover(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """cache_transfer_manager.read_storage_task queries from ``start_read_block_idx`` (the
    blocks the server already holds), then reads with ``token_ids[:matched * block_size]``
    and ``gpu_block_ids[:matched]``: the tokens end ``start`` blocks short of the last block
    asked for. The read raised RequestError into FastDeploy's thread (an ERROR and a
    traceback there, nothing loaded); it loads the blocks the tokens cover, in order."""
    k, v = _gqa(True)
    tokens = list(range(6 * BS))
    with _store() as store:
        assert store.write("w", k, v, tokens, [10, 11, 12, 13, 14, 15], 0) == 6
        dk, dv = _gqa(False)
        start = 2
        matched = store.query("q", tokens, start)
        assert matched == 4
        dst = [20, 21, 22, 23, 24]
        with caplog.at_level(logging.DEBUG, "kvpipe"):
            n = store.read("r", dk, dv, tokens[: matched * BS], dst[:matched], start)
        assert n == 2  # blocks 2 and 3: the tokens cover blocks 0 .. 3
        assert _rows(dk + dv, dst[:2]) == _rows(k + v, [12, 13])
        assert _rows(dk + dv, dst[2:]) == _rows(dk + dv, [0, 0, 0])  # untouched
        assert [r.levelname for r in caplog.records if "cover" in r.message] == ["WARNING"]
        caplog.clear()
        with caplog.at_level(logging.DEBUG, "kvpipe"):  # tokens that cover nothing past it
            assert store.read("r2", dk, dv, tokens[: 2 * BS], dst[:2], start) == 0
        assert [r.levelname for r in caplog.records if "cover" in r.message] == ["DEBUG"]
        assert store.read("r3", dk, dv, tokens, dst[:4], start) == 4  # enough tokens: all
        assert _rows(dk + dv, dst[:4]) == _rows(k + v, [12, 13, 14, 15])
        dk, dv = _gqa(False)  # tokens past the blocks given, as write takes them: those read
        assert store.read("r4", dk, dv, tokens, [30, 31], 0) == 2
        assert _rows(dk + dv, [30, 31]) == _rows(k + v, [10, 11])


def test_a_read_from_a_start_index_past_the_tokens_loads_nothing_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The common case of FastDeploy's short tokens: the server holds more blocks than the
    store has past them (``start`` 4, ``matched`` 1), so ``token_ids[:matched *
    block_size]`` ends before the start index. The read raised RequestError ('4 tokens make
    1 full block(s); block_ids has 4') into FastDeploy's thread (an ERROR and a traceback
    there) instead of loading the 0 blocks the tokens cover; the WARNING said the tokens
    covered blocks up to 4."""
    k, v = _gqa(True)
    tokens = list(range(8 * BS))
    with _store() as store:
        assert store.write("w", k, v, tokens, [10, 11, 12, 13, 14], 0) == 5
        dk, dv = _gqa(False)
        start = 4
        matched = store.query("q", tokens, start)
        assert matched == 1
        before = _rows(dk + dv, [20])
        with caplog.at_level(logging.DEBUG, "kvpipe"):
            n = store.read("r", dk, dv, tokens[: matched * BS], [20], start)
        assert n == 0
        assert _rows(dk + dv, [20]) == before  # untouched
        warned = [r for r in caplog.records if "cover" in r.message]
        assert [r.levelname for r in warned] == ["WARNING"]
        assert "cover blocks up to 1," in warned[0].message  # block 0 only: 1 full block
        assert store.read("r2", dk, dv, tokens, [20], start) == 1  # enough tokens: loaded
        assert _rows(dk + dv, [20]) == _rows(k + v, [14])


@pytest.mark.parametrize(("start", "pd"), [(2, False), (4, False), (1, True)])
def test_a_read_after_its_query_loads_every_block_matched(start: int, pd: bool) -> None:
    """In FastDeploy's order (read_storage_task: query(task, tokens, start), then from the
    same thread read(task, tokens[:matched * block_size], ids[:matched], start)) the read
    takes the query's tokens, which its own begin, and loads every block matched from the
    start index, not only those its cut tokens cover (none at all once start >= matched;
    on the decode side of PD via storage, a RequestError)."""
    k, v = _gqa(True)
    tokens = list(range(6 * BS + (3 if pd else 0)))
    n = 7 if pd else 6
    shared = kvpipe.MemoryStore()

    with _instance(shared, "prefill" if pd else "mixed", pd) as writer:
        assert writer.write("w", k, v, tokens, list(range(10, 10 + n)), 0) == n
    dk, dv = _gqa(False)
    with _instance(shared, "decode" if pd else "mixed", pd) as reader:
        if not pd:  # a mixed instance looks up nothing before its caches are bound
            assert reader.read("bind", dk, dv, tokens[:BS], [31], 0) == 1
        matched = reader.query("t", tokens, start)
        assert matched == n - start
        dst = list(range(20, 20 + matched))
        got = reader.read("t", dk, dv, tokens[: matched * BS], dst, start)
        assert got == matched
        assert _rows(dk + dv, dst) == _rows(k + v, list(range(10 + start, 10 + n)))


def test_query_counts_from_the_start_index_when_blocks_before_it_are_not_stored() -> None:
    """``query(..., start_match_block_idx=m)`` asks about blocks ``m ..`` only (FastDeploy's
    AttentionStore passes the index to the SDK's ``match``): a server holding blocks ``0 ..
    m-1`` itself finds the stored blocks after them, even when those first blocks were never
    stored (or were evicted from the store). Counting from block 0 and subtracting ``m``
    returned 0 here: a missed hit."""
    k, v = _gqa(True)
    tokens = list(range(4 * BS))
    with _store() as store:
        assert store.write("t1", k, v, tokens, [7, 8], 2) == 2  # blocks 2 and 3 only
        assert store.query("q0", tokens, 0) == 0
        assert store.query("q1", tokens, 1) == 0
        assert store.query("q2", tokens, 2) == 2
        assert store.query("q3", tokens, 3) == 1
        assert store.query("q4", tokens, 4) == 0
        assert store.write("t2", k, v, tokens, [5, 6], 0) == 2
        assert store.query("q5", tokens, 0) == 4
        assert store.query("q6", tokens, 1) == 3


def test_flush_token_index_records_gpu_then_gone_from_this_pod() -> None:
    """FastDeploy's flush-only mode (PR #7609) passes ``reside_in_gpu=flush_cache_exists``:
    ``True`` at request finish (the blocks are in this pod's GPU), ``False`` when the blocks
    no longer exist on this node (a CPU eviction: ``prefix_cache_manager.free_cpu_block_ids``;
    its AttentionStore tells the SDK they moved from HBM to nowhere). So ``False`` is
    ``EVICTED`` for this pod, never "held in CPU memory"."""
    k, v = _gqa(True)
    tokens = list(range(4 * BS))
    seen: list[list[kvpipe.Residency | None]] = []

    async def where(pipe: kvpipe.Pipeline) -> int:
        found = await pipe.locate(tokens)
        seen.append([b.held_by(store.pod_name) for b in found])
        return len(found)

    with _store() as store:
        assert store.write("t1", k, v, tokens, [1, 2, 3, 4], 0) == 4  # binds the caches
        store.flush_token_index("f1", tokens, 0, True)
        assert store._on_last_pipe("locate", "l1", 5.0, where) == 4
        store.flush_token_index("f2", tokens, 2, False)
        assert store._on_last_pipe("locate", "l2", 5.0, where) == 4
    gpu, gone = kvpipe.Residency.GPU, kvpipe.Residency.EVICTED
    assert seen == [[gpu] * 4, [gpu, gpu, gone, gone]]


def test_write_takes_token_ids_past_the_blocks_it_is_given() -> None:
    """FastDeploy's write-back passes the request's token ids (prompt plus output with
    output caching: prefix_cache_manager.write_cache_to_storage) with one gpu block per key
    of the radix-tree leaf, so the ids may cover more full blocks than ``start +
    len(gpu_block_ids)`` (the last sampled token's block is never in the tree). Its
    AttentionStore.write slices them to ``token_ids[: (start + slice_end) * block_token_size]``
    and stores the blocks it was given; so does the adapter, instead of raising (which the
    manager's _run_write_back_storage turns into 0 blocks written)."""
    k, v = _gqa(True)
    tokens = list(range(4 * BS))  # 4 full blocks; the tree holds the first 3
    with _store() as store:
        assert store.write("t1", k, v, tokens, [5, 6, 7], 0) == 3
        assert store.query("t1", tokens, 0) == 3
        assert store.write("t2", k, v, [*tokens, 9], [8], 3) == 1  # from the start index
        assert store.write("t3", k, v, tokens, [], 4) == 0
        dk, dv = _gqa(False)
        assert store.read("t4", dk, dv, tokens, [10, 11, 12, 13], 0) == 4
        assert _rows(dk + dv, [10, 11, 12, 13]) == _rows(k + v, [5, 6, 7, 8])


def _mtp(fill: bool, expand_ratio: float) -> tuple[list, list]:
    """FastDeploy's caches with MTP (speculative method "mtp"): the model's ``LAYERS`` layers,
    then ``num_extra_cache_layer`` = 1 draft-model layer of ``int(BLOCKS *
    num_gpu_block_expand_ratio)`` blocks, heads, block size, head dim and dtype as the
    model's (cache_transfer_manager._init_gpu_cache, spec_decode/mtp.py
    initialize_kv_cache). The draft layer's block ``b`` is the model's block ``b``: MTP
    copies the request's block table; its blocks past the model's are its own free list."""
    k, v = _gqa(fill)
    n = int(BLOCKS * expand_ratio)
    for caches in (k, v):
        t = paddle.randn([n, 2, BS, 8]) if fill else paddle.zeros([n, 2, BS, 8])
        caches.append(t.astype("bfloat16"))
    return k, v


@pytest.mark.parametrize("expand_ratio", [1, 1.25])
def test_mtp_caches_round_trip_with_the_draft_layer(expand_ratio: float) -> None:
    """The manager passes ``layer_num = num_layers + num_extra_layers`` and as many
    tensors; with ``num_gpu_block_expand_ratio`` above 1 (a speculative_config key) the
    draft layer has more blocks than the others. Its blocks come back with the model's,
    under the same block ids, as FastDeploy's AttentionStore moves them (one block id list
    for every layer); its blocks past the model's are not touched."""
    src_k, src_v = _mtp(True, expand_ratio)
    dst_k, dst_v = _mtp(False, expand_ratio)
    tokens = list(range(3 * BS))
    with KVPipeAttentionStore(
        layer_num=LAYERS + 1,
        block_token_size=BS,
        store=kvpipe.MemoryStore(),
        cache_sets=2,
    ) as store:
        assert store.write("t", src_k, src_v, tokens, [3, 4, 5], 0) == 3
        assert store.query("t", tokens, 0) == 3
        assert store.read("t", dst_k, dst_v, tokens, [BLOCKS - 1, 0, 7], 0) == 3
    assert _rows(dst_k + dst_v, [BLOCKS - 1, 0, 7]) == _rows(src_k + src_v, [3, 4, 5])
    for t in (dst_k[-1], dst_v[-1]):
        assert not t.astype("float32").numpy()[BLOCKS:].any()


def test_a_draft_layer_with_fewer_blocks_is_a_clear_value_error() -> None:
    """num_gpu_block_expand_ratio below 1: the model's block ids would run past the draft
    layer's blocks, so the caches are refused, naming the shapes."""
    k, v = _mtp(True, 0.5)
    with (
        KVPipeAttentionStore(
            layer_num=LAYERS + 1, block_token_size=BS, store=kvpipe.MemoryStore()
        ) as store,
        pytest.raises(kvpipe.LayoutError, match=r"\[16, 2, 4, 8\]"),
    ):
        store.write("t", k, v, list(range(BS)), [0], 0)


def test_layout_mismatch_is_a_clear_value_error() -> None:
    """A LayoutError (a ValueError): it was a bare ValueError, outside kvpipe's hierarchy
    (the adapter even turned from_tensors' LayoutError into one)."""
    k, v = _gqa(True)
    with _store() as store, pytest.raises(kvpipe.LayoutError, match="block_token_size"):
        bad = KVPipeAttentionStore(layer_num=LAYERS, block_token_size=8, store=kvpipe.MemoryStore())
        try:
            bad.write("t", k, v, list(range(8)), [0], 0)
        finally:
            bad.close()
    with _store() as store, pytest.raises(kvpipe.LayoutError, match="layer_num"):
        store.write("t", k[:1], v[:1], list(range(8)), [0, 1], 0)


def test_bad_arguments_raise() -> None:
    k, v = _gqa(True)
    with _store() as store, pytest.raises(kvpipe.RequestError):
        store.write("t", k, v, list(range(8)), [0, 0], 0)  # a repeated block id


def test_env_identity_and_unknown_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AS_NAMESPACE", "ns1")
    monkeypatch.setenv("AS_MODEL_VERSION", "v9")
    monkeypatch.setenv("AS_POD_NAME", "pod")
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "3")
    with _store(namespace="ignored", something_new=1) as store:
        assert store.kvpipe_namespace == "ns1.v9"
        assert store.pod_name == "pod_mixed_0"
        assert store.config.slice_block_num == 3


class HangingStore(kvpipe.MemoryStore):
    """Stores the first ``ok`` put calls, then never answers a put again."""

    def __init__(self, ok: int) -> None:
        super().__init__()
        self.ok = ok

    async def put_blocks(self, batch: kvpipe.PutBatch) -> Sequence[kvpipe.BlockStatus]:
        if self.ok <= 0:
            await anyio.sleep_forever()
        self.ok -= 1
        return await super().put_blocks(batch)


def test_hanging_store_write_returns_the_stored_prefix(
    caplog: pytest.LogCaptureFixture, virtual_loop: trio.testing.MockClock
) -> None:
    """Slices of 2 blocks; the store hangs from the second slice: write returns 2 (the
    stored prefix) at that slice's ``slice_timeout``, with one WARNING, and the next calls
    still work.

    In virtual time (``virtual_loop``): in real time the first slice, the dedup probe and
    opening the pipeline raced the 0.2 s slice timeout and the 0.5 s call timeout, and on a
    loaded machine lost (the second slice then started too late for its own slice timeout:
    ``total_timeout``). The calls' timeouts only guard hangs; the slice timeout is exact."""
    config = kvpipe.PipelineConfig(slice_block_num=2, slice_timeout=0.2, staging_bytes=1 << 20)
    k, v = _gqa(True)
    store = KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=HangingStore(1), config=config
    )
    with store, caplog.at_level(logging.WARNING):
        tokens = list(range(6 * BS))
        assert store.write("t1", k, v, tokens, list(range(6)), 0, 30.0) == 2
        assert [r.levelname for r in caplog.records if "t1" in r.getMessage()] == ["WARNING"]
        stop = "slice_timeout (slice 1 ran out of time after 0.200 s)"
        assert stop in caplog.records[-1].getMessage()
        assert store.query("t2", tokens, 0) == 2
        dk, dv = _gqa(False)
        assert store.read("t3", dk, dv, tokens, list(range(10, 16)), 0, 30.0) == 2


class SlowStore(kvpipe.MemoryStore):
    """Each put call takes 0.4 s."""

    async def put_blocks(self, batch: kvpipe.PutBatch) -> Sequence[kvpipe.BlockStatus]:
        await anyio.sleep(0.4)
        return await super().put_blocks(batch)


def test_as_write_total_timeout_takes_the_place_of_the_calls_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FastDeploy's AttentionStore.write takes ``AS_WRITE_TOTAL_TIMEOUT`` over the timeout
    the manager passes (``float(os.getenv("AS_WRITE_TOTAL_TIMEOUT", str(timeout)))``); the
    manager passes one on every call, so a deployment sets the variable to give long
    write-backs their time. Three slices of 0.4 s each: all stored within the variable's
    5 s although the call says 0.5 s."""
    monkeypatch.setenv("AS_WRITE_TOTAL_TIMEOUT", "5")
    monkeypatch.setenv("AS_WRITE_SLICE_BLOCK_NUM", "1")
    monkeypatch.setenv("AS_WRITE_SLICE_TIMEOUT", "3")
    k, v = _gqa(True)
    tokens = list(range(3 * BS))
    with KVPipeAttentionStore(layer_num=LAYERS, block_token_size=BS, store=SlowStore()) as store:
        assert store.config.total_timeout == 5.0
        assert store.write("t", k, v, tokens, [0, 1, 2], 0, 0.5) == 3


class StuckRegistrationStore(kvpipe.MemoryStore):
    """Registering staging (a pipeline opening) never answers: a transport that hangs."""

    def __init__(self) -> None:
        super().__init__()
        self.registering = threading.Event()

    async def register_staging(self, buffer: memoryview) -> None:
        self.registering.set()
        await anyio.sleep_forever()


def test_a_read_that_gives_up_returns_only_after_its_copy_into_the_caches_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read whose answer did not come back within ``timeout + HOP_SLACK`` (here: its
    last copy into the caches, begun before the deadline, still running) returned 0 at
    once, while that copy went on writing into the blocks: FastDeploy recycles the blocks of
    a read that loaded 0 (``request_match_blocks``: ``recycle_gpu_blocks``), so they would
    be overwritten under the request they go to next. The read now returns only once
    nothing writes into the caches any more.

    No real deadline is raced: the read's own timeout is far out of reach, the caller's
    wait for the loop thread runs out (a fake ``concurrent.futures.wait``) exactly once the
    copy has begun, and the copy is held until the caller either waits for the given-up
    call to end (the fix) or has returned (the bug: caught while the copy still runs)."""
    import kvpipe.actors.reader as reader
    import kvpipe.integrations._portal as portal

    monkeypatch.setattr(reader, "INLINE_COPY_BYTES", 0)  # the copy in a copy thread
    real_scatter, real_wait = reader.check_and_scatter, concurrent.futures.wait
    started, go = threading.Event(), threading.Event()
    running: list[int] = []

    def held_scatter(*args: Any) -> Any:
        running.append(1)
        started.set()
        go.wait(30)  # a liveness bound only: go is set by the caller's wait or the test
        try:
            return real_scatter(*args)
        finally:
            running.pop()

    def runs_out_once_copying(
        fs: Any, timeout: Any = None, return_when: str = concurrent.futures.ALL_COMPLETED
    ) -> Any:
        if return_when != concurrent.futures.ALL_COMPLETED:  # an open's wait: a real one
            return real_wait(fs, timeout, return_when)
        started.wait(30)
        return real_wait(fs, 0)  # the copy is held: the call has not ended

    class CallerWaits(threading.Event):
        """The event ``LoopThread.call`` waits on for a given-up call to end: the caller
        waiting on it lets the held copy go on."""

        def wait(self, timeout: float | None = None) -> bool:
            go.set()
            return super().wait(timeout)

    k, v = _gqa(True)
    tokens = list(range(4 * BS))
    # close_timeout: how long a given-up call is waited for (far past the held copy's 30 s)
    with _store(close_timeout=60.0) as store:
        assert store.write("t1", k, v, tokens, [0, 1, 2, 3], 0) == 4
        dk, dv = _gqa(False)
        with monkeypatch.context() as m:
            m.setattr(reader, "check_and_scatter", held_scatter)
            m.setattr(concurrent.futures, "wait", runs_out_once_copying)
            m.setattr(
                portal, "threading", SimpleNamespace(**{**vars(threading), "Event": CallerWaits})
            )
            try:
                assert store.read("t2", dk, dv, tokens, [4, 5, 6, 7], 0, 30.0) == 0
                still_copying = bool(running)
                after = _rows(dk + dv, [4, 5, 6, 7])
            finally:
                go.set()
        assert started.is_set(), "the read's copy into the caches never began"
        assert not still_copying, "read returned while its copy into the caches still ran"
        assert after == _rows(k + v, [0, 1, 2, 3])  # the copy ran to its end before
        # nothing changes the caches after the read returned
        assert store.query("t3", tokens, 0) == 4  # the loop has moved on
        assert _rows(dk + dv, [4, 5, 6, 7]) == after


def test_first_calls_with_a_hanging_store_return_by_their_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first write opens the pipeline (registers staging with the store); a store that
    never answers must not hold FastDeploy's worker threads past their timeout: the write
    and a read waiting behind it return 0 with one WARNING each."""
    k, v = _gqa(True)
    fake = StuckRegistrationStore()
    store = KVPipeAttentionStore(layer_num=LAYERS, block_token_size=BS, store=fake)
    results: dict[str, int] = {}
    tokens = list(range(2 * BS))

    def write() -> None:
        results["write"] = store.write("t1", k, v, tokens, [0, 1], 0, 0.2)

    def read() -> None:
        fake.registering.wait()  # behind the write's opening
        results["read"] = store.read("t2", k, v, tokens, [2, 3], 0, 0.2)

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=f, daemon=True) for f in (write, read)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)  # a liveness bound far past timeout + HOP_SLACK, not a timing check
        try:
            assert not any(t.is_alive() for t in threads), "a call hung on the pipeline's open"
            assert results == {"write": 0, "read": 0}
            for task in ("t1", "t2"):
                warned = [r for r in caplog.records if task in r.getMessage()]
                assert [r.levelname for r in warned] == ["WARNING"]
        finally:
            store.close()


def test_called_inside_a_running_loop_raises() -> None:
    k, v = _gqa(True)
    with _store() as store:

        async def inside() -> None:
            with pytest.raises(RuntimeError, match="running event loop"):
                store.write("t", k, v, list(range(4)), [0], 0)

        anyio.run(inside)


def test_called_inside_a_running_loop_raises_once_the_caches_are_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Once a first call (from a plain thread) has bound the caches, the next calls skip
    opening, where the misuse was caught: ``write`` / ``read`` / ``query`` /
    ``flush_token_index`` made from inside a running event loop were logged as a failed
    store call and answered 0 / nothing, where the docs (and the first call) raise
    ``kvpipe.WrongEventLoop``."""
    k, v = _gqa(True)
    tokens = list(range(2 * BS))
    with _store() as store:
        assert store.write("t", k, v, tokens, [0, 1], 0) == 2
        calls = [
            lambda: store.write("t", k, v, tokens, [0, 1], 0),
            lambda: store.read("t", k, v, tokens, [2, 3], 0),
            lambda: store.query("t", tokens, 0),
            lambda: store.flush_token_index("t", tokens, 0, True),
        ]

        async def inside() -> None:
            for call in calls:
                with pytest.raises(kvpipe.WrongEventLoop, match="running event loop"):
                    call()

        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            anyio.run(inside)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert store.query("t", tokens, 0) == 2  # from a plain thread it works


def test_query_and_flush_inside_a_running_loop_raise_before_the_caches_are_bound() -> None:
    """Before a write or read bound the caches, ``query`` and ``flush_token_index`` never
    reached the loop: from inside a running event loop they answered as if called from a
    thread (a decode instance's query: every block asked about, as stored), where the docs
    and every other call raise ``kvpipe.WrongEventLoop``."""
    tokens = list(range(3 * BS))
    with _store(splitwise_role="decode") as store:

        async def inside() -> None:
            with pytest.raises(kvpipe.WrongEventLoop, match="running event loop"):
                store.query("t", tokens, 0)
            with pytest.raises(kvpipe.WrongEventLoop, match="running event loop"):
                store.flush_token_index("t", tokens, 0, True)

        anyio.run(inside)
        assert store.query("t", tokens, 0) == 3  # from a plain thread: every block asked


def test_process_exit_without_close_is_prompt(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import ctypes, paddle, kvpipe
        from kvpipe.integrations.fastdeploy import KVPipeAttentionStore, KVPipeStorage, _namespace
        paddle.set_device("cpu")
        a = KVPipeAttentionStore(layer_num=1, block_token_size=4, store=kvpipe.MemoryStore())
        k = [paddle.ones([4, 1, 4, 8], dtype="bfloat16")]
        v = [paddle.ones([4, 1, 4, 8], dtype="bfloat16")]
        assert a.write("t", k, v, list(range(8)), [0, 1], 0) == 2
        s = KVPipeStorage(file_path={str(tmp_path)!r}, namespace="m")
        b = ctypes.create_string_buffer(64)
        assert s.batch_set(["x"], [ctypes.addressof(b)], [64]) == [0]
        print("done")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done" in out.stdout


def test_bad_store_url_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ConfigError naming the variable, as for kvpipe's other environment variables (a
    ValueError still); it was a bare ValueError."""
    for url in ("ftp://x", "file://relative", "mooncake://host", "memory://x/y"):
        monkeypatch.setenv("KVPIPE_STORE", url)
        for make in (lambda: KVPipeAttentionStore(layer_num=1), KVPipeStorage):
            with pytest.raises(kvpipe.ConfigError, match="KVPIPE_STORE") as info:
                make()
            assert info.value.field == "KVPIPE_STORE"


def test_a_bad_integer_in_the_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ENABLE_EP_DP_IN_FD=yes was int()'s bare ValueError out of the constructor."""
    monkeypatch.setenv("ENABLE_EP_DP_IN_FD", "yes")
    with pytest.raises(kvpipe.ConfigError, match="ENABLE_EP_DP_IN_FD") as info:
        KVPipeAttentionStore(layer_num=1, store=kvpipe.MemoryStore())
    assert info.value.field == "ENABLE_EP_DP_IN_FD"
    monkeypatch.setenv("ENABLE_EP_DP_IN_FD", "0")
    with KVPipeAttentionStore(layer_num=1, store=kvpipe.MemoryStore(), pod_name="p") as store:
        assert store.pod_name == "p"


# -- KVCacheStorage (file / mooncake) ----------------------------------------------------------


def _buf(data: bytes) -> tuple[ctypes.Array[ctypes.c_char], int]:
    b = ctypes.create_string_buffer(data, len(data))
    return b, ctypes.addressof(b)


@pytest.fixture
def fs(tmp_path: Path) -> Iterator[KVPipeStorage]:
    with KVPipeStorage(file_path=str(tmp_path), namespace="model") as s:
        yield s


def test_storage_called_inside_a_running_loop_raises(fs: KVPipeStorage) -> None:
    """A misuse, not a storage failure: raised (as the docs say), not logged and reported
    as -1 / False / 0 like a store that failed."""
    _keep, addr = _buf(b"x" * 64)  # the buffer lives as long as the test

    async def inside() -> None:
        for call in (
            lambda: fs.batch_set(["k"], [addr], [64]),
            lambda: fs.batch_get(["k"], [addr], [64]),
            lambda: fs.exists(["k"]),
        ):
            with pytest.raises(kvpipe.WrongEventLoop, match="running event loop"):
                call()

    anyio.run(inside)
    assert fs.batch_set(["k"], [addr], [64]) == [0]  # from a plain thread it works


def test_storage_calls_answered_without_the_loop_raise_inside_a_running_loop(
    fs: KVPipeStorage, caplog: pytest.LogCaptureFixture
) -> None:
    """The docs: calling either class from inside a running event loop raises
    ``kvpipe.WrongEventLoop``. The calls that answer without a hop onto the loop thread
    answered as from a thread instead: ``clear`` with nothing to remove True, ``exists([])``
    {}, ``query`` of no keys 0, and ``batch_set`` / ``batch_get`` whose targets name no
    buffer or whose lists differ in length -1 with a WARNING, as a store that failed; only
    the same calls with work to do raised."""
    _keep, addr = _buf(b"x" * 64)

    async def inside() -> None:
        for call in (
            lambda: fs.clear(),
            lambda: fs.exists([]),
            lambda: fs.query([], []),
            lambda: fs.batch_set(["k"], [0], [64]),
            lambda: fs.batch_get(["k"], [addr], []),
        ):
            with pytest.raises(kvpipe.WrongEventLoop, match="running event loop"):
                call()

    with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
        anyio.run(inside)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert fs.clear() is True  # from a plain thread it works


def test_attention_store_calls_with_bad_arguments_raise_wrong_event_loop_inside_a_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call from inside a running event loop is that misuse whatever its arguments (the
    docs, and query's docstring: "still raises WrongEventLoop"). A decode instance's query
    whose start index is past its tokens answered 0 with an ERROR, and a write or read
    with a negative start index raised RequestError, before the event loop was looked
    at."""
    k, v = _gqa(False)
    tokens = list(range(2 * BS))
    with _store(splitwise_role="decode") as store:

        async def inside() -> None:
            for call in (
                lambda: store.query("t", tokens, 5),
                lambda: store.write("t", k, v, tokens, [0], -1),
                lambda: store.read("t", k, v, tokens, [0], -1),
            ):
                with pytest.raises(kvpipe.WrongEventLoop, match="running event loop"):
                    call()

        with caplog.at_level(logging.WARNING, "kvpipe.integrations"):
            anyio.run(inside)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_storage_with_no_memory_for_staging_fails_like_a_store(
    fs: KVPipeStorage, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The staging for a new value size cannot be allocated (memory pressure): the process's
    failure, not the caller's mistake, so -1 with one WARNING as when the store fails. It
    was raised into FastDeploy's thread, as a ``ConfigError`` (a ``ValueError``)."""
    from kvpipe import _staging

    def no_memory(*args: object) -> object:
        raise MemoryError

    _keep, addr = _buf(b"y" * 96)
    monkeypatch.setattr(_staging, "_page_aligned", no_memory)
    with caplog.at_level(logging.WARNING):
        assert fs.batch_set(["k"], [addr], [96]) == [-1]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "staging_bytes" in warnings[0], warnings
    monkeypatch.undo()
    assert fs.batch_set(["k"], [addr], [96]) == [0]  # with memory again, it works


def test_storage_round_trip_from_8_threads(fs: KVPipeStorage) -> None:
    rng = np.random.default_rng(1)
    host = rng.integers(0, 256, 8 * 16 * 4096, dtype=np.uint8)  # the manager's host buffer
    out = np.zeros_like(host)
    base, obase = host.ctypes.data, out.ctypes.data

    def one(i: int) -> tuple[list[int], list[int], list[int]]:
        keys = [f"m_{i}_{j}_key" for j in range(16)]
        offs = [(i * 16 + j) * 4096 for j in range(16)]
        first = fs.batch_set(keys, [base + o for o in offs], [4096] * 16)
        again = fs.batch_set(keys, [base + o for o in offs], [4096] * 16)
        got = fs.batch_get(keys, [obase + o for o in offs], [4096] * 16)
        return first, again, got

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert all(r == ([0] * 16, [0] * 16, [4096] * 16) for r in results)
    assert out.tobytes() == host.tobytes()
    assert fs.deduplicated == 8 * 16


def test_query_counts_leading_complete_parts(fs: KVPipeStorage) -> None:
    _b, p = _buf(b"x" * 32)
    fs.batch_set(["k0", "v0", "s0", "t0", "k1", "v1", "k2", "v2", "s2", "t2"], [p] * 10, [32] * 10)
    assert fs.query(["k0", "k1", "k2"], ["v0", "v1", "v2"]) == 3
    assert (
        fs.query(["k0", "k1", "k2"], ["v0", "v1", "v2"], ["s0", "s1", "s2"], ["t0", "t1", "t2"])
        == 1
    )
    assert fs.query(["k0", "kx", "k2"], ["v0", "v1", "v2"], None, None, 5.0) == 1  # leading only
    assert fs.query(None, None) == 0
    assert fs.query(["k0"], ["v0", "v1"]) == 0


def test_tampered_file_never_reaches_the_buffer(fs: KVPipeStorage, tmp_path: Path) -> None:
    _b, p = _buf(bytes(range(256)) * 16)
    assert fs.set("victim", p, 4096) == 0
    (f,) = [x for x in (tmp_path / "model").rglob("*.kvb")]
    data = bytearray(f.read_bytes())
    data[4096 + 10] ^= 0xFF
    f.write_bytes(bytes(data))
    out, op = _buf(b"\xaa" * 4096)
    assert fs.get("victim", op, 4096) == -1
    assert out.raw == b"\xaa" * 4096


def test_short_target_is_refused(fs: KVPipeStorage) -> None:
    _b, p = _buf(b"y" * 64)
    fs.set("k", p, 64)
    out, op = _buf(b"\0" * 64)
    assert fs.get("k", op, 32) == -1
    assert out.raw == b"\0" * 64


def test_path_tricks_in_keys_stay_inside(fs: KVPipeStorage, tmp_path: Path) -> None:
    _b, p = _buf(b"z" * 64)
    keys = ["../../escape", "/etc/passwd", "a/../../b", "..", "x" * 2000, "ключ"]
    assert fs.batch_set(keys, [p] * len(keys), [64] * len(keys)) == [0] * len(keys)
    outside = [x for x in tmp_path.rglob("*") if not x.is_relative_to(tmp_path / "model")]
    assert outside == []
    assert all(fs.exists(keys).values())


def test_close_lets_go_of_the_keys_kept_for_clear(tmp_path: Path) -> None:
    """Up to ``remember_keys`` keys (a million by default, ~150 MB) stayed alive with the
    object after close, though clear cannot run then."""
    storage = KVPipeStorage(file_path=str(tmp_path / "s"))
    _keep, ptr = _buf(b"x" * 64)
    assert storage.batch_set(["a", "b"], [ptr, ptr], [64, 64]) == [0, 0]
    assert len(storage._own) == 2
    storage.close()
    assert len(storage._own) == 0
    assert storage.clear() is False  # closed: as every call after close (a failed store)


def test_clear_removes_only_own_entries(fs: KVPipeStorage, tmp_path: Path) -> None:
    foreign = tmp_path / "model" / "c.txt"
    foreign.write_text("data")
    _b, p = _buf(b"q" * 64)
    fs.batch_set(["a", "b"], [p, p], [64, 64])
    assert fs.clear() is True
    assert fs.exists(["a", "b"]) == {"a": False, "b": False}
    assert foreign.read_text() == "data"


def test_deployments_of_another_tp_size_keep_their_own_values(tmp_path: Path) -> None:
    """FastDeploy's keys name the rank but not the TP size (``prefix{p}_{hash}_{rank}_key``,
    cache_transfer_manager.read_storage_task), and a rank's block is a different slice
    (and size) at another TP size. Two deployments of one model at TP 1 and TP 2 on one
    store shared each key: the second's batch_set found it stored and skipped it, and its
    read (query, then batch_get of its own size) found the other's value of another size,
    which the file store took for corrupt and quarantined: neither deployment's value
    survived. With the TP size in the key each keeps and reads back its own."""
    keys_k, keys_v = ["prefix_h0_0_key"], ["prefix_h0_0_value"]

    def write_then_read(s: KVPipeStorage, nbytes: int, fill: int) -> tuple[int, list[int], bytes]:
        _src, sp = _buf(bytes([fill]) * nbytes)
        assert s.batch_set(keys_k + keys_v, [sp, sp], [nbytes, nbytes]) == [0, 0]
        return read(s, nbytes)

    def read(s: KVPipeStorage, nbytes: int) -> tuple[int, list[int], bytes]:
        m = s.query(keys_k, keys_v, None, None, 10.0)
        dst, dp = _buf(b"\0" * nbytes)
        got = s.batch_get(keys_k[:m] + keys_v[:m], [dp] * (2 * m), [nbytes] * (2 * m))
        return m, got, dst.raw

    with (
        KVPipeStorage(file_path=str(tmp_path), namespace="m", tp_rank=0, tp_size=1) as tp1,
        KVPipeStorage(file_path=str(tmp_path), namespace="m", tp_rank=0, tp_size=2) as tp2,
    ):
        assert write_then_read(tp1, 64, 1) == (1, [64, 64], b"\1" * 64)
        assert write_then_read(tp2, 32, 2) == (1, [32, 32], b"\2" * 32)
        assert read(tp1, 64) == (1, [64, 64], b"\1" * 64)


# FastDeploy's own file-store unit tests (tests/cache_manager/test_cache_manager_file_store.py),
# with KVPipeStorage in place of FileStore, where they test behaviour. Each names its original.


def test_fd_init_creates_directory(tmp_path: Path) -> None:  # test_init_creates_directory
    new_dir = tmp_path / "new_subdir"
    with KVPipeStorage(file_path=str(new_dir)) as s:
        assert new_dir.exists() and s.file_path == str(new_dir)


def test_fd_init_with_namespace(tmp_path: Path) -> None:  # test_init_with_namespace
    with KVPipeStorage(file_path=str(tmp_path), namespace="my_ns") as s:
        assert s.file_path == str(tmp_path / "my_ns") and (tmp_path / "my_ns").exists()


def test_fd_init_none_file_path_raises() -> None:  # test_init_none_file_path_raises
    for bad in (None, ""):
        with pytest.raises(kvpipe.ConfigError, match="file_path must be specified"):
            KVPipeStorage(file_path=bad)
    with pytest.raises(kvpipe.ConfigError, match="not both"):
        KVPipeStorage(file_path="/tmp/x", store=kvpipe.MemoryStore())


def test_fd_a_file_path_that_cannot_be_made_is_a_backend_error(tmp_path: Path) -> None:
    """The directory that rank 0 makes at construction is a file: the OS's FileExistsError
    escaped as it was (the store's own open says the same as a BackendError)."""
    (tmp_path / "f").write_text("x")
    with pytest.raises(kvpipe.BackendError, match="File exists") as info:
        KVPipeStorage(file_path=str(tmp_path / "f"))
    assert isinstance(info.value.__cause__, OSError)


def test_fd_bad_target_pointers(tmp_path: Path) -> None:
    """A zero or negative pointer or size: -1 for that key (as batch_get and FastDeploy's
    FileStore answer it); no pointer at all: a TypeError (test_fd_storage.py has the rest)."""
    with KVPipeStorage(file_path=str(tmp_path)) as fs:
        assert fs.batch_set(["k"], [0], [8]) == [-1]
        with pytest.raises(TypeError, match="target_location"):
            fs.set("k", None, 8)


def test_fd_init_non_zero_tp_rank_skips_mkdir(tmp_path: Path) -> None:  # same name
    with KVPipeStorage(file_path=str(tmp_path / "non_existent"), tp_rank=1) as s:
        assert not (tmp_path / "non_existent").exists()
        assert s.file_path == str(tmp_path / "non_existent")


def test_fd_init_opens_a_file_store_whose_directory_is_there(tmp_path: Path) -> None:
    """Rank 0 (which makes the directory), or a rank coming after it, opens the file store
    at construction: its recovery scan ran in the first query or batch_set, inside that
    call's timeout (a big store: the first calls answered 0 and their writes were lost)."""
    with KVPipeStorage(file_path=str(tmp_path / "d"), tp_rank=0) as first:
        assert isinstance(first.store, kvpipe.FileStore) and first.store._root is not None
        with KVPipeStorage(file_path=str(tmp_path / "d"), tp_rank=1) as later:
            assert isinstance(later.store, kvpipe.FileStore) and later.store._root is not None


def test_fd_default_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVPIPE_STORE", raising=False)
    monkeypatch.setenv("FILE_BACKEND_STORAGE_DIR", str(tmp_path / "fd"))
    with KVPipeStorage(namespace="m") as s:
        assert s.file_path == str(tmp_path / "fd" / "m")
    monkeypatch.setenv("KVPIPE_STORE", f"file://{tmp_path}/kv")
    with KVPipeStorage(namespace="m") as s:
        assert s.file_path == str(tmp_path / "kv" / "m")


def test_fd_register_buffer_returns_none(fs: KVPipeStorage) -> None:  # same name
    assert fs.register_buffer(0, 0) is None


def test_fd_exists_and_set_skips_existing(fs: KVPipeStorage) -> None:
    # test_exists_returns_correct_results, test_set_skips_existing_key
    _b, p = _buf(b"\x01\x02\x03\x04")
    assert fs.set("key1", p, 4) == 0
    assert fs.exists(["key1", "key2"]) == {"key1": True, "key2": False}
    assert fs.set("key1", p, 4) == 0 and fs.deduplicated == 1


def test_fd_get(fs: KVPipeStorage) -> None:
    # test_get_nonexistent_key, test_get_invalid_target_size, test_get_success
    out, op = _buf(b"\0" * 10)
    assert fs.get("no_such_key", op, 10) == -1
    _data, p = _buf(bytes([1, 2, 3, 4]))
    fs.set("good_key", p, 4)
    assert fs.get("good_key", op, 0) == -1
    assert fs.get("good_key", op, 4) == 4 and out.raw[:4] == bytes([1, 2, 3, 4])


def test_fd_batch_length_mismatch_and_missing(fs: KVPipeStorage) -> None:
    # test_batch_set_length_mismatch, test_batch_get_length_mismatch,
    # test_batch_set_success, test_batch_get_nonexistent_keys
    assert fs.batch_set(["k1", "k2"], [100], [10, 20]) == [-1, -1]
    assert fs.batch_get(["k1", "k2"], [100], [10, 20]) == [-1, -1]
    (_b1, p1), (_b2, p2) = _buf(b"\x01\x02"), _buf(b"\x03\x04")
    assert fs.batch_set(["k1", "k2"], [p1, p2], [2, 2]) == [0, 0]
    _o1, q1 = _buf(b"\0" * 10)
    assert fs.batch_get(["no_key1", "no_key2"], [q1, q1], [10, 10]) == [-1, -1]


def test_fd_query(fs: KVPipeStorage) -> None:
    # test_query_empty_keys, test_query_none_keys, test_query_with_matching_pairs,
    # test_query_mismatched_lengths_returns_zero
    assert fs.query(k_cache_keys=[], v_cache_keys=[]) == 0
    assert fs.query(k_cache_keys=None, v_cache_keys=None) == 0
    _b, p = _buf(b"data")
    fs.batch_set(["k1", "v1", "k2"], [p] * 3, [4] * 3)
    assert fs.query(k_cache_keys=["k1", "k2"], v_cache_keys=["v1", "v2"]) == 1
    assert fs.query(k_cache_keys=["k1"], v_cache_keys=["v1", "v2"]) == 0


@pytest.mark.slow
def test_prefill_to_decode_over_a_shared_file_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A prefill process writes (partial last block included) through its own instance; the
    decode side (this process) reads all-or-nothing: byte-exact; with the store gone the read
    fails cleanly (count short of the blocks, one WARNING, no exception)."""
    env = dict(os.environ, FD_PD_TRANSFER_VIA_STORAGE="1", KVPIPE_STORE=f"file://{tmp_path}")
    code = textwrap.dedent(
        """
        import numpy as np, paddle
        from kvpipe.integrations.fastdeploy import KVPipeAttentionStore
        paddle.set_device("cpu")
        paddle.seed(7)
        k = [paddle.randn([8, 2, 4, 8]).astype("bfloat16") for _ in range(2)]
        v = [paddle.randn([8, 2, 4, 8]).astype("bfloat16") for _ in range(2)]
        with KVPipeAttentionStore(layer_num=2, block_token_size=4, splitwise_role="prefill") as p:
            assert p.write("req", k, v, list(range(14)), [0, 1, 2, 3], 0) == 4
        np.save("PATH", np.stack([np.stack([t[:4].numpy() for t in k]),
                                  np.stack([t[:4].numpy() for t in v])]))
        """
    ).replace("PATH", str(tmp_path / "src.npy"))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    src = np.load(tmp_path / "src.npy")
    old = {k: os.environ.get(k) for k in ("FD_PD_TRANSFER_VIA_STORAGE", "KVPIPE_STORE")}
    os.environ.update(FD_PD_TRANSFER_VIA_STORAGE="1", KVPIPE_STORE=f"file://{tmp_path}")
    try:
        dk, dv = _gqa(False)
        with KVPipeAttentionStore(
            layer_num=LAYERS, block_token_size=BS, splitwise_role="decode"
        ) as d:
            assert d.read("req", dk, dv, list(range(14)), [10, 11, 12, 13], 0) == 4
            got = np.stack(
                [np.stack([t[10:14].numpy() for t in dk]), np.stack([t[10:14].numpy() for t in dv])]
            )
            assert got.tobytes() == src.tobytes()
            for f in tmp_path.rglob("*.kvb"):
                f.unlink()
            with caplog.at_level(logging.WARNING):
                assert d.read("req", dk, dv, list(range(14)), [20, 21, 22, 23], 0) < 4
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and "req" in warnings[0].getMessage()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class StopsAtFirstMiss(kvpipe.MemoryStore):
    """Answers ``exists`` as a file store may (``False`` for every key after the first
    missing one) and counts the keys it was asked about."""

    exists_answers_every_key = False

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.probed = 0

    async def exists(self, batch: kvpipe.KeyBatch) -> Sequence[bool]:
        self.calls += 1
        self.probed += len(batch.keys)
        got = list(await super().exists(batch))
        lead = next((j for j, ok in enumerate(got) if not ok), len(got))
        return got[: lead + 1] + [False] * (len(got) - lead - 1)


def test_long_sequences_probe_each_key_at_most_twice() -> None:
    """FastDeploy's query and batch_set cover every block of a request (2048 blocks for 128k
    tokens): probing the keys after each miss again made them quadratic (2048 blocks: 57 s
    of query, and a batch_set past its 30 s timeout, nothing stored). A query is one store
    call; batch_set probes each key at most twice and still skips exactly the stored ones."""
    n = 64
    store = StopsAtFirstMiss()
    host = np.arange(2 * n * 16, dtype=np.uint8)
    base = host.ctypes.data
    ks, vs = [f"k{i}" for i in range(n)], [f"v{i}" for i in range(n)]
    with KVPipeStorage(store=store) as s:
        assert s.batch_set(ks[::2], [base + 16 * i for i in range(0, n, 2)], [16] * (n // 2))
        assert s.batch_set(["k0", "v0", "k1", "v1"], [base, base, base, base], [16] * 4)
        store.calls = store.probed = 0
        assert s.query(ks, vs) == 2
        assert store.calls == 1
        store.calls = store.probed = 0
        dedup = s.deduplicated
        keys = ks + vs
        assert s.batch_set(keys, [base + 16 * i for i in range(2 * n)], [16] * (2 * n)) == [0] * (
            2 * n
        )
        assert s.deduplicated - dedup == n // 2 + 3  # k0, k2, ..., k62 and k1, v0, v1: skipped
        assert store.probed <= 2 * len(keys)
        assert s.query(ks, vs) == n


def test_batch_set_copies_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long request's batch_set is as big as the manager's whole write buffer (2048
    blocks x 2 keys x a block's bytes for all layers); copying all of it before storing any
    doubled that in host memory. Copies not stored yet stay within one chunk."""
    from kvpipe.integrations import _fd_storage

    n = 200
    host = np.arange(n * 16, dtype=np.uint8)
    lo, hi = host.ctypes.data, host.ctypes.data + host.nbytes
    copies: list[int] = []  # one per copy out of the caller's buffer
    alive: list[int] = []  # per put: copies made but not stored yet
    stored: list[int] = []
    real = ctypes.memmove

    def watched(dst: object, src: object, count: int) -> object:
        if isinstance(src, int) and lo <= src < hi:
            copies.append(src)
        return real(dst, src, count)

    class Watching(kvpipe.MemoryStore):
        async def put_blocks(self, batch: kvpipe.PutBatch) -> Sequence[kvpipe.BlockStatus]:
            alive.append(len(copies) - len(stored))
            stored.extend(batch.keys)
            return await super().put_blocks(batch)

    monkeypatch.setattr(ctypes, "memmove", watched)
    with KVPipeStorage(store=Watching()) as s:
        keys = [f"k{i}" for i in range(n)]
        ptrs = [lo + 16 * i for i in range(n)]
        assert s.batch_set(keys, ptrs, [16] * n) == [0] * n
        out = np.zeros_like(host)
        got = s.batch_get(keys, [out.ctypes.data + 16 * i for i in range(n)], [16] * n)
        assert got == [16] * n
    assert bytes(out) == bytes(host)
    assert len(copies) == n
    assert max(alive) <= _fd_storage.BATCH_SET_CHUNK


def test_batch_get_fetches_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager's read is as big as its write (``_run_read_storage``: every matched
    block's key and value, the whole read buffer); batch_get fetched every value into host
    memory before placing any in the caller's buffer, so a long request's read doubled the
    manager's read buffer in host memory, as batch_set's copies once did. Values fetched
    but not placed yet stay within one chunk."""
    from kvpipe.integrations import _fd_storage

    n = 200
    host = np.arange(n * 16, dtype=np.uint8)
    out = np.zeros_like(host)
    lo, hi = out.ctypes.data, out.ctypes.data + out.nbytes
    placed: list[int] = []  # one per copy into the caller's buffer
    alive: list[int] = []  # per get: values fetched but not placed yet
    fetched: list[str] = []
    real = ctypes.memmove

    def watched(dst: object, src: object, count: int) -> object:
        if isinstance(dst, int) and lo <= dst < hi:
            placed.append(dst)
        return real(dst, src, count)

    class Watching(kvpipe.MemoryStore):
        async def get_blocks(self, batch: kvpipe.GetBatch) -> Sequence[kvpipe.BlockStatus]:
            alive.append(len(fetched) - len(placed))
            fetched.extend(batch.keys)
            return await super().get_blocks(batch)

    with KVPipeStorage(store=Watching()) as s:
        keys = [f"k{i}" for i in range(n)]
        assert s.batch_set(keys, [host.ctypes.data + 16 * i for i in range(n)], [16] * n) == [0] * n
        monkeypatch.setattr(ctypes, "memmove", watched)
        assert s.batch_get(keys, [lo + 16 * i for i in range(n)], [16] * n) == [16] * n
    assert bytes(out) == bytes(host)
    assert len(placed) == n
    assert max(alive) <= _fd_storage.BATCH_GET_CHUNK, alive


class RefusingRegistrationStore(kvpipe.MemoryStore):
    """A store that is down: registering staging fails."""

    async def register_staging(self, buffer: memoryview) -> None:
        raise kvpipe.BackendError("down", "register_staging", "connection refused")


def test_a_store_down_at_the_first_call_returns_0_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Registering staging fails when the first write opens the pipeline (the store is
    down): FastDeploy's thread gets 0 and one WARNING, as for any store failure, not an
    exception."""
    k, v = _gqa(True)
    store = KVPipeAttentionStore(
        layer_num=LAYERS, block_token_size=BS, store=RefusingRegistrationStore()
    )
    try:
        with caplog.at_level(logging.WARNING):
            assert store.write("t1", k, v, list(range(2 * BS)), [0, 1], 0, 5.0) == 0
        warned = [r for r in caplog.records if "t1" in r.getMessage()]
        assert [r.levelname for r in warned] == ["WARNING"]
    finally:
        store.close()


@pytest.mark.parametrize(
    ("tokens", "start"), [([], 0), (list(range(16)), 9), (list(range(16)), -1)]
)
def test_query_answers_0_for_bad_arguments_never_raising(
    tokens: list[int], start: int, caplog: pytest.LogCaptureFixture
) -> None:
    """FastDeploy's read_storage_task and write_back_storage_task call query outside the
    handlers that send their done signal (cache_transfer_manager.py): a query that raised
    (RequestError for no tokens or a start index past them, once the caches were bound) left
    the engine waiting for that signal for good. It answers 0, logged at ERROR."""
    k, v = _gqa(True)
    with _store() as store:
        assert store.write("t", k, v, list(range(16)), [0, 1, 2, 3], 0) == 4
        assert store.query("t", tokens, start) == 0
    assert any(r.levelname == "ERROR" and "bad arguments" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("tokens", "start"),
    [
        (None, 0),
        (list(range(16)), "x"),
        (list(range(16)), None),
        (list(range(16)), -1),
        (list(range(16)), 1.5),
        (list(range(16)), 9),
    ],
)
def test_query_on_a_decode_instance_before_its_first_read_answers_0_for_bad_arguments(
    tokens: Any, start: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A decode instance's query before the caches are bound answers every block asked
    about, computed from the arguments outside the handler that answers 0 for bad ones: no
    tokens (None) or a start index that is no int raised into FastDeploy's thread (TypeError,
    ValueError from int()), and a negative or fractional one answered blocks (5, 3) where a
    bound instance answers 0. Each is now a bad argument: 0, logged at ERROR."""
    with _store(splitwise_role="decode") as store:
        assert store.query("t", tokens, start) == 0
    assert any(r.levelname == "ERROR" and "bad arguments" in r.getMessage() for r in caplog.records)


def test_query_with_bad_arguments_on_every_call_logs_a_bounded_number_of_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A manager that keeps asking with the same bad arguments (a start index past its
    tokens) got 'query ... bad arguments, answering 0' at ERROR on every call. The first
    shows, with its task and why; the rest go to DEBUG until the interval passes."""
    k, v = _gqa(True)
    n = 20
    with _store() as store:
        assert store.write("t", k, v, list(range(16)), [0, 1, 2, 3], 0) == 4
        with caplog.at_level(logging.DEBUG, "kvpipe.integrations"):
            for i in range(n):
                assert store.query(f"q{i}", list(range(16)), 9) == 0
    bad = [r for r in caplog.records if "bad arguments" in r.getMessage()]
    loud = [r.getMessage() for r in bad if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "q0" in loud[0], loud
    assert len(bad) == n


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"shard_id": 1.5}, "shard_id"),
        ({"shard_id": True}, "shard_id"),
        ({"shard_id": -1}, "shard_id"),
        ({"shard_num": 0}, "shard_num"),
        ({"shard_id": 2, "shard_num": 2}, "shard_id"),
    ],
)
def test_shards_that_name_no_rank_are_refused_at_construction(
    kw: dict[str, object], field: str
) -> None:
    """int() took 1.5 or True as shard 1, and a shard_id >= shard_num surfaced only at the
    first write or read; a bad shard is a ConfigError when the adapter is made, as
    FastDeploy's own AttentionStore fails its construction."""
    with pytest.raises(kvpipe.ConfigError) as caught:
        KVPipeAttentionStore(
            layer_num=LAYERS, block_token_size=BS, store=kvpipe.MemoryStore(), **kw
        )
    assert caught.value.field == field


def test_numpy_shards_are_taken_as_their_ints() -> None:
    with _store(shard_id=np.int64(1), shard_num=np.uint32(2)) as store:
        assert (store.shard_id, store.shard_num) == (1, 2)
        assert type(store.shard_id) is int


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"block_token_size": 0}, "block_token_size"),
        ({"block_token_size": -4}, "block_token_size"),
        ({"block_token_size": 4.5}, "block_token_size"),
        ({"block_token_size": True}, "block_token_size"),
        ({"layer_num": 0}, "layer_num"),
        ({"layer_num": 2.5}, "layer_num"),
    ],
)
def test_a_layer_count_or_block_size_that_names_none_is_refused_at_construction(
    kw: dict[str, object], field: str
) -> None:
    """int() took 2.5 layers as 2 and 4.5 tokens a block as 4 without a word, and a
    block_token_size of 0 was kept: a decode instance's first query divided by it and raised
    ZeroDivisionError into FastDeploy's thread, outside the handler that sends the task's
    done signal. Each is a ConfigError naming the field when the adapter is made, as a bad
    shard is; numpy integers are taken as their ints."""
    args: dict[str, object] = {"layer_num": LAYERS, "block_token_size": BS, **kw}
    with pytest.raises(kvpipe.ConfigError) as caught:
        KVPipeAttentionStore(store=kvpipe.MemoryStore(), splitwise_role="decode", **args)
    assert caught.value.field == field
    with KVPipeAttentionStore(
        layer_num=np.int64(LAYERS), block_token_size=np.uint16(BS), store=kvpipe.MemoryStore()
    ) as store:
        assert (store.layer_num, store.block_token_size) == (LAYERS, BS)
        assert type(store.block_token_size) is int


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan"), float("inf"), "5", True])
def test_a_close_timeout_that_is_no_positive_number_is_refused(bad: object) -> None:
    """close_timeout=0 was taken as not given (``or``): the config's 10 s in its place,
    silently. A negative one was kept: it is also how long a write or read given up at its
    deadline waits for its copy into or out of the caches to end, and <= 0 skips that wait,
    so FastDeploy reused blocks still being copied. As PipelineConfig.close_timeout: a
    finite number > 0, else a ConfigError naming the field; None takes the config's."""
    with pytest.raises(kvpipe.ConfigError) as caught:
        _store(close_timeout=bad)
    assert caught.value.field == "close_timeout"
    with _store(close_timeout=2.5) as given, _store() as default:
        assert given._loop.close_timeout == 2.5
        assert default._loop.close_timeout == default.config.close_timeout


def test_numpy_start_indices_are_taken_by_write_and_read_as_by_query() -> None:
    """query took a numpy integer start index (check_start_block) while write and read
    raised RequestError for the same value: a read in FastDeploy's order (query, then read
    with the same start) loaded nothing. All three take it as its int; the read's tokens
    that end short of the blocks asked for are handled as for an int start."""
    k, v = _gqa(True)
    tokens = list(range(6 * BS))
    with _store() as store:
        assert store.write("w", k, v, tokens[: 2 * BS], [10, 11], np.int64(0)) == 2
        assert store.write("w", k, v, tokens, [12, 13, 14, 15], np.int32(2)) == 4
        start = np.int64(2)
        matched = store.query("q", tokens, start)
        assert matched == 4
        dk, dv = _gqa(False)
        dst = [20, 21, 22, 23]
        assert store.read("q", dk, dv, tokens[: matched * BS], dst, start) == 4
        assert _rows(dk + dv, dst) == _rows(k + v, [12, 13, 14, 15])
        # without the query's tokens: those the read's own cover (blocks 2 and 3)
        assert store.read("r", dk, dv, tokens[: matched * BS], dst, np.uint8(2)) == 2
        for bad in (True, 1.0, -1):
            with pytest.raises(kvpipe.RequestError):
                store.read("r", dk, dv, tokens, dst, bad)
