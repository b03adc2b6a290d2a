"""The format of one stored block value: the payload, then a 48-byte trailer.

::

    payload   layout.block_nbytes bytes: every (layer, role) block in contract order
    trailer   magic "KVPB" | version u16 | flags u16 | payload length u64
              | BLAKE2b-128 of the key (16 B) | XXH3-64 of the payload u64 | reserved (8 B)

Every block is self-verifying whatever the backend: a read checks the value's length, that it
belongs to the key it was fetched under and, with checksums on, that no byte changed. A block
that fails any check is never scattered into the cache.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import xxhash

__all__ = (
    "TRAILER_NBYTES",
    "check_blocks",
    "check_trailer",
    "gather_seal_blocks",
    "place_if_sound",
    "seal_blocks",
    "value_nbytes",
)

native: Any
try:  # hashes a batch of values with the GIL released once (setup.py; optional)
    from . import _digests as native
except ImportError:  # not built: python-xxhash, one GIL round trip per value
    native = None

_TRAILER: Final = struct.Struct("<4sHHQ16sQ8x")
TRAILER_NBYTES: Final = _TRAILER.size
MAGIC: Final = b"KVPB"
VERSION: Final = 1
FLAG_CHECKSUM: Final = 1
#: Where the payload's XXH3-64 lies in the trailer.
_DIGEST_AT: Final = struct.calcsize("<4sHHQ16s")

Bytes = npt.NDArray[np.uint8]


def value_nbytes(payload_nbytes: int) -> int:
    """Bytes of a stored value for a payload of ``payload_nbytes``."""
    return payload_nbytes + TRAILER_NBYTES


def seal_blocks(
    values: Sequence[Bytes],
    payload_nbytes: int,
    key_digests: Sequence[bytes],
    checksum: bool,
    *,
    whole: bool | None = None,
) -> list[int] | None:
    """Write the trailer of each value (payloads already in place). With ``whole`` (default:
    ``checksum``), also return each whole sealed value's XXH3-64, from the same pass over the
    payload (:attr:`kvpipe.backends.PutBatch.checksums`), else ``None``.

    Raises:
        ValueError: The key digests do not match the values one for one.
    """
    if len(key_digests) != len(values):
        raise ValueError(f"{len(key_digests)} key digests for {len(values)} values")
    whole = checksum if whole is None else whole
    flags = FLAG_CHECKSUM if checksum else 0
    if checksum and native is not None and values:
        trailers = b"".join(
            _TRAILER.pack(MAGIC, VERSION, flags, payload_nbytes, k, 0) for k in key_digests
        )  # the extension writes each payload's digest at _DIGEST_AT
        digests: list[int] = native.seal(values, payload_nbytes, trailers, _DIGEST_AT)
        return digests if whole else None
    end = payload_nbytes + TRAILER_NBYTES
    out: list[int] = []
    for value, key_digest in zip(values, key_digests, strict=True):
        h = xxhash.xxh3_64(value[:payload_nbytes].data) if checksum or whole else None
        digest = h.intdigest() if h is not None and checksum else 0
        trailer = _TRAILER.pack(MAGIC, VERSION, flags, payload_nbytes, key_digest, digest)
        value[payload_nbytes:end] = np.frombuffer(trailer, np.uint8)
        if h is not None and whole:
            h.update(trailer)
            out.append(h.intdigest())
    return out if whole else None


def gather_seal_blocks(
    rows: Sequence[Any],
    blocks: npt.NDArray[np.int64],
    table: Any,
    values: Sequence[Bytes],
    payload_nbytes: int,
    key_digests: Sequence[bytes],
) -> list[int] | None:
    """Copy cache block ``blocks[i]`` (its pieces: ``table``'s ``int64`` triples of row array,
    offset in the value and bytes, :attr:`kvpipe._hostcopy.RowGroups.table`) from the cache
    ``rows`` into ``values[i]`` and seal it with a checksum, each piece hashed right after its
    copy while still in the processor's cache, in one GIL-free native call.

    Returns:
        Each whole sealed value's XXH3-64 (as :func:`seal_blocks` returns it), or ``None``
        where the extension is not built (nothing is copied then).

    Raises:
        ValueError: Key digests or blocks not one per value, or a table that does not fit the
            rows and payload (checked before anything is copied).
    """
    if native is None:
        return None
    if len(key_digests) != len(values):
        raise ValueError(f"{len(key_digests)} key digests for {len(values)} values")
    trailers = b"".join(
        _TRAILER.pack(MAGIC, VERSION, FLAG_CHECKSUM, payload_nbytes, k, 0) for k in key_digests
    )  # the extension writes each payload's digest at _DIGEST_AT
    digests: list[int] = native.gather_seal(
        rows, blocks, table, values, payload_nbytes, trailers, _DIGEST_AT
    )
    return digests


def check_blocks(
    values: Sequence[Bytes], payload_nbytes: int, key_digests: Sequence[bytes], verify: bool
) -> list[str | None]:
    """Check fetched values: for each, ``None`` when it is sound, else why it is not.

    Args:
        values: The values' bytes (each at least ``payload_nbytes + TRAILER_NBYTES`` long).
        payload_nbytes: The payload size the layout expects.
        key_digests: Digest of the key each was fetched under.
        verify: Also recompute each payload checksum, when the writer recorded one.

    Raises:
        ValueError: The key digests do not match the values one for one.
    """
    if len(key_digests) != len(values):
        raise ValueError(f"{len(key_digests)} key digests for {len(values)} values")
    end = payload_nbytes + TRAILER_NBYTES
    out: list[str | None] = []
    expected: dict[int, int] = {}  # value index -> the checksum its trailer recorded
    for i, (value, key_digest) in enumerate(zip(values, key_digests, strict=True)):
        if len(value) < end:
            out.append("value shorter than a block")
            continue
        why, recorded = _trailer_verdict(
            value[payload_nbytes:end].tobytes(), payload_nbytes, key_digest
        )
        if why is None and verify and recorded is not None:
            expected[i] = recorded  # compared below, once every payload is hashed
        out.append(why)
    if expected:
        which = list(expected)
        payloads = [values[i] for i in which]
        if native is not None:
            digests: list[int] = native.payload_digests(payloads, payload_nbytes)
        else:
            digests = [xxhash.xxh3_64_intdigest(v[:payload_nbytes].data) for v in payloads]
        for i, digest in zip(which, digests, strict=True):
            if digest != expected[i]:
                out[i] = "checksum mismatch"
    return out


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
    why, recorded = _trailer_verdict(trailer, payload_nbytes, key_digest)
    if why is None and payload_digest is not None and recorded is not None:
        if payload_digest() != recorded:
            return "checksum mismatch"
    return why


#: :func:`place_if_sound`'s verdicts (the native extension's codes).
PLACED: Final = 0
WHOLE_MISMATCH: Final = 1
_TRAILER_DIFFERS: Final = 2
#: A mapped value could not be read (its file shrank, or a page of it failed).
UNREADABLE: Final = 3


def place_if_sound(
    value: Bytes | memoryview,
    payload_nbytes: int,
    checksum: int | None,
    key_digest: bytes,
    verify: bool,
    rows: Sequence[Any],
    block: int,
    table: Any,
    mapped: bool = False,
) -> int | None:
    """Check a fetched value and copy it into cache block ``block`` only if it passes, in one
    GIL-free call to the native extension.

    It passes when its whole XXH3-64 is ``checksum`` (when given) and its trailer is the one
    :func:`seal_blocks` writes with a checksum for ``key_digest`` (with ``verify``, the
    payload's XXH3-64 included).

    Args:
        value: The value's bytes.
        payload_nbytes: The payload size the layout expects.
        checksum: The XXH3-64 of the whole value, as its store recorded it; ``None``: the
            store recorded none (the trailer's checks alone).
        key_digest: Digest of the key it was fetched under.
        verify: Also compare the payload's checksum with the trailer's.
        rows: The cache's 2-D byte arrays, one row per block, each row contiguous.
        block: The cache block to copy into.
        table: int64 triples (row array index, offset in the value, bytes)
            (:attr:`~kvpipe._hostcopy.RowGroups.table`).
        mapped: ``value`` maps a file: a read of it that faults (the file shrank, or a
            page of it could not be read) is caught, and the block may then hold part of it.

    Returns:
        :data:`PLACED` (checked and copied); :data:`WHOLE_MISMATCH` (not what its store
        wrote: nothing copied); :data:`UNREADABLE` (``mapped`` only); ``None``: nothing
        copied, the caller checks the slow way (no extension, or an unexpected trailer:
        :func:`check_trailer` says why).

    Raises:
        ValueError, IndexError, BufferError: ``rows`` or ``table`` are not what the
            extension takes (checked before anything is copied).
    """
    if native is None:
        return None
    trailer = _TRAILER.pack(MAGIC, VERSION, FLAG_CHECKSUM, payload_nbytes, key_digest, 0)
    whole = checksum is not None
    code: int = native.check_place(
        value,
        payload_nbytes,
        checksum or 0,
        trailer,
        _DIGEST_AT,
        verify,
        rows,
        block,
        table,
        mapped,
        whole,
    )
    return None if code == _TRAILER_DIFFERS else code


def _trailer_verdict(
    trailer: bytes, payload_nbytes: int, key_digest: bytes
) -> tuple[str | None, int | None]:
    """What is wrong with a trailer, the payload's checksum left aside (``None``: nothing),
    and the checksum it recorded (``None``: none was)."""
    magic, version, flags, length, kdigest, digest = _TRAILER.unpack(trailer)
    if magic != MAGIC:
        return "bad magic", None
    if version != VERSION:
        return f"unknown format version {version}", None
    if length != payload_nbytes:
        return f"payload length {length}, expected {payload_nbytes}", None
    if kdigest != key_digest:
        return "value belongs to another key", None
    return None, digest if flags & FLAG_CHECKSUM else None
