"""The stored block format: a 48-byte trailer after the payload, and check_blocks' verdicts.

Every test runs twice: hashing through the native extension (``kvpipe._digests``, where it
was built) and through python-xxhash, one value at a time."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

import kvpipe._blockformat as blockformat
from kvpipe._blockformat import (
    PLACED,
    TRAILER_NBYTES,
    WHOLE_MISMATCH,
    check_blocks,
    gather_seal_blocks,
    place_if_sound,
    seal_blocks,
    value_nbytes,
)
from kvpipe._keys import key_digest
from tests.helpers import check_block, needs_native_digests, seal_block

NATIVE = blockformat.native


@pytest.fixture(autouse=True, params=["native", "python"])
def hashing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "native":
        needs_native_digests()
    else:
        monkeypatch.setattr(blockformat, "native", None)
    return str(request.param)


PAYLOAD = 100
DIGEST = key_digest("ns@0123456789abcdef@0-1@00")
OTHER = key_digest("ns@0123456789abcdef@0-1@01")


def _sealed(checksum: bool = True, extra: int = 0) -> np.ndarray:
    value = np.zeros(value_nbytes(PAYLOAD) + extra, dtype=np.uint8)
    value[:PAYLOAD] = np.arange(PAYLOAD, dtype=np.uint8) * 7
    seal_block(value, PAYLOAD, DIGEST, checksum)
    return value


def test_trailer_is_48_bytes() -> None:
    assert TRAILER_NBYTES == 48
    assert value_nbytes(0) == 48
    assert value_nbytes(PAYLOAD) == PAYLOAD + 48


def test_trailer_layout() -> None:
    value = _sealed()
    trailer = value[PAYLOAD:].tobytes()
    magic, version, flags, length, kdigest, digest = struct.unpack("<4sHHQ16sQ", trailer[:40])
    assert magic == b"KVPB"
    assert version == 1
    assert flags == 1
    assert length == PAYLOAD
    assert kdigest == DIGEST
    assert digest == xxhash.xxh3_64_intdigest(value[:PAYLOAD].tobytes())
    assert trailer[40:] == bytes(8)  # reserved


def test_seal_leaves_payload_and_bytes_past_trailer_alone() -> None:
    value = np.full(value_nbytes(PAYLOAD) + 10, 0xEE, dtype=np.uint8)
    value[:PAYLOAD] = 3
    seal_block(value, PAYLOAD, DIGEST, True)
    assert (value[:PAYLOAD] == 3).all()
    assert (value[PAYLOAD + 48 :] == 0xEE).all()


def test_seal_without_checksum() -> None:
    value = _sealed(checksum=False)
    _, _, flags, _, _, digest = struct.unpack("<4sHHQ16sQ", value[PAYLOAD : PAYLOAD + 40])
    assert flags == 0
    assert digest == 0
    assert check_block(value, PAYLOAD, DIGEST, True) is None
    value[0] ^= 1  # not detectable without a recorded checksum
    assert check_block(value, PAYLOAD, DIGEST, True) is None


@pytest.mark.parametrize("verify", [True, False])
def test_sound_block(verify: bool) -> None:
    assert check_block(_sealed(), PAYLOAD, DIGEST, verify) is None
    assert check_block(_sealed(extra=17), PAYLOAD, DIGEST, verify) is None


def test_short_value() -> None:
    value = _sealed()
    assert check_block(value[:-1], PAYLOAD, DIGEST, True) == "value shorter than a block"
    assert check_block(value[:10], PAYLOAD, DIGEST, False) == "value shorter than a block"


def test_bad_magic() -> None:
    value = _sealed()
    value[PAYLOAD] ^= 0x20
    assert check_block(value, PAYLOAD, DIGEST, True) == "bad magic"


def test_unknown_version() -> None:
    value = _sealed()
    value[PAYLOAD + 4 : PAYLOAD + 6] = np.frombuffer(struct.pack("<H", 2), np.uint8)
    assert check_block(value, PAYLOAD, DIGEST, True) == "unknown format version 2"


def test_length_mismatch() -> None:
    value = _sealed()
    value[PAYLOAD + 8 : PAYLOAD + 16] = np.frombuffer(struct.pack("<Q", 99), np.uint8)
    assert check_block(value, PAYLOAD, DIGEST, True) == "payload length 99, expected 100"


def test_expected_length_differs() -> None:
    value = _sealed(extra=8)  # long enough to hold the trailer at either position
    assert check_block(value, PAYLOAD - 4, DIGEST, True) is not None


@pytest.mark.parametrize("verify", [True, False])
def test_other_key(verify: bool) -> None:
    assert check_block(_sealed(), PAYLOAD, OTHER, verify) == "value belongs to another key"


def test_checksum_mismatch_only_when_verifying() -> None:
    value = _sealed()
    value[PAYLOAD // 2] ^= 0x01
    assert check_block(value, PAYLOAD, DIGEST, True) == "checksum mismatch"
    assert check_block(value, PAYLOAD, DIGEST, False) is None


def test_stored_checksum_flip_detected() -> None:
    value = _sealed()
    value[PAYLOAD + 32] ^= 0x80
    assert check_block(value, PAYLOAD, DIGEST, True) == "checksum mismatch"


def test_empty_payload() -> None:
    value = np.zeros(48, dtype=np.uint8)
    seal_block(value, 0, DIGEST, True)
    assert check_block(value, 0, DIGEST, True) is None


@pytest.mark.parametrize("checksum", [True, False])
def test_sealing_with_whole_digests_seals_the_same_and_digests_the_whole_value(
    checksum: bool,
) -> None:
    value = np.zeros(value_nbytes(PAYLOAD), dtype=np.uint8)
    value[:PAYLOAD] = np.arange(PAYLOAD, dtype=np.uint8) * 7
    [digest] = _sealed_whole([value], PAYLOAD, [DIGEST], checksum)
    assert np.array_equal(value, _sealed(checksum))
    assert digest == xxhash.xxh3_64_intdigest(value.data)
    assert check_block(value, PAYLOAD, DIGEST, True) is None


def _sealed_whole(
    values: list[np.ndarray], payload: int, digests: list[bytes], checksum: bool
) -> list[int]:
    wholes = seal_blocks(values, payload, digests, checksum, whole=True)
    assert wholes is not None
    return wholes


def _batch(sizes: list[int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, value_nbytes(n) + 5, dtype=np.uint8) for n in sizes]


@pytest.mark.parametrize("payload", [0, 1, 7, 100, 4096, 70001])
@pytest.mark.parametrize("checksum", [True, False])
def test_a_batch_seals_as_each_value_alone(payload: int, checksum: bool) -> None:
    values = _batch([payload] * 4, payload)
    alone = [v.copy() for v in values]
    keys = [key_digest(f"ns@0123456789abcdef@0-1@{i:02x}") for i in range(4)]
    digests = seal_blocks(values, payload, keys, checksum)
    wholes = [
        _sealed_whole([v], payload, [k], checksum)[0] for v, k in zip(alone, keys, strict=True)
    ]
    for v, a in zip(values, alone, strict=True):
        assert np.array_equal(v, a)
    end = value_nbytes(payload)
    assert wholes == [xxhash.xxh3_64_intdigest(v[:end].data) for v in values]
    assert digests == (wholes if checksum else None)
    assert seal_blocks([], payload, [], checksum) == ([] if checksum else None)


def test_a_batch_checks_as_each_value_alone() -> None:
    keys = [key_digest(f"ns@0123456789abcdef@0-1@{i:02x}") for i in range(7)]
    values = _batch([PAYLOAD] * 7, 3)
    seal_blocks(values, PAYLOAD, keys, True)
    seal_block(values[6], PAYLOAD, keys[6], False)  # no checksum recorded
    values[1][5] ^= 1  # payload changed
    values[2][PAYLOAD] ^= 1  # magic
    values[4] = values[4][: PAYLOAD + 3]  # short
    values[5][-10] ^= 1  # the trailer's reserved bytes: not checked
    keys_read = list(keys)
    keys_read[3] = OTHER  # fetched under another key
    want = [
        None,
        "checksum mismatch",
        "bad magic",
        "value belongs to another key",
        "value shorter than a block",
        None,
        None,
    ]
    assert check_blocks(values, PAYLOAD, keys_read, True) == want
    assert [
        check_block(v, PAYLOAD, k, True) for v, k in zip(values, keys_read, strict=True)
    ] == want
    assert check_blocks(values, PAYLOAD, keys_read, False)[1] is None
    with pytest.raises(ValueError):
        check_blocks(values, PAYLOAD, keys_read[:-1], True)


# place_if_sound: one native call checks a value and copies it into the cache rows; without
# the extension it decides nothing (None) and copies nothing.

#: Two cache tensors of 3 blocks: the payload's first 60 bytes go to tensor 1, the rest to 0.
TABLE = np.array([(1, 0, 60), (0, 60, 40)], np.int64)


def _rows() -> list[np.ndarray]:
    return [np.full((3, 40), 0xAA, np.uint8), np.full((3, 60), 0xAA, np.uint8)]


def _place(
    value: np.ndarray,
    rows: list[np.ndarray],
    *,
    whole: int | None = None,
    key: bytes = DIGEST,
    verify: bool = True,
    table: np.ndarray = TABLE,
    block: int = 1,
) -> int | None:
    checksum = xxhash.xxh3_64_intdigest(value.tobytes()) if whole is None else whole
    return place_if_sound(value, PAYLOAD, checksum, key, verify, rows, block, table)


def _untouched(rows: list[np.ndarray]) -> bool:
    return all(bool((r == 0xAA).all()) for r in rows)


def test_place_if_sound_copies_a_sound_value(hashing: str) -> None:
    value, rows = _sealed(), _rows()
    if hashing == "python":
        assert _place(value, rows) is None and _untouched(rows)
        return
    assert _place(value, rows) == PLACED
    assert rows[1][1].tobytes() == value[:60].tobytes()
    assert rows[0][1].tobytes() == value[60:PAYLOAD].tobytes()
    assert all(bool((r[[0, 2]] == 0xAA).all()) for r in rows)  # other blocks: untouched


def test_place_if_sound_refuses_a_value_its_store_did_not_write(hashing: str) -> None:
    value, rows = _sealed(), _rows()
    whole = xxhash.xxh3_64_intdigest(value.tobytes()) ^ 1
    want = None if hashing == "python" else WHOLE_MISMATCH
    assert _place(value, rows, whole=whole) == want
    assert _untouched(rows)


@pytest.mark.parametrize("verify", [True, False])
def test_place_if_sound_checks_the_payload_only_when_verifying(hashing: str, verify: bool) -> None:
    value, rows = _sealed(), _rows()
    value[5] ^= 1  # changed before its store hashed it: only the trailer's checksum tells
    verdict = _place(value, rows, verify=verify)
    if hashing == "python" or verify:
        assert verdict is None and _untouched(rows)
        assert check_block(value, PAYLOAD, DIGEST, True) == "checksum mismatch"
    else:
        assert verdict == PLACED and rows[1][1].tobytes() == value[:60].tobytes()


@pytest.mark.parametrize("verify", [True, False])
def test_place_if_sound_without_a_recorded_checksum_checks_the_trailer(
    hashing: str, verify: bool
) -> None:
    """A store that records no checksum of its own (``None``): the trailer decides, the
    payload's hash compared only with ``verify``."""
    value, rows = _sealed(), _rows()
    verdict = place_if_sound(value, PAYLOAD, None, DIGEST, verify, rows, 1, TABLE)
    if hashing == "python":
        assert verdict is None and _untouched(rows)
        return
    assert verdict == PLACED and rows[0][1].tobytes() == value[60:PAYLOAD].tobytes()
    bad, rows = _sealed(), _rows()
    bad[70] ^= 1
    verdict = place_if_sound(bad, PAYLOAD, None, DIGEST, verify, rows, 1, TABLE)
    if verify:
        assert verdict is None and _untouched(rows)
    else:  # as check_block(verify=False): the payload is not hashed
        assert verdict == PLACED and rows[0][1].tobytes() == bad[60:PAYLOAD].tobytes()
    other, rows = _sealed(), _rows()
    assert place_if_sound(other, PAYLOAD, None, OTHER, verify, rows, 1, TABLE) is None
    assert _untouched(rows)


@pytest.mark.parametrize(
    "spoil",
    [
        lambda v: v.__setitem__(PAYLOAD, v[PAYLOAD] ^ 1),  # magic
        lambda v: v.__setitem__(PAYLOAD + 4, 9),  # version
        lambda v: v.__setitem__(PAYLOAD + 8, v[PAYLOAD + 8] ^ 1),  # length
        lambda v: v.__setitem__(-1, 1),  # reserved: the slow way accepts it
    ],
)
def test_place_if_sound_leaves_any_other_trailer_to_the_slow_way(
    hashing: str, spoil: object
) -> None:
    value, rows = _sealed(), _rows()
    spoil(value)  # type: ignore[operator]
    assert _place(value, rows) is None and _untouched(rows)
    other, rows = _sealed(), _rows()
    assert _place(other, rows, key=OTHER) is None and _untouched(rows)
    unsummed, rows = _sealed(checksum=False), _rows()  # a writer that recorded no checksum
    assert _place(unsummed, rows) is None and _untouched(rows)
    assert check_block(unsummed, PAYLOAD, DIGEST, True) is None


def test_place_if_sound_checks_its_arguments_before_copying(hashing: str) -> None:
    if hashing == "python":  # nothing to check: it decides nothing
        assert _place(_sealed(), _rows(), block=7) is None
        return
    good = (1, 0, 60)
    wide = np.full((3, 80), 0xAA, np.uint8)[:, ::2]  # rows of 40 bytes, every other one
    frozen = _rows()
    for r in frozen:
        r.flags.writeable = False
    cases: list[tuple[list[np.ndarray], int, list[tuple[int, int, int]], type[Exception]]] = [
        (_rows(), 3, [good], IndexError),  # block past the end
        (_rows(), -1, [good], IndexError),
        (_rows(), 0, [good, (2, 60, 40)], ValueError),  # no such row array
        (_rows(), 0, [good, (0, 120, 40)], ValueError),  # piece past the value's end
        (_rows(), 0, [good, (0, 60, 39)], ValueError),  # piece narrower than the row
        ([wide, _rows()[1]], 0, [good, (0, 60, 40)], ValueError),  # row not contiguous
        ([np.full(40, 0xAA, np.uint8), _rows()[1]], 0, [good], ValueError),  # not 2-D
        (frozen, 0, [good], ValueError),  # not writable (numpy: "read-only")
    ]
    for rows, block, table, error in cases:
        with pytest.raises(error):
            _place(_sealed(), rows, block=block, table=np.array(table, np.int64))
        assert _untouched(rows)  # not even the first, sound piece
    with pytest.raises(ValueError):  # not whole triples
        _place(_sealed(), _rows(), table=np.zeros(4, np.int64))
    with pytest.raises(ValueError):  # a value shorter than a payload and a trailer
        _place(_sealed()[:-1], _rows())


# gather_seal_blocks: one native call copies each block's pieces out of the cache rows into
# its value and seals it, as a gather then seal_blocks would; without the extension it copies
# nothing and returns None (the caller gathers and seals apart).


def _gather_rows() -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, 256, (3, 40), np.uint8), rng.integers(0, 256, (3, 60), np.uint8)]


def _gather_seal(
    rows: list[np.ndarray], blocks: list[int], table: np.ndarray = TABLE, extra: int = 0
) -> tuple[list[int] | None, list[np.ndarray]]:
    values = [np.full(value_nbytes(PAYLOAD) + extra, 0x55, np.uint8) for _ in blocks]
    ids = np.array(blocks, np.int64)
    digests = [key_digest(f"ns@0123456789abcdef@0-1@{b:02x}") for b in blocks]
    return gather_seal_blocks(rows, ids, table, values, PAYLOAD, digests), values


def _expected(rows: list[np.ndarray], block: int, table: np.ndarray) -> tuple[int, np.ndarray]:
    """What a gather then seal_blocks of ``block`` gives: the digest and the value."""
    value = np.full(value_nbytes(PAYLOAD), 0x55, np.uint8)
    for which, at, n in table.tolist():
        value[at : at + n] = rows[which][block]
    digest = key_digest(f"ns@0123456789abcdef@0-1@{block:02x}")
    sums = seal_blocks([value], PAYLOAD, [digest], True)
    assert sums is not None
    return sums[0], value


@pytest.mark.parametrize(
    "table",
    [
        TABLE,  # back to back from 0: each piece hashed right after its copy
        np.array([(0, 60, 40), (1, 0, 60)], np.int64),  # out of order: hashed afterwards
        np.array([(1, 0, 60)], np.int64),  # bytes 60-99 not covered: hashed as they are
        np.array([(0, 0, 40), (0, 60, 40)], np.int64),  # a gap inside, ending at the payload's end
    ],
)
def test_gather_seal_blocks_matches_a_gather_then_seal(hashing: str, table: np.ndarray) -> None:
    rows = _gather_rows()
    sums, values = _gather_seal(rows, [2, 0, 2], table, extra=3)
    if hashing == "python":
        assert sums is None and all(bool((v == 0x55).all()) for v in values)
        return
    assert sums is not None and len(sums) == 3
    for block, got, value in zip([2, 0, 2], sums, values, strict=True):
        want, expected = _expected(rows, block, table)
        assert got == want
        assert value[: value_nbytes(PAYLOAD)].tobytes() == expected.tobytes()
        assert bool((value[value_nbytes(PAYLOAD) :] == 0x55).all())  # past the trailer
        own = key_digest(f"ns@0123456789abcdef@0-1@{block:02x}")
        assert check_block(value[: value_nbytes(PAYLOAD)], PAYLOAD, own, True) is None


def test_gather_seal_blocks_checks_its_arguments_before_copying(hashing: str) -> None:
    if hashing == "python":
        assert _gather_seal(_gather_rows(), [7])[0] is None  # decides nothing
        return
    good = (1, 0, 60)
    wide = np.zeros((3, 80), np.uint8)[:, ::2]  # rows of 40 bytes, every other one
    cases: list[tuple[list[np.ndarray], list[int], list[tuple[int, int, int]], type[Exception]]] = [
        (_gather_rows(), [0, 3], [good], IndexError),  # block past the end
        (_gather_rows(), [-1], [good], IndexError),
        (_gather_rows(), [0], [good, (2, 60, 40)], ValueError),  # no such row array
        (_gather_rows(), [0], [good, (0, 70, 40)], ValueError),  # piece past the payload
        (_gather_rows(), [0], [good, (0, 60, 39)], ValueError),  # narrower than the row
        ([wide, _gather_rows()[1]], [0], [good, (0, 60, 40)], ValueError),  # not contiguous
        ([np.zeros(40, np.uint8), _gather_rows()[1]], [0], [good], ValueError),  # not 2-D
    ]
    for rows, blocks, table, error in cases:
        values = [np.full(value_nbytes(PAYLOAD), 0x55, np.uint8) for _ in blocks]
        with pytest.raises(error):
            gather_seal_blocks(
                rows,
                np.array(blocks, np.int64),
                np.array(table, np.int64),
                values,
                PAYLOAD,
                [DIGEST] * len(blocks),
            )
        assert all(bool((v == 0x55).all()) for v in values)  # not even the first value
    rows, ids, digests = _gather_rows(), np.array([0, 1], np.int64), [DIGEST, OTHER]
    value = np.zeros(value_nbytes(PAYLOAD), np.uint8)
    with pytest.raises(ValueError):  # one block id per value
        gather_seal_blocks(rows, ids, TABLE, [value], PAYLOAD, digests[:1])
    with pytest.raises(ValueError):  # one key digest per value
        gather_seal_blocks(rows, ids, TABLE, [value, value.copy()], PAYLOAD, digests[:1])
    with pytest.raises(ValueError):  # a value too short for a payload and a trailer
        gather_seal_blocks(rows, ids[:1], TABLE, [value[:-1]], PAYLOAD, digests[:1])
    with pytest.raises(ValueError):  # not whole triples
        gather_seal_blocks(rows, ids[:1], np.zeros(4, np.int64), [value], PAYLOAD, digests[:1])
    frozen = value.copy()
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError)):  # a value that cannot be written
        gather_seal_blocks(rows, ids[:1], TABLE, [frozen], PAYLOAD, digests[:1])


# Sizes and offsets near the largest Py_ssize_t: the checks must not overflow (a sum that
# wrapped negative once passed them, and the call then read or wrote far past the value).
_HUGE_ARGUMENTS = """
import sys
import numpy as np
from kvpipe import _blockformat
native = _blockformat.native
big, value, no_rows = sys.maxsize - 8, bytearray(64), np.zeros((0, 3), np.int64)
calls = [
    lambda: native.seal([value], big, bytes(16), 0),  # payload + trailer past the largest
    lambda: native.seal([value], 0, bytes(16), sys.maxsize - 4),  # digest past the trailer
    lambda: native.gather_seal([], np.zeros(1, np.int64), no_rows, [value], big, bytes(16), 0),
    lambda: native.gather_seal(
        [], np.zeros(1, np.int64), no_rows, [value], 0, bytes(16), sys.maxsize - 4
    ),
    lambda: native.check_place(value, 0, 0, bytes(16), sys.maxsize - 4, True, [], 0, no_rows),
]
for call in calls:
    try:
        call()
        print("accepted")
    except ValueError:
        print("ValueError")
"""


def test_native_calls_refuse_sizes_that_overflow(hashing: str) -> None:
    if hashing == "python":
        return
    child = subprocess.run(  # a crash must fail this test, not end the run
        [sys.executable, "-c", _HUGE_ARGUMENTS], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, (child.returncode, child.stderr)
    assert child.stdout.split() == ["ValueError"] * 5


# ``rows`` may be any iterable: taking it runs Python code, which here adds values to the list
# the call was given after it counted them (the call once sealed every value then present,
# reading a block id and writing a digest past the ends of its arrays for each added one).
_VALUES_GROW = """
import numpy as np
from kvpipe import _blockformat
rows, values = np.zeros((4, 16), np.uint8), [np.zeros(64, np.uint8)]
def grow_values():
    values.extend(np.zeros(64, np.uint8) for _ in range(1000))
    yield rows
table = np.array([[0, 0, 16]], np.int64)
try:
    _blockformat.native.gather_seal(
        grow_values(), np.zeros(1, np.int64), table, values, 16, bytes(48), 32
    )
    print("accepted")
except ValueError:
    print("ValueError")
"""


def test_gather_seal_refuses_values_that_grew_while_it_took_the_rows(hashing: str) -> None:
    if hashing == "python":
        return
    child = subprocess.run(  # a crash must fail this test, not end the run
        [sys.executable, "-c", _VALUES_GROW], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, (child.returncode, child.stderr)
    assert child.stdout.split() == ["ValueError"]


@pytest.mark.parametrize("shift", [0, 1, 8, 15])
@pytest.mark.parametrize("width", [4096, 4097, 40_003])
def test_place_if_sound_copies_large_pieces_to_any_alignment(
    hashing: str, shift: int, width: int
) -> None:
    """Pieces of 4 KiB and more go through the extension's streaming copy: every byte lands,
    whatever the destination's alignment and the piece's length, and nothing around it."""
    payload = 2 * width
    value = np.zeros(value_nbytes(payload), np.uint8)
    value[:payload] = np.random.default_rng(width + shift).integers(0, 256, payload, np.uint8)
    seal_block(value, payload, DIGEST, True)
    blocks = 3
    rows = []
    for _ in range(2):  # rows at ``shift`` bytes past an aligned buffer's start
        raw = np.full(blocks * width + shift + 64, 0xAA, np.uint8)
        rows.append(raw[shift : shift + blocks * width].reshape(blocks, width))
    table = np.array([(1, 0, width), (0, width, width)], np.int64)
    whole = xxhash.xxh3_64_intdigest(value.tobytes())
    verdict = place_if_sound(value, payload, whole, DIGEST, True, rows, 1, table)
    if hashing == "python":  # nothing decided, nothing copied
        assert verdict is None and all(bool((r == 0xAA).all()) for r in rows)
        return
    assert verdict == PLACED
    assert rows[1][1].tobytes() == value[:width].tobytes()
    assert rows[0][1].tobytes() == value[width:payload].tobytes()
    for r in rows:
        assert bool((r[[0, 2]] == 0xAA).all())
        assert bool((r.base[:shift] == 0xAA).all()) and bool(
            (r.base[shift + blocks * width :] == 0xAA).all()
        )
