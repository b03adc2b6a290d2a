from collections.abc import Sequence
from typing import Any

def payload_digests(values: Sequence[Any], nbytes: int, /) -> list[int]: ...
def seal(
    values: Sequence[Any], payload_nbytes: int, trailers: bytes, digest_at: int, /
) -> list[int]: ...
