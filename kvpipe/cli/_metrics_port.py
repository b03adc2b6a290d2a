"""``--metrics-port``: serve a run's Prometheus metrics on 127.0.0.1 while it runs.

A command that takes the flag (``kvpipe demo``) wraps its run in :func:`metrics_page` and
:meth:`~kvpipe.PipelineMetrics.add` s every pipeline it opens, under a label of its choice.
The page is prometheus-client's own HTTP server (``start_http_server``, in a daemon thread of
its own) over the run's registry: a scrape reads the pipelines' statistics from that thread,
which :meth:`kvpipe.Pipeline.statistics` allows (it only reads).

``--metrics-linger S`` keeps the page up for S seconds after the run, so that the final
numbers of a short run can still be scraped or looked at; given without ``--metrics-port``
it is a usage error (exit 2), not silently ignored.
"""

from __future__ import annotations

import argparse
import math
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
        default=None,
        metavar="S",
        help="with --metrics-port: keep serving for S seconds after the run (default: 0; "
        "without --metrics-port it is a usage error)",
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
        ui.UsageError: A bad port or linger, ``--metrics-linger`` without
            ``--metrics-port``, or the port cannot be bound.
    """
    port: int | None = args.metrics_port
    linger: float = 0.0 if args.metrics_linger is None else args.metrics_linger
    if port is None:
        if args.metrics_linger is not None:  # it would do nothing: say so, do not ignore it
            raise ui.UsageError("--metrics-linger needs --metrics-port (nothing is served)")
        yield None
        return
    if not 0 <= port <= 65535:
        raise ui.UsageError(f"--metrics-port must be in [0, 65535], got {port}")
    if not (math.isfinite(linger) and linger >= 0):  # inf: it would serve forever
        raise ui.UsageError(f"--metrics-linger must be a finite number >= 0, got {linger}")
    metrics = kvpipe.PipelineMetrics()  # Unsupported without prometheus_client
    from prometheus_client import start_http_server

    try:
        server, thread = start_http_server(port, addr=HOST, registry=metrics.registry)
    except OSError as exc:
        raise ui.UsageError(f"--metrics-port {port}: cannot listen on {HOST}: {exc}") from exc
    io.err.print(f"metrics: http://{HOST}:{server.server_port}/metrics", highlight=False)
    try:
        yield metrics
        if linger > 0:
            io.err.print(f"metrics: serving for {linger:g} s more", highlight=False)
            await anyio.sleep(linger)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(server.shutdown)
            server.server_close()
            await anyio.to_thread.run_sync(thread.join)
