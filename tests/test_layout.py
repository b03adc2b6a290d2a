"""CacheLayout: shapes and dtypes per layout, byte sizes, the tensor-order contract, the
fingerprint, parameter validation and tensor names."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import kvpipe
from kvpipe._layout import ROLE_ORDER, CacheLayout, numpy_dtype

GQA_ARGS: dict[str, Any] = dict(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16"
)
MLA_ARGS: dict[str, Any] = dict(
    num_layers=4, kv_lora_rank=512, rope_dim=64, block_size=16, dtype="bfloat16"
)
DSA_ARGS: dict[str, Any] = dict(
    num_layers=4, kv_lora_rank=512, rope_dim=64, index_head_dim=128, quant_block=128, block_size=64
)


def _specs(layout: CacheLayout) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {r.name: (r.dtype, r.block_shape) for r in layout.role_specs}


# ---------------------------------------------------------------- shapes per layout


def test_gqa_shapes_and_dtypes() -> None:
    layout = CacheLayout.gqa(**GQA_ARGS)
    assert layout.kind == "gqa"
    assert layout.roles == ("key", "value")
    assert layout.block_size == 16
    assert layout.num_layers == 4
    assert _specs(layout) == {
        "key": ("bfloat16", (2, 16, 64)),
        "value": ("bfloat16", (2, 16, 64)),
    }
    # 2 roles * 2 heads * 16 tokens * 64 dims * 2 bytes * 4 layers
    assert layout.block_nbytes == 2 * (2 * 16 * 64 * 2) * 4 == 32768


def test_gqa_other_dtype_is_used_for_key_and_value() -> None:
    layout = CacheLayout.gqa(**{**GQA_ARGS, "dtype": "float32"})
    assert _specs(layout)["key"] == ("float32", (2, 16, 64))
    assert _specs(layout)["value"] == ("float32", (2, 16, 64))
    assert layout.block_nbytes == 2 * (2 * 16 * 64 * 4) * 4


def test_gqa_fp8_scales_shapes_and_dtypes() -> None:
    layout = CacheLayout.gqa(**GQA_ARGS, fp8_scales=True)
    assert layout.roles == ("key", "value", "key_scale", "value_scale")
    assert _specs(layout) == {
        "key": ("uint8", (2, 16, 64)),
        "value": ("uint8", (2, 16, 64)),
        "key_scale": ("bfloat16", (2, 16)),
        "value_scale": ("bfloat16", (2, 16)),
    }
    # scales are bf16: 2 bytes per element, not 4
    assert layout.role("key_scale").block_nbytes == 2 * 16 * 2 == 64
    assert layout.role("key").block_nbytes == 2 * 16 * 64 == 2048
    assert layout.block_nbytes == (2048 + 2048 + 64 + 64) * 4 == 16896


def test_gqa_fp8_scales_of_another_dtype() -> None:
    bf16 = CacheLayout.gqa(**GQA_ARGS, fp8_scales=True)
    fp16 = CacheLayout.gqa(**GQA_ARGS, fp8_scales=True, scale_dtype="float16")
    assert _specs(fp16)["key_scale"] == _specs(fp16)["value_scale"] == ("float16", (2, 16))
    assert fp16.block_nbytes == bf16.block_nbytes  # two bytes either way, but other bytes:
    assert fp16.fingerprint != bf16.fingerprint  # never loaded into the other
    explicit = CacheLayout.gqa(**GQA_ARGS, fp8_scales=True, scale_dtype="bfloat16")
    assert explicit.fingerprint == bf16.fingerprint  # the default's keys are unchanged
    with pytest.raises(kvpipe.LayoutError, match="needs fp8_scales"):
        CacheLayout.gqa(**GQA_ARGS, scale_dtype="float16")
    with pytest.raises(kvpipe.LayoutError, match="unknown dtype"):
        CacheLayout.gqa(**GQA_ARGS, fp8_scales=True, scale_dtype="fp16")
    with pytest.raises(kvpipe.LayoutError, match="unknown dtype"):  # was TypeError: unhashable
        CacheLayout.gqa(**{**GQA_ARGS, "dtype": ["float16"]})


def test_mla_shapes_and_dtypes() -> None:
    layout = CacheLayout.mla(**MLA_ARGS)
    assert layout.kind == "mla"
    assert layout.roles == ("key",)
    assert _specs(layout) == {"key": ("bfloat16", (1, 16, 576))}
    assert layout.block_nbytes == 16 * 576 * 2 * 4 == 73728


def test_dsa_shapes_and_dtypes() -> None:
    layout = CacheLayout.dsa(**DSA_ARGS)
    assert layout.kind == "dsa"
    assert layout.roles == ("key", "indexer")
    # 512 + 4*(512//128) + 2*64 = 656; 128 + 128//128*4 = 132
    assert _specs(layout) == {
        "key": ("uint8", (1, 64, 656)),
        "indexer": ("uint8", (64, 132)),
    }
    assert layout.block_nbytes == (64 * 656 + 64 * 132) * 4 == 201728


def test_dsa_widths_follow_the_formula_for_other_sizes() -> None:
    layout = CacheLayout.dsa(
        num_layers=1, kv_lora_rank=256, rope_dim=32, index_head_dim=64, quant_block=32, block_size=8
    )
    assert _specs(layout) == {
        "key": ("uint8", (1, 8, 256 + 4 * 2 + 2 * 32)),
        "indexer": ("uint8", (8, 64 + 2 * 4)),
    }
    assert layout.block_nbytes == 8 * 328 + 8 * 72


def test_role_spec_block_nbytes_uses_itemsize() -> None:
    layout = CacheLayout.gqa(
        num_layers=1, num_kv_heads=3, head_dim=5, block_size=7, dtype="float16"
    )
    assert layout.role("key").block_nbytes == 3 * 7 * 5 * 2
    assert layout.block_nbytes == 2 * 3 * 7 * 5 * 2


def test_role_lookup_of_missing_role_raises() -> None:
    layout = CacheLayout.gqa(**GQA_ARGS)
    with pytest.raises(kvpipe.LayoutError):
        layout.role("indexer")
    with pytest.raises(kvpipe.LayoutError):
        CacheLayout.mla(**MLA_ARGS).role("value")


# ---------------------------------------------------------------- tensor order contract


def test_role_order_constant() -> None:
    assert ROLE_ORDER == ("key", "value", "key_scale", "value_scale", "indexer")


def test_tensor_order_contract(any_layout: CacheLayout) -> None:
    order = any_layout.tensor_order()
    roles = any_layout.roles
    assert len(order) == any_layout.num_layers * len(roles)
    # roles within a layer follow ROLE_ORDER
    assert list(roles) == sorted(roles, key=ROLE_ORDER.index)
    for i, (role, layer) in enumerate(order):
        assert layer == i // len(roles)
        assert role == roles[i % len(roles)]
    # layer-major: layers never decrease
    assert [layer for _, layer in order] == sorted(layer for _, layer in order)


def test_tensor_order_gqa_indexing() -> None:
    layout = CacheLayout.gqa(**GQA_ARGS)
    order = layout.tensor_order()
    for layer in range(layout.num_layers):
        assert order[2 * layer] == ("key", layer)
        assert order[2 * layer + 1] == ("value", layer)


def test_tensor_order_fp8_indexing() -> None:
    layout = CacheLayout.gqa(**GQA_ARGS, fp8_scales=True)
    order = layout.tensor_order()
    for layer in range(layout.num_layers):
        assert order[4 * layer] == ("key", layer)
        assert order[4 * layer + 1] == ("value", layer)
        assert order[4 * layer + 2] == ("key_scale", layer)
        assert order[4 * layer + 3] == ("value_scale", layer)


def test_tensor_order_mla_and_dsa_indexing() -> None:
    mla = CacheLayout.mla(**MLA_ARGS).tensor_order()
    assert mla == tuple(("key", layer) for layer in range(4))
    dsa = CacheLayout.dsa(**DSA_ARGS).tensor_order()
    for layer in range(4):
        assert dsa[2 * layer] == ("key", layer)
        assert dsa[2 * layer + 1] == ("indexer", layer)


# ---------------------------------------------------------------- fingerprint

GOLDEN_GQA_FINGERPRINT = "a0cd5e367a82708e"
GOLDEN_DSA_FINGERPRINT = "d93db7772e8b86e3"


def test_fingerprint_golden_values() -> None:
    # A change here changes every storage key: stored data would no longer be found.
    assert CacheLayout.gqa(**GQA_ARGS).fingerprint == GOLDEN_GQA_FINGERPRINT
    assert CacheLayout.dsa(**DSA_ARGS).fingerprint == GOLDEN_DSA_FINGERPRINT


def test_fingerprint_is_16_hex_and_stable(any_layout: CacheLayout) -> None:
    fp = any_layout.fingerprint
    assert len(fp) == 16
    assert all(c in "0123456789abcdef" for c in fp)
    assert fp == any_layout.fingerprint


def test_fingerprint_equal_for_equal_params() -> None:
    assert CacheLayout.gqa(**GQA_ARGS).fingerprint == CacheLayout.gqa(**GQA_ARGS).fingerprint
    assert CacheLayout.gqa(**GQA_ARGS) == CacheLayout.gqa(**GQA_ARGS)


VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("gqa", GQA_ARGS),
    ("gqa", {**GQA_ARGS, "num_layers": 5}),
    ("gqa", {**GQA_ARGS, "num_kv_heads": 4}),
    ("gqa", {**GQA_ARGS, "head_dim": 128}),
    ("gqa", {**GQA_ARGS, "block_size": 32}),
    ("gqa", {**GQA_ARGS, "dtype": "float16"}),
    ("gqa", {**GQA_ARGS, "fp8_scales": True}),
    ("mla", MLA_ARGS),
    ("mla", {**MLA_ARGS, "num_layers": 5}),
    ("mla", {**MLA_ARGS, "kv_lora_rank": 256}),
    ("mla", {**MLA_ARGS, "rope_dim": 32}),
    ("mla", {**MLA_ARGS, "block_size": 32}),
    ("mla", {**MLA_ARGS, "dtype": "float16"}),
    # same key width (576) as MLA_ARGS, different split
    ("mla", {**MLA_ARGS, "kv_lora_rank": 448, "rope_dim": 128}),
    ("dsa", DSA_ARGS),
    ("dsa", {**DSA_ARGS, "num_layers": 5}),
    ("dsa", {**DSA_ARGS, "kv_lora_rank": 256}),
    ("dsa", {**DSA_ARGS, "rope_dim": 32}),
    ("dsa", {**DSA_ARGS, "index_head_dim": 64}),
    ("dsa", {**DSA_ARGS, "quant_block": 64}),
    ("dsa", {**DSA_ARGS, "block_size": 32}),
]


def test_fingerprint_differs_when_any_parameter_differs() -> None:
    fps = [getattr(CacheLayout, kind)(**args).fingerprint for kind, args in VARIANTS]
    assert len(set(fps)) == len(fps)


def test_fingerprint_differs_between_kinds_with_identical_bytes() -> None:
    # an MLA layout and a 1-head GQA-like layout of equal block bytes still differ
    mla = CacheLayout.mla(num_layers=1, kv_lora_rank=8, rope_dim=8, block_size=4, dtype="uint8")
    gqa = CacheLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="uint8")
    assert mla.block_nbytes == gqa.block_nbytes
    assert mla.fingerprint != gqa.fingerprint


# ---------------------------------------------------------------- validation

BAD_INTS: list[Any] = [0, -1, True, False, 1.5, "3", None]


@pytest.mark.parametrize("bad", BAD_INTS)
@pytest.mark.parametrize("param", ["num_layers", "num_kv_heads", "head_dim", "block_size"])
def test_gqa_rejects_bad_int_params(param: str, bad: Any) -> None:
    with pytest.raises(kvpipe.LayoutError, match=param):
        CacheLayout.gqa(**{**GQA_ARGS, param: bad})


@pytest.mark.parametrize("bad", BAD_INTS)
@pytest.mark.parametrize("param", ["num_layers", "kv_lora_rank", "rope_dim", "block_size"])
def test_mla_rejects_bad_int_params(param: str, bad: Any) -> None:
    with pytest.raises(kvpipe.LayoutError, match=param):
        CacheLayout.mla(**{**MLA_ARGS, param: bad})


@pytest.mark.parametrize("bad", BAD_INTS)
@pytest.mark.parametrize(
    "param",
    ["num_layers", "kv_lora_rank", "rope_dim", "index_head_dim", "quant_block", "block_size"],
)
def test_dsa_rejects_bad_int_params(param: str, bad: Any) -> None:
    with pytest.raises(kvpipe.LayoutError, match=param):
        CacheLayout.dsa(**{**DSA_ARGS, param: bad})


@pytest.mark.parametrize("dtype", ["float64", "bf16", "fp8", "", "BFLOAT16", "int32"])
def test_unknown_dtype_rejected(dtype: str) -> None:
    with pytest.raises(kvpipe.LayoutError, match="dtype"):
        CacheLayout.gqa(**{**GQA_ARGS, "dtype": dtype})
    with pytest.raises(kvpipe.LayoutError, match="dtype"):
        CacheLayout.mla(**{**MLA_ARGS, "dtype": dtype})
    with pytest.raises(kvpipe.LayoutError):
        numpy_dtype(dtype)


def test_layout_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        CacheLayout.gqa(**{**GQA_ARGS, "num_layers": 0})


@pytest.mark.parametrize(
    ("name", "np_dtype", "itemsize"),
    [
        ("bfloat16", np.dtype(ml_dtypes.bfloat16), 2),
        ("float16", np.dtype(np.float16), 2),
        ("float32", np.dtype(np.float32), 4),
        ("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn), 1),
        ("uint8", np.dtype(np.uint8), 1),
        ("int8", np.dtype(np.int8), 1),
    ],
)
def test_known_dtypes(name: str, np_dtype: np.dtype[Any], itemsize: int) -> None:
    assert numpy_dtype(name) == np_dtype
    assert numpy_dtype(name).itemsize == itemsize


def test_layout_is_frozen() -> None:
    layout = CacheLayout.gqa(**GQA_ARGS)
    with pytest.raises(AttributeError):
        layout.block_size = 32  # type: ignore[misc]


# ---------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("role", "layer", "rank", "device", "expected"),
    [
        ("key", 3, 1, 2, "key_caches_3_rank1.device2"),
        ("value", 0, 0, 0, "value_caches_0_rank0.device0"),
        ("key_scale", 7, 2, 5, "key_cache_scales_7_rank2.device5"),
        ("value_scale", 1, 0, 3, "value_cache_scales_1_rank0.device3"),
        ("indexer", 60, 7, 7, "indexer_caches_60_rank7.device7"),
    ],
)
def test_tensor_name(role: str, layer: int, rank: int, device: int, expected: str) -> None:
    assert CacheLayout.tensor_name(role, layer, rank, device) == expected


def test_tensor_name_defaults_to_rank0_device0() -> None:
    assert CacheLayout.tensor_name("key", 2) == "key_caches_2_rank0.device0"


def test_describe_mentions_kind_and_fingerprint(any_layout: CacheLayout) -> None:
    text = any_layout.describe()
    assert any_layout.kind in text
    assert any_layout.fingerprint in text
    assert str(any_layout.block_nbytes) in text
