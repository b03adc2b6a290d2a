"""``--metrics-port``: serve a run's Prometheus metrics on 127.0.0.1 while it runs.

A command that takes the flag (``kvpipe demo``) wraps its run in :func:`metrics_page` and
:meth:`~kvpipe.PipelineMetrics.add` s every pipeline it opens, under a label of its choice.
The page is prometheus-client's own HTTP server (``start_http_server``, in a daemon thread of
its own) over the run's registry: a scrape reads the pipelines' statistics from that thread,
which :meth:`kvpipe.Pipeline.statistics` allows (it only reads).

``--metrics-linger S`` keeps the page up for S seconds after the run, so that the final
numbers of a short run can still be scraped or looked at.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import anyio
import anyio.to_thread

import kvpipe

from . import _console as ui

__all__ = ("HOST", "add_arguments", "metrics_page")

#: The page is only ever served on the loopback interface.
HOST: Final = "127.0.0.1"


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


@asynccontextmanager
async def metrics_page(
    args: argparse.Namespace, io: ui.CommandIO
) -> AsyncIterator[kvpipe.PipelineMetrics | None]:
    """The run's :class:`kvpipe.PipelineMetrics`, served on ``--metrics-port`` while the
    block runs (and ``--metrics-linger`` seconds after); ``None`` without the flag.

    Cancellation: the server is stopped on the way out whatever ends the block (stopping it
    waits up to its poll interval, half a second, in a worker thread, shielded).

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
    metrics = kvpipe.PipelineMetrics()  # Unsupported without prometheus_client
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=HOST, registry=metrics.registry)
    except OSError as exc:
        raise ui.UsageError(f"--metrics-port {port}: cannot listen on {HOST}: {exc}") from exc
    io.err.print(f"metrics: http://{HOST}:{server.server_port}/metrics", highlight=False)
    try:
        yield metrics
        if args.metrics_linger > 0:
            io.err.print(f"metrics: serving for {args.metrics_linger:g} s more", highlight=False)
            await anyio.sleep(args.metrics_linger)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(server.shutdown)
            server.server_close()
            await anyio.to_thread.run_sync(thread.join)
