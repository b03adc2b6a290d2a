"""On a GPU with a CUDA build of PyTorch (``@pytest.mark.cuda``; skipped where there is no
GPU, and as a module where PyTorch is missing): a cache of real ``torch`` CUDA tensors, the
current-stream lookup, ordering after the model's kernels on that stream, the DLPack path,
and pinned host caches on the real driver."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvpipe

torch: Any = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda

LAYOUT = kvpipe.CacheLayout.gqa(num_layers=4, num_kv_heads=8, head_dim=128, block_size=16)
#: Cycles of ``torch.cuda._sleep`` that keep "the model" busy when kvpipe is called: ~0.2 s
#: at the H200's 1.98 GHz, far longer than a write or read of four blocks takes to start.
BUSY = 400_000_000


@pytest.fixture
def tensors() -> Iterator[list[Any]]:
    if not torch.cuda.is_available():
        pytest.skip("this PyTorch has no CUDA")
    out = [
        torch.zeros((16, *LAYOUT.role(role).block_shape), dtype=torch.bfloat16, device="cuda:0")
        for role, _layer in LAYOUT.tensor_order()
    ]
    torch.cuda.synchronize()
    yield out
    torch.cuda.synchronize()


def _model_writes(tensors: list[Any], blocks: slice) -> None:
    """Queue "the model": a long kernel, then random non-zero bytes into ``blocks`` of every
    tensor, on the current stream."""
    torch.cuda._sleep(BUSY)
    for t in tensors:
        t.view(torch.uint8)[blocks].random_(1, 256)  # no zero byte


def _bytes(t: Any, blocks: slice) -> bytes:
    return bytes(t.view(torch.uint8)[blocks].cpu().numpy().tobytes())


async def test_write_and_read_follow_the_current_torch_stream(tensors: list[Any]) -> None:
    cache = kvpipe.KVCache.from_tensors(LAYOUT, tensors)
    assert cache.framework == "torch" and cache.device == "cuda:0"
    tokens = np.arange(4 * LAYOUT.block_size)
    model = torch.cuda.Stream()
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
        assert pipe.statistics().device_path == "cuda"
        with torch.cuda.stream(model):
            _model_writes(tensors, slice(0, 4))
            result = await pipe.write(tokens, [0, 1, 2, 3])  # stream=None: `model`
            assert result.complete and result.written == 4
            torch.cuda._sleep(BUSY)  # the model still reads blocks 8..11 when read() is called
            before = [t[8:12].clone() for t in tensors]
            got = await pipe.read(tokens, [8, 9, 10, 11])
            assert got.complete
        model.synchronize()
    for t, old in zip(tensors, before, strict=True):
        assert not torch.equal(old.view(torch.uint8), t[8:12].view(torch.uint8))
        assert _bytes(t, slice(8, 12)) == _bytes(t, slice(0, 4))


async def test_without_the_producer_stream_the_write_reads_stale_blocks(
    tensors: list[Any],
) -> None:
    """The control: ordered after an idle stream instead, the same write stores the zeros
    the blocks held before the model's kernel ran (what the stream lookup prevents)."""
    for t in tensors:
        t.view(torch.uint8)[8:12].fill_(255)
    torch.cuda.synchronize()
    cache = kvpipe.KVCache.from_tensors(LAYOUT, tensors)
    tokens = np.arange(4 * LAYOUT.block_size) + 10**6
    model, idle = torch.cuda.Stream(), torch.cuda.Stream()
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
        with torch.cuda.stream(model):
            _model_writes(tensors, slice(0, 4))
            assert (await pipe.write(tokens, [0, 1, 2, 3], stream=idle.cuda_stream)).complete
        model.synchronize()
        assert (await pipe.read(tokens, [8, 9, 10, 11], stream=idle.cuda_stream)).complete
    torch.cuda.synchronize()
    for t in tensors:
        assert not any(_bytes(t, slice(8, 12)))  # stale: blocks 0..3 before the model wrote


class DLPackOnly:
    """A CUDA tensor seen only through the DLPack protocol (no ``data_ptr``)."""

    def __init__(self, t: Any) -> None:
        self._t = t
        self.shape = t.shape

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._t.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        kind, index = self._t.__dlpack_device__()
        return int(kind), int(index)


async def test_dlpack_tensors_with_an_explicit_stream(tensors: list[Any]) -> None:
    cache = kvpipe.KVCache.from_tensors(LAYOUT, [DLPackOnly(t) for t in tensors])
    assert cache.device == "cuda:0"
    assert list(cache.pointers) == [t.data_ptr() for t in tensors]
    tokens = np.arange(4 * LAYOUT.block_size) + 2 * 10**6
    model = torch.cuda.Stream()
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
        with pytest.raises(kvpipe.RequestError, match="stream="):
            await pipe.write(tokens, [0, 1, 2, 3])
        with torch.cuda.stream(model):
            _model_writes(tensors, slice(4, 8))
        s = model.cuda_stream
        assert (await pipe.write(tokens, [4, 5, 6, 7], stream=s)).complete
        assert (await pipe.read(tokens, [12, 13, 14, 15], stream=s)).complete
    torch.cuda.synchronize()
    for t in tensors:
        assert _bytes(t, slice(12, 16)) == _bytes(t, slice(4, 8))


async def test_pinned_host_cache_on_the_real_driver() -> None:
    layout = kvpipe.CacheLayout.mla(num_layers=3, kv_lora_rank=512, rope_dim=64, block_size=16)
    cache = kvpipe.create_host_cache(layout, 8)
    try:
        rng = np.random.default_rng(5)
        for rows in cache.byte_rows:
            assert not rows.any()  # zeroed
            rows[:4] = rng.integers(0, 256, rows[:4].shape, dtype=np.uint8)
        tokens = np.arange(4 * layout.block_size)
        async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
            assert pipe.statistics().device_path == "host"
            assert (await pipe.write(tokens, [0, 1, 2, 3])).complete
            assert (await pipe.read(tokens, [4, 5, 6, 7])).complete
        for rows in cache.byte_rows:
            assert (rows[4:8] == rows[0:4]).all()
    finally:
        cache.free()
