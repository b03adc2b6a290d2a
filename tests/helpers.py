"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sysconfig
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import kvpipe
from kvpipe import _blockformat


def seal_block(value: np.ndarray, payload_nbytes: int, key_digest: bytes, checksum: bool) -> None:
    """Write the trailer of one value (its payload already in place)."""
    _blockformat.seal_blocks([value], payload_nbytes, [key_digest], checksum)


def check_block(
    value: np.ndarray, payload_nbytes: int, key_digest: bytes, verify: bool
) -> str | None:
    """One fetched value's check: ``None`` when it is sound, else why it is not."""
    return _blockformat.check_blocks([value], payload_nbytes, [key_digest], verify)[0]


def needs_native_digests() -> None:
    """Skip the calling test where the C extension ``kvpipe._digests`` could not be built (no
    C compiler); fail it where a compiler is present but the extension is missing: setup.py
    builds it optional with ``-Werror``, so a new warning would drop it without a word."""
    _needs_built(_blockformat.native, "kvpipe._digests")


def needs_native_fileio() -> None:
    """As :func:`needs_native_digests`, for the file store's ``_fileio``."""
    from kvpipe.backends.file import _native

    _needs_built(_native.fileio, "kvpipe.backends.file._fileio")


def _needs_built(module: object, name: str) -> None:
    if module is not None:
        return
    cc = str(sysconfig.get_config_var("CC") or "").split()
    assert not cc or shutil.which(cc[0]) is None, (
        f"a C compiler is here but {name} was not built (see setup.py)"
    )
    pytest.skip(f"the native extension {name} was not built (no C compiler)")


def fill_random(cache: kvpipe.KVCache, seed: int = 0) -> None:
    """Fill every tensor of a cache with random bytes."""
    rng = np.random.default_rng(seed)
    for rows in cache.byte_rows:
        rows[:] = rng.integers(0, 256, size=rows.shape, dtype=np.uint8)


LAYOUTS = {
    "gqa": lambda: kvpipe.CacheLayout.gqa(
        num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype="bfloat16"
    ),
    "gqa_fp8": lambda: kvpipe.CacheLayout.gqa(
        num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, fp8_scales=True
    ),
    "mla": lambda: kvpipe.CacheLayout.mla(
        num_layers=3, kv_lora_rank=64, rope_dim=16, block_size=16, dtype="bfloat16"
    ),
    "dsa": lambda: kvpipe.CacheLayout.dsa(
        num_layers=3,
        kv_lora_rank=512,
        rope_dim=64,
        index_head_dim=128,
        quant_block=128,
        block_size=16,
    ),
}


async def until(pred: Callable[[], bool], limit: int = 10_000, wall: float = 10.0) -> None:
    """Yield to other tasks until ``pred()`` holds (no sleeping, so virtual time stands
    still); gives up after ``limit`` yields and ``wall`` real seconds both: a condition that
    waits on a worker thread gets its time on a loaded machine too."""
    started = time.monotonic()
    for i in itertools.count():
        if pred():
            return
        if i >= limit and time.monotonic() - started > wall:
            raise AssertionError("condition never became true")
        await anyio.lowlevel.checkpoint()


async def checkpoints(n: int = 20) -> None:
    """Yield to other tasks ``n`` times."""
    for _ in range(n):
        await anyio.lowlevel.checkpoint()


@contextlib.asynccontextmanager
async def host_threads_busy() -> AsyncIterator[None]:
    """Every one of the event loop library's shared worker threads taken, as a server's
    blocking endpoints may take them, until the block exits."""
    limiter = anyio.to_thread.current_default_thread_limiter()
    borrowers: list[object] = []
    try:
        while limiter.available_tokens:
            borrowers.append(object())
            await limiter.acquire_on_behalf_of(borrowers[-1])
        yield
    finally:
        for borrower in borrowers:
            limiter.release_on_behalf_of(borrower)


async def ends_with_host_threads_busy(call: Callable[[], Awaitable[object]]) -> bool:
    """Whether ``call()`` ends while :func:`host_threads_busy` (a 5 s guard against a hang,
    not a timing); the threads are given back before this returns, so it ends either way."""
    ended = anyio.Event()

    async def run() -> None:
        await call()
        ended.set()

    async with anyio.create_task_group() as tg:
        async with host_threads_busy():
            tg.start_soon(run)
            with anyio.move_on_after(5):
                await ended.wait()
            return ended.is_set()


def record_thread_starts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str]]:
    """Every ``Thread.start`` from now on: (the starting thread's ident, the new one's name)."""
    starts: list[tuple[int, str]] = []
    start = threading.Thread.start

    def recorded(self: threading.Thread) -> None:
        starts.append((threading.get_ident(), self.name))
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recorded)
    return starts


@contextlib.contextmanager
def mounted(mnt: Path, fstype: str, options: str) -> Iterator[Path]:
    """A fresh file system of ``fstype`` mounted on the empty directory ``mnt`` (we run as
    root in CI), unmounted afterwards. Where mounting is not possible the test is skipped
    and says why."""
    if os.geteuid() != 0:
        pytest.skip(f"mounting a {fstype} needs root")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount command here")
    cmd = ["mount", "-t", fstype, "-o", options, fstype, str(mnt)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a {fstype} here: {done.stderr.strip() or done.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], check=False).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
