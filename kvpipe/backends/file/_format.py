"""The file store's on-disk format and naming (pure functions, no I/O).

One file per block::

    header   4096 bytes: magic "KVPF" | version u16 | flags u16 | header length u32
             | payload length u64 | XXH3-64 of the payload u64 | created (unix time) f64
             | layout fingerprint (16 ASCII bytes) | key length u16 | key (UTF-8)
             | zero padding | XXH3-64 of header bytes [0, 4088) u64
    payload  the stored value, ``payload length`` bytes
    padding  version 2 only: zero bytes up to the next multiple of 4096 (files written with
             direct I/O, whose lengths must be whole pages); not covered by the checksum

Nothing in a file is ever executed or unpickled: a reader checks the header (its checksum,
magic, version, lengths, key) before trusting the payload, and the payload's checksum after.

Paths come from a hash of the key, never its characters, so no key can name a path outside
the store: ``blocks/<namespace>/<h[0:2]>/<h>.kvb``, ``h`` the BLAKE2b-128 of the key in hex.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Final, final

import xxhash

__all__ = (
    "HEADER_NBYTES",
    "PAGE",
    "BlockHeader",
    "HeaderError",
    "block_location",
    "file_nbytes",
    "is_temp_name",
    "pack_header",
    "parse_temp_name",
    "temp_name",
    "unpack_header",
)

HEADER_NBYTES: Final = 4096
MAGIC: Final = b"KVPF"
VERSION: Final = 1
#: The payload is followed by zero padding to a whole number of pages.
VERSION_PADDED: Final = 2
PAGE: Final = 4096
_FIXED: Final = struct.Struct("<4sHHIQQd16sH")
_SUM_AT: Final = HEADER_NBYTES - 8
MAX_KEY_BYTES: Final = 1024
_NAMESPACE_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TEMP_RE: Final = re.compile(
    r"\.([0-9a-f]{32})\.kvb\.tmp\.([A-Za-z0-9._-]{1,64})\.(\d+)\.[0-9a-f]{8}"
)
BLOCK_SUFFIX: Final = ".kvb"


class HeaderError(ValueError):
    """A header is not a valid kvpipe file-store header."""


@final
@dataclass(frozen=True, slots=True)
class BlockHeader:
    """A parsed header."""

    key: str
    payload_nbytes: int
    checksum: int
    created: float
    fingerprint: str
    padded: bool = False

    @property
    def file_nbytes(self) -> int:
        """The size the block's file must have."""
        return file_nbytes(self.payload_nbytes, self.padded)


def file_nbytes(payload_nbytes: int, padded: bool) -> int:
    """Size of a block file: header, payload and, when ``padded``, zeros to a page end."""
    body = -(-payload_nbytes // PAGE) * PAGE if padded else payload_nbytes
    return HEADER_NBYTES + body


def pack_header(
    key: str,
    payload_nbytes: int,
    checksum: int,
    created: float,
    fingerprint: str,
    padded: bool = False,
) -> bytes:
    """The 4096-byte header of a block file (format version 2 when ``padded``)."""
    raw_key = key.encode()
    if len(raw_key) > MAX_KEY_BYTES:
        raise HeaderError(f"key of {len(raw_key)} bytes exceeds {MAX_KEY_BYTES}")
    fp = fingerprint.encode()[:16].ljust(16, b"\0")
    head = (
        _FIXED.pack(
            MAGIC,
            VERSION_PADDED if padded else VERSION,
            0,
            HEADER_NBYTES,
            payload_nbytes,
            checksum,
            created,
            fp,
            len(raw_key),
        )
        + raw_key
    )
    buf = bytearray(HEADER_NBYTES)
    buf[: len(head)] = head
    buf[_SUM_AT:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:_SUM_AT])))
    return bytes(buf)


def unpack_header(raw: bytes) -> BlockHeader:
    """Parse and check a header (its own checksum included).

    Raises:
        HeaderError: Anything is off: length, checksum, magic, version, key length.
    """
    if len(raw) != HEADER_NBYTES:
        raise HeaderError(f"header is {len(raw)} bytes, expected {HEADER_NBYTES}")
    (stored,) = struct.unpack_from("<Q", raw, _SUM_AT)
    if xxhash.xxh3_64_intdigest(raw[:_SUM_AT]) != stored:
        if raw[:4] != MAGIC:
            raise HeaderError("bad magic")
        raise HeaderError("header checksum mismatch")
    magic, version, _flags, hlen, payload, checksum, created, fp, klen = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise HeaderError("bad magic")
    if version not in (VERSION, VERSION_PADDED):
        raise HeaderError(f"unknown format version {version}")
    if hlen != HEADER_NBYTES:
        raise HeaderError(f"header length {hlen}")
    if klen > MAX_KEY_BYTES:
        raise HeaderError(f"key length {klen}")
    try:
        key = raw[_FIXED.size : _FIXED.size + klen].decode()
    except UnicodeDecodeError:
        raise HeaderError("key is not UTF-8") from None
    fingerprint = fp.rstrip(b"\0").decode("ascii", "replace")
    return BlockHeader(key, payload, checksum, created, fingerprint, version == VERSION_PADDED)


def key_namespace(key: str) -> str:
    """The namespace directory of a key: its part before ``@`` when that is a valid
    namespace, else ``_``."""
    head = key.split("@", 1)[0]
    return head if "@" in key and _NAMESPACE_RE.fullmatch(head) else "_"


def block_location(key: str) -> tuple[tuple[str, ...], str]:
    """``(directory parts under the root, file name)`` of a key's block file."""
    h = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
    # One level of 256 shards: soon all exist, so a write almost never creates a directory.
    return ("blocks", key_namespace(key), h[0:2]), h + BLOCK_SUFFIX


def temp_name(final: str, host: str, pid: int, nonce: str) -> str:
    """A temporary name next to ``final`` that says who is writing it."""
    return f".{final}.tmp.{host}.{pid}.{nonce}"


def is_temp_name(name: str) -> bool:
    """Whether a directory entry is one of our temporary files."""
    return name.startswith(".") and ".kvb.tmp." in name


def parse_temp_name(name: str) -> tuple[str, int] | None:
    """``(host, pid)`` of a temporary file's writer, or ``None`` if it does not parse."""
    m = _TEMP_RE.fullmatch(name)
    return (m.group(2), int(m.group(3))) if m else None
