"""Device caches: ``KVCache.from_tensors`` over Paddle GPU, PyTorch CUDA and DLPack CUDA
tensors (stand-ins: no GPU here), its checks, ``byte_rows`` refused; ``create_kv_cache`` on
a GPU; ``create_host_cache`` (pinned, exactly the device byte sizes) through the driver's
test double, and its clean ``Unsupported`` where there is no driver."""

from __future__ import annotations

import ctypes
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe._layout import numpy_dtype
from kvpipe.cuda import probe_device
from tests.cuda.devcache import ODD_LAYOUTS, FakeCudaTensor, fake_device_cache, free_device_cache
from tests.cuda.fake_driver import FakeDriver
from tests.helpers import LAYOUTS, fill_random


def _specs(layout: kvpipe.CacheLayout, n: int) -> list[tuple[tuple[int, ...], str]]:
    return [
        ((n, *layout.role(r).block_shape), layout.role(r).dtype) for r, _ in layout.tensor_order()
    ]


@pytest.mark.parametrize("name", sorted({**LAYOUTS, **ODD_LAYOUTS}))
def test_torch_like_cuda_tensors_make_a_device_cache(fake: FakeDriver, name: str) -> None:
    layout = {**LAYOUTS, **ODD_LAYOUTS}[name]()
    cache = fake_device_cache(fake, layout, 5, index=1)
    assert cache.device == "cuda:1"
    assert cache.num_blocks == 5
    assert cache.pointers == tuple(t.ptr for t in cache.tensors())
    with pytest.raises(kvpipe.Unsupported, match="device cache"):
        cache.byte_rows  # noqa: B018
    assert "device=cuda:1" in repr(cache)
    free_device_cache(fake, cache)
    assert cache.freed


class _PaddlePlace:
    def __init__(self, gpu: int | None) -> None:
        self.gpu = gpu

    def is_gpu_place(self) -> bool:
        return self.gpu is not None

    def is_cpu_place(self) -> bool:
        return self.gpu is None

    def gpu_device_id(self) -> int:
        assert self.gpu is not None
        return self.gpu


class PaddleLikeGpuTensor:
    """Enough of a Paddle GPU tensor: ``place.is_gpu_place()``, ``data_ptr()``."""

    __module__ = "paddle.base.fake"

    def __init__(self, shape: tuple[int, ...], dtype: str, ptr: int, gpu: int = 0) -> None:
        self.shape = list(shape)
        self.dtype = f"paddle.{dtype}"
        self.place = _PaddlePlace(gpu)
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr

    def is_contiguous(self) -> bool:
        return True


def test_paddle_gpu_tensors(fake: FakeDriver) -> None:
    layout = ODD_LAYOUTS["gqa_fp8_odd"]()
    ptrs = [fake.device_alloc(math.prod(s) * numpy_dtype(d).itemsize) for s, d in _specs(layout, 4)]
    tensors = [
        PaddleLikeGpuTensor(s, d, p) for (s, d), p in zip(_specs(layout, 4), ptrs, strict=True)
    ]
    cache = kvpipe.KVCache.from_tensors(layout, tensors)
    assert (cache.device, cache.framework, cache.pointers) == ("cuda:0", "paddle", tuple(ptrs))
    for p in ptrs:
        fake.device_free(p)


@pytest.mark.parametrize("what", ["dtype", "shape", "contiguous", "devices", "mixed"])
def test_device_tensors_are_checked(fake: FakeDriver, what: str) -> None:
    layout = LAYOUTS["gqa"]()
    tensors: list[Any] = [FakeCudaTensor(fake, s, d) for s, d in _specs(layout, 3)]
    if what == "dtype":
        tensors[1].dtype = "torch.float16"
    elif what == "shape":
        tensors[2].shape = (3, 99)
    elif what == "contiguous":
        tensors[0].contiguous = False
    elif what == "devices":
        tensors[3].device = SimpleNamespace(type="cuda", index=1)
    else:
        tensors[3] = np.zeros(tensors[3].shape, dtype=np.uint16).view(np.float16)
    with pytest.raises(kvpipe.LayoutError):
        kvpipe.KVCache.from_tensors(layout, tensors)
    for t in tensors:
        if isinstance(t, FakeCudaTensor):
            fake.device_free(t.ptr)


# ---------------------------------------------------------------- DLPack


class _DLTensorC(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("code", ctypes.c_uint8),
        ("bits", ctypes.c_uint8),
        ("lanes", ctypes.c_uint16),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    )


class DLPackCudaTensor:
    """A DLPack producer on a CUDA device (as CuPy or JAX would be): a real capsule."""

    def __init__(self, ptr: int, shape: tuple[int, ...], code: int, bits: int, device: int = 0,
                 strides: tuple[int, ...] | None = None, offset: int = 0) -> None:  # fmt: skip
        self.shape = shape
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = (ctypes.c_int64 * len(shape))(*strides) if strides else None
        self._dl = _DLTensorC(ptr - offset, 2, device, len(shape), code, bits, 1, self._shape,
                              self._strides, offset, None, None)  # fmt: skip
        self.streams: list[Any] = []

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, int(self._dl.device_id))

    def __dlpack__(self, stream: Any = None) -> Any:
        self.streams.append(stream)
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
        return new(ctypes.addressof(self._dl), b"dltensor", None)


_DL_CODES = {"bfloat16": (4, 16), "uint8": (1, 8), "float16": (2, 16), "float32": (2, 32)}


@pytest.mark.parametrize("name", ["gqa", "gqa_fp8", "mla", "dsa"])
def test_dlpack_cuda_tensors(fake: FakeDriver, name: str) -> None:
    layout = LAYOUTS[name]()
    tensors = []
    for shape, dtype in _specs(layout, 3):
        ptr = fake.device_alloc(math.prod(shape) * numpy_dtype(dtype).itemsize + 64)
        tensors.append(DLPackCudaTensor(ptr + 64, shape, *_DL_CODES[dtype], offset=64))
    cache = kvpipe.KVCache.from_tensors(layout, tensors)
    assert cache.device == "cuda:0" and cache.framework == "dlpack"
    assert [p - 64 for p in cache.pointers] == [int(t._dl.data) for t in tensors]
    assert all(t.streams == [-1] for t in tensors)  # asked not to synchronise
    for p in cache.pointers:
        fake.device_free(p - 64)


def test_dlpack_strides_and_dtype_are_checked(fake: FakeDriver) -> None:
    layout = kvpipe.CacheLayout.mla(
        num_layers=1, kv_lora_rank=4, rope_dim=4, block_size=2, dtype="float16"
    )
    ptr = fake.device_alloc(4096)
    shape = (3, 1, 2, 8)
    dense = DLPackCudaTensor(ptr, shape, 2, 16, strides=(16, 16, 8, 1))
    assert kvpipe.KVCache.from_tensors(layout, [dense]).pointers == (ptr,)
    transposed = DLPackCudaTensor(ptr, shape, 2, 16, strides=(16, 16, 1, 2))
    with pytest.raises(kvpipe.LayoutError, match="contiguous"):
        kvpipe.KVCache.from_tensors(layout, [transposed])
    wrong = DLPackCudaTensor(ptr, shape, 4, 16)
    with pytest.raises(kvpipe.LayoutError, match="dtype bfloat16"):
        kvpipe.KVCache.from_tensors(layout, [wrong])
    fake.device_free(ptr)


# ---------------------------------------------------------------- device tensors sharing memory


def test_one_cuda_tensor_for_key_and_value_is_refused(fake: FakeDriver) -> None:
    layout = LAYOUTS["gqa"]()
    tensors: list[Any] = [FakeCudaTensor(fake, s, d) for s, d in _specs(layout, 3)]
    own_value = tensors[1]
    tensors[1] = tensors[0]  # value[0] is key[0]
    with pytest.raises(kvpipe.LayoutError, match=r"key\[0\] and value\[0\] share memory"):
        kvpipe.KVCache.from_tensors(layout, tensors)
    for t in {id(t): t for t in [*tensors, own_value]}.values():
        fake.device_free(t.ptr)


@pytest.mark.parametrize("overlap", [0, 2, None], ids=["adjacent", "one_element", "same"])
def test_dlpack_views_of_one_allocation_must_not_overlap(
    fake: FakeDriver, overlap: int | None
) -> None:
    """DLPack tensors cut from one device allocation (data + byte_offset): back to back they
    make a cache; the second starting ``overlap`` bytes before the first ends (or at the same
    address) is refused."""
    layout = kvpipe.CacheLayout.mla(
        num_layers=2, kv_lora_rank=4, rope_dim=4, block_size=2, dtype="float16"
    )
    shape = (3, 1, 2, 8)
    nbytes = math.prod(shape) * 2
    base = fake.device_alloc(2 * nbytes)
    second = base + (0 if overlap is None else nbytes - overlap)
    tensors = [DLPackCudaTensor(p, shape, 2, 16, offset=p - base) for p in (base, second)]
    if overlap == 0:
        assert kvpipe.KVCache.from_tensors(layout, tensors).pointers == (base, base + nbytes)
    else:
        with pytest.raises(kvpipe.LayoutError, match=r"key\[0\] and key\[1\] share memory"):
            kvpipe.KVCache.from_tensors(layout, tensors)
    fake.device_free(base)


def test_overlapping_paddle_gpu_tensors_are_refused(fake: FakeDriver) -> None:
    layout = ODD_LAYOUTS["gqa_fp8_odd"]()
    specs = _specs(layout, 4)
    sizes = [math.prod(s) * numpy_dtype(d).itemsize for s, d in specs]
    base = fake.device_alloc(sum(sizes))
    ptrs = [base + sum(sizes[:i]) for i in range(len(sizes))]
    ptrs[-1] = ptrs[-2] + 2  # inside the one before it
    tensors = [PaddleLikeGpuTensor(s, d, p) for (s, d), p in zip(specs, ptrs, strict=True)]
    (ra, la), (rb, lb) = layout.tensor_order()[-2:]
    with pytest.raises(kvpipe.LayoutError, match=rf"{ra}\[{la}\] and {rb}\[{lb}\] share"):
        kvpipe.KVCache.from_tensors(layout, tensors)
    fake.device_free(base)


# ---------------------------------------------------------------- create_kv_cache on a GPU


@pytest.mark.parametrize("device", ["gpu:0", "gpu", "cuda:0"])
def test_create_on_gpu_with_cpu_only_paddle_is_unsupported(device: str) -> None:
    paddle = pytest.importorskip("paddle")
    if paddle.device.is_compiled_with_cuda():
        pytest.skip("this Paddle is built with CUDA")
    layout = LAYOUTS["gqa"]()
    with pytest.raises(kvpipe.Unsupported, match="no CUDA support"):
        kvpipe.create_kv_cache(layout, 2, framework="paddle", device=device)
    with pytest.raises(kvpipe.Unsupported, match="numpy"):
        kvpipe.create_kv_cache(layout, 2, device=device)


def test_create_on_an_unknown_device_is_a_layout_error() -> None:
    with pytest.raises(kvpipe.LayoutError, match="unknown device"):
        kvpipe.create_kv_cache(LAYOUTS["gqa"](), 2, device="tpu:0")


# ---------------------------------------------------------------- create_host_cache


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_host_cache_is_pinned_with_the_device_byte_sizes(fake: FakeDriver, name: str) -> None:
    layout = LAYOUTS[name]()
    cache = kvpipe.create_host_cache(layout, 7, device_driver=fake)
    assert cache.device == "cpu"
    # one pinned allocation per role, exactly that role's bytes over all layers
    sizes = {s.name: layout.num_layers * 7 * s.block_nbytes for s in layout.role_specs}
    assert sorted(n for kind, n in fake.alloc_log if kind == "pinned") == sorted(sizes.values())
    assert sum(sizes.values()) == 7 * layout.block_nbytes
    if "key_scale" in layout.roles:
        spec = layout.role("key_scale")
        assert spec.block_nbytes == 2 * math.prod(spec.block_shape)  # bf16: 2 B/element
    for (role, _layer), t in zip(layout.tensor_order(), cache.tensors(), strict=True):
        assert t.nbytes == 7 * layout.role(role).block_nbytes
        assert not t.any()  # zeroed (pinned memory is not)
    fill_random(cache)  # usable as a host cache
    cache.free()
    cache.free()  # idempotent
    assert cache.freed
    with pytest.raises(kvpipe.LayoutError, match="freed"):
        cache.byte_rows  # noqa: B018
    fake.assert_clean()


def test_host_cache_allocation_failure_frees_what_was_allocated(fake: FakeDriver) -> None:
    layout = LAYOUTS["gqa_fp8"]()
    real = fake.host_alloc
    calls = 0

    def flaky(nbytes: int) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise kvpipe.DeviceError("cuMemHostAlloc", "CUDA_ERROR_OUT_OF_MEMORY")
        return real(nbytes)

    fake.host_alloc = flaky  # type: ignore[method-assign]
    with pytest.raises(kvpipe.DeviceError):
        kvpipe.create_host_cache(layout, 3, device_driver=fake)
    fake.assert_clean()


def test_host_cache_leaves_the_thread_s_current_context_as_it_was(fake: FakeDriver) -> None:
    """The caller's thread has another device's context current (its framework's): making
    a host cache, freeing it, or failing to make one gives it that context back."""
    layout = LAYOUTS["gqa"]()
    fake.set_current(fake.FOREIGN)
    cache = kvpipe.create_host_cache(layout, 3, device_driver=fake)
    assert fake.current_of() == fake.FOREIGN
    cache.free()
    assert fake.current_of() == fake.FOREIGN
    fake.fail_next("host_alloc", "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(kvpipe.DeviceError):
        kvpipe.create_host_cache(layout, 3, device_driver=fake)
    assert fake.current_of() == fake.FOREIGN
    fake.assert_clean()


def test_host_cache_without_a_driver_is_unsupported() -> None:
    if probe_device().available:
        pytest.skip("a CUDA driver is present here")
    with pytest.raises(kvpipe.Unsupported):
        kvpipe.create_host_cache(LAYOUTS["gqa"](), 2)


def test_host_cache_in_a_pipeline_round_trip(fake: FakeDriver) -> None:
    import anyio

    layout = LAYOUTS["gqa_fp8"]()
    src = kvpipe.create_host_cache(layout, 6, device_driver=fake)
    dst = kvpipe.create_host_cache(layout, 6, device_driver=fake)
    fill_random(src, seed=4)

    async def main() -> None:
        store = kvpipe.MemoryStore()
        tokens = np.arange(4 * layout.block_size)
        async with kvpipe.open_pipeline(src, store) as pipe:
            assert (await pipe.write(tokens, [5, 4, 3, 2])).complete
            assert pipe.statistics().device_path == "host"
        async with kvpipe.open_pipeline(dst, store) as pipe:
            assert (await pipe.read(tokens, [0, 1, 2, 3])).complete

    anyio.run(main)
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert (b[[0, 1, 2, 3]] == a[[5, 4, 3, 2]]).all()
    src.free()
    dst.free()
    with pytest.raises(kvpipe.ConfigError, match="freed"):
        kvpipe.Pipeline(src, kvpipe.MemoryStore())
    fake.assert_clean()
