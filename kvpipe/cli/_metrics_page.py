"""``--metrics-port``: serve a run's Prometheus metrics on 127.0.0.1 while it runs.

A command that takes the flag (``kvpipe demo``) wraps its run in :func:`metrics_page` and
:meth:`~kvpipe.PipelineMetrics.add` s every pipeline it opens, under a label of its choice.
The page is served from the run's own event loop (a tiny HTTP/1.1 responder on an anyio TCP
listener), so a scrape reads the statistics in the loop's thread, between two steps of the
run. ``GET /metrics`` answers the Prometheus text format; anything else is a 404.

``--metrics-linger S`` keeps the page up for S seconds after the run, so that the final
numbers of a short run can still be scraped or looked at.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio
import anyio.abc

import kvpipe

from . import _console as ui

__all__ = ("HOST", "add_arguments", "metrics_page", "serve_metrics")

#: The page is only ever served on the loopback interface.
HOST: Final = "127.0.0.1"
_MAX_HEAD: Final = 16 * 1024
_READ_TIMEOUT: Final = 5.0
_TEXT: Final = "text/plain; charset=utf-8"
log = logging.getLogger("kvpipe.cli.metrics")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--metrics-port`` and ``--metrics-linger`` to a command's parser."""
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help=f"serve Prometheus metrics of the run at http://{HOST}:PORT/metrics "
        "(0: any free port, printed on stderr; needs kvpipe[metrics])",
    )
    parser.add_argument(
        "--metrics-linger",
        type=float,
        default=0.0,
        metavar="S",
        help="with --metrics-port: keep serving for S seconds after the run",
    )


def _response(status: str, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


async def _answer(metrics: kvpipe.PipelineMetrics, stream: anyio.abc.ByteStream) -> None:
    """Read one request head and answer it; the connection is closed afterwards."""
    async with stream:
        head = b""
        with anyio.move_on_after(_READ_TIMEOUT):
            while b"\r\n\r\n" not in head and len(head) < _MAX_HEAD:
                try:
                    head += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    return
        parts = head.split(b"\r\n", 1)[0].split()
        method, path = (parts[0], parts[1].split(b"?")[0]) if len(parts) >= 2 else (b"", b"")
        if method in (b"GET", b"HEAD") and path == b"/metrics":
            try:
                body, content_type = metrics.exposition()
                reply = _response("200 OK", body, content_type)
            except Exception as exc:  # a scrape must never end the run it watches
                log.exception("metrics page failed")
                reply = _response("500 Internal Server Error", f"{exc!r}\n".encode(), _TEXT)
        else:
            reply = _response("404 Not Found", b"see /metrics\n", _TEXT)
        if method == b"HEAD":
            reply = reply.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        try:
            await stream.send(reply)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass


async def serve_metrics(
    metrics: kvpipe.PipelineMetrics,
    port: int,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``metrics`` at ``http://127.0.0.1:port/metrics`` until cancelled.

    Reports the bound port through ``task_status`` (``tg.start``), which is how port 0 gets
    its number.

    Raises:
        OSError: The port cannot be bound (taken, or not allowed).
    """
    listener = await anyio.create_tcp_listener(local_host=HOST, local_port=port)
    async with listener:
        bound = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        task_status.started(bound)

        async def handle(stream: anyio.abc.SocketStream) -> None:
            try:
                await _answer(metrics, stream)
            except Exception:  # one bad connection must not end the server, or the run
                log.exception("metrics page: a connection failed")

        await listener.serve(handle)


@asynccontextmanager
async def metrics_page(
    args: argparse.Namespace, io: ui.CommandIO
) -> AsyncIterator[kvpipe.PipelineMetrics | None]:
    """The run's :class:`kvpipe.PipelineMetrics`, served on ``--metrics-port`` while the
    block runs (and ``--metrics-linger`` seconds after); ``None`` without the flag.

    Raises:
        kvpipe.Unsupported: ``prometheus_client`` is not installed.
        ui.UsageError: A bad port or linger, or the port cannot be bound.
    """
    port: int | None = args.metrics_port
    if port is None:
        yield None
        return
    if not 0 <= port <= 65535:
        raise ui.UsageError(f"--metrics-port must be in [0, 65535], got {port}")
    if not args.metrics_linger >= 0:
        raise ui.UsageError(f"--metrics-linger must be >= 0, got {args.metrics_linger}")
    metrics = kvpipe.PipelineMetrics()
    async with anyio.create_task_group() as tg:
        try:
            bound = await tg.start(serve_metrics, metrics, port)
        except OSError as exc:
            raise ui.UsageError(f"--metrics-port {port}: cannot listen on {HOST}: {exc}") from exc
        io.err.print(f"metrics: http://{HOST}:{bound}/metrics", highlight=False)
        try:
            yield metrics
            if args.metrics_linger > 0:
                io.err.print(
                    f"metrics: serving for {args.metrics_linger:g} s more", highlight=False
                )
                await anyio.sleep(args.metrics_linger)
        finally:
            tg.cancel_scope.cancel()
