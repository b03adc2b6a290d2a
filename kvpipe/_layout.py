"""Cache layouts: which tensors a model's KV cache has, their shapes, and their order.

The ordering contract: a cache is a list of tensors, **layer-major**, and within a layer the
roles come in the fixed order ``key, value, key_scale, value_scale, indexer`` (roles a layout
does not have are left out). Attention kernels index that list as ``caches[2*layer]`` or
``caches[4*layer + 2]``, so the order is part of the contract, not an accident of dict order.
A stored block value packs one block of every tensor in that same order, then a trailer
(:mod:`kvpipe._blockformat`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Final, Literal, final

import ml_dtypes
import numpy as np

from ._errors import LayoutError

__all__ = ("ROLE_ORDER", "CacheLayout", "RoleSpec", "numpy_dtype")

#: Roles in their contract order within a layer.
ROLE_ORDER: Final = ("key", "value", "key_scale", "value_scale", "indexer")

_NAME_PREFIX: Final = {
    "key": "key_caches",
    "value": "value_caches",
    "key_scale": "key_cache_scales",
    "value_scale": "value_cache_scales",
    "indexer": "indexer_caches",
}

_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "uint8": np.dtype(np.uint8),
    "int8": np.dtype(np.int8),
}


def numpy_dtype(name: str) -> np.dtype[np.generic]:
    """The numpy dtype for a kvpipe dtype name (``"bfloat16"``, ``"uint8"``, ...).

    Raises:
        LayoutError: The name is not one kvpipe knows.
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value, a list say
        raise LayoutError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@final
@dataclass(frozen=True, slots=True)
class RoleSpec:
    """One role of a layout: its dtype and the shape of one block of it.

    Attributes:
        name: One of :data:`ROLE_ORDER`.
        dtype: A kvpipe dtype name.
        block_shape: Shape of one block; a tensor is ``[num_blocks, *block_shape]``.
    """

    name: str
    dtype: str
    block_shape: tuple[int, ...]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer of this role."""
        return math.prod(self.block_shape) * numpy_dtype(self.dtype).itemsize


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LayoutError(f"{name} must be a positive int, got {value!r}")
    return value


@final
@dataclass(frozen=True, slots=True)
class CacheLayout:
    """The shape of a model's KV cache, as its attention backend lays it out.

    Build one with :meth:`gqa`, :meth:`mla` or :meth:`dsa`.

    Attributes:
        kind: ``"gqa"``, ``"mla"`` or ``"dsa"``.
        num_layers: Number of attention layers.
        block_size: Tokens per cache block.
        role_specs: The roles of one layer, in contract order.
        params: The constructor arguments (they define :attr:`fingerprint`).
    """

    kind: Literal["gqa", "mla", "dsa"]
    num_layers: int
    block_size: int
    role_specs: tuple[RoleSpec, ...]
    params: tuple[tuple[str, object], ...]

    @classmethod
    def gqa(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: str = "bfloat16",
        fp8_scales: bool = False,
        scale_dtype: str = "bfloat16",
    ) -> CacheLayout:
        """GQA / MHA: key and value ``[kv_heads, block_size, head_dim]`` per block.

        With ``fp8_scales`` (block-wise fp8) the caches are ``uint8`` and two scale roles
        ``key_scale`` / ``value_scale`` of ``[kv_heads, block_size]`` and ``scale_dtype``
        are added (FastDeploy makes its scales in paddle's default dtype: ``float32``, or the
        model's where it set that default).

        Raises:
            LayoutError: A size is not positive, a dtype unknown, or ``scale_dtype`` given
                without ``fp8_scales``.
        """
        _positive("num_layers", num_layers)
        _positive("num_kv_heads", num_kv_heads)
        _positive("head_dim", head_dim)
        _positive("block_size", block_size)
        numpy_dtype(dtype)
        if not isinstance(fp8_scales, bool):
            raise LayoutError(f"fp8_scales must be a bool, got {fp8_scales!r}")
        numpy_dtype(scale_dtype)
        if scale_dtype != "bfloat16" and not fp8_scales:
            raise LayoutError(f"scale_dtype={scale_dtype!r} needs fp8_scales=True")
        shape = (num_kv_heads, block_size, head_dim)
        roles: tuple[RoleSpec, ...]
        if fp8_scales:
            scale = (num_kv_heads, block_size)
            roles = (
                RoleSpec("key", "uint8", shape),
                RoleSpec("value", "uint8", shape),
                RoleSpec("key_scale", scale_dtype, scale),
                RoleSpec("value_scale", scale_dtype, scale),
            )
        else:
            roles = (RoleSpec("key", dtype, shape), RoleSpec("value", dtype, shape))
        params = (
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            # block-wise fp8 stores uint8 whatever the compute dtype: keep it out of the key
            ("dtype", "uint8" if fp8_scales else dtype),
            ("fp8_scales", fp8_scales),
        )
        return cls("gqa", num_layers, block_size, roles, params)

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        block_size: int,
        dtype: str = "bfloat16",
    ) -> CacheLayout:
        """MLA: key only, ``[1, block_size, kv_lora_rank + rope_dim]`` per block."""
        _positive("num_layers", num_layers)
        _positive("kv_lora_rank", kv_lora_rank)
        _positive("rope_dim", rope_dim)
        _positive("block_size", block_size)
        numpy_dtype(dtype)
        roles = (RoleSpec("key", dtype, (1, block_size, kv_lora_rank + rope_dim)),)
        params = (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim), ("dtype", dtype))
        return cls("mla", num_layers, block_size, roles, params)

    @classmethod
    def dsa(
        cls,
        *,
        num_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        index_head_dim: int,
        quant_block: int,
        block_size: int,
    ) -> CacheLayout:
        """DSA: uint8 key plus uint8 ``indexer``.

        key: ``[1, block_size, kv_lora_rank + 4*(kv_lora_rank//128) + 2*rope_dim]``
        (656 bytes per token for 512/64); indexer:
        ``[block_size, index_head_dim + index_head_dim//quant_block*4]``.
        """
        _positive("num_layers", num_layers)
        _positive("kv_lora_rank", kv_lora_rank)
        _positive("rope_dim", rope_dim)
        _positive("index_head_dim", index_head_dim)
        _positive("quant_block", quant_block)
        _positive("block_size", block_size)
        key_width = kv_lora_rank + 4 * (kv_lora_rank // 128) + 2 * rope_dim
        index_width = index_head_dim + index_head_dim // quant_block * 4
        roles = (
            RoleSpec("key", "uint8", (1, block_size, key_width)),
            RoleSpec("indexer", "uint8", (block_size, index_width)),
        )
        params = (
            ("kv_lora_rank", kv_lora_rank),
            ("rope_dim", rope_dim),
            ("index_head_dim", index_head_dim),
            ("quant_block", quant_block),
        )
        return cls("dsa", num_layers, block_size, roles, params)

    @property
    def roles(self) -> tuple[str, ...]:
        """Role names of one layer, in contract order."""
        return tuple(r.name for r in self.role_specs)

    def role(self, name: str) -> RoleSpec:
        """The spec of one role.

        Raises:
            LayoutError: The layout has no such role.
        """
        for spec in self.role_specs:
            if spec.name == name:
                return spec
        raise LayoutError(f"layout {self.kind!r} has no role {name!r}; roles are {self.roles}")

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block across all layers and roles (the payload of one stored block)."""
        return self.num_layers * sum(r.block_nbytes for r in self.role_specs)

    def tensor_order(self) -> tuple[tuple[str, int], ...]:
        """``(role, layer)`` of every tensor in the contract order (layer-major)."""
        return tuple((r.name, layer) for layer in range(self.num_layers) for r in self.role_specs)

    @property
    def fingerprint(self) -> str:
        """16 hex characters identifying this layout; part of every storage key."""
        canon = json.dumps(
            {
                "kind": self.kind,
                "num_layers": self.num_layers,
                "block_size": self.block_size,
                "roles": [[r.name, r.dtype, list(r.block_shape)] for r in self.role_specs],
                "params": [[k, v] for k, v in self.params],
            },
            sort_keys=True,
            separators=(",", ":"),
        )
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    @staticmethod
    def tensor_name(role: str, layer: int, rank: int = 0, device_id: int = 0) -> str:
        """The conventional tensor name, e.g. ``key_caches_3_rank0.device0``.

        Raises:
            LayoutError: ``role`` is not a known role.
        """
        if role not in _NAME_PREFIX:
            raise LayoutError(f"unknown role {role!r}; roles are {ROLE_ORDER}")
        return f"{_NAME_PREFIX[role]}_{layer}_rank{rank}.device{device_id}"

    def describe(self) -> str:
        """A one-line human description, for logs and the CLI."""
        roles = ", ".join(f"{r.name}:{r.dtype}{list(r.block_shape)}" for r in self.role_specs)
        return (
            f"{self.kind} layers={self.num_layers} block_size={self.block_size} "
            f"roles=({roles}) block={self.block_nbytes} B fingerprint={self.fingerprint}"
        )
