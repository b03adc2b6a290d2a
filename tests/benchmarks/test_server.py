"""The server scenario: uvicorn answering another process's requests while kvpipe and the
hand-written offload move blocks. Structure and sanity only, never a wall time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvpipe._cache import create_kv_cache
from kvpipe.benchmarks._workload import model_layout, random_cache, same_bytes
from kvpipe.benchmarks.server import PHASES, HandOffload
from kvpipe.cli import main


@pytest.mark.parametrize("on_disk", [False, True], ids=["memory", "file"])
async def test_hand_offload_moves_every_byte(tmp_path: Path, on_disk: bool) -> None:
    layout = model_layout("256KiB")
    src = random_cache(layout, 7)  # not a multiple of the chunk nor of the threads
    dst = create_kv_cache(layout, 7)
    hand = HandOffload(src, dst, 3, 2, str(tmp_path) if on_disk else None)
    assert await hand.one_pass() > 0
    assert same_bytes(src, dst)
    assert hand.store == {} and os.listdir(tmp_path) == []  # the copies were dropped


def test_server_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("uvicorn")
    out, md, doc = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "perf.md"
    doc.write_text("prose\n<!-- kvpipe-bench:server -->\nold\n<!-- /kvpipe-bench:server -->\n")
    argv = ["bench", "--smoke", "--scenario", "server", "--dir", str(tmp_path)]
    argv += ["--server-store", "memory", "--server-store", "file", "--server-rate", "400"]
    rc = main([*argv, "--json", str(out), "--markdown", str(md), "--doc", str(doc)])
    assert rc == 0
    records = json.loads(out.read_text())["server"]
    assert [r["store"] for r in records] == ["memory", "file"]
    for r in records:
        assert r["loop"] == "uvloop" and r["lifespan"] == ["startup", "shutdown"]
        client = r["client"]
        # every request the client sent was answered, correctly, and the app saw each one
        assert client["errors"] == 0 and client["unanswered_at_exit"] == 0
        assert client["sent"] == client["answered"] == r["served"] > 0
        assert r["bytes_per_phase"] == 2 * r["blocks"] * r["block_bytes"] > 0
        assert [x["phase"] for x in r["rounds"]] == list(PHASES)  # one recorded round
        for phase in PHASES:
            s = r["summary"][phase]
            assert s["requests"] >= 1 and 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
        assert r["summary"]["kvpipe"]["gbps"] > 0 and r["summary"]["hand"]["gbps"] > 0
        assert "gbps" not in r["summary"]["idle"]
        assert r["p99_ratio"] > 0 and r["gbps_ratio"] > 0
        # requests are attributed to at most one phase each
        assert sum(r["summary"][p]["requests"] for p in PHASES) <= client["answered"]
    assert "| memory | kvpipe |" in md.read_text()
    updated = doc.read_text()
    assert "prose" in updated and "old" not in updated and "| file | hand |" in updated
    assert list(tmp_path.glob("kvpipe-bench-*")) == []  # cleaned up
    assert "kvpipe bench: server" in capsys.readouterr().out


def test_load_result_attributes_by_scheduled_time() -> None:
    from kvpipe.benchmarks._asgi import LoadResult

    res = LoadResult(np.array([1.0, 1.5, 2.0, 2.5]), np.array([0.1, 0.2, 0.3, 0.4]))
    assert res.between(1.5, 2.5).tolist() == [0.2, 0.3]


@pytest.mark.parametrize(
    "answer", [b"HTTP/1.1 500 Internal Server Error", b""], ids=["500", "hangup"]
)
async def test_load_refuses_a_run_with_failed_requests(answer: bytes) -> None:
    # Latencies are kept only for answered requests: a run where some failed must not
    # report them as if the server had answered everything.
    import asyncio

    from kvpipe.benchmarks._asgi import Load

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if not answer:
                    break
                writer.write(answer + b"\r\ncontent-length: 2\r\n\r\nno")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(RuntimeError, match="failed"):
            async with Load(port, 200.0, 2, 60.0):
                await asyncio.sleep(0.1)
    finally:
        server.close()
        await server.wait_closed()


def test_server_bench_checks_each_phases_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-written offload's reloads stop moving bytes after the warm-up round: the
    scenario refuses the run (each phase reloads into a cleared cache, checked after its
    window). Only the caches as the last round left them were checked, so the warm-up's
    bytes vouched for every later round."""
    pytest.importorskip("uvicorn")
    from kvpipe.benchmarks import server

    real = server.HandOffload.one_pass
    passes = [0]

    async def stops_reloading(self: HandOffload) -> float:
        passes[0] += 1
        if passes[0] > 1:
            return 0.001  # "done", nothing reloaded
        return await real(self)

    monkeypatch.setattr(server.HandOffload, "one_pass", stops_reloading)
    argv = ["bench", "--smoke", "--scenario", "server", "--dir", str(tmp_path)]
    argv += ["--server-store", "memory", "--json", str(tmp_path / "r.json")]
    with pytest.raises(RuntimeError, match="hand reloaded different bytes"):
        main(argv)


async def test_a_load_generator_that_cannot_start_is_reported_and_cleaned_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens on the port: the client exits before it says "ready". That is a
    # RuntimeError naming the cause, with the client reaped and its directory removed.
    import socket
    import tempfile

    from kvpipe.benchmarks._asgi import Load

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed below: nothing listens there
    load = Load(port, 100.0, 1, 10.0)
    with pytest.raises(RuntimeError, match="HTTP load generator did not start"):
        async with load:
            pass
    assert os.listdir(tmp_path) == []
    assert load._proc.returncode is not None


async def test_every_pass_of_a_phase_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pass reloads into a cleared cache and is checked (outside the phase's windows):
    with the cache cleared once per phase and checked after its last pass, the last pass
    vouched for the others."""
    pytest.importorskip("uvicorn")
    from kvpipe.benchmarks import server
    from kvpipe.benchmarks.server import ServerBenchConfig, run_server_bench

    real = server.HandOffload.one_pass
    passes = [0]

    async def only_every_other_pass_reloads(self: HandOffload) -> float:
        passes[0] += 1
        if passes[0] % 2:
            return 0.001  # "done", nothing reloaded
        return await real(self)

    monkeypatch.setattr(server.HandOffload, "one_pass", only_every_other_pass_reloads)
    cfg = ServerBenchConfig(
        cache_bytes=4 << 20, per_request=2, passes=2, rounds=1, idle_seconds=0.02, rate=200.0
    )
    with pytest.raises(RuntimeError, match="hand reloaded different bytes"):
        await run_server_bench(cfg)
