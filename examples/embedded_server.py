"""An asyncio HTTP server with kvpipe embedded, playing an inference engine's request lifecycle.

A plain ``asyncio.start_server`` server on 127.0.0.1 (standard library and anyio only; kvpipe
runs in the server's own event loop). For each ``POST /generate`` with a prompt:

1. its blocks are allocated from the small "GPU" cache (a free list; when it runs short, the
   least recently finished requests are evicted, and their blocks recorded as evicted in the
   residency index: ``flush_index(..., residency=Residency.EVICTED)``, from the first block
   no resident request still holds a copy of, such as a shared system prompt's);
2. its stored prefix is looked up (``lookup``) and reloaded (``read``) into the new blocks,
   and every reloaded byte is checked against what prefill computes for those tokens;
3. "prefill" computes the rest: blocks of bytes derived from the tokens (a hash chain over
   the blocks, as real KV depends on every token before it), so any result can be checked;
4. the finished request is offloaded (``write``) and recorded as resident on this node
   (``flush_index``); its blocks stay in the cache until evicted.

The answer says how many blocks were reused from storage and how many computed. Endpoints:

- ``POST /generate`` ``{"tokens": [int, ...]}`` → ``{"blocks", "reused", "computed",
  "verified", "lookup", "written", "skipped", ...}``
- ``GET /metrics`` — kvpipe's :class:`kvpipe.PipelineMetrics` registry, plus the server's
  own event-loop lag histogram registered in the same registry (needs ``prometheus_client``:
  ``pip install 'kvpipe[metrics]'``; without it the server runs and ``/metrics`` answers 503
  with that command)
- ``GET /health`` — status, totals, and the event-loop lag (p50/p99/max) since start or since
  the last ``POST /lag/reset``. A ticker task measures its own lateness every millisecond.

Run it and send it a request::

    python examples/embedded_server.py --port 8000
    curl -s -d '{"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}' \\
        http://127.0.0.1:8000/generate

It prints ``listening on http://127.0.0.1:PORT`` when ready (``--port 0``: any free port) and
a summary line when stopped (Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import signal
import sys
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

import kvpipe

try:
    import prometheus_client
except ImportError:  # /metrics is off; everything else runs without it
    prometheus_client = None

METRICS_INSTALL = "pip install 'kvpipe[metrics]'"

LAYOUT = kvpipe.CacheLayout.gqa(
    num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16"
)  # 32 KiB blocks
#: The "GPU" cache: small, so finished requests get evicted.
NUM_BLOCKS = 256
#: Requests prefilled at once, and the longest prompt (blocks): together they always fit.
MAX_ACTIVE, MAX_BLOCKS = 8, 24
#: Simulated prefill time per computed block (the model runs off the event loop).
PREFILL_SECONDS_PER_BLOCK = 0.0005
TICK = 0.001
MAX_BODY = 1 << 20

IdArray = npt.NDArray[np.int64]


def block_contents(tokens: npt.NDArray[np.int64], count: int) -> list[bytes]:
    """What prefill computes for blocks ``0 .. count-1``: ``block_nbytes`` bytes each, drawn
    from a seed that chains every token up to the end of the block."""
    bs, out, chain = LAYOUT.block_size, [], b""
    for i in range(count):
        chain = hashlib.blake2b(chain + tokens[i * bs : (i + 1) * bs].tobytes()).digest()
        rng = np.random.default_rng(int.from_bytes(chain[:16], "little"))
        out.append(rng.bytes(LAYOUT.block_nbytes))
    return out


def shared_blocks(a: npt.NDArray[np.int64], b: npt.NDArray[np.int64]) -> int:
    """How many leading full blocks two sequences share (their keys then match too)."""
    bs = LAYOUT.block_size
    full = min(len(a), len(b)) // bs
    differ = np.flatnonzero(a[: full * bs] != b[: full * bs])
    return full if differ.size == 0 else int(differ[0]) // bs


class Engine:
    """The cache, its free list, the resident requests, and the request lifecycle."""

    def __init__(self, pipe: kvpipe.Pipeline) -> None:
        self.pipe = pipe
        self.rows = pipe.cache.byte_rows  # uint8 [NUM_BLOCKS, bytes] per tensor
        self.free: list[int] = list(range(NUM_BLOCKS))
        self.resident: collections.OrderedDict[int, tuple[npt.NDArray[np.int64], IdArray]] = (
            collections.OrderedDict()
        )
        self.admission = anyio.Semaphore(MAX_ACTIVE)
        self.totals = collections.Counter[str]()

    # -- blocks ------------------------------------------------------------------------------

    async def alloc(self, n: int) -> IdArray:
        """Take ``n`` free blocks, evicting finished requests (oldest first) when short."""
        evicted = []
        while len(self.free) < n:
            assert self.resident, "admission keeps active requests within the cache"
            _, (tokens, ids) = self.resident.popitem(last=False)
            self.free.extend(int(b) for b in ids)
            evicted.append(tokens)
        ids = np.array(self.free[:n], dtype=np.int64)
        del self.free[:n]
        try:
            for tokens in evicted:  # the blocks are gone from this node's cache: say so
                # ... all but the leading ones a resident request still holds a copy of
                kept = max((shared_blocks(tokens, t) for t, _ in self.resident.values()), default=0)
                blocks = 0
                if kept < len(tokens) // LAYOUT.block_size:
                    blocks = await self.flush(tokens, kvpipe.Residency.EVICTED, start_block=kept)
                self.totals["evicted_requests"] += 1
                self.totals["evicted_blocks"] += blocks
        except BaseException:  # PipelineClosed, or cancelled: the caller never gets them
            self.free.extend(int(b) for b in ids)
            raise
        return ids

    async def flush(
        self, tokens: npt.NDArray[np.int64], residency: kvpipe.Residency, start_block: int = 0
    ) -> int:
        """Record where this node holds a sequence's blocks (from ``start_block``); a failure
        only costs accuracy of the index, so it is counted, not raised."""
        try:
            return await self.pipe.flush_index(tokens, start_block=start_block, residency=residency)
        except (kvpipe.OperationTimeout, kvpipe.BackendError, kvpipe.ActorCrashed):
            self.totals["flush_errors"] += 1
            return 0

    def fill(self, ids: IdArray, contents: Sequence[bytes], first: int) -> None:
        """Prefill: write blocks ``first ..`` (a worker thread: not on the event loop)."""
        for i in range(first, len(ids)):
            data, offset = np.frombuffer(contents[i], np.uint8), 0
            for rows in self.rows:  # the block's part of each (role, layer) tensor
                rows[ids[i]] = data[offset : offset + rows.shape[1]]
                offset += rows.shape[1]

    def matches(self, ids: IdArray, contents: Sequence[bytes]) -> bool:
        """Whether blocks ``ids`` hold ``contents`` byte for byte (a worker thread)."""
        for block, expected in zip(ids, contents, strict=True):
            got = b"".join(rows[block].tobytes() for rows in self.rows)
            if got != expected:
                return False
        return True

    # -- the lifecycle -----------------------------------------------------------------------

    async def generate(self, tokens: npt.NDArray[np.int64]) -> dict[str, Any]:
        bs = LAYOUT.block_size
        n, full = -(-len(tokens) // bs), len(tokens) // bs
        async with self.admission:
            ids = await self.alloc(n)
            kept = False
            try:
                try:
                    hit = await self.pipe.lookup(tokens)
                except (kvpipe.OperationTimeout, kvpipe.BackendError, kvpipe.ActorCrashed):
                    hit = 0  # serve without the stored prefix
                loaded = (await self.pipe.read(tokens, ids)).loaded if hit else 0
                contents = await anyio.to_thread.run_sync(block_contents, tokens, n)
                verified = await anyio.to_thread.run_sync(
                    self.matches, ids[:loaded], contents[:loaded]
                )
                await anyio.to_thread.run_sync(self.fill, ids, contents, loaded)
                await anyio.sleep(PREFILL_SECONDS_PER_BLOCK * (n - loaded))
                w = await self.pipe.write(tokens, ids)  # full blocks; must not free before
                await self.flush(tokens, kvpipe.Residency.GPU)
                self.totals["requests"] += 1
                self.resident[self.totals["requests"]] = (tokens, ids)
                kept = True
            finally:
                if not kept:
                    self.free.extend(int(b) for b in ids)
        self.totals.update(reused=loaded, computed=n - loaded, verify_failures=int(not verified))
        return {
            "blocks": n,
            "full_blocks": full,
            "lookup": hit,
            "reused": loaded,
            "computed": n - loaded,
            "verified": verified,
            "written": w.written,
            "skipped": w.skipped,
            "write_complete": w.complete,
        }


class LagWindow:
    """The last ``size`` lag samples (seconds), in a preallocated ring: appending costs one
    store, and :meth:`snapshot` one memory copy, so the event loop never walks the samples."""

    def __init__(self, size: int) -> None:
        self._ring = np.zeros(size, dtype=np.float64)
        self._count = self._next = 0

    def __len__(self) -> int:
        return self._count

    def append(self, lag: float) -> None:
        self._ring[self._next] = lag
        self._next = (self._next + 1) % len(self._ring)
        self._count = min(self._count + 1, len(self._ring))

    def clear(self) -> None:
        self._count = self._next = 0

    def snapshot(self) -> npt.NDArray[np.float64]:
        """A copy of the samples held, in no particular order (enough for percentiles)."""
        return self._ring[: self._count].copy()


def summarize(data: npt.NDArray[np.float64]) -> dict[str, float]:
    """p50, p99 and max of lag samples, in ms (a worker thread: it sorts up to 600,000)."""
    values = data if data.size else np.zeros(1)
    p50, p99 = np.percentile(values, [50, 99])
    return {
        "samples": int(data.size),
        "p50_ms": round(float(p50) * 1e3, 3),
        "p99_ms": round(float(p99) * 1e3, 3),
        "max_ms": round(float(values.max()) * 1e3, 3),
    }


class LagMeter:
    """A ticker's lateness: how much later than asked its 1 ms sleeps wake up."""

    def __init__(self, metrics: kvpipe.PipelineMetrics | None, window: int = 600_000) -> None:
        self.samples = LagWindow(window)
        self.histogram = (
            None
            if metrics is None
            else prometheus_client.Histogram(
                "embedded_loop_lag_seconds",
                "How late the server's 1 ms ticker woke up.",
                buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
                registry=metrics.registry,  # next to kvpipe's metrics, on the same page
            )
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(TICK)
            lag = max(0.0, loop.time() - started - TICK)
            self.samples.append(lag)
            if self.histogram is not None:
                self.histogram.observe(lag)

    async def summary(self) -> dict[str, float]:
        """The samples copied on the loop (~1 ms for a full window), summarized in a worker
        thread: computing the percentiles here would add the very lag they report."""
        return await anyio.to_thread.run_sync(summarize, self.samples.snapshot())


class Server:
    """The HTTP/1.1 front: one request per connection."""

    def __init__(
        self, engine: Engine, metrics: kvpipe.PipelineMetrics | None, lag: LagMeter
    ) -> None:
        self.engine, self.metrics, self.lag = engine, metrics, lag

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            status, ctype, body = await self._respond(reader)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        except Exception as exc:  # never leave a client without an answer
            status, ctype, body = "500 Internal Server Error", "text/plain", f"{exc!r}\n".encode()
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
            writer.close()
            await writer.wait_closed()
        except OSError:
            pass  # the client left

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target = [*request_line.split(" "), "", ""][:2]
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)
        }
        length = int(headers.get("content-length") or 0)
        if length > MAX_BODY:
            return "413 Content Too Large", "text/plain", b"body too large\n"
        body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
        path = target.split("?")[0]
        if (method, path) == ("GET", "/metrics"):
            if self.metrics is None:
                note = f"metrics are off: prometheus_client is not installed ({METRICS_INSTALL})\n"
                return "503 Service Unavailable", "text/plain", note.encode()
            page, ctype = self.metrics.exposition()
            return "200 OK", ctype, page
        if (method, path) == ("GET", "/health"):
            return self._json(await self.health())
        if (method, path) == ("POST", "/lag/reset"):
            self.lag.samples.clear()
            return self._json({"reset": True})
        if (method, path) == ("POST", "/generate"):
            tokens = self._tokens(body)
            if tokens is None:
                return self._json(
                    {"error": f"tokens: 1..{MAX_BLOCKS * 16} ints"}, "400 Bad Request"
                )
            try:
                return self._json(await self.engine.generate(tokens))
            except kvpipe.PipelineClosed:
                return self._json({"error": "kv offload unavailable"}, "503 Service Unavailable")
        return self._json({"error": "not found"}, "404 Not Found")

    @staticmethod
    def _tokens(body: bytes) -> npt.NDArray[np.int64] | None:
        try:
            raw = json.loads(body)["tokens"]
        except (ValueError, KeyError, TypeError):
            return None
        ok = isinstance(raw, list) and 0 < len(raw) <= MAX_BLOCKS * LAYOUT.block_size
        if not ok or not all(isinstance(t, int) and 0 <= t < 2**31 for t in raw):
            return None
        return np.array(raw, dtype=np.int64)

    @staticmethod
    def _json(value: Any, status: str = "200 OK") -> tuple[str, str, bytes]:
        return status, "application/json", json.dumps(value).encode() + b"\n"

    async def health(self) -> dict[str, Any]:
        engine = self.engine
        answer = {
            "status": "ok" if not engine.pipe.closed else "closed",
            **dict(engine.totals),
            "resident_blocks": NUM_BLOCKS - len(engine.free),
            "free_blocks": len(engine.free),
        }
        return {**answer, "lag": await self.lag.summary()}


async def serve(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    config = kvpipe.PipelineConfig(slice_block_num=8, staging_bytes=32 << 20)
    cache = kvpipe.create_kv_cache(LAYOUT, NUM_BLOCKS)
    store: kvpipe.StorageBackend = (
        kvpipe.FileStore(args.dir, durability="none") if args.dir else kvpipe.MemoryStore()
    )
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(store)
        pipe = await stack.enter_async_context(
            kvpipe.open_pipeline(cache, store, config=config, namespace="embedded")
        )
        metrics = kvpipe.PipelineMetrics(pipe) if prometheus_client is not None else None
        if metrics is None:
            note = f"/metrics is off: prometheus_client is not installed ({METRICS_INSTALL})"
            print(note, file=sys.stderr)
        lag = LagMeter(metrics)
        app = Server(Engine(pipe), metrics, lag)
        server = await asyncio.start_server(app.handle, "127.0.0.1", args.port)
        port = server.sockets[0].getsockname()[1]
        print(f"listening on http://127.0.0.1:{port}", flush=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lag.run)
            await stop.wait()
            server.close()
            await server.wait_closed()
            tg.cancel_scope.cancel()
        health = await app.health()
    print("stopped:", json.dumps(health), flush=True)
    return 1 if health.get("verify_failures") else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (0: any)")
    parser.add_argument("--dir", help="store blocks in a file store here (default: memory)")
    return asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
