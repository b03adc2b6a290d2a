"""The format of one stored block value: the payload, then a 48-byte trailer.

::

    payload   layout.block_nbytes bytes: every (layer, role) block in contract order
    trailer   magic "KVPB" | version u16 | flags u16 | payload length u64
              | BLAKE2b-128 of the key (16 B) | XXH3-64 of the payload u64 | reserved (8 B)

The trailer makes every block self-verifying end to end, whatever the backend: a read checks
that the value is as long as expected, belongs to the key it was fetched under (a store that
returns the wrong object is caught) and, with checksums on, that no byte changed. A block that
fails any check is never scattered into the cache.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = (
    "TRAILER_NBYTES",
    "check_block",
    "check_trailer",
    "seal_and_digest",
    "seal_block",
    "value_nbytes",
)

_TRAILER: Final = struct.Struct("<4sHHQ16sQ8x")
TRAILER_NBYTES: Final = _TRAILER.size
MAGIC: Final = b"KVPB"
VERSION: Final = 1
FLAG_CHECKSUM: Final = 1

Bytes = npt.NDArray[np.uint8]


def value_nbytes(payload_nbytes: int) -> int:
    """Bytes of a stored value for a payload of ``payload_nbytes``."""
    return payload_nbytes + TRAILER_NBYTES


def seal_block(value: Bytes, payload_nbytes: int, key_digest: bytes, checksum: bool) -> None:
    """Write the trailer of ``value`` (whose payload is already in place)."""
    payload = value[:payload_nbytes]
    digest = xxhash.xxh3_64_intdigest(payload.data) if checksum else 0
    flags = FLAG_CHECKSUM if checksum else 0
    trailer = _TRAILER.pack(MAGIC, VERSION, flags, payload_nbytes, key_digest, digest)
    value[payload_nbytes : payload_nbytes + TRAILER_NBYTES] = np.frombuffer(trailer, np.uint8)


def seal_and_digest(value: Bytes, payload_nbytes: int, key_digest: bytes, checksum: bool) -> int:
    """:func:`seal_block`, and return the XXH3-64 of the whole sealed value (payload and
    trailer) — computed in the same pass over the payload as the trailer's checksum, for a
    store that keeps a checksum of each value (:attr:`kvpipe.backends.PutBatch.checksums`).
    """
    h = xxhash.xxh3_64(value[:payload_nbytes].data)
    digest = h.intdigest() if checksum else 0
    flags = FLAG_CHECKSUM if checksum else 0
    trailer = _TRAILER.pack(MAGIC, VERSION, flags, payload_nbytes, key_digest, digest)
    value[payload_nbytes : payload_nbytes + TRAILER_NBYTES] = np.frombuffer(trailer, np.uint8)
    h.update(trailer)
    return h.intdigest()


def check_block(value: Bytes, payload_nbytes: int, key_digest: bytes, verify: bool) -> str | None:
    """Check a fetched value; ``None`` when it is sound, else why it is not.

    Args:
        value: The value's bytes (at least ``payload_nbytes + TRAILER_NBYTES`` long).
        payload_nbytes: The payload size the layout expects.
        key_digest: Digest of the key it was fetched under.
        verify: Also recompute the payload checksum, when the writer recorded one.
    """
    if len(value) < payload_nbytes + TRAILER_NBYTES:
        return "value shorter than a block"
    raw = value[payload_nbytes : payload_nbytes + TRAILER_NBYTES].tobytes()
    return check_trailer(
        raw,
        payload_nbytes,
        key_digest,
        (lambda: xxhash.xxh3_64_intdigest(value[:payload_nbytes].data)) if verify else None,
    )


def check_trailer(
    trailer: bytes,
    payload_nbytes: int,
    key_digest: bytes,
    payload_digest: Callable[[], int] | None,
) -> str | None:
    """Check a value's trailer; ``None`` when it is sound, else why it is not.

    Args:
        trailer: The ``TRAILER_NBYTES`` bytes after the payload.
        payload_nbytes: The payload size the layout expects.
        key_digest: Digest of the key it was fetched under.
        payload_digest: The XXH3-64 of the payload as read (called only when the writer
            recorded a checksum); ``None``: the checksum is not verified.
    """
    magic, version, flags, length, kdigest, digest = _TRAILER.unpack(trailer)
    if magic != MAGIC:
        return "bad magic"
    if version != VERSION:
        return f"unknown format version {version}"
    if length != payload_nbytes:
        return f"payload length {length}, expected {payload_nbytes}"
    if kdigest != key_digest:
        return "value belongs to another key"
    if payload_digest is not None and flags & FLAG_CHECKSUM and payload_digest() != digest:
        return "checksum mismatch"
    return None
