"""FileStore against hostile files and paths: tampered blocks, confinement, permissions.

Every tampered file must end as a reported corrupt block (or a missing one), moved out of the
block tree into ``quarantine/``, never as wrong bytes loaded, a crash, a hang or a read
outside the root. The helpers here are shared by the other ``test_file_*`` modules.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import struct
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import xxhash

import kvpipe
from kvpipe._blockformat import value_nbytes
from kvpipe._keys import Scope, as_tokens, block_keys
from kvpipe._staging import StagingPool
from kvpipe._workers import ThreadRunner
from kvpipe.backends import BlockStatus, GetBatch, PutBatch, StorageBackend
from kvpipe.backends.file import FileStore
from kvpipe.backends.file._format import HEADER_NBYTES, block_location, pack_header
from kvpipe.testing.batches import Batches

pytestmark = pytest.mark.usefixtures("file_io")

T = TypeVar("T")

#: Payload bytes per block in the backend-level tests (a value adds the 48-byte trailer).
PAYLOAD = 4096 + 13
VALUE = value_nbytes(PAYLOAD)
SCOPE = Scope("conformance", "0123456789abcdef")  # the scope of Batches' keys
FIXED = struct.Struct("<4sHHIQQd16sH")  # the header's fixed fields (see _format)
SUM_AT = HEADER_NBYTES - 8


# -- helpers shared by the test_file_* modules ---------------------------------------------------


@asynccontextmanager
async def batches(slots: int = 64) -> AsyncIterator[Batches]:
    """Real batches over real staging; checks that nothing stays leased."""
    pool = StagingPool(VALUE, slots)
    async with ThreadRunner() as runner:
        yield Batches(pool, runner)
    assert pool.in_use == 0, "staging left leased"


def make_values(n: int, seed: int) -> list[bytes]:
    """``n`` random values of ``VALUE`` bytes."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, VALUE, dtype=np.uint8).tobytes() for _ in range(n)]


def block_file(root: Path, key: str) -> Path:
    """Where a key's block file lives under ``root``."""
    parts, name = block_location(key)
    return root.joinpath(*parts, name)


async def put_chain(
    b: Batches,
    store: StorageBackend,
    keys: Sequence[str],
    values: Sequence[bytes],
    parent: str | None = None,
    first: int = 0,
) -> list[BlockStatus]:
    """Put consecutive blocks of one chain, telling the store their parent."""
    lease = await b.pool.acquire(len(keys))
    try:
        for i, value in enumerate(values):
            b.pool.slot(lease.slots[i])[:] = np.frombuffer(value, np.uint8)
        batch = PutBatch(
            SCOPE,
            "hostile",
            keys,
            first,
            as_tokens(np.arange((first + len(keys)) * 4)),
            parent,
            lease=lease,
            value_nbytes=VALUE,
            runner=b.runner,
            limiter=None,
        )
        return list(await store.put_blocks(batch))
    finally:
        lease.release()


async def get_raw(
    b: Batches, store: StorageBackend, keys: Sequence[str], fill: int = 0
) -> tuple[list[BlockStatus], list[bytes]]:
    """Get ``keys`` into buffers pre-filled with ``fill``; statuses and buffer bytes."""
    lease = await b.pool.acquire(len(keys))
    try:
        for slot in lease.slots:
            b.pool.slot(slot)[:] = fill
        batch = GetBatch(
            SCOPE,
            "hostile",
            keys,
            0,
            as_tokens(np.arange(len(keys) * 4)),
            lease=lease,
            value_nbytes=VALUE,
            runner=b.runner,
            limiter=None,
        )
        statuses = list(await store.get_blocks(batch))
        return statuses, [b.pool.slot(s).tobytes() for s in lease.slots[: len(keys)]]
    finally:
        lease.release()


async def exists(b: Batches, store: StorageBackend, key: str) -> bool:
    """Whether the store says ``key`` exists (asked on its own)."""
    return list(await store.exists(b.key_batch([key]))) == [True]


def reseal(header: bytearray | bytes) -> bytes:
    """A header with its own checksum recomputed (a forged, self-consistent header)."""
    buf = bytearray(header)
    struct.pack_into("<Q", buf, SUM_AT, xxhash.xxh3_64_intdigest(bytes(buf[:SUM_AT])))
    return bytes(buf)


def rewrite_header(path: Path, **fields: object) -> None:
    """Replace fixed header fields (magic, version, flags, hlen, payload, checksum, created,
    fp, klen) and reseal the header so that only the changed field is wrong."""
    raw = bytearray(path.read_bytes())
    names = ("magic", "version", "flags", "hlen", "payload", "checksum", "created", "fp", "klen")
    current = dict(zip(names, FIXED.unpack_from(raw), strict=True))
    unknown = set(fields) - set(names)
    assert not unknown, unknown
    current.update(fields)
    FIXED.pack_into(raw, 0, *(current[n] for n in names))
    raw[:HEADER_NBYTES] = reseal(raw[:HEADER_NBYTES])
    path.write_bytes(bytes(raw))


def tree(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every entry under ``root``: kind, size and content digest (for files)."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = ("link", 0, os.readlink(p).encode())
            elif stat.S_ISDIR(st.st_mode):
                out[str(p.relative_to(root))] = ("dir", 0, b"")
            elif stat.S_ISREG(st.st_mode):
                digest = xxhash.xxh3_128_digest(p.read_bytes())
                out[str(p.relative_to(root))] = ("file", st.st_size, digest)
            else:
                out[str(p.relative_to(root))] = ("other", 0, b"")
    return out


def quarantined(root: Path) -> list[str]:
    """Names of the entries in ``root/quarantine`` (none when it does not exist)."""
    q = root / "quarantine"
    return sorted(os.listdir(q)) if q.is_dir() else []


def _thread_blocked_opening_fifo() -> bool:
    """Whether a thread of this process sleeps in the kernel waiting for a FIFO's peer."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/wchan") as f:
                if f.read().strip() == "wait_for_partner":
                    return True
        except OSError:
            continue
    return False


async def call_unblocking_fifo(fifo: Path, fn: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
    """Run ``fn``; if one of our threads blocks opening ``fifo`` for reading (a hang: nothing
    would ever open its other end), open the other end to free it, and report that it did.

    Returns ``(fn's result, whether it hung on the FIFO)``.
    """
    done = anyio.Event()
    result: list[T] = []
    hung = False

    async def call() -> None:
        try:
            result.append(await fn())
        finally:
            done.set()

    async def rescue() -> None:
        nonlocal hung
        while not done.is_set():
            if _thread_blocked_opening_fifo():
                hung = True
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        tg.start_soon(rescue)
    return result[0], hung


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[FileStore]:
    async with FileStore(tmp_path / "store", durability="none") as s:
        yield s


@pytest.fixture
async def b() -> AsyncIterator[Batches]:
    async with batches() as bb:
        yield bb


# -- tampered block files ------------------------------------------------------------------------


def _truncate_payload(p: Path, other: Path) -> None:
    os.truncate(p, HEADER_NBYTES + 100)


def _truncate_in_header(p: Path, other: Path) -> None:
    os.truncate(p, 100)


def _truncate_last_byte(p: Path, other: Path) -> None:
    os.truncate(p, p.stat().st_size - 1)


def _zero_length(p: Path, other: Path) -> None:
    os.truncate(p, 0)


def _extended(p: Path, other: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"\0" * 17)


def _flip(offset: int) -> Callable[[Path, Path], None]:
    def flip(p: Path, other: Path) -> None:
        raw = bytearray(p.read_bytes())
        raw[offset] ^= 0xFF
        p.write_bytes(bytes(raw))

    return flip


def _wrong_magic_raw(p: Path, other: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[:4] = b"PK\x03\x04"
    p.write_bytes(bytes(raw))


def _wrong_magic_resealed(p: Path, other: Path) -> None:
    rewrite_header(p, magic=b"KVPX")


def _version_2(p: Path, other: Path) -> None:
    rewrite_header(p, version=2)


def _huge_payload(p: Path, other: Path) -> None:
    rewrite_header(p, payload=2**62)


def _max_payload(p: Path, other: Path) -> None:
    rewrite_header(p, payload=2**64 - 1)


def _header_length(p: Path, other: Path) -> None:
    rewrite_header(p, hlen=8192)


def _key_length(p: Path, other: Path) -> None:
    rewrite_header(p, klen=65535)


def _key_not_utf8(p: Path, other: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[FIXED.size] = 0xFF
    raw[:HEADER_NBYTES] = reseal(raw[:HEADER_NBYTES])
    p.write_bytes(bytes(raw))


def _fingerprint(p: Path, other: Path) -> None:
    rewrite_header(p, fp=b"fedcba9876543210")


def _payload_checksum_field(p: Path, other: Path) -> None:
    (checksum,) = struct.unpack_from("<Q", p.read_bytes(), 24)
    rewrite_header(p, checksum=checksum ^ 1)


def _self_consistent_wrong_size(p: Path, other: Path) -> None:
    """A valid block file, header and checksum included, of a value one byte longer."""
    raw = p.read_bytes()
    (_, _, _, _, _, _, created, fp, klen) = FIXED.unpack_from(raw)
    key = raw[FIXED.size : FIXED.size + klen].decode()
    payload = raw[HEADER_NBYTES:] + b"\x01"
    header = pack_header(
        key, len(payload), xxhash.xxh3_64_intdigest(payload), created, fp.rstrip(b"\0").decode()
    )
    p.write_bytes(header + payload)


def _other_keys_block(p: Path, other: Path) -> None:
    shutil.copyfile(other, p)


def _garbage(p: Path, other: Path) -> None:
    p.write_bytes(os.urandom(HEADER_NBYTES + VALUE))


def _pickle_bomb(p: Path, other: Path) -> None:
    # What a FastDeploy-style store would unpickle; here it is just a bad header.
    p.write_bytes(b"\x80\x04cos\nsystem\n(S'touch /tmp/kvpipe-pwned'\ntR." + b"\0" * VALUE)


TAMPERS: dict[str, Callable[[Path, Path], None]] = {
    "truncated_payload": _truncate_payload,
    "truncated_in_header": _truncate_in_header,
    "truncated_last_byte": _truncate_last_byte,
    "zero_length": _zero_length,
    "extended": _extended,
    "flipped_first_payload_byte": _flip(HEADER_NBYTES),
    "flipped_middle_payload_byte": _flip(HEADER_NBYTES + 2049),
    "flipped_last_byte": _flip(HEADER_NBYTES + VALUE - 1),
    "flipped_header_key_byte": _flip(FIXED.size + 3),
    "flipped_header_length_byte": _flip(16),
    "flipped_header_padding_byte": _flip(3000),
    "flipped_header_checksum": _flip(SUM_AT + 2),
    "wrong_magic": _wrong_magic_raw,
    "wrong_magic_resealed": _wrong_magic_resealed,
    "version_2": _version_2,
    "huge_payload_size": _huge_payload,
    "max_payload_size": _max_payload,
    "header_length_field": _header_length,
    "key_length_field": _key_length,
    "key_not_utf8": _key_not_utf8,
    "fingerprint_mismatch": _fingerprint,
    "payload_checksum_field": _payload_checksum_field,
    "self_consistent_wrong_size": _self_consistent_wrong_size,
    "other_keys_block": _other_keys_block,
    "garbage": _garbage,
    "pickle": _pickle_bomb,
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
async def test_tampered_block_is_reported_quarantined_and_forgotten(
    tamper: str, store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    keys, _ = b.keys(3, seed=1)
    other_keys, _ = b.keys(1, seed=2)
    values = make_values(3, seed=1)
    assert await b.put(store, keys, values) == [BlockStatus.OK] * 3
    assert await b.put(store, other_keys, make_values(1, seed=2)) == [BlockStatus.OK]
    victim = block_file(root, keys[1])
    before = victim.read_bytes()
    TAMPERS[tamper](victim, block_file(root, other_keys[0]))
    assert victim.read_bytes() != before

    statuses, got = await get_raw(b, store, keys, fill=0x5A)

    assert statuses == [BlockStatus.OK, BlockStatus.CORRUPT, BlockStatus.OK]
    assert got[0] == values[0] and got[2] == values[2]
    assert not victim.exists() and not victim.is_symlink()
    assert len(quarantined(root)) == 1
    assert not await exists(b, store, keys[1])
    assert (await get_raw(b, store, keys[1:2]))[0] == [BlockStatus.MISSING]
    assert keys[1] not in store._catalog.known_keys()  # type: ignore[union-attr]
    stats = store.statistics()
    assert stats["corrupt"] == 1 and stats["quarantined"] == 1
    # The key is not wedged: it can be stored again and reads back byte-exact.
    assert await b.put(store, keys[1:2], values[1:2]) == [BlockStatus.OK]
    assert await get_raw(b, store, keys) == ([BlockStatus.OK] * 3, values)


async def test_a_directory_where_a_block_file_should_be(
    store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    keys, _ = b.keys(2, seed=3)
    values = make_values(2, seed=3)
    assert await b.put(store, keys, values) == [BlockStatus.OK] * 2
    victim = block_file(root, keys[1])
    victim.unlink()
    victim.mkdir()
    (victim / "inner.kvb").write_bytes(b"x")

    statuses, got = await get_raw(b, store, keys)
    assert not await exists(b, store, keys[1])
    # The directory must not stay where the block belongs, or the key can never be stored
    # again (renaming a new block over a directory fails, forever).
    rewritten = await b.put(store, keys[1:2], values[1:2])
    assert rewritten == [BlockStatus.OK], "the key is wedged by a directory at its name"
    assert await get_raw(b, store, keys) == ([BlockStatus.OK] * 2, values)
    assert statuses[0] is BlockStatus.OK and got[0] == values[0]
    assert statuses[1] in (BlockStatus.CORRUPT, BlockStatus.MISSING)
    assert len(quarantined(root)) == 1


async def test_a_fifo_where_a_block_file_should_be_does_not_hang_a_read(
    store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    keys, _ = b.keys(2, seed=4)
    values = make_values(2, seed=4)
    assert await b.put(store, keys, values) == [BlockStatus.OK] * 2
    victim = block_file(root, keys[1])
    victim.unlink()
    os.mkfifo(victim, 0o600)

    (statuses, got), hung = await call_unblocking_fifo(victim, lambda: get_raw(b, store, keys))

    assert not hung, "get_blocks blocked forever opening a FIFO planted at a block's name"
    assert statuses[0] is BlockStatus.OK and got[0] == values[0]
    assert statuses[1] in (BlockStatus.CORRUPT, BlockStatus.MISSING)
    assert not await exists(b, store, keys[1])


async def test_a_huge_claimed_payload_is_neither_allocated_nor_read(
    store: FileStore, b: Batches, tmp_path: Path
) -> None:
    keys, _ = b.keys(1, seed=5)
    assert await b.put(store, keys, make_values(1, seed=5)) == [BlockStatus.OK]
    victim = block_file(tmp_path / "store", keys[0])
    rewrite_header(victim, payload=2**62)
    # The file itself has a sane length: only the header lies.
    tracemalloc.start()
    try:
        statuses, _ = await get_raw(b, store, keys)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert statuses == [BlockStatus.CORRUPT]
    assert peak < 16 * 2**20, f"reading a lying header allocated {peak} B"


# -- end to end: the pipeline over a file store with a tampered block ----------------------------

LAYOUT = kvpipe.CacheLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=16)
NBLOCKS = 8
TOKENS = np.arange(NBLOCKS * 16)
SENTINEL = 0xA5


def _source_cache() -> kvpipe.KVCache:
    cache = kvpipe.create_kv_cache(LAYOUT, 32)
    rng = np.random.default_rng(7)
    for rows in cache.byte_rows:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    return cache


def _pipeline_keys(namespace: str) -> tuple[str, ...]:
    scope = Scope(namespace, LAYOUT.fingerprint)
    return block_keys(scope, as_tokens(TOKENS), LAYOUT.block_size, False)


async def _read_back_with_block_tampered(
    tmp_path: Path, k: int, tamper: Callable[[Path, list[Path]], None]
) -> None:
    root = tmp_path / "store"
    src = _source_cache()
    config = kvpipe.PipelineConfig(slice_block_num=3)
    ids = np.arange(NBLOCKS)
    async with FileStore(root) as store:
        async with kvpipe.open_pipeline(src, store, config=config, namespace="e2e") as pipe:
            w = await pipe.write(TOKENS, ids)
            assert w.complete and w.written == NBLOCKS
        keys = _pipeline_keys("e2e")
        files = [block_file(root, key) for key in keys]
        assert all(f.is_file() for f in files)
        tamper(files[k], files)

        dst = kvpipe.create_kv_cache(LAYOUT, 32)
        for rows in dst.byte_rows:
            rows[:] = SENTINEL
        dst_ids = np.arange(31, 31 - NBLOCKS, -1)
        async with kvpipe.open_pipeline(dst, store, config=config, namespace="e2e") as pipe:
            r = await pipe.read(TOKENS, dst_ids)
            assert r.loaded == k
            assert k in r.failed_blocks
            assert r.stop_reason == "failed_block"
            for a, c in zip(src.byte_rows, dst.byte_rows, strict=True):
                assert np.array_equal(a[ids[:k]], c[dst_ids[:k]])
                for i in range(k, NBLOCKS):
                    row = c[dst_ids[i]]
                    # untouched, or (never for block k) the block's true bytes
                    assert np.all(row == SENTINEL) or (i != k and np.array_equal(row, a[ids[i]])), (
                        f"cache block for sequence block {i} was overwritten"
                    )
            assert await pipe.lookup(TOKENS) == k
            again = await pipe.read(TOKENS, dst_ids)
            assert again.loaded == k


@pytest.mark.parametrize("k", [0, 4, NBLOCKS - 1])
async def test_pipeline_stops_at_a_corrupt_block(tmp_path: Path, k: int) -> None:
    def flip(p: Path, files: list[Path]) -> None:
        raw = bytearray(p.read_bytes())
        raw[HEADER_NBYTES + 10] ^= 0x01
        p.write_bytes(bytes(raw))

    await _read_back_with_block_tampered(tmp_path, k, flip)


async def test_pipeline_stops_at_a_truncated_block(tmp_path: Path) -> None:
    await _read_back_with_block_tampered(
        tmp_path, 5, lambda p, files: os.truncate(p, HEADER_NBYTES + 7)
    )


async def test_pipeline_catches_a_forged_block_the_file_store_cannot(tmp_path: Path) -> None:
    """Block 3's file replaced by block 6's, its header re-keyed and resealed: the file
    store's checks all pass; the pipeline's own trailer (key digest) must catch it."""

    def forge(p: Path, files: list[Path]) -> None:
        mine = p.read_bytes()
        theirs = bytearray(files[6].read_bytes())
        theirs[:HEADER_NBYTES] = mine[:HEADER_NBYTES]  # our key, their payload checksum
        (checksum,) = struct.unpack_from("<Q", files[6].read_bytes(), 24)
        struct.pack_into("<Q", theirs, 24, checksum)
        theirs[:HEADER_NBYTES] = reseal(theirs[:HEADER_NBYTES])
        p.write_bytes(bytes(theirs))

    await _read_back_with_block_tampered(tmp_path, 3, forge)


# -- confinement -------------------------------------------------------------------------------

BAD_NAMESPACES = [
    "../../etc",
    "..",
    ".",
    "a/b",
    "x\x00y",
    "/etc",
    "/tmp/kvpipe-outside",
    "a\\b",
    "",
    " ",
    ".hidden",
    "-flag",
    "a b",
    "ns\n",
    "x" * 129,
]


@pytest.mark.parametrize("namespace", BAD_NAMESPACES)
async def test_bad_namespace_is_rejected_at_pipeline_construction(
    namespace: str, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    cache = kvpipe.create_kv_cache(LAYOUT, 4)
    async with FileStore(root) as store:
        await store.open()
        with pytest.raises(kvpipe.ConfigError):
            async with kvpipe.open_pipeline(cache, store, namespace=namespace):
                pytest.fail("the pipeline opened")  # pragma: no cover
        with pytest.raises(kvpipe.ConfigError):
            kvpipe.Pipeline(cache, store, namespace=namespace)
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert not (root / "blocks").exists()


BAD_KEYS = [
    "../../etc/passwd",
    "..",
    ".",
    "a/b",
    "/etc/passwd",
    "x\x00y",
    "a b",
    "a\\b",
    "",
    "k\n",
    "conformance@0123456789abcdef@0-1@../../x",
    ".hidden",
    "x" * 513,
    "ключ",
]


@pytest.mark.parametrize("key", BAD_KEYS)
async def test_invalid_raw_keys_are_refused_by_every_method(
    key: str, store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    good, _ = b.keys(1, seed=9)
    batch_keys = [good[0], key]
    with pytest.raises(kvpipe.RequestError, match="invalid block key"):
        await put_chain(b, store, batch_keys, make_values(2, seed=9))
    with pytest.raises(kvpipe.RequestError, match="invalid block key"):
        await get_raw(b, store, batch_keys)
    with pytest.raises(kvpipe.RequestError, match="invalid block key"):
        await store.exists(b.key_batch(batch_keys))
    with pytest.raises(kvpipe.RequestError, match="invalid block key"):
        await store.delete(batch_keys)
    with pytest.raises(kvpipe.RequestError, match="invalid block key"):
        await store.get_residency(batch_keys)
    with pytest.raises(kvpipe.RequestError, match="invalid block key"):
        await store.put_residency([kvpipe.ResidencyEntry(key, "node", kvpipe.Residency.GPU, 0.0)])
    assert sorted(os.listdir(tmp_path)) == ["store"]
    assert not (root / "blocks").exists()
    assert store._catalog is not None and store._catalog.known_keys() == set()


@pytest.mark.parametrize("key", ["a..@x", "a@..", "A:@..", "0@@@", "Z-._:@.-", "a.@.:-"])
async def test_odd_but_valid_keys_stay_inside_the_root(
    key: str, store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = (tmp_path / "store").resolve()
    values = make_values(1, seed=10)
    assert await b.put(store, [key], values) == [BlockStatus.OK]
    assert await get_raw(b, store, [key]) == ([BlockStatus.OK], values)
    path = block_file(root, key)
    assert path.is_file() and path.resolve().is_relative_to(root / "blocks")
    assert sorted(os.listdir(tmp_path)) == ["store"]


def _outside_block(outside: Path, src: Path, rel: Path) -> Path:
    """A copy of a valid block file at ``outside/rel`` (what a followed link would find)."""
    target = outside / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    return target


LINK_AT = ["blocks", "namespace", "shard"]


def _key_under(prefix: Sequence[str], not_this: str) -> str:
    """Another key whose block file lies under the directory ``prefix``."""
    for i in itertools.count():
        key = f"{SCOPE.prefix}probe{i}"
        parts, _ = block_location(key)
        if key != not_this and parts[: len(prefix)] == tuple(prefix):
            return key
    raise AssertionError  # pragma: no cover


@pytest.mark.parametrize("where", LINK_AT)
async def test_a_planted_directory_symlink_is_not_followed(
    where: str, store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    keys, _ = b.keys(1, seed=11)
    values = make_values(1, seed=11)
    assert await b.put(store, keys, values) == [BlockStatus.OK]
    path = block_file(root, keys[0])
    depth = LINK_AT.index(where)  # blocks/<ns>/<ab>
    linked = root.joinpath(*path.relative_to(root).parts[: depth + 1])
    fresh = _key_under(path.relative_to(root).parts[: depth + 1], keys[0])
    rel = path.relative_to(linked)
    # The outside tree holds a perfectly valid copy of the block, so following the link
    # would "work": only refusing to follow it keeps the read inside the root.
    _outside_block(outside, path, rel)
    shutil.rmtree(linked)
    linked.symlink_to(outside, target_is_directory=True)
    before = tree(outside)

    statuses, got = await get_raw(b, store, keys)
    assert statuses[0] in (BlockStatus.CORRUPT, BlockStatus.FAILED, BlockStatus.MISSING)
    assert values[0][:512] not in got[0] and got[0] != values[0]
    assert not await exists(b, store, keys[0])

    assert await b.put(store, keys, values) == [BlockStatus.FAILED]
    assert await b.put(store, [fresh], make_values(1, seed=12)) == [BlockStatus.FAILED]
    try:
        await store.delete(keys)
    except kvpipe.BackendError:
        pass  # refusing is fine; touching the outside tree is not
    assert tree(outside) == before, "something changed outside the root"
    assert linked.is_symlink()


async def test_a_planted_file_symlink_is_not_read_and_is_replaced_on_write(
    store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    keys, _ = b.keys(2, seed=13)
    values = make_values(2, seed=13)
    assert await b.put(store, keys, values) == [BlockStatus.OK] * 2
    path = block_file(root, keys[1])
    target = _outside_block(outside, path, Path("stolen.kvb"))
    path.unlink()
    path.symlink_to(target)
    before = tree(outside)

    statuses, got = await get_raw(b, store, keys)
    assert statuses[0] is BlockStatus.OK and got[0] == values[0]
    assert statuses[1] in (BlockStatus.CORRUPT, BlockStatus.FAILED, BlockStatus.MISSING)
    assert values[1][:512] not in got[1]
    assert not await exists(b, store, keys[1])
    assert tree(outside) == before

    # Writing publishes a regular file in the root; the link (not its target) is replaced.
    assert await b.put(store, keys[1:], values[1:]) == [BlockStatus.OK]
    assert not path.is_symlink() and path.is_file()
    assert await get_raw(b, store, keys) == ([BlockStatus.OK] * 2, values)
    assert tree(outside) == before


async def test_a_symlink_to_a_secret_is_never_read_into_the_buffer(
    store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    secret = tmp_path / "secret.txt"
    pattern = b"TOP-SECRET-" * 1000
    secret.write_bytes(pattern)
    keys, _ = b.keys(1, seed=14)
    assert await b.put(store, keys, make_values(1, seed=14)) == [BlockStatus.OK]
    path = block_file(root, keys[0])
    path.unlink()
    path.symlink_to(secret)
    statuses, got = await get_raw(b, store, keys)
    assert statuses[0] is not BlockStatus.OK
    assert b"TOP-SECRET" not in got[0]
    assert secret.read_bytes() == pattern


async def test_a_quarantine_symlink_does_not_move_files_outside(
    store: FileStore, b: Batches, tmp_path: Path
) -> None:
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    keys, _ = b.keys(2, seed=15)
    values = make_values(2, seed=15)
    assert await b.put(store, keys, values) == [BlockStatus.OK] * 2
    (root / "quarantine").symlink_to(outside, target_is_directory=True)
    _flip(HEADER_NBYTES + 5)(block_file(root, keys[1]), Path())

    statuses, got = await get_raw(b, store, keys)

    assert os.listdir(outside) == []
    assert statuses == [BlockStatus.OK, BlockStatus.CORRUPT]
    assert got[0] == values[0]
    assert not await exists(b, store, keys[1])


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


async def test_files_are_0600_and_directories_0700(b: Batches, tmp_path: Path) -> None:
    root = tmp_path / "store"
    old = os.umask(0o022)  # a typical umask: owner-only must come from the store itself
    try:
        async with FileStore(root, durability="full") as store:
            keys, _ = b.keys(3, seed=16)
            assert await b.put(store, keys, make_values(3, seed=16)) == [BlockStatus.OK] * 3
            _flip(HEADER_NBYTES)(block_file(root, keys[2]), Path())
            assert (await get_raw(b, store, keys))[0][2] is BlockStatus.CORRUPT
            modes = _modes(root)
            modes[""] = stat.S_IMODE(root.stat().st_mode)
    finally:
        os.umask(old)
    dirs = {p for p in modes if (root / p).is_dir()}
    assert {"", "blocks", "quarantine", "blocks/conformance"} <= dirs
    assert any(p.endswith(".kvb") for p in modes)
    wrong = {p: oct(m) for p, m in modes.items() if m != (0o700 if p in dirs else 0o600)}
    assert wrong == {}, f"not owner-only: {wrong}"


# -- residency records another writer left in the catalog ----------------------------------------


@pytest.mark.parametrize(
    ("column", "value"), [("residency", "disk"), ("updated_at", "soon")], ids=["residency", "time"]
)
async def test_a_residency_record_it_cannot_read_is_a_backend_error(
    column: str, value: str, store: FileStore, tmp_path: Path
) -> None:
    """A record in the shared catalog that this version cannot read (a residency a newer
    writer knows, a time stored as text) is a ``BackendError`` naming the store, as the
    Mooncake index's is: ``get_residency`` raised a bare ``ValueError`` out of
    ``Residency('disk')``, outside the one hierarchy, and handed a textual time on as
    ``updated_at``."""
    import sqlite3

    key = "ns@0123456789abcdef@0-1@" + "ab" * 16
    await store.put_residency([kvpipe.ResidencyEntry(key, "n", kvpipe.Residency.GPU, 1.0)])
    db = sqlite3.connect(tmp_path / "store" / "catalog.sqlite3")
    with db:
        db.execute(f"UPDATE residency SET {column}=?", (value,))
    db.close()
    with pytest.raises(kvpipe.BackendError, match="get_residency"):
        await store.get_residency([key])
