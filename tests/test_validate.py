"""Request validation: every RequestError case of check_request / check_tokens /
check_timeout, and the shapes that are accepted."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe import RequestError
from kvpipe._validate import check_request, check_timeout, check_tokens

BS = 4
CACHE = 10


def _check(
    tokens: Any,
    ids: Any,
    start: Any = 0,
    partial: Any = False,
    num_cache_blocks: int = CACHE,
) -> Any:
    return check_request(tokens, ids, start, partial, BS, num_cache_blocks)


# ---------------------------------------------------------------- check_tokens


@pytest.mark.parametrize(
    "tokens",
    [
        [[1, 2], [3, 4]],
        np.zeros((2, 2), dtype=np.int64),
        np.int64(5),
        7,
        [],
        np.array([], dtype=np.int64),
        [1.0, 2.0],
        np.array([1.5]),
        [True, False],
        np.array([1, 0], dtype=bool),
        [1, -1],
        np.array([0, 5, -3], dtype=np.int32),
        ["1", "2"],
        [2**64],
        np.array([2**63], dtype=np.uint64),
        np.array([2**64 - 1, 7], dtype=">u8"),  # big-endian: was wrapped to -1, taken
        [1 + 2j],
    ],
)
def test_check_tokens_rejects(tokens: Any) -> None:
    with pytest.raises(RequestError):
        check_tokens(tokens)


def test_check_tokens_negative_names_index() -> None:
    with pytest.raises(RequestError, match="index 2"):
        check_tokens([4, 5, -1, 6])


@pytest.mark.parametrize(
    "tokens",
    [
        [0, 1, 2],
        (5,),
        np.array([1, 2, 3], dtype=np.int32),
        np.array([1, 2, 3], dtype=np.uint8),
        np.array([2**63 - 1], dtype=np.uint64),
        np.arange(10)[::3],
    ],
)
def test_check_tokens_accepts(tokens: Any) -> None:
    out = check_tokens(tokens)
    assert out.dtype == np.dtype("<i8")
    assert out.ndim == 1
    assert out.tolist() == [int(t) for t in np.asarray(tokens)]


# ---------------------------------------------------------------- check_timeout


def test_check_timeout_default_and_values() -> None:
    assert check_timeout(None, 3.5) == 3.5
    assert check_timeout(2, 3.5) == 2.0
    assert isinstance(check_timeout(2, 3.5), float)
    assert check_timeout(0.25, 3.5) == 0.25


@pytest.mark.parametrize("seconds", [np.int64(2), np.uint8(2), np.float32(2.0), np.float64(2.0)])
def test_check_timeout_takes_numpy_numbers(seconds: Any) -> None:
    # As start_block does: np.int64(2) and np.float32(2.0) were refused as "must be a number".
    assert check_timeout(seconds, 3.5) == 2.0
    assert type(check_timeout(seconds, 3.5)) is float


@pytest.mark.parametrize(
    "bad",
    [
        *(0, -1, 0.0, math.nan, math.inf, -math.inf, True, "1", [1]),
        *(np.float32(0), np.int64(-1), np.float32(math.nan), np.float64(math.inf), np.True_),
        pytest.param(10**400, id="10**400"),  # too large for a float: raised OverflowError
        pytest.param(-(10**400), id="-10**400"),
    ],
)
def test_check_timeout_rejects(bad: Any) -> None:
    with pytest.raises(RequestError):
        check_timeout(bad, 3.0)


# ---------------------------------------------------------------- check_request: accepted


def test_full_blocks_only() -> None:
    req = _check(list(range(8)), [3, 7])
    assert req.start_block == 0
    assert req.end_block == 2
    assert req.block_ids.tolist() == [3, 7]
    assert req.block_ids.dtype == np.int64
    assert req.tokens.tolist() == list(range(8))


def test_partial_block_id_allowed_without_include_partial() -> None:
    # 10 tokens: 2 full blocks + a partial one; its id may be passed but is not moved
    req = _check(list(range(10)), [3, 7, 9])
    assert req.end_block == 2
    assert req.block_ids.tolist() == [3, 7]


def test_include_partial_moves_the_partial_block() -> None:
    req = _check(list(range(10)), [3, 7, 9], partial=True)
    assert req.end_block == 3
    assert req.block_ids.tolist() == [3, 7, 9]


def test_include_partial_without_a_tail() -> None:
    req = _check(list(range(8)), [3, 7], partial=True)
    assert req.end_block == 2


def test_start_block_range() -> None:
    tokens = list(range(12))
    assert _check(tokens, [0, 1, 2], start=2).start_block == 2
    # start == end: nothing to move, accepted
    req = _check(tokens, [0, 1, 2], start=3)
    assert (req.start_block, req.end_block) == (3, 3)
    assert _check(tokens, [0, 1, 2], start=np.int64(1)).start_block == 1


def test_fewer_tokens_than_a_block() -> None:
    req = _check([1, 2], [])
    assert (req.start_block, req.end_block) == (0, 0)
    assert _check([1, 2], [5]).end_block == 0
    assert _check([1, 2], [5], partial=True).end_block == 1


def test_numpy_block_ids_of_other_int_dtypes() -> None:
    req = _check(list(range(8)), np.array([9, 0], dtype=np.uint8))
    assert req.block_ids.tolist() == [9, 0]
    assert req.block_ids.dtype == np.int64


# ---------------------------------------------------------------- check_request: rejected


@pytest.mark.parametrize(
    ("tokens", "ids", "partial"),
    [
        (list(range(8)), [1], False),  # too few
        (list(range(8)), [1, 2, 3], False),  # too many (no partial block)
        (list(range(10)), [1, 2], True),  # partial block needs an id
        (list(range(10)), [1, 2, 3, 4], False),  # more than the blocks the tokens occupy
        (list(range(10)), [1, 2, 3, 4], True),
        ([1, 2], [1, 2], False),
    ],
)
def test_wrong_number_of_block_ids(tokens: list[int], ids: list[int], partial: bool) -> None:
    with pytest.raises(RequestError, match="block_ids"):
        _check(tokens, ids, partial=partial)


@pytest.mark.parametrize("ids", [[0, CACHE], [-1, 0], [0, 2**40]])
def test_block_ids_out_of_range(ids: list[int]) -> None:
    with pytest.raises(RequestError, match="outside"):
        _check(list(range(8)), ids)


def test_block_ids_duplicate() -> None:
    with pytest.raises(RequestError, match="repeats"):
        _check(list(range(12)), [4, 5, 4])
    with pytest.raises(RequestError, match="repeats"):
        _check(list(range(10)), [4, 5, 5], partial=True)


@pytest.mark.parametrize(
    "ids", [[[0, 1]], np.zeros((1, 2), dtype=np.int64), [0.0, 1.0], [True, False], ["0", "1"]]
)
def test_block_ids_bad_type_or_shape(ids: Any) -> None:
    with pytest.raises(RequestError, match="block_ids"):
        _check(list(range(8)), ids)


@pytest.mark.parametrize("start", [3, 4, 100, -1, True, False, 1.0, "0", None])
def test_bad_start_block(start: Any) -> None:
    with pytest.raises(RequestError, match="start_block"):
        _check(list(range(8)), [0, 1], start=start)


def test_start_block_past_end_with_partial() -> None:
    tokens = list(range(10))
    assert _check(tokens, [0, 1, 2], start=3, partial=True).start_block == 3
    with pytest.raises(RequestError, match="start_block"):
        _check(tokens, [0, 1, 2], start=3, partial=False)


@pytest.mark.parametrize("partial", [1, 0, "yes", None, np.True_])
def test_include_partial_must_be_bool(partial: Any) -> None:
    with pytest.raises(RequestError, match="include_partial"):
        _check(list(range(8)), [0, 1], partial=partial)


@pytest.mark.parametrize("tokens", [[[0, 1, 2, 3]], [], [0.5] * 4, [True] * 4, [0, 1, -2, 3]])
def test_bad_tokens_rejected_by_check_request(tokens: Any) -> None:
    with pytest.raises(RequestError):
        _check(tokens, [0])


@settings(max_examples=150, deadline=None)
@given(
    n_tokens=st.integers(1, 40),
    partial=st.booleans(),
    data=st.data(),
)
def test_accepted_requests_are_consistent(
    n_tokens: int, partial: bool, data: st.DataObject
) -> None:
    full = n_tokens // BS
    occupied = -(-n_tokens // BS)
    end = occupied if partial else full
    n_ids = data.draw(st.integers(end, occupied))
    ids = data.draw(st.permutations(range(max(n_ids, CACHE))))[:n_ids]
    start = data.draw(st.integers(0, end))
    cache = max(n_ids, CACHE)
    req = check_request(list(range(n_tokens)), ids, start, partial, BS, cache)
    assert req.end_block == end
    assert req.start_block == start
    assert req.block_ids.tolist() == list(ids[:end])
    assert len(req.tokens) == n_tokens


# ---------------------------------------------------------------- framework tensors


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_paddle_float_tensors_are_not_taken_for_ids(dtype: str) -> None:
    # Paddle exports bfloat16 as uint16 and float8 as int8: numpy sees integers, the bit
    # patterns of the floats (1.0 -> 16256 or 56), which were taken for ids.
    import paddle

    floats = paddle.to_tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).astype(dtype)
    with pytest.raises(RequestError, match=f"token_ids must be integers, got dtype {dtype}"):
        check_tokens(floats)
    with pytest.raises(RequestError, match=f"block_ids must be integers, got dtype {dtype}"):
        _check(list(range(8)), floats[:2], num_cache_blocks=2**15)


def test_paddle_int_tensors_are_ids() -> None:
    import paddle

    assert check_tokens(paddle.to_tensor([3, 1, 2], dtype="int32")).tolist() == [3, 1, 2]
    req = _check(paddle.arange(8), paddle.to_tensor([9, 0], dtype="uint8"))
    assert req.block_ids.tolist() == [9, 0]
