"""examples/embedded_server.py under load: 8 concurrent clients, 32 requests sharing prompt
prefixes, 127.0.0.1 only. Checks the answers (reuse of stored prefixes, every reloaded byte
verified), the metrics page against the answers, and the server's event-loop lag (a generous
bound only; the numbers are printed)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import anyio
import anyio.abc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import kvpipe

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "embedded_server.py"
BS = 16  # the example's block size
CLIENTS, PER_CLIENT = 8, 4
#: The system prompts (in blocks) the clients share: client c uses prefix c % 4.
PREFIX_BLOCKS = (3, 4, 5, 6)


@dataclass
class Answer:
    client: int
    prefix: int
    started: float
    finished: float
    body: dict[str, Any]


# The test avoids one-byte ``bytes`` literals such as b" ": CPython shares one object per
# byte value, and kvpipe/cuda/_nvrtc.py (``b" " * size`` with size 1, handed to NVRTC to fill)
# overwrites the shared b" " with b"\x00" in any process that compiled the kernels earlier —
# as the test session has, in tests/cuda (to fix there: allocate the buffers with bytes(size)).


async def http(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    """One request on its own connection; the status code and the body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n\r\n"
        await stream.send(head.encode() + body)
        data = b""
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    head_bytes, _, payload = data.partition(b"\r\n\r\n")
    status_line = head_bytes.split(b"\r\n", 1)[0].split()  # not split(b" "): see above
    assert status_line[:1] == [b"HTTP/1.1"], f"{method} {path}: bad reply {data[:200]!r}"
    return int(status_line[1]), payload


def prompt(prefix: int, client: int, index: int) -> list[int]:
    """The shared system prompt ``prefix``, then this request's own blocks and a partial tail."""
    system = np.random.default_rng([7, prefix]).integers(0, 50_000, PREFIX_BLOCKS[prefix] * BS)
    rng = np.random.default_rng([client, index])
    own = rng.integers(0, 50_000, int(rng.integers(1, 5)) * BS + int(rng.integers(0, BS)))
    own[0] = 50_000 + client * PER_CLIENT + index  # no two requests share a block past it
    return [int(t) for t in np.concatenate([system, own])]


def metric_values(page: str) -> dict[str, defaultdict[tuple[str, str], float]]:
    """name → (op, outcome) → value, summed over other labels ("", "" when it has none)."""
    out: dict[str, defaultdict[tuple[str, str], float]] = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            key = (s.labels.get("op", ""), s.labels.get("outcome", ""))
            out.setdefault(s.name, defaultdict(float))[key] += s.value
    return out


#: Runs the example as a script in an interpreter where ``import prometheus_client`` fails,
#: as it does where only kvpipe's base dependencies are installed (``make run``).
WITHOUT_PROMETHEUS = (
    "import runpy, sys; sys.modules['prometheus_client'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


async def start_server(
    stderr: IO[bytes], *args: str, metrics: bool = True
) -> tuple[anyio.abc.Process, int]:
    """Start the example on a free port; the process and the port it printed."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}
    python = [sys.executable] if metrics else [sys.executable, "-c", WITHOUT_PROMETHEUS]
    argv = [*python, str(EXAMPLE), "--port", "0", *args]
    proc = await anyio.open_process(argv, env=env, stderr=stderr)
    assert proc.stdout is not None
    line = b""
    with anyio.fail_after(60):
        while b"\n" not in line:
            line += await proc.stdout.receive()
    first = line.decode().splitlines()[0]
    assert first.startswith("listening on http://127.0.0.1:"), first
    return proc, int(first.rsplit(":", 1)[1])


@pytest.mark.parametrize("store", ["memory", "file"])
async def test_embedded_server_under_concurrent_clients(store: str, tmp_path: Path) -> None:
    answers: list[Answer] = []
    output = b""
    with (tmp_path / "stderr.txt").open("wb") as errors:  # the child keeps its own copy
        proc, port = await start_server(
            errors, *(["--dir", str(tmp_path / "kv")] if store == "file" else [])
        )
    async with proc:
        try:
            assert (await http(port, "POST", "/lag/reset"))[0] == 200

            async def client(c: int) -> None:
                for i in range(PER_CLIENT):
                    body = json.dumps({"tokens": prompt(c % 4, c, i)}).encode()
                    started = anyio.current_time()
                    status, payload = await http(port, "POST", "/generate", body)
                    assert status == 200, payload
                    answers.append(
                        Answer(c, c % 4, started, anyio.current_time(), json.loads(payload))
                    )

            with anyio.fail_after(60):
                async with anyio.create_task_group() as clients:
                    for c in range(CLIENTS):
                        clients.start_soon(client, c)
                health = json.loads((await http(port, "GET", "/health"))[1])
                status, page = await http(port, "GET", "/metrics")
                assert status == 200
                assert (await http(port, "GET", "/nowhere"))[0] == 404
        except BaseException:
            print(f"server stderr:\n{(tmp_path / 'stderr.txt').read_text()}", file=sys.stderr)
            raise
        finally:
            proc.terminate()  # SIGTERM: the example closes its pipeline and prints a summary
            with anyio.fail_after(30):
                await proc.wait()
                assert proc.stdout is not None
                with contextlib.suppress(anyio.EndOfStream):
                    while True:
                        output += await proc.stdout.receive()
    assert proc.returncode == 0, output
    assert b"stopped: " in output and b'"verify_failures": 0' in output, output
    # -- answers ------------------------------------------------------------------------
    assert len(answers) == CLIENTS * PER_CLIENT
    for a in answers:
        b = a.body
        assert b["verified"] is True, b
        assert b["reused"] + b["computed"] == b["blocks"] and b["reused"] <= b["full_blocks"]
        assert b["write_complete"] and b["skipped"] + b["written"] == b["full_blocks"], b
        # Once a request with the same system prompt has finished (its write returned), the
        # prompt is stored: every later request of that prefix reloads it at least.
        if any(o.prefix == a.prefix and o.finished < a.started for o in answers):
            assert b["reused"] >= PREFIX_BLOCKS[a.prefix], (a, b)
    later = [
        a for a in answers if any(o.finished < a.started and o.prefix == a.prefix for o in answers)
    ]
    assert len(later) >= CLIENTS * (PER_CLIENT - 1)  # each client's 2nd.. request at least
    reused = sum(a.body["reused"] for a in answers)
    assert reused > 0
    assert health["requests"] == len(answers) and health["verify_failures"] == 0
    assert health["reused"] == reused
    # -- metrics, against the answers ---------------------------------------------------
    m = metric_values(page.decode())
    total = ("", "")
    assert m["kvpipe_blocks_written_total"][total] == sum(a.body["written"] for a in answers)
    assert m["kvpipe_blocks_skipped_total"][total] == sum(a.body["skipped"] for a in answers)
    assert m["kvpipe_blocks_read_total"][total] == reused
    requests = m["kvpipe_request_seconds_count"]
    assert requests[("write", "complete")] == len(answers)
    assert requests[("lookup", "ok")] == len(answers)
    reads = sum(n for (op, _), n in requests.items() if op == "read")
    assert reads == sum(a.body["lookup"] > 0 for a in answers) > 0
    evicted = health.get("evicted_requests", 0)
    assert requests[("flush", "ok")] == len(answers) + evicted
    full = sum(a.body["full_blocks"] for a in answers)
    assert m["kvpipe_blocks_flushed_total"][total] == full + health.get("evicted_blocks", 0)
    assert evicted > 0, "the small cache should have evicted finished requests"
    assert sum(m["kvpipe_slices_total"].values()) == sum(m["kvpipe_slice_seconds_count"].values())
    assert m["kvpipe_restarts_total"][total] == 0
    assert m["embedded_loop_lag_seconds_count"][total] > 0
    # -- event-loop lag: report, and only a generous bound --------------------------------
    lag = health["lag"]
    print(f"\nembedded server ({store} store) event-loop lag under 8 clients: {lag}")
    assert lag["samples"] > 10  # the ticker ran during the load
    assert lag["p99_ms"] < 100, lag


async def test_embedded_server_runs_without_prometheus_client(tmp_path: Path) -> None:
    """With only the base dependencies (what ``make run`` installs), the server serves and
    verifies requests; /metrics answers 503 with the command that installs what it needs."""
    with (tmp_path / "stderr.txt").open("wb") as errors:
        proc, port = await start_server(errors, metrics=False)
    async with proc:
        try:
            with anyio.fail_after(60):
                body = json.dumps({"tokens": prompt(0, 0, 0)}).encode()
                for reused in (False, True):
                    status, payload = await http(port, "POST", "/generate", body)
                    assert status == 200, payload
                    answer = json.loads(payload)
                    assert answer["verified"] and (answer["reused"] > 0) == reused, answer
                status, page = await http(port, "GET", "/metrics")
        finally:
            proc.terminate()
            with anyio.fail_after(30):
                await proc.wait()
    assert status == 503 and b"pip install 'kvpipe[metrics]'" in page, page
    assert proc.returncode == 0
    assert "/metrics is off" in (tmp_path / "stderr.txt").read_text()


def _example_module() -> Any:
    """examples/embedded_server.py imported in this process (its classes, not its server)."""
    spec = importlib.util.spec_from_file_location("embedded_server_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_a_request_refused_by_a_closed_pipeline_gives_its_blocks_back() -> None:
    """Once the pipeline is closed (it escalated after repeated crashes, or is shutting
    down), every request is refused with ``PipelineClosed`` (503), including one whose
    allocation evicted finished requests and then failed to record the eviction in the
    index: the blocks it took go back to the free list, so the cache's accounting holds
    and later requests keep getting a 503 rather than failing the admission invariant."""
    example = _example_module()
    cache = kvpipe.create_kv_cache(example.LAYOUT, example.NUM_BLOCKS)
    config = kvpipe.PipelineConfig(staging_bytes=8 << 20)
    async with kvpipe.MemoryStore() as store:
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            engine = example.Engine(pipe)
            r = 0
            while len(engine.free) >= example.MAX_BLOCKS:  # fill the cache
                await engine.generate(np.arange(r * 10**6, r * 10**6 + example.MAX_BLOCKS * BS))
                r += 1

        def held() -> int:
            return len(engine.free) + sum(len(ids) for _, ids in engine.resident.values())

        assert held() == example.NUM_BLOCKS
        for r in range(example.NUM_BLOCKS // example.MAX_BLOCKS + 2):
            with pytest.raises(kvpipe.PipelineClosed):
                await engine.generate(np.arange(r, r + example.MAX_BLOCKS * BS))
            assert held() == example.NUM_BLOCKS, r


async def test_evicting_a_request_keeps_the_prefix_another_resident_request_holds() -> None:
    """Two finished requests share a 3-block system prompt, each holding its own copy in the
    cache; evicting the older one records only its own blocks as evicted: the residency
    index still says this node holds the shared prompt on the GPU (the newer request's
    copy), and the evicted request's own blocks are recorded as evicted."""
    example = _example_module()
    cache = kvpipe.create_kv_cache(example.LAYOUT, example.NUM_BLOCKS)
    config = kvpipe.PipelineConfig(staging_bytes=8 << 20, node_id="node-a")
    system = np.arange(3 * BS)
    older = np.concatenate([system, np.arange(10**6, 10**6 + 2 * BS)])
    newer = np.concatenate([system, np.arange(2 * 10**6, 2 * 10**6 + 2 * BS)])
    async with kvpipe.MemoryStore() as store:
        async with kvpipe.open_pipeline(cache, store, config=config) as pipe:
            engine = example.Engine(pipe)
            await engine.generate(older)
            await engine.generate(newer)
            engine.free.extend(await engine.alloc(len(engine.free) + 1))  # evicts `older`
            assert engine.totals["evicted_requests"] == 1
            assert [len(ids) for _, ids in engine.resident.values()] == [5]  # `newer`
            held = [loc.held_by("node-a") for loc in await pipe.locate(newer)]
            gone = [loc.held_by("node-a") for loc in await pipe.locate(older)]
    assert held == [kvpipe.Residency.GPU] * 5, held
    assert gone == [kvpipe.Residency.GPU] * 3 + [kvpipe.Residency.EVICTED] * 2, gone


async def test_health_computes_the_lag_percentiles_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``GET /health`` summarizes up to 600,000 lag samples (tens of ms of numpy work with a
    full window): done on the event loop, each probe would add the very lag it reports. The
    percentiles are computed in a worker thread, and the answer is the same summary."""
    example = _example_module()
    lag = example.LagMeter(None)
    samples = np.random.default_rng(3).exponential(0.0004, 5_000)
    for s in samples:
        lag.samples.append(float(s))
    computed_on: list[int] = []
    percentile = np.percentile

    def recording_percentile(*args: Any, **kwargs: Any) -> Any:
        computed_on.append(threading.get_ident())
        return percentile(*args, **kwargs)

    monkeypatch.setattr(example.np, "percentile", recording_percentile)
    engine = SimpleNamespace(pipe=SimpleNamespace(closed=False), totals={}, free=[])
    app = example.Server(engine, None, lag)
    reader = asyncio.StreamReader()
    reader.feed_data(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    reader.feed_eof()
    status, _, body = await app._respond(reader)
    assert status == "200 OK"
    assert computed_on and threading.get_ident() not in computed_on, computed_on
    p50, p99 = percentile(samples, [50, 99])
    assert json.loads(body)["lag"] == {
        "samples": 5_000,
        "p50_ms": round(float(p50) * 1e3, 3),
        "p99_ms": round(float(p99) * 1e3, 3),
        "max_ms": round(float(samples.max()) * 1e3, 3),
    }


async def test_the_lag_window_keeps_the_latest_samples_and_reset_empties_it() -> None:
    """The ring of lag samples: once full, each new sample replaces the oldest; a reset
    (``POST /lag/reset``) starts an empty window, summarized as zeros."""
    example = _example_module()
    lag = example.LagMeter(None, window=10)
    for ms in range(25):
        lag.samples.append(ms / 1e3)
    held = sorted(lag.samples.snapshot() * 1e3)
    assert len(lag.samples) == 10 and held == pytest.approx(list(range(15, 25))), held
    assert (await lag.summary())["max_ms"] == 24.0
    lag.samples.clear()
    assert await lag.summary() == {"samples": 0, "p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
    lag.samples.append(0.002)
    assert await lag.summary() == {"samples": 1, "p50_ms": 2.0, "p99_ms": 2.0, "max_ms": 2.0}
