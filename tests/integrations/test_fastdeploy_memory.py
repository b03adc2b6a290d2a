"""Nothing a closed FastDeploy adapter owned stays alive in a reference cycle: with the cyclic
garbage collector disabled, the adapter, its loop thread, its pipelines and its store are
freed by reference counting once it is closed, also after calls the store failed."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.integrations.fastdeploy import KVPipeAttentionStore, KVPipeStorage

LAYERS, BLOCKS, BS = 2, 8, 4


class _Failing(kvpipe.MemoryStore):
    """Once armed, every store call raises; ``refuse`` refuses the staging (a pipeline's
    open fails), ``hang`` never answers it (the open runs out of time)."""

    def __init__(self, how: str = "") -> None:
        super().__init__()
        self.how = how
        self.armed = False

    def _check(self) -> None:
        if self.armed:
            raise OSError("injected")

    async def register_staging(self, buffer: memoryview) -> None:
        if self.how == "refuse":
            raise OSError("injected")
        if self.how == "hang":
            import anyio

            await anyio.sleep_forever()

    async def put_blocks(self, batch: kvpipe.backends.PutBatch) -> list[kvpipe.BlockStatus]:
        self._check()
        return list(await super().put_blocks(batch))

    async def get_blocks(self, batch: kvpipe.backends.GetBatch) -> list[kvpipe.BlockStatus]:
        self._check()
        return list(await super().get_blocks(batch))

    async def exists(self, batch: kvpipe.backends.KeyBatch) -> list[bool]:
        self._check()
        return list(await super().exists(batch))


def _dead(refs: dict[str, weakref.ref[Any]]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


@pytest.mark.parametrize("how", ["query", "refuse", "hang"])
def test_a_failed_attention_store_call_leaves_no_cycle(how: str, no_cyclic_gc: None) -> None:
    """A query the store failed, or a first write whose pipeline could not open (staging
    refused, or no answer within the call's timeout): each call answers 0 with a WARNING.
    The error came back from the loop thread through anyio's portal, which kept it in a
    reference cycle with the frames it passed: the adapter, its pipeline, its store and the
    server's cache tensors stayed alive after close."""
    paddle = pytest.importorskip("paddle")
    paddle.set_device("cpu")
    store = _Failing("" if how == "query" else how)
    adapter = KVPipeAttentionStore(
        layer_num=LAYERS,
        block_token_size=BS,
        store=store,
        config=kvpipe.PipelineConfig(staging_bytes=1 << 20),
    )
    k = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    v = [paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16") for _ in range(LAYERS)]
    tokens = list(range(2 * BS))
    refs = {"adapter": weakref.ref(adapter), "store": weakref.ref(store), "key": weakref.ref(k[0])}
    if how == "query":
        assert adapter.write("t", k, v, tokens, [0, 1], 0) == 2
        refs["pipeline"] = weakref.ref(next(iter(adapter._pipes.values())).pipe)
        store.armed = True
        assert adapter.query("t", tokens, 0) == 0
    else:
        assert adapter.write("t", k, v, tokens, [0, 1], 0, 0.0 if how == "hang" else 30.0) == 0
    adapter.close()
    del adapter, store, k, v
    assert _dead(refs) == [], "held in a reference cycle"


def test_a_failed_storage_call_leaves_no_cycle(no_cyclic_gc: None) -> None:
    """``KVPipeStorage`` calls the store failed (each answers -1 or False with a WARNING)
    kept the adapter and its store in a reference cycle through anyio's portal."""
    store = _Failing()
    storage = KVPipeStorage(store=store)
    refs = {"adapter": weakref.ref(storage), "store": weakref.ref(store)}
    value = np.arange(256, dtype=np.uint8)
    at = value.ctypes.data
    store.armed = True
    assert storage.batch_set(["a", "b"], [at, at + 128], [128, 128]) == [-1, -1]
    assert storage.batch_get(["a", "b"], [at, at + 128], [128, 128]) == [-1, -1]
    assert storage.exists(["a"]) == {"a": False}
    storage.close()
    del storage, store
    assert _dead(refs) == [], "held in a reference cycle"
