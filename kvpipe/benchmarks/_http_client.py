"""The load generator of the ``server`` scenario: a steady stream of small HTTP GETs, run as
its own process (``python _http_client.py ...``; standard library only, no kvpipe import).

Open loop: request ``i`` is due at ``start + i / rate`` whatever happened to the earlier ones,
and its latency runs from that scheduled time to the end of its response, so a server that
stalls is charged for every request that queued behind the stall (no coordinated omission).
Requests go out over ``--connections`` keep-alive HTTP/1.1 connections, one request at a time
each; a due request waits for the first free connection.

It prints ``ready`` once every connection is open, then sends until its standard input closes,
``--max-seconds`` pass or ``--max-requests`` were sent, whichever comes first; then it writes
``(scheduled time, latency)`` pairs of the answered requests, seconds on ``time.monotonic()``
(the system's monotonic clock, the same in every process), as native float64 to ``--out``
and prints a JSON summary line.
"""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import sys
import threading
import time

REQUEST = b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
BODY = b"ok"


async def _connection(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    due: asyncio.Queue[float | None],
    out: array.array[float],
    errors: list[int],
) -> None:
    """Answer due requests on one connection until it gets ``None`` or breaks."""
    try:
        while (scheduled := await due.get()) is not None:
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length)
            if head.startswith(b"HTTP/1.1 200") and body == BODY:
                out.extend((scheduled, time.monotonic() - scheduled))
            else:
                errors[0] += 1
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        errors[0] += 1
    finally:
        writer.close()


async def run(args: argparse.Namespace) -> tuple[array.array[float], dict[str, int]]:
    """Send until told to stop; returns the (scheduled, latency) pairs and the summary."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def wait_stdin() -> None:  # a daemon thread: never holds the process up at exit
        sys.stdin.buffer.read()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_stdin, daemon=True).start()
    due: asyncio.Queue[float | None] = asyncio.Queue()
    out: array.array[float] = array.array("d")
    errors = [0]
    conns = [await asyncio.open_connection(args.host, args.port) for _ in range(args.connections)]
    workers = [asyncio.create_task(_connection(r, w, due, out, errors)) for r, w in conns]
    print("ready", flush=True)
    start = time.monotonic() + 0.01
    sent = 0
    while not stop.is_set() and sent < args.max_requests:
        at = start + sent / args.rate
        if at - start > args.max_seconds:
            break
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        due.put_nowait(at)
        sent += 1
    for _ in workers:
        due.put_nowait(None)
    _, pending = await asyncio.wait(workers, timeout=args.drain_seconds)
    for task in pending:
        task.cancel()
    return out, {
        "sent": sent,
        "answered": len(out) // 2,
        "errors": errors[0],
        "unanswered_at_exit": len(pending),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rate", type=float, default=500.0, help="requests per second")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--drain-seconds", type=float, default=10.0)
    parser.add_argument("--out", required=True, help="where the (scheduled, latency) pairs go")
    args = parser.parse_args(argv)
    pairs, summary = asyncio.run(run(args))
    with open(args.out, "wb") as f:
        pairs.tofile(f)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
