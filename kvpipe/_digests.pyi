from collections.abc import Sequence
from typing import Any

def payload_digests(values: Sequence[Any], nbytes: int, /) -> list[int]: ...
def seal(
    values: Sequence[Any], payload_nbytes: int, trailers: bytes, digest_at: int, /
) -> list[int]: ...
def addresses(values: Sequence[Any], /) -> list[int]: ...
def check_place(
    value: Any,
    payload_nbytes: int,
    checksum: int,
    trailer: bytes,
    digest_at: int,
    verify: bool,
    rows: Sequence[Any],
    block: int,
    table: Any,
    mapped: bool = False,
    whole: bool = True,
    /,
) -> int: ...
def gather_seal(
    rows: Sequence[Any],
    blocks: Any,
    table: Any,
    values: Sequence[Any],
    payload_nbytes: int,
    trailers: bytes,
    digest_at: int,
    /,
) -> list[int]: ...
