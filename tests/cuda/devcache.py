"""Fake device caches over :class:`FakeDriver` memory, and helpers to fill and read them."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt

import kvpipe
from kvpipe._layout import numpy_dtype
from tests.cuda.fake_driver import FakeDriver

Rows = npt.NDArray[np.uint8]

# Layouts with odd sizes: DSA's 656-byte key rows, a GQA block of 60 bytes (not a multiple
# of 16, so consecutive blocks and segments are misaligned), fp8 with bf16 scales.
ODD_LAYOUTS = {
    "gqa_odd": lambda: kvpipe.CacheLayout.gqa(
        num_layers=2, num_kv_heads=2, head_dim=3, block_size=5, dtype="bfloat16"
    ),
    "gqa_fp8_odd": lambda: kvpipe.CacheLayout.gqa(
        num_layers=2, num_kv_heads=3, head_dim=5, block_size=3, fp8_scales=True
    ),
    "mla_odd": lambda: kvpipe.CacheLayout.mla(
        num_layers=2, kv_lora_rank=7, rope_dim=3, block_size=3, dtype="float16"
    ),
    "dsa_real_rows": lambda: kvpipe.CacheLayout.dsa(
        num_layers=2,
        kv_lora_rank=512,
        rope_dim=64,
        index_head_dim=128,
        quant_block=128,
        block_size=3,
    ),
}


class FakeCudaTensor:
    """Enough of a PyTorch CUDA tensor for ``KVCache.from_tensors``: device memory of a
    :class:`FakeDriver`, a ``device`` of type ``cuda``, ``data_ptr()``."""

    def __init__(self, fake: FakeDriver, shape: tuple[int, ...], dtype: str, index: int = 0):
        self.nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
        self.ptr = fake.device_alloc(self.nbytes)
        self.shape = shape
        self.dtype = f"torch.{dtype}"
        self.device = SimpleNamespace(type="cuda", index=index)
        self.contiguous = True

    def data_ptr(self) -> int:
        return self.ptr

    def is_contiguous(self) -> bool:
        return self.contiguous


def fake_device_cache(
    fake: FakeDriver, layout: kvpipe.CacheLayout, num_blocks: int, index: int = 0
) -> kvpipe.KVCache:
    """A device cache whose tensors live in the fake's device memory (zeroed)."""
    tensors: list[Any] = []
    for role, _layer in layout.tensor_order():
        spec = layout.role(role)
        t = FakeCudaTensor(fake, (num_blocks, *spec.block_shape), spec.dtype, index)
        fake.write_device(t.ptr, bytes(t.nbytes))
        tensors.append(t)
    return kvpipe.KVCache.from_tensors(layout, tensors)


def device_rows(fake: FakeDriver, cache: kvpipe.KVCache) -> list[Rows]:
    """A host copy of every tensor, ``[num_blocks, role_block_nbytes]``, in contract order."""
    out = []
    for (role, _layer), ptr in zip(cache.layout.tensor_order(), cache.pointers, strict=True):
        nbytes = cache.layout.role(role).block_nbytes
        raw = fake.read_device(ptr, cache.num_blocks * nbytes)
        out.append(np.frombuffer(raw, np.uint8).reshape(cache.num_blocks, nbytes).copy())
    return out


def fill_device(fake: FakeDriver, cache: kvpipe.KVCache, seed: int) -> list[Rows]:
    """Random bytes into every tensor; returns what was written (host copies)."""
    rng = np.random.default_rng(seed)
    rows = []
    for (role, _layer), ptr in zip(cache.layout.tensor_order(), cache.pointers, strict=True):
        nbytes = cache.layout.role(role).block_nbytes
        data = rng.integers(0, 256, size=(cache.num_blocks, nbytes), dtype=np.uint8)
        fake.write_device(ptr, data.tobytes())
        rows.append(data)
    return rows


def free_device_cache(fake: FakeDriver, cache: kvpipe.KVCache) -> None:
    """Give the cache's fake device memory back (so leak checks see only the engine's)."""
    for t in cache.tensors():
        fake.device_free(t.ptr)
    cache.free()
