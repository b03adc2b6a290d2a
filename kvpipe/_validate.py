"""Validation of requests, before anything is queued (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, final

import numpy as np
import numpy.typing as npt

from ._device_tensors import dtype_name
from ._errors import RequestError
from ._keys import Tokens, as_tokens

__all__ = (
    "CheckedRequest",
    "check_flag",
    "check_request",
    "check_start_block",
    "check_timeout",
    "check_tokens",
)

IntArray = npt.NDArray[np.int64]


@final
@dataclass(frozen=True, slots=True)
class CheckedRequest:
    """A validated write or read request.

    Attributes:
        tokens: Token ids as int64.
        block_ids: Cache block per sequence block (``end_block`` of them).
        start_block: First block to move.
        end_block: One past the last block to move.
    """

    tokens: Tokens
    block_ids: IntArray
    start_block: int
    end_block: int


def _as_ids(value: Any, name: str) -> npt.NDArray[Any]:
    """``value`` as a 1-D array of integers (an empty one of any dtype), no copy made.

    Raises:
        RequestError: What numpy refuses (ragged nesting, say), another shape, or another
            dtype, also a floating one that numpy sees as integers (Paddle hands over bfloat16
            as uint16 and float8 as int8 bit patterns).
    """
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"{name} is not an array of ids: {exc}") from exc
    if arr.ndim != 1:
        raise RequestError(f"{name} must be 1-D, got shape {arr.shape}")
    source = dtype_name(getattr(value, "dtype", arr.dtype))
    if len(arr) and (arr.dtype.kind not in "iu" or "float" in source):  # bool is kind "b"
        raise RequestError(f"{name} must be integers, got dtype {source}")
    return arr


def check_tokens(token_ids: Any) -> Tokens:
    """Token ids as a non-empty 1-D int64 array of non-negative values.

    Raises:
        RequestError: Anything else.
    """
    arr = _as_ids(token_ids, "token_ids")
    if len(arr) == 0:
        raise RequestError("token_ids is empty")
    # Any byte order: a big-endian uint64 is not equal to np.uint64, and would wrap too.
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise RequestError("token_ids has values above the int64 range")
    # A private read-only copy: neither the caller nor a backend can change the other's.
    tokens = np.array(as_tokens(arr), copy=True)
    if arr.dtype.kind == "i" and int(tokens.min()) < 0:
        raise RequestError(f"token_ids has a negative id at index {int(np.argmin(tokens))}")
    tokens.flags.writeable = False
    return tokens


def check_flag(value: Any, name: str) -> bool:
    """A flag argument (``include_partial``, ``require_all``) as given, when it is a bool.

    Raises:
        RequestError: Anything else (``"no"`` is truthy: it must not switch the flag on).
    """
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a bool, got {value!r}")
    return value


def check_timeout(timeout: float | None, default: float) -> float:
    """A per-call timeout override, or the default.

    Raises:
        RequestError: Not a finite positive number.
    """
    if timeout is None:
        return default
    if isinstance(timeout, bool) or not isinstance(timeout, int | float | np.integer | np.floating):
        raise RequestError(f"timeout must be a number, got {timeout!r}")
    try:
        seconds = float(timeout)
    except OverflowError:  # an int too large for a float
        seconds = math.inf if timeout > 0 else -math.inf
    if not math.isfinite(seconds) or seconds <= 0:
        raise RequestError(f"timeout must be finite and > 0, got {timeout!r}")
    return seconds


def check_start_block(start_block: Any, end: int) -> int:
    """``start_block`` as an int in ``[0, end]``: an int or a numpy integer, not a bool.

    Raises:
        RequestError: Not an int, or out of range.
    """
    if isinstance(start_block, bool) or not isinstance(start_block, int | np.integer):
        raise RequestError(f"start_block must be an int, got {start_block!r}")
    start = int(start_block)
    if not 0 <= start <= end:
        raise RequestError(f"start_block {start} is outside [0, {end}]")
    return start


def check_request(
    token_ids: Any,
    block_ids: Any,
    start_block: int,
    include_partial: bool,
    block_size: int,
    num_cache_blocks: int,
) -> CheckedRequest:
    """Validate a write or read.

    ``block_ids`` must name a cache block for every sequence block that is moved: at least
    the full blocks (plus the partial one with ``include_partial``), at most one per block
    the tokens occupy. Ids must be in range and distinct.

    Raises:
        RequestError: What was wrong, naming the argument.
    """
    tokens = check_tokens(token_ids)
    check_flag(include_partial, "include_partial")
    full = len(tokens) // block_size
    occupied = -(-len(tokens) // block_size)
    end = occupied if include_partial else full
    ids = _as_ids(block_ids, "block_ids")
    if not end <= len(ids) <= occupied:
        raise RequestError(
            f"{len(tokens)} tokens make {full} full block(s)"
            + (" and a partial one" if occupied > full else "")
            + f"; block_ids has {len(ids)} (expected {end}"
            + (f" to {occupied})" if occupied > end else ")")
        )
    start = check_start_block(start_block, end)
    moved = ids[start:end]
    if len(moved):
        # Checked in the ids' own dtype: a huge uint64 would wrap negative in int64.
        lo, hi = int(moved.min()), int(moved.max())
        if lo < 0 or hi >= num_cache_blocks:
            bad = lo if lo < 0 else hi
            raise RequestError(f"block id {bad} is outside the cache's [0, {num_cache_blocks})")
    if len(set(moved.tolist())) != len(moved):
        raise RequestError("block_ids repeats a cache block within the blocks to move")
    return CheckedRequest(tokens, ids[:end].astype(np.int64), start, end)
