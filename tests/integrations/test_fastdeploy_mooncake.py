"""kvpipe.integrations.fastdeploy over a real Mooncake Store on 127.0.0.1 (master and metadata
server started per test, see ``kvpipe.backends.mooncake_local``), then with its master killed.

Bounds on call durations are the adapter's promise (a call returns by its ``timeout`` plus
:data:`HOP_SLACK`, plus a little for a busy machine), never speed targets.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.backends.mooncake_local import LocalMooncake
from kvpipe.integrations.fastdeploy import HOP_SLACK, KVPipeAttentionStore, KVPipeStorage

paddle = pytest.importorskip("paddle")
paddle.set_device("cpu")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LAYERS, BLOCKS, BS = 2, 32, 4
TIMEOUT = 2.0  # each call's timeout once the master is gone
BOUND = TIMEOUT + HOP_SLACK + 1.0  # what a caller may wait at most (1 s for a busy machine)


@pytest.fixture
def server() -> Iterator[LocalMooncake]:
    """This test's own metadata server and master (the test kills the master)."""
    with LocalMooncake() as started:
        yield started


def _url(server: LocalMooncake) -> str:
    return f"mooncake://{server.master_address}?metadata={server.metadata_url}"


def _caches(fill: bool) -> tuple[list[Any], list[Any]]:
    def one() -> Any:
        if fill:
            return paddle.randn([BLOCKS, 2, BS, 8]).astype("bfloat16")
        return paddle.zeros([BLOCKS, 2, BS, 8], dtype="bfloat16")

    return [one() for _ in range(LAYERS)], [one() for _ in range(LAYERS)]


def _rows(caches: list[Any], ids: list[int]) -> bytes:
    return b"".join(np.ascontiguousarray(t[i].numpy()).tobytes() for t in caches for i in ids)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    started = time.monotonic()
    result = fn()
    return result, time.monotonic() - started


#: The pipeline's notice that a write goes on without its dedup probe: a degradation it
#: reports once per write whatever the write's outcome, not the outcome the adapter promises
#: to report once.
DEDUP_NOTICE = "dedup probe failed"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and DEDUP_NOTICE not in r.getMessage()
    ]


PREFILL = """
import sys, numpy as np, paddle
from kvpipe.integrations.fastdeploy import KVPipeAttentionStore
paddle.set_device("cpu")
paddle.seed(11)
k = [paddle.randn([8, 2, 4, 8]).astype("bfloat16") for _ in range(2)]
v = [paddle.randn([8, 2, 4, 8]).astype("bfloat16") for _ in range(2)]
p = KVPipeAttentionStore(layer_num=2, block_token_size=4, splitwise_role="prefill")
n = p.write("req", k, v, list(range(14)), [0, 1, 2, 3], 0, 20.0)
np.save(sys.argv[1], np.stack([np.stack([t[:4].numpy() for t in k]),
                               np.stack([t[:4].numpy() for t in v])]))
print("written", n, flush=True)
sys.stdin.readline()  # the blocks live in this client's segment: keep it until told
p.close()
print("closed", flush=True)
"""


def test_prefill_to_decode_over_mooncake_then_master_killed(
    server: LocalMooncake,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A prefill process (store from ``KVPIPE_STORE=mooncake://...``) writes 14 tokens, 3 full
    blocks and the partial last one; the decode side (this process, its own instance and
    client contributing no memory) reads all 4 all-or-nothing into other block ids:
    byte-exact. With the master killed, the decode read returns the honest count 0 with one
    WARNING, no exception, by its timeout plus the slack."""
    env = {
        "FD_PD_TRANSFER_VIA_STORAGE": "1",
        "KVPIPE_STORE": _url(server),
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    src_file = tmp_path / "src.npy"
    prefill = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PREFILL), str(src_file)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert prefill.stdout is not None and prefill.stdin is not None
        assert prefill.stdout.readline().split() == ["written", "4"], prefill.stderr
        src = np.load(src_file)
        store = kvpipe.MooncakeStore(
            server.master_address, server.metadata_url, global_segment_size=0
        )
        dk, dv = _caches(False)
        tokens = list(range(14))
        with KVPipeAttentionStore(
            layer_num=LAYERS, block_token_size=BS, splitwise_role="decode", store=store
        ) as decode:
            assert decode.all_or_nothing_read
            # FastDeploy's order: a query, then a read of what it matched. Unbound, a decode
            # instance's query answers every block (it would never read on a 0).
            assert decode.query("req", tokens, 0) == 4
            assert decode.read("req", dk, dv, tokens, [10, 11, 12, 13], 0, 10.0) == 4
            got = np.stack(
                [np.stack([t[10:14].numpy() for t in dk]), np.stack([t[10:14].numpy() for t in dv])]
            )
            assert got.tobytes() == src.tobytes()
            assert decode.query("req", tokens, 0) == 4  # the partial block counts on decode

            server.kill_master()
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                loaded, took = _timed(
                    lambda: decode.read("req", dk, dv, tokens, [20, 21, 22, 23], 0, TIMEOUT)
                )
            assert loaded == 0
            assert took < BOUND
            warnings = _warnings(caplog)
            assert len(warnings) == 1 and "req" in warnings[0], warnings
            assert _rows(dk + dv, [20, 21, 22, 23]) == bytes(len(_rows(dk + dv, [20])) * 4)
        prefill.stdin.write("exit\n")
        prefill.stdin.flush()
        out, err = prefill.communicate(timeout=90)
        assert prefill.returncode == 0, err[-2000:]
        assert "closed" in out
    finally:
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


def test_store_down_every_call_answers_nothing_with_one_warning(
    server: LocalMooncake, caplog: pytest.LogCaptureFixture
) -> None:
    """Both adapters on a live master, then the master SIGKILLed: every call returns
    FastDeploy's "nothing" (counts 0; -1 codes; ``exists`` all False; ``clear`` False) with
    exactly one WARNING, no exception, by its timeout plus the slack; the caller's buffers
    and caches are never written. (A write also gets the pipeline's dedup-probe notice.)"""
    config = kvpipe.PipelineConfig(slice_block_num=2, slice_timeout=1.0, lookup_timeout=TIMEOUT)
    k, v = _caches(True)
    dk, dv = _caches(False)
    stored, fresh = list(range(2 * BS)), list(range(1000, 1000 + 2 * BS))
    host = np.arange(4 * 256, dtype=np.uint8)
    out = np.full_like(host, 0xAA)
    keys = [f"m_{i}_key" for i in range(4)]
    ptrs, optrs = [host.ctypes.data + 256 * i for i in range(4)], [out.ctypes.data] * 4
    as_store = kvpipe.MooncakeStore(
        server.master_address, server.metadata_url, global_segment_size=64 << 20
    )
    kv_store = kvpipe.MooncakeStore(
        server.master_address, server.metadata_url, global_segment_size=0
    )
    with (
        KVPipeAttentionStore(
            layer_num=LAYERS, block_token_size=BS, store=as_store, config=config
        ) as attention,
        KVPipeStorage(store=kv_store, timeout=TIMEOUT) as storage,
    ):
        assert attention.write("t0", k, v, stored, [0, 1], 0, 10.0) == 2
        assert storage.batch_set(keys, ptrs, [256] * 4) == [0] * 4
        assert storage.query(keys[:2], keys[2:]) == 2
        server.kill_master()

        calls: list[tuple[str, Callable[[], Any], Any]] = [
            ("write", lambda: attention.write("t1", k, v, fresh, [2, 3], 0, TIMEOUT), 0),
            ("read", lambda: attention.read("t2", dk, dv, stored, [4, 5], 0, TIMEOUT), 0),
            ("query", lambda: attention.query("t3", stored, 0, TIMEOUT), 0),
            ("batch_set", lambda: storage.batch_set(["n0", "n1"], ptrs[:2], [256] * 2), [-1] * 2),
            ("batch_get", lambda: storage.batch_get(keys, optrs, [256] * 4), [-1] * 4),
            ("exists", lambda: storage.exists(keys[:2]), dict.fromkeys(keys[:2], False)),
            ("query", lambda: storage.query(keys[:2], keys[2:], None, None, TIMEOUT), 0),
            ("clear", storage.clear, False),
        ]
        for name, call, nothing in calls:
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                result, took = _timed(call)
            assert result == nothing, name
            assert took < BOUND, (name, took)
            assert len(_warnings(caplog)) == 1, (name, _warnings(caplog))
        assert _rows(dk + dv, [4, 5]) == bytes(len(_rows(dk + dv, [4, 5])))
        assert out.tobytes() == b"\xaa" * out.nbytes
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            attention.flush_token_index("t4", stored, 0, True)  # logged, never raised
        assert len(_warnings(caplog)) <= 1
