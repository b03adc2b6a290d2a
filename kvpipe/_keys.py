"""Storage keys: one function computes them, for writers and readers alike.

A block's key chains a hash of its tokens with its parent's digest, so a key names the whole
prefix up to the end of its block. Digests are BLAKE2b-128 over the parent digest and the
block's token ids as little-endian int64: stable across processes, machines and Python
versions (no ``hash()``, no pickle).

The key string scopes the digest by namespace, layout fingerprint, tensor-parallel rank and
world size::

    {namespace}@{fingerprint}@{rank}-{world_size}@{digest hex}[:partial:{N}]

The partial last block (fewer than ``block_size`` tokens, ``N`` of them) is written only when
asked (prefill→decode transfer); its key ends in ``:partial:N``.
"""

from __future__ import annotations

import hashlib
import numbers
import re
from dataclasses import dataclass
from typing import Any, Final, final

import numpy as np
import numpy.typing as npt

from ._errors import ConfigError

__all__ = ("Scope", "block_keys", "chain_digests", "key_digest", "validate_namespace")

_NAMESPACE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_PERSON: Final = b"kvpipe-chain-v1"
_ROOT: Final = bytes(16)

Tokens = npt.NDArray[np.int64]


def validate_namespace(namespace: str) -> str:
    """Check a namespace: 1–128 characters of ``[A-Za-z0-9._-]``, not starting with ``.``/``-``.

    Raises:
        ConfigError: The namespace is not a string of that form.
    """
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace):
        raise ConfigError(
            "namespace",
            f"{namespace!r} is not 1-128 characters of [A-Za-z0-9._-] starting with a "
            "letter or digit",
        )
    return namespace


@final
@dataclass(frozen=True, slots=True)
class Scope:
    """What a key is scoped by besides its tokens.

    Attributes:
        namespace: A model / deployment name (validated by :func:`validate_namespace`).
        fingerprint: The cache layout's fingerprint.
        rank: Tensor-parallel rank of the writer (a numpy integer is kept as its int).
        world_size: Tensor-parallel world size.
    """

    namespace: str
    fingerprint: str
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        validate_namespace(self.namespace)
        if not re.fullmatch(r"[0-9a-f]{16}", self.fingerprint):
            raise ConfigError("fingerprint", f"{self.fingerprint!r} is not 16 hex characters")
        for name, value, low in (("world_size", self.world_size, 1), ("rank", self.rank, 0)):
            # numpy integers too (not numpy's bool, no Integral), kept as the int they are
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ConfigError(name, f"must be an int >= {low}, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.rank >= self.world_size:
            raise ConfigError("rank", f"rank {self.rank} is not below world_size {self.world_size}")

    @property
    def prefix(self) -> str:
        """The part of every key before the digest."""
        return f"{self.namespace}@{self.fingerprint}@{self.rank}-{self.world_size}@"


def as_tokens(token_ids: Any) -> Tokens:
    """Token ids as a 1-D little-endian int64 array (no copy when already one)."""
    arr: Tokens = np.ascontiguousarray(np.asarray(token_ids), dtype="<i8")
    return arr


def chain_digests(tokens: Tokens, block_size: int, include_partial: bool) -> list[bytes]:
    """Chained 16-byte digests of every full block (and the partial tail if asked)."""
    raw, step = tokens.tobytes(), block_size * 8
    end = len(raw) if include_partial else len(raw) - len(raw) % step
    digests: list[bytes] = []
    parent = _ROOT
    for start in range(0, end, step):
        block = raw[start : min(start + step, end)]
        parent = hashlib.blake2b(parent + block, digest_size=16, person=_PERSON).digest()
        digests.append(parent)
    return digests


def block_keys(
    scope: Scope, tokens: Tokens, block_size: int, include_partial: bool
) -> tuple[str, ...]:
    """Keys of every block of ``tokens`` under ``scope``, from block 0: one key per block;
    the last is the partial block's (``...:partial:N``) when it is included.

    Args:
        scope: Namespace, layout fingerprint, rank and world size.
        tokens: Token ids (see :func:`as_tokens`).
        block_size: Tokens per block.
        include_partial: Also key the partial last block, if there is one.
    """
    prefix = scope.prefix  # made once, not per block
    keys = [prefix + d.hex() for d in chain_digests(tokens, block_size, include_partial)]
    if len(keys) > len(tokens) // block_size:  # the last is the partial block's
        keys[-1] += f":partial:{len(tokens) % block_size}"
    return tuple(keys)


def key_digest(key: str) -> bytes:
    """A 16-byte digest of a whole key string (written into each block's trailer)."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest()
