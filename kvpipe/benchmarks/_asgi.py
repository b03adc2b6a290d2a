"""The server half of the ``server`` scenario: a minimal ASGI app served by uvicorn on the
caller's own event loop, and the load generator (:mod:`._http_client`) as another process.

uvicorn is an optional dependency (the ``bench`` extra); :func:`require_uvicorn` says so when
it is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, final

import anyio
import numpy as np
import numpy.typing as npt

__all__ = ("Load", "LoadResult", "Served", "http_parser", "require_uvicorn", "serve_app")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

CLIENT = Path(__file__).with_name("_http_client.py")


class UvicornUnavailable(RuntimeError):
    """uvicorn is not installed."""


def require_uvicorn() -> None:
    """Raises :class:`UvicornUnavailable` (with the extra to install) when uvicorn is missing."""
    if find_spec("uvicorn") is None:
        raise UvicornUnavailable(
            "the server scenario needs uvicorn: install the 'bench' extra "
            "(pip install 'kvpipe[bench]')"
        )


def http_parser() -> str:
    """The HTTP parser uvicorn picks (``auto``): httptools when installed, else h11."""
    return "httptools" if find_spec("httptools") is not None else "h11"


@final
class Served:
    """A plain ASGI app: ``200 ok`` to every HTTP request; counts them; handles lifespan."""

    def __init__(self) -> None:
        self.requests = 0
        self.lifespan: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].removeprefix("lifespan.")
                self.lifespan.append(kind)
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        if scope["type"] != "http":
            return
        self.requests += 1
        headers = [(b"content-type", b"text/plain"), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})


@asynccontextmanager
async def serve_app(app: Served) -> AsyncIterator[int]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port, yielded) on the running asyncio
    loop until the block exits; then shut uvicorn down (lifespan included).

    Raises:
        UvicornUnavailable: uvicorn is not installed.
        RuntimeError: Not on asyncio, or the server did not start within 10 s.
    """
    require_uvicorn()
    import uvicorn

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("the server scenario runs on asyncio (uvicorn)") from None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="auto",
        ws="none",
        lifespan="on",
        log_config=None,
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            with anyio.fail_after(10):
                while not server.started:
                    if server.should_exit:
                        raise RuntimeError("uvicorn did not start")
                    await anyio.sleep(0.01)
            try:
                yield port
            finally:
                server.should_exit = True
    finally:
        sock.close()


@final
@dataclass
class LoadResult:
    """What the load generator saw: per answered request its scheduled send time and its
    latency (seconds, ``time.monotonic()``), and its summary line."""

    scheduled: npt.NDArray[np.float64]
    latency: npt.NDArray[np.float64]
    summary: dict[str, int] = field(default_factory=dict)

    def between(self, start: float, end: float) -> npt.NDArray[np.float64]:
        """Latencies of the requests scheduled in ``[start, end)``."""
        mask = (self.scheduled >= start) & (self.scheduled < end)
        return self.latency[mask]


@final
class Load:
    """The load generator as a child process: ``async with Load(port, ...) as load:`` starts
    it and waits until it is connected; leaving the block closes its standard input (its
    signal to stop), waits for it and reads its latencies into :attr:`result`.

    Only answered requests have a latency, so a run where any request failed (an error
    answer, a broken connection, a request left unanswered) raises ``RuntimeError`` on
    leaving the block instead of yielding the latencies of the rest."""

    def __init__(self, port: int, rate: float, connections: int, max_seconds: float) -> None:
        self.argv = [
            sys.executable,
            str(CLIENT),
            "--port",
            str(port),
            "--rate",
            str(rate),
            "--connections",
            str(connections),
            "--max-seconds",
            str(max_seconds),
        ]
        self.result: LoadResult | None = None

    async def __aenter__(self) -> Load:
        """Start the client and wait for its ``ready`` line.

        Raises:
            RuntimeError: The client exited, said something else, or said nothing within
                30 s (it is stopped and its directory removed).
        """
        self._dir = tempfile.mkdtemp(prefix="kvpipe-bench-http-")
        self._out = os.path.join(self._dir, "latencies.f64")
        try:
            self._proc = await anyio.open_process(
                [*self.argv, "--out", self._out],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,
            )
        except BaseException:
            await anyio.to_thread.run_sync(_rmtree, self._dir)
            raise
        try:
            line = await self._first_line()
        except BaseException:
            await self._kill()
            raise
        if not line.startswith(b"ready"):
            await self._kill()
            raise RuntimeError(f"HTTP load generator did not start: {line!r}")
        return self

    async def _first_line(self) -> bytes:
        """The client's first line of output.

        Raises:
            RuntimeError: It exited first (its error went to standard error), or wrote no
                line within 30 s.
        """
        stdout = self._proc.stdout
        assert stdout is not None
        line = b""
        try:
            with anyio.fail_after(30):
                while b"\n" not in line:
                    line += await stdout.receive()
        except anyio.EndOfStream:
            raise RuntimeError(
                f"HTTP load generator did not start: it exited before it was ready "
                f"(output {line!r}; its error, if any, went to standard error)"
            ) from None
        except TimeoutError:
            raise RuntimeError(
                f"HTTP load generator did not start: not ready within 30 s (output {line!r})"
            ) from None
        return line

    async def _kill(self) -> None:
        try:
            self._proc.kill()
        except ProcessLookupError:  # it has exited already
            pass
        with anyio.CancelScope(shield=True):
            await self._proc.wait()
            await self._proc.aclose()
        await anyio.to_thread.run_sync(_rmtree, self._dir)

    async def __aexit__(self, *exc: object) -> None:
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        try:
            await proc.stdin.aclose()
            chunks = []
            with anyio.fail_after(30):
                async for chunk in proc.stdout:
                    chunks.append(chunk)
                rc = await proc.wait()
        except BaseException:
            await self._kill()
            raise
        if rc != 0:
            await self._kill()
            raise RuntimeError(f"HTTP load generator exited with {rc}")
        summary = json.loads(b"".join(chunks).decode().strip().splitlines()[-1])
        pairs = np.fromfile(self._out, dtype=np.float64).reshape(-1, 2)
        self.result = LoadResult(pairs[:, 0].copy(), pairs[:, 1].copy(), summary)
        await proc.aclose()
        await anyio.to_thread.run_sync(_rmtree, self._dir)
        failed = summary["sent"] - summary["answered"]
        if exc[0] is None and (failed or summary["errors"] or summary["unanswered_at_exit"]):
            raise RuntimeError(f"HTTP load generator: requests failed or unanswered: {summary}")


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
