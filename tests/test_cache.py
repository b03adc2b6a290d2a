"""KVCache: allocation (numpy and Paddle CPU), contract order, names, byte rows that alias the
tensors, ``from_tensors`` with sequences and mappings, and every rejection."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe import CacheLayout, KVCache, create_kv_cache
from kvpipe._layout import numpy_dtype

FRAMEWORKS = ["numpy", "paddle"]
NUM_BLOCKS = 5


def _np_tensors(layout: CacheLayout, num_blocks: int = NUM_BLOCKS) -> list[Any]:
    return [
        np.zeros((num_blocks, *layout.role(role).block_shape), numpy_dtype(layout.role(role).dtype))
        for role, _ in layout.tensor_order()
    ]


def _paddle_tensors(layout: CacheLayout, num_blocks: int = NUM_BLOCKS) -> list[Any]:
    import paddle

    return [
        paddle.zeros([num_blocks, *layout.role(role).block_shape], dtype=layout.role(role).dtype)
        for role, _ in layout.tensor_order()
    ]


def _to_numpy_bytes(t: Any) -> np.ndarray[Any, Any]:
    """A copy of a tensor's bytes, as [num_blocks, -1] uint8 (numpy or paddle)."""
    arr = t if isinstance(t, np.ndarray) else t.numpy()
    out: np.ndarray[Any, Any] = np.ascontiguousarray(arr).reshape(arr.shape[0], -1).view(np.uint8)
    return out.copy()


# ---------------------------------------------------------------- create_kv_cache


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_create_shapes_dtypes_and_order(any_layout: CacheLayout, framework: Any) -> None:
    cache = create_kv_cache(any_layout, num_blocks=NUM_BLOCKS, framework=framework)
    assert cache.num_blocks == NUM_BLOCKS
    assert cache.layout is any_layout
    assert cache.framework == framework
    tensors = cache.tensors()
    order = any_layout.tensor_order()
    assert len(tensors) == len(order)
    for t, (role, layer) in zip(tensors, order, strict=True):
        spec = any_layout.role(role)
        assert tuple(int(d) for d in t.shape) == (NUM_BLOCKS, *spec.block_shape)
        assert str(t.dtype).rsplit(".", 1)[-1] == spec.dtype
        assert cache[role, layer] is t
        if framework == "numpy":
            assert isinstance(t, np.ndarray)
            assert t.dtype == numpy_dtype(spec.dtype)
        else:
            assert type(t).__module__.startswith("paddle")
            assert t.place.is_cpu_place()
    assert len(cache.byte_rows) == len(order)
    for rows, (role, _) in zip(cache.byte_rows, order, strict=True):
        assert rows.dtype == np.uint8
        assert rows.shape == (NUM_BLOCKS, any_layout.role(role).block_nbytes)
    # allocated zeroed
    assert all(not rows.any() for rows in cache.byte_rows)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensors_returns_a_fresh_list(framework: Any) -> None:
    layout = CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2)
    cache = create_kv_cache(layout, 2, framework=framework)
    lst = cache.tensors()
    lst.clear()
    assert len(cache.tensors()) == 4


def test_getitem_gqa_fp8_contract_positions() -> None:
    layout = CacheLayout.gqa(
        num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, fp8_scales=True
    )
    cache = create_kv_cache(layout, 2)
    ts = cache.tensors()
    for layer in range(3):
        assert cache["key", layer] is ts[4 * layer]
        assert cache["value", layer] is ts[4 * layer + 1]
        assert cache["key_scale", layer] is ts[4 * layer + 2]
        assert cache["value_scale", layer] is ts[4 * layer + 3]
        assert ts[4 * layer + 2].shape == (2, 2, 4)
        assert ts[4 * layer + 2].dtype == numpy_dtype("bfloat16")


def test_getitem_unknown_raises_keyerror() -> None:
    cache = create_kv_cache(
        CacheLayout.gqa(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2), 2
    )
    with pytest.raises(KeyError):
        cache["indexer", 0]
    with pytest.raises(KeyError):
        cache["key", 2]


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "4"])
def test_create_rejects_bad_num_blocks(bad: Any) -> None:
    layout = CacheLayout.mla(num_layers=1, kv_lora_rank=4, rope_dim=2, block_size=2)
    with pytest.raises(kvpipe.LayoutError):
        create_kv_cache(layout, bad)


def test_create_refuses_a_cache_too_large_for_one_array() -> None:
    # numpy's own ValueError ("Maximum allowed dimension exceeded") came out untyped.
    layout = CacheLayout.mla(num_layers=1, kv_lora_rank=4, rope_dim=2, block_size=2)
    with pytest.raises(kvpipe.LayoutError, match="too large"):
        create_kv_cache(layout, 2**62)


def test_create_rejects_unknown_framework() -> None:
    layout = CacheLayout.mla(num_layers=1, kv_lora_rank=4, rope_dim=2, block_size=2)
    with pytest.raises(kvpipe.LayoutError, match="framework"):
        create_kv_cache(layout, 2, framework="torch")  # type: ignore[arg-type]


@pytest.mark.parametrize("device", [0, None, b"cpu"])
def test_create_rejects_a_device_that_is_not_a_string(device: Any) -> None:
    # device=0 (a torch habit) raised AttributeError: 'int' object has no attribute 'partition'.
    layout = CacheLayout.mla(num_layers=1, kv_lora_rank=4, rope_dim=2, block_size=2)
    with pytest.raises(kvpipe.LayoutError, match="unknown device"):
        create_kv_cache(layout, 2, device=device)


def test_create_rejects_a_layout_that_is_not_one() -> None:
    # Raised AttributeError: 'str' object has no attribute 'tensor_order'.
    with pytest.raises(kvpipe.LayoutError, match=r"layout must be a kvpipe\.CacheLayout"):
        create_kv_cache("gqa", 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["gpu", "gpu:0", "cuda"])
def test_create_on_device_is_unsupported(device: str) -> None:
    layout = CacheLayout.mla(num_layers=1, kv_lora_rank=4, rope_dim=2, block_size=2)
    with pytest.raises(kvpipe.Unsupported):
        create_kv_cache(layout, 2, device=device)
    with pytest.raises(kvpipe.Unsupported):
        create_kv_cache(layout, 2, framework="paddle", device=device)


# ---------------------------------------------------------------- names


def test_names_gqa_fp8() -> None:
    layout = CacheLayout.gqa(
        num_layers=4, num_kv_heads=1, head_dim=4, block_size=2, fp8_scales=True
    )
    cache = create_kv_cache(layout, 1)
    names = cache.names(rank=1, device_id=2)
    assert len(names) == 16
    assert names[0] == "key_caches_0_rank1.device2"
    assert names[1] == "value_caches_0_rank1.device2"
    assert names[2] == "key_cache_scales_0_rank1.device2"
    assert names[3] == "value_cache_scales_0_rank1.device2"
    assert names[4 * 3] == "key_caches_3_rank1.device2"
    assert names[4 * 3 + 3] == "value_cache_scales_3_rank1.device2"


def test_names_dsa_and_defaults() -> None:
    layout = CacheLayout.dsa(
        num_layers=2, kv_lora_rank=128, rope_dim=8, index_head_dim=16, quant_block=16, block_size=2
    )
    cache = create_kv_cache(layout, 1)
    assert cache.names() == [
        "key_caches_0_rank0.device0",
        "indexer_caches_0_rank0.device0",
        "key_caches_1_rank0.device0",
        "indexer_caches_1_rank0.device0",
    ]


def test_names_follow_tensor_order(any_layout: CacheLayout) -> None:
    cache = create_kv_cache(any_layout, 1)
    assert cache.names(rank=3, device_id=1) == [
        CacheLayout.tensor_name(role, layer, 3, 1) for role, layer in any_layout.tensor_order()
    ]


# ---------------------------------------------------------------- byte rows alias the tensors


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_byte_rows_alias_tensor_memory(any_layout: CacheLayout, framework: Any) -> None:
    cache = create_kv_cache(any_layout, NUM_BLOCKS, framework=framework)
    rng = np.random.default_rng(7)
    for i, (rows, t) in enumerate(zip(cache.byte_rows, cache.tensors(), strict=True)):
        block = i % NUM_BLOCKS
        pattern = rng.integers(0, 256, size=rows.shape[1], dtype=np.uint8)
        rows[block] = pattern
        seen = _to_numpy_bytes(t)
        assert np.array_equal(seen[block], pattern)
        others = np.delete(seen, block, axis=0)
        assert not others.any()


def test_numpy_tensor_writes_show_in_byte_rows(any_layout: CacheLayout) -> None:
    cache = create_kv_cache(any_layout, NUM_BLOCKS)
    for i, (rows, t) in enumerate(zip(cache.byte_rows, cache.tensors(), strict=True)):
        block = (i + 1) % NUM_BLOCKS
        t.view(np.uint8).reshape(NUM_BLOCKS, -1)[block] = 0xA5
        assert (rows[block] == 0xA5).all()
        assert np.count_nonzero(rows) == rows.shape[1]


def test_paddle_tensor_writes_show_in_byte_rows() -> None:
    layout = CacheLayout.gqa(
        num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, fp8_scales=True
    )
    cache = create_kv_cache(layout, NUM_BLOCKS, framework="paddle")
    key = cache["key", 1]
    key[2] = 9  # in place
    rows = cache.byte_rows[4]
    assert (rows[2] == 9).all()
    assert np.count_nonzero(rows) == rows.shape[1]
    scale = cache["value_scale", 0]
    scale.fill_(1.0)  # bf16 1.0 = 0x3F80, little endian
    srows = cache.byte_rows[3]
    assert (srows[:, 0::2] == 0x80).all()
    assert (srows[:, 1::2] == 0x3F).all()


# ---------------------------------------------------------------- from_tensors


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_from_tensors_sequence(any_layout: CacheLayout, framework: str) -> None:
    tensors = _np_tensors(any_layout) if framework == "numpy" else _paddle_tensors(any_layout)
    cache = KVCache.from_tensors(any_layout, tensors)
    assert cache.num_blocks == NUM_BLOCKS
    assert cache.framework == framework
    assert all(a is b for a, b in zip(cache.tensors(), tensors, strict=True))
    for (role, layer), t in zip(any_layout.tensor_order(), tensors, strict=True):
        assert cache[role, layer] is t
    # no copy: writing the caller's tensor shows in the cache's rows
    cache.byte_rows[-1][NUM_BLOCKS - 1] = 3
    assert (_to_numpy_bytes(tensors[-1])[NUM_BLOCKS - 1] == 3).all()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_from_tensors_mapping(any_layout: CacheLayout, framework: str) -> None:
    tensors = _np_tensors(any_layout) if framework == "numpy" else _paddle_tensors(any_layout)
    order = any_layout.tensor_order()
    # insertion order deliberately reversed: the cache must still be in contract order
    mapping = {rl: t for rl, t in reversed(list(zip(order, tensors, strict=True)))}
    cache = KVCache.from_tensors(any_layout, mapping)
    assert all(a is b for a, b in zip(cache.tensors(), tensors, strict=True))
    for rl, t in mapping.items():
        assert cache[rl] is t


def test_from_tensors_dlpack_only_object() -> None:
    layout = CacheLayout.gqa(
        num_layers=1, num_kv_heads=1, head_dim=4, block_size=2, dtype="float32"
    )

    class DLPackOnly:
        def __init__(self, arr: np.ndarray[Any, Any]) -> None:
            self._arr = arr
            self.shape = arr.shape

        def __dlpack__(self, **kwargs: Any) -> Any:
            return self._arr.__dlpack__(**kwargs)

        def __dlpack_device__(self) -> Any:
            return self._arr.__dlpack_device__()

    arrays = _np_tensors(layout, 3)
    cache = KVCache.from_tensors(layout, [DLPackOnly(a) for a in arrays])
    cache.byte_rows[1][2] = 0xFF
    assert (arrays[1].view(np.uint8).reshape(3, -1)[2] == 0xFF).all()


class _FakeDevice:
    def __init__(self, type_: str) -> None:
        self.type = type_


class _TorchLike:
    """Enough of a torch tensor for the ``data_ptr()`` path."""

    def __init__(self, arr: np.ndarray[Any, Any], dtype: str, device: str = "cpu") -> None:
        self._arr = arr
        self.shape = arr.shape
        self.dtype = f"torch.{dtype}"
        self.device = _FakeDevice(device)

    def data_ptr(self) -> int:
        return int(self._arr.ctypes.data)

    def is_contiguous(self) -> bool:
        return bool(self._arr.flags.c_contiguous)


def test_from_tensors_data_ptr_object_aliases() -> None:
    layout = CacheLayout.gqa(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2)
    arrays = _np_tensors(layout, 3)
    cache = KVCache.from_tensors(layout, [_TorchLike(a, "bfloat16") for a in arrays])
    cache.byte_rows[0][1] = 0x11
    assert (arrays[0].view(np.uint8).reshape(3, -1)[1] == 0x11).all()
    assert not arrays[0].view(np.uint8).reshape(3, -1)[[0, 2]].any()


def test_from_tensors_data_ptr_object_on_device_unsupported() -> None:
    # CUDA tensors make a device cache (tests/cuda/test_device_cache.py); other devices
    # are out of reach.
    layout = CacheLayout.gqa(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2)
    arrays = _np_tensors(layout, 3)
    with pytest.raises(kvpipe.Unsupported):
        KVCache.from_tensors(layout, [_TorchLike(a, "bfloat16", "xpu") for a in arrays])


class _XpuPlace:
    def is_cpu_place(self) -> bool:
        return False

    def is_gpu_place(self) -> bool:
        return False

    def __str__(self) -> str:
        return "Place(xpu:0)"


class _PaddleLikeXpu(_TorchLike):
    """Enough of a Paddle tensor on a place neither CPU nor GPU (XPU, a custom device)."""

    __module__ = "paddle.base.fake"

    def __init__(self, arr: np.ndarray[Any, Any], dtype: str) -> None:
        super().__init__(arr, dtype)
        self.dtype = f"paddle.{dtype}"
        self.place = _XpuPlace()


def test_from_tensors_paddle_on_another_device_is_unsupported_and_says_so() -> None:
    # Paddle GPU tensors make a device cache (tests/cuda/test_device_cache.py); an XPU or
    # custom-device tensor is out of reach in any build, which the message must not blame
    # on a missing CUDA device path.
    layout = CacheLayout.gqa(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2)
    arrays = _np_tensors(layout, 3)
    with pytest.raises(kvpipe.Unsupported) as info:
        KVCache.from_tensors(layout, [_PaddleLikeXpu(a, "bfloat16") for a in arrays])
    assert "Place(xpu:0)" in str(info.value)
    assert "CUDA device path" not in str(info.value)


def test_from_tensors_data_ptr_object_wrong_dtype() -> None:
    layout = CacheLayout.gqa(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2)
    arrays = _np_tensors(layout, 3)
    with pytest.raises(kvpipe.LayoutError, match="dtype"):
        KVCache.from_tensors(layout, [_TorchLike(a, "float16") for a in arrays])


# ---------------------------------------------------------------- from_tensors rejections

GQA = CacheLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3)


def test_rejects_wrong_dtype_numpy() -> None:
    tensors = _np_tensors(GQA)
    tensors[1] = tensors[1].astype(np.float16)
    with pytest.raises(kvpipe.LayoutError, match="dtype"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_wrong_dtype_paddle() -> None:
    import paddle

    tensors = _paddle_tensors(GQA)
    tensors[2] = paddle.zeros(list(tensors[2].shape), dtype="float16")
    with pytest.raises(kvpipe.LayoutError, match="dtype"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_wrong_shape_numpy() -> None:
    tensors = _np_tensors(GQA)
    tensors[3] = np.zeros((NUM_BLOCKS, 2, 3, 5), tensors[3].dtype)
    with pytest.raises(kvpipe.LayoutError, match="shape"):
        KVCache.from_tensors(GQA, tensors)
    tensors = _np_tensors(GQA)
    tensors[0] = tensors[0].reshape(NUM_BLOCKS, -1)  # same bytes, flattened
    with pytest.raises(kvpipe.LayoutError, match="shape"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_wrong_shape_paddle() -> None:
    import paddle

    tensors = _paddle_tensors(GQA)
    tensors[1] = paddle.zeros([NUM_BLOCKS, 2, 4, 3], dtype="bfloat16")  # transposed dims
    with pytest.raises(kvpipe.LayoutError, match="shape"):
        KVCache.from_tensors(GQA, tensors)


@pytest.mark.parametrize("count", [0, 1, 3, 5])
def test_rejects_wrong_count(count: int) -> None:
    tensors = (_np_tensors(GQA) * 2)[:count]
    with pytest.raises(kvpipe.LayoutError):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_missing_mapping_key() -> None:
    mapping = dict(zip(GQA.tensor_order(), _np_tensors(GQA), strict=True))
    del mapping["value", 1]
    with pytest.raises(kvpipe.LayoutError, match="missing"):
        KVCache.from_tensors(GQA, mapping)


@pytest.mark.parametrize("extra", [("indexer", 0), ("key", 2), ("key_scale", 0)])
def test_rejects_extra_mapping_key(extra: tuple[str, int]) -> None:
    tensors = _np_tensors(GQA)
    mapping = dict(zip(GQA.tensor_order(), tensors, strict=True))
    mapping[extra] = tensors[0]
    with pytest.raises(kvpipe.LayoutError, match="unexpected"):
        KVCache.from_tensors(GQA, mapping)


def test_rejects_extra_mapping_keys_that_do_not_sort_together() -> None:
    # The message listed the extra keys sorted: ("key", "1") beside ("key", 1), or "key"
    # beside a tuple, raised TypeError ('<' not supported) instead.
    tensors = _np_tensors(GQA)
    mapping: dict[Any, Any] = dict(zip(GQA.tensor_order(), tensors, strict=True))
    mapping["key", "1"] = mapping["key"] = tensors[0]
    mapping["key", 2] = tensors[1]
    with pytest.raises(kvpipe.LayoutError, match=r"unexpected .*\('key', '1'\)"):
        KVCache.from_tensors(GQA, mapping)


def test_rejects_non_contiguous_numpy() -> None:
    tensors = _np_tensors(GQA)
    wide = np.zeros((NUM_BLOCKS, 2, 3, 8), tensors[0].dtype)
    tensors[0] = wide[..., ::2]
    assert tensors[0].shape == (NUM_BLOCKS, 2, 3, 4)
    with pytest.raises(kvpipe.LayoutError, match="contiguous"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_fortran_order_numpy() -> None:
    tensors = _np_tensors(GQA)
    tensors[1] = np.asfortranarray(tensors[1])
    with pytest.raises(kvpipe.LayoutError, match="contiguous"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_read_only_numpy() -> None:
    tensors = _np_tensors(GQA)
    tensors[2].setflags(write=False)
    with pytest.raises(kvpipe.LayoutError, match="read-only"):
        KVCache.from_tensors(GQA, tensors)


@pytest.mark.parametrize("index", [1, 3])
def test_rejects_mismatched_num_blocks(index: int) -> None:
    tensors = _np_tensors(GQA)
    tensors[index] = np.zeros((NUM_BLOCKS + 1, *tensors[index].shape[1:]), tensors[index].dtype)
    with pytest.raises(kvpipe.LayoutError):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_mismatched_num_blocks_paddle() -> None:
    import paddle

    tensors = _paddle_tensors(GQA)
    tensors[3] = paddle.zeros([NUM_BLOCKS - 1, 2, 3, 4], dtype="bfloat16")
    with pytest.raises(kvpipe.LayoutError):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_zero_blocks() -> None:
    with pytest.raises(kvpipe.LayoutError):
        KVCache.from_tensors(GQA, _np_tensors(GQA, 0))


def test_rejects_unsupported_type() -> None:
    class Shaped:
        shape = (NUM_BLOCKS, 2, 3, 4)
        dtype = "bfloat16"

    with pytest.raises(kvpipe.LayoutError, match="unsupported"):
        KVCache.from_tensors(GQA, [Shaped() for _ in range(4)])
    with pytest.raises(kvpipe.LayoutError):
        KVCache.from_tensors(GQA, [[[0]] for _ in range(4)])
    with pytest.raises(kvpipe.LayoutError):
        KVCache.from_tensors(GQA, ["not a tensor"] * 4)


# ---------------------------------------------------------------- tensors sharing memory


def _from_one_buffer(layout: CacheLayout, starts: list[int] | None = None) -> list[Any]:
    """The layout's tensors cut from one buffer, back to back (no gap), or at byte offsets
    ``starts``."""
    specs = [
        ((NUM_BLOCKS, *layout.role(r).block_shape), numpy_dtype(layout.role(r).dtype))
        for r, _ in layout.tensor_order()
    ]
    sizes = [int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs]
    if starts is None:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
    raw = np.zeros(max(a + n for a, n in zip(starts, sizes, strict=True)), np.uint8)
    return [
        raw[a : a + n].view(dtype).reshape(shape)
        for a, n, (shape, dtype) in zip(starts, sizes, specs, strict=True)
    ]


def test_tensors_back_to_back_in_one_buffer_are_accepted(any_layout: CacheLayout) -> None:
    """Adjacent tensors (one ends where the next starts) share no byte."""
    tensors = _from_one_buffer(any_layout)
    cache = KVCache.from_tensors(any_layout, tensors)
    cache.byte_rows[-1][:] = 0xFF
    assert not any(r.any() for r in cache.byte_rows[:-1])


def test_rejects_the_same_tensor_for_key_and_value() -> None:
    tensors = _np_tensors(GQA)
    tensors[1] = tensors[0]  # value[0] is key[0]
    with pytest.raises(kvpipe.LayoutError, match=r"key\[0\] and value\[0\] share memory"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_one_tensor_for_two_layers_in_a_mapping() -> None:
    layout = CacheLayout.mla(num_layers=3, kv_lora_rank=16, rope_dim=8, block_size=2)
    tensors = dict(zip(layout.tensor_order(), _np_tensors(layout), strict=True))
    tensors["key", 2] = tensors["key", 0]
    with pytest.raises(kvpipe.LayoutError, match=r"key\[0\] and key\[2\] share memory"):
        KVCache.from_tensors(layout, tensors)


def test_rejects_the_same_scales_for_key_and_value() -> None:
    layout = CacheLayout.gqa(
        num_layers=1, num_kv_heads=2, head_dim=16, block_size=2, fp8_scales=True
    )
    tensors = _np_tensors(layout)
    names = layout.tensor_order()
    key_scale, value_scale = names.index(("key_scale", 0)), names.index(("value_scale", 0))
    tensors[value_scale] = tensors[key_scale]
    with pytest.raises(kvpipe.LayoutError, match=r"key_scale\[0\] and value_scale\[0\]"):
        KVCache.from_tensors(layout, tensors)


@pytest.mark.parametrize("by", ["one element", "all but one element"])
def test_rejects_overlapping_views_of_one_buffer(any_layout: CacheLayout, by: str) -> None:
    """The last tensor starts inside the one before it (overlapping it by one element of its
    own, or all but one): refused, naming both, whatever the layout (DSA's indexer
    included)."""
    order = any_layout.tensor_order()
    sizes = [NUM_BLOCKS * any_layout.role(r).block_nbytes for r, _ in order]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    (role_a, layer_a), (role_b, layer_b) = order[-2], order[-1]
    item = numpy_dtype(any_layout.role(role_b).dtype).itemsize
    starts[-1] -= item if by == "one element" else sizes[-2] - item
    tensors = _from_one_buffer(any_layout, starts)
    match = rf"{role_a}\[{layer_a}\] and {role_b}\[{layer_b}\] share memory"
    with pytest.raises(kvpipe.LayoutError, match=match):
        KVCache.from_tensors(any_layout, tensors)


def test_rejects_overlapping_tensors_apart_in_contract_order() -> None:
    """key[0] and value[1] (first and last in contract order) overlap; value[0] and key[1]
    lie after both in the buffer."""
    n = NUM_BLOCKS * GQA.role("key").block_nbytes
    assert GQA.tensor_order()[0] == ("key", 0) and GQA.tensor_order()[3] == ("value", 1)
    tensors = _from_one_buffer(GQA, [0, 2 * n, 3 * n, n // 2])
    with pytest.raises(kvpipe.LayoutError, match=r"key\[0\] and value\[1\] share memory"):
        KVCache.from_tensors(GQA, tensors)


def test_rejects_one_data_ptr_tensor_for_two_roles() -> None:
    layout = CacheLayout.gqa(num_layers=1, num_kv_heads=2, head_dim=4, block_size=2)
    arrays = _np_tensors(layout, 3)
    shared = _TorchLike(arrays[0], "bfloat16")
    with pytest.raises(kvpipe.LayoutError, match=r"key\[0\] and value\[0\] share memory"):
        KVCache.from_tensors(layout, [shared, shared])


def test_rejects_one_paddle_tensor_for_two_roles() -> None:
    tensors = _paddle_tensors(GQA)
    tensors[3] = tensors[2]
    with pytest.raises(kvpipe.LayoutError, match=r"key\[1\] and value\[1\] share memory"):
        KVCache.from_tensors(GQA, tensors)
