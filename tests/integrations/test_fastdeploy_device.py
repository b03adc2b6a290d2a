"""The FastDeploy adapter over Paddle GPU caches, on the CUDA driver's test double: what the
cache transfer manager's calls do through kvpipe's CUDA path (CI has no GPU)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe._layout import numpy_dtype
from kvpipe.cuda import _engine as cuda_engine
from kvpipe.integrations.fastdeploy import KVPipeAttentionStore
from tests.cuda.fake_driver import FakeDriver, Gate

LAYERS, HEADS, BLOCK, DIM, BLOCKS = 2, 2, 4, 8, 10


class FakePaddleGpuTensor:
    """Enough of a Paddle GPU tensor for the adapter and ``KVCache.from_tensors``: device
    memory of a :class:`FakeDriver`, a GPU ``place``, ``data_ptr()``."""

    def __init__(self, fake: FakeDriver, shape: tuple[int, ...], dtype: str = "bfloat16"):
        self.nbytes = math.prod(shape) * numpy_dtype(dtype).itemsize
        self.ptr = fake.device_alloc(self.nbytes)
        self.shape = list(shape)
        self.dtype = f"paddle.{dtype}"
        self.place = SimpleNamespace(is_gpu_place=lambda: True, gpu_device_id=lambda: 0)

    def data_ptr(self) -> int:
        return self.ptr

    def is_contiguous(self) -> bool:
        return True


FakePaddleGpuTensor.__module__ = "paddle.fake"  # recognised as Paddle's, as the real ones are


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    driver = FakeDriver()
    driver.open(0)
    driver.make_current()
    yield driver
    driver.run_until_idle()
    driver.close()
    assert driver.violations == [], driver.violations


def _caches(fake: FakeDriver, seed: int) -> tuple[list[FakePaddleGpuTensor], ...]:
    rng = np.random.default_rng(seed)
    caches: tuple[list[FakePaddleGpuTensor], ...] = ([], [])
    for tensors in caches:
        for _ in range(LAYERS):
            t = FakePaddleGpuTensor(fake, (BLOCKS, HEADS, BLOCK, DIM))
            fake.write_device(t.ptr, rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes())
            tensors.append(t)
    return caches


def _block(fake: FakeDriver, caches: tuple[list[FakePaddleGpuTensor], ...], b: int) -> bytes:
    """Cache block ``b`` of every tensor, in FastDeploy's order."""
    out = b""
    for tensors in caches:
        for t in tensors:
            n = t.nbytes // BLOCKS
            out += fake.read_device(t.ptr + b * n, n)
    return out


def test_write_query_read_through_the_cuda_path(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager's calls, from threads of its own: writes of five blocks in three calls
    (later ones from later start indexes, as its write-back does), a query, and a read into
    other cache blocks in another order; every byte comes back. A write is ordered after
    Paddle's current stream: called while the model's kernel still writes block 1, it waits
    for the kernel and stores what it wrote."""
    stream = fake.stream_create()
    monkeypatch.setattr(cuda_engine, "current_stream", lambda framework, ordinal: stream)
    keys, values = _caches(fake, seed=1)
    tokens = list(range(5 * BLOCK))
    block1 = [(t.ptr + t.nbytes // BLOCKS, t.nbytes // BLOCKS) for t in keys + values]

    def model_kernel() -> None:
        for address, n in block1:
            fake.write_device(address, b"\x42" * n)

    config = kvpipe.PipelineConfig(slice_block_num=2)
    with KVPipeAttentionStore(
        layer_num=LAYERS,
        block_token_size=BLOCK,
        store=kvpipe.MemoryStore(),
        config=config,
        device_driver=fake,
    ) as adapter:
        assert adapter.write("t1", keys, values, tokens[:BLOCK], [0], 0) == 1  # opens it
        gate = Gate()
        fake.host_op(stream, model_kernel, writes=block1, gate=gate, label="the model")
        polls = fake.calls.count("event_query")
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(adapter.write, "t1", keys, values, tokens[: 3 * BLOCK], [1, 2], 1)
            # The write's gather polls the model's mark (it is not queued behind it).
            waited = time.monotonic() + 10
            while fake.calls.count("event_query") < polls + 3 and time.monotonic() < waited:
                time.sleep(0.001)
            assert fake.calls.count("event_query") >= polls + 3
            assert not second.done()  # its copy cannot run before the model's kernel
            gate.open()
            assert second.result(timeout=10) == 2
        assert adapter.write("t1", keys, values, tokens, [3, 4], 3) == 2
        assert adapter.query("t1", tokens, 0) == 5
        before = [_block(fake, (keys, values), b) for b in range(5)]
        assert before[1] == b"\x42" * len(before[1])
        assert adapter.read("t2", keys, values, tokens, [9, 8, 7, 6, 5], 0) == 5
    after = [_block(fake, (keys, values), b) for b in (9, 8, 7, 6, 5)]
    assert after == before
    fake.stream_destroy(stream)
    for t in keys + values:
        fake.device_free(t.ptr)


def _tensors(fake: FakeDriver, n: int, shape: tuple[int, ...], dtype: str, seed: int) -> list[Any]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = FakePaddleGpuTensor(fake, shape, dtype)
        fake.write_device(t.ptr, rng.integers(0, 256, t.nbytes, dtype=np.uint8).tobytes())
        out.append(t)
    return out


@pytest.mark.parametrize("kind", ["gqa-fp8-float32-scales", "mla"])
def test_every_layout_round_trips_from_4_threads(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Block-wise fp8 with its scale tensors, and MLA (no value cache): 4 threads each write
    a sequence of 2 blocks and read it back into other blocks; every byte comes back, the
    scales too."""
    stream = fake.stream_create()
    monkeypatch.setattr(cuda_engine, "current_stream", lambda framework, ordinal: stream)
    scales: list[Any] | None = None
    if kind == "mla":
        keys = _tensors(fake, LAYERS, (BLOCKS * 2, 1, BLOCK, 72), "bfloat16", seed=2)
        values: list[Any] = []
    else:
        keys = _tensors(fake, LAYERS, (BLOCKS * 2, HEADS, BLOCK, DIM), "uint8", seed=3)
        values = _tensors(fake, LAYERS, (BLOCKS * 2, HEADS, BLOCK, DIM), "uint8", seed=4)
        scales = _tensors(fake, 2 * LAYERS, (BLOCKS * 2, HEADS, BLOCK), "float32", seed=5)
    every = keys + values + (scales or [])
    with KVPipeAttentionStore(
        layer_num=LAYERS,
        block_token_size=BLOCK,
        store=kvpipe.MemoryStore(),
        config=kvpipe.PipelineConfig(slice_block_num=1),
        rope_dim=8,
        device_driver=fake,
    ) as adapter:

        def one(i: int) -> tuple[int, int]:
            tokens = list(range(i * 1000, i * 1000 + 2 * BLOCK))
            src, dst = [2 * i, 2 * i + 1], [BLOCKS + 2 * i + 1, BLOCKS + 2 * i]
            w = adapter.write(f"w{i}", keys, values, tokens, src, 0, scale_cache=scales)
            r = adapter.read(f"r{i}", keys, values, tokens, dst, 0, scale_cache=scales)
            return w, r

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == [(2, 2)] * 4
    for t in every:
        n = t.nbytes // (BLOCKS * 2)
        for i in range(4):
            for src, dst in ((2 * i, BLOCKS + 2 * i + 1), (2 * i + 1, BLOCKS + 2 * i)):
                assert fake.read_device(t.ptr + dst * n, n) == fake.read_device(t.ptr + src * n, n)
    fake.stream_destroy(stream)
    for t in every:
        fake.device_free(t.ptr)


def test_an_mtp_draft_layer_with_more_blocks_round_trips(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FastDeploy with MTP and ``num_gpu_block_expand_ratio`` 1.5: the manager's last layer
    (the draft model's) has 15 blocks to the model's 10, and the model's block ids. A write
    and a read into other blocks move its blocks with the model's; its blocks past the
    model's are not touched."""
    stream = fake.stream_create()
    monkeypatch.setattr(cuda_engine, "current_stream", lambda framework, ordinal: stream)
    keys, values = _caches(fake, seed=6)
    extra = int(BLOCKS * 1.5)
    keys += _tensors(fake, 1, (extra, HEADS, BLOCK, DIM), "bfloat16", seed=7)
    values += _tensors(fake, 1, (extra, HEADS, BLOCK, DIM), "bfloat16", seed=8)
    tail = [fake.read_device(t.ptr, t.nbytes) for t in (keys[-1], values[-1])]
    tokens = list(range(3 * BLOCK))
    with KVPipeAttentionStore(
        layer_num=LAYERS + 1, block_token_size=BLOCK, store=kvpipe.MemoryStore(), device_driver=fake
    ) as adapter:
        assert adapter.write("t", keys, values, tokens, [0, 1, 2], 0) == 3
        assert adapter.read("t", keys, values, tokens, [9, 8, 7], 0) == 3
    for t in keys + values:
        n = t.nbytes // int(t.shape[0])
        for src, dst in ((0, 9), (1, 8), (2, 7)):
            assert fake.read_device(t.ptr + dst * n, n) == fake.read_device(t.ptr + src * n, n)
    for t, before in zip((keys[-1], values[-1]), tail, strict=True):
        n = t.nbytes // extra
        assert fake.read_device(t.ptr + BLOCKS * n, (extra - BLOCKS) * n) == before[BLOCKS * n :]
    fake.stream_destroy(stream)
    for t in keys + values:
        fake.device_free(t.ptr)
