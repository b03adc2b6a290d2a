"""Storage keys: the chain property, golden digests (stable across processes), partial keys,
scoping, namespace validation and token dtypes."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvpipe
from kvpipe._keys import (
    Scope,
    as_tokens,
    block_keys,
    chain_digests,
    key_digest,
    validate_namespace,
)

FP = "a0cd5e367a82708e"
SCOPE = Scope("llama3-8b", FP, 0, 1)

GOLDEN_TOKENS = list(range(40))
GOLDEN_KEYS = (
    "llama3-8b@a0cd5e367a82708e@0-1@7f9ccf6bfeb9b87997d0d1961a49af04",
    "llama3-8b@a0cd5e367a82708e@0-1@0fab12a64665d4f8311da5d564b41b41",
    "llama3-8b@a0cd5e367a82708e@0-1@43af3a6d005209638da5930f48f5cea4:partial:8",
)
GOLDEN_KEY_DIGEST = "cf4ab791c62b8d2b2109c90275287816"  # key_digest("abc")


def _keys(tokens: Any, block_size: int = 16, partial: bool = False, scope: Scope = SCOPE) -> Any:
    return block_keys(scope, as_tokens(tokens), block_size, partial)


# ---------------------------------------------------------------- golden values


def test_golden_keys() -> None:
    bk = _keys(GOLDEN_TOKENS, 16, True)
    assert bk == GOLDEN_KEYS
    assert len(bk) == 3


def test_golden_digests_match_documented_scheme() -> None:
    # BLAKE2b-128, person "kvpipe-chain-v1", over parent digest + int64 LE tokens; root = 0*16
    raw = np.arange(40, dtype="<i8").tobytes()
    parent = bytes(16)
    expected = []
    for lo, hi in ((0, 16), (16, 32), (32, 40)):
        parent = hashlib.blake2b(
            parent + raw[lo * 8 : hi * 8], digest_size=16, person=b"kvpipe-chain-v1"
        ).digest()
        expected.append(parent)
    assert chain_digests(as_tokens(GOLDEN_TOKENS), 16, True) == expected
    assert [d.hex() for d in expected] == [k.split("@")[-1].split(":")[0] for k in GOLDEN_KEYS]


def test_golden_key_digest() -> None:
    assert key_digest("abc").hex() == GOLDEN_KEY_DIGEST
    assert len(key_digest(GOLDEN_KEYS[0])) == 16
    assert key_digest(GOLDEN_KEYS[0]) != key_digest(GOLDEN_KEYS[1])


def test_keys_stable_in_a_fresh_process() -> None:
    code = (
        "from kvpipe._keys import Scope, as_tokens, block_keys\n"
        f"s = Scope('llama3-8b', {FP!r}, 0, 1)\n"
        "print('\\n'.join(block_keys(s, as_tokens(list(range(40))), 16, True)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=Path(kvpipe.__file__).parent.parent,
    )
    assert tuple(out.stdout.split()) == GOLDEN_KEYS


# ---------------------------------------------------------------- chain property


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 8),
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=60),
    st.data(),
)
def test_chain_property(block_size: int, tokens: list[int], data: st.DataObject) -> None:
    before = _keys(tokens, block_size, True)
    j = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[j] = tokens[j] + 1
    after = _keys(changed, block_size, True)
    assert len(before) == len(after) == -(-len(tokens) // block_size)
    block = j // block_size
    assert before[:block] == after[:block]
    for b in range(block, len(before)):
        assert before[b] != after[b]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 1000), min_size=0, max_size=60), st.data())
def test_key_names_whole_prefix(block_size: int, tokens: list[int], data: st.DataObject) -> None:
    """Key i depends on exactly tokens[: (i+1)*block_size]: extending never changes it."""
    extra = data.draw(st.lists(st.integers(0, 1000), max_size=20))
    short = _keys(tokens, block_size)
    long = _keys(tokens + extra, block_size)
    assert long[: len(short)] == short


def test_same_block_content_at_different_positions_differs() -> None:
    keys = _keys([5] * 48, 16)
    assert len(set(keys)) == 3


def test_block_size_changes_keys() -> None:
    assert _keys(list(range(32)), 16)[0] != _keys(list(range(32)), 8)[1]


# ---------------------------------------------------------------- partial keys


def test_partial_only_with_include_partial_and_a_tail() -> None:
    tokens = list(range(40))
    without = _keys(tokens, 16, False)
    assert len(without) == 2
    assert not any(":partial:" in k for k in without)
    assert without == GOLDEN_KEYS[:2]

    exact = _keys(list(range(32)), 16, True)  # no tail
    assert len(exact) == 2
    assert not any(":partial:" in k for k in exact)


@pytest.mark.parametrize("n", [1, 5, 15, 17, 31, 33])
def test_partial_suffix_counts_tail_tokens(n: int) -> None:
    bk = _keys(list(range(n)), 16, True)
    tail = n % 16
    assert len(bk) == n // 16 + 1
    assert bk[-1].endswith(f":partial:{tail}")
    assert all(":partial:" not in k for k in bk[:-1])


def test_partial_key_differs_from_full_key_of_longer_sequence() -> None:
    # the partial block of 40 tokens is a prefix of block 2 of 48 tokens: different keys
    part = _keys(list(range(40)), 16, True)[2]
    full = _keys(list(range(48)), 16, True)[2]
    assert part != full
    assert part.split(":partial:")[0] != full


def test_too_short_for_a_block() -> None:
    assert _keys([1, 2, 3], 16, False) == ()
    assert _keys([], 16, True) == ()


# ---------------------------------------------------------------- scope


def test_scope_parts_in_key() -> None:
    scope = Scope("model.v2_a-b", "0123456789abcdef", rank=3, world_size=8)
    key = _keys(list(range(16)), 16, scope=scope)[0]
    assert scope.prefix == "model.v2_a-b@0123456789abcdef@3-8@"
    assert key.startswith(scope.prefix)
    assert len(key) == len(scope.prefix) + 32


@pytest.mark.parametrize(
    "other",
    [
        Scope("llama3-70b", FP, 0, 1),
        Scope("llama3-8b", "0123456789abcdef", 0, 1),
        Scope("llama3-8b", FP, 0, 2),
        Scope("llama3-8b", FP, 1, 2),
    ],
)
def test_different_scopes_give_different_keys(other: Scope) -> None:
    tokens = list(range(48))
    base = set(_keys(tokens))
    assert base.isdisjoint(_keys(tokens, scope=other))


def test_scope_rejects_rank_not_below_world_size() -> None:
    with pytest.raises(kvpipe.ConfigError) as info:
        Scope("ns", FP, 1, 1)
    assert info.value.field == "rank"
    with pytest.raises(kvpipe.ConfigError):
        Scope("ns", FP, 4, 2)


@pytest.mark.parametrize(
    ("rank", "world_size", "field"),
    [
        (-1, 1, "rank"),
        (0, 0, "world_size"),
        (True, 2, "rank"),
        (0, True, "world_size"),
        (0, 1.0, "world_size"),
        ("0", 1, "rank"),
    ],
)
def test_scope_rejects_bad_rank_and_world_size(rank: Any, world_size: Any, field: str) -> None:
    with pytest.raises(kvpipe.ConfigError) as info:
        Scope("ns", FP, rank, world_size)
    assert info.value.field == field


def test_scope_takes_numpy_integers_as_ranks_and_sizes() -> None:
    """A rank or world size that is a numpy integer (ranks enumerated from an array, a size
    from ``np.prod`` of a mesh) was refused as "must be an int", where ``start_block`` and
    ``common_prefix`` take numpy integers; it is now the same scope, and key, as the int."""
    scope = Scope("ns", FP, np.int64(1), np.uint32(2))  # type: ignore[arg-type]
    assert scope == Scope("ns", FP, 1, 2)
    assert type(scope.rank) is int and type(scope.world_size) is int
    assert scope.prefix == f"ns@{FP}@1-2@"
    for rank, world_size, field in ((np.int64(2), 2, "rank"), (np.int8(-1), 2, "rank")):
        with pytest.raises(kvpipe.ConfigError) as info:
            Scope("ns", FP, rank, world_size)  # type: ignore[arg-type]
        assert info.value.field == field
    with pytest.raises(kvpipe.ConfigError) as info:
        Scope("ns", FP, np.bool_(True), 2)  # type: ignore[arg-type]
    assert info.value.field == "rank"


@pytest.mark.parametrize("fp", ["", "0123", "0123456789ABCDEF", "0123456789abcdeg", FP + "0"])
def test_scope_rejects_bad_fingerprint(fp: str) -> None:
    with pytest.raises(kvpipe.ConfigError) as info:
        Scope("ns", fp)
    assert info.value.field == "fingerprint"


def test_scope_accepts_layout_fingerprint() -> None:
    layout = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=8, rope_dim=4, block_size=4)
    assert Scope("ns", layout.fingerprint).fingerprint == layout.fingerprint


# ---------------------------------------------------------------- namespace


@pytest.mark.parametrize("ns", ["a", "llama3-8b", "A.b_c-D", "9", "x" * 128, "m..v"])
def test_validate_namespace_accepts(ns: str) -> None:
    assert validate_namespace(ns) == ns
    assert Scope(ns, FP).namespace == ns


@pytest.mark.parametrize(
    "ns",
    [
        "",
        "../../etc",
        "/",
        "a/b",
        "a\x00b",
        "x" * 129,
        ".hidden",
        "-flag",
        "_x",
        "a b",
        "a@b",
        "a:b",
        "ü",
        "a\\b",
    ],
)
def test_validate_namespace_rejects(ns: str) -> None:
    with pytest.raises(kvpipe.ConfigError) as info:
        validate_namespace(ns)
    assert info.value.field == "namespace"
    with pytest.raises(kvpipe.ConfigError):
        Scope(ns, FP)


@pytest.mark.parametrize("ns", ["abc\n", "x" * 128 + "\n"])
def test_validate_namespace_rejects_trailing_newline(ns: str) -> None:
    # `$` in a regex matches before a final newline; a namespace must not end in one
    with pytest.raises(kvpipe.ConfigError):
        validate_namespace(ns)


@pytest.mark.parametrize("ns", [None, 3, b"abc"])
def test_validate_namespace_rejects_non_strings(ns: Any) -> None:
    with pytest.raises(kvpipe.ConfigError):
        validate_namespace(ns)


# ---------------------------------------------------------------- token dtypes


@pytest.mark.parametrize(
    "dtype", [np.int32, np.int64, np.uint16, np.uint32, np.int16, np.dtype(">i8")]
)
def test_token_dtypes_give_same_keys(dtype: Any) -> None:
    ref = _keys(GOLDEN_TOKENS, 16, True)
    assert _keys(np.array(GOLDEN_TOKENS, dtype=dtype), 16, True) == ref


def test_python_list_and_tuple_inputs() -> None:
    assert _keys(tuple(GOLDEN_TOKENS), 16, True) == GOLDEN_KEYS


def test_as_tokens_is_little_endian_int64() -> None:
    arr = as_tokens(np.array([1, 2, 3], dtype=np.int32))
    assert arr.dtype == np.dtype("<i8")
    assert arr.flags.c_contiguous
    strided = np.arange(10, dtype=np.int64)[::2]
    assert as_tokens(strided).tolist() == [0, 2, 4, 6, 8]
    assert _keys(strided, 2) == _keys([0, 2, 4, 6, 8], 2)
