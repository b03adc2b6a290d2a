"""A Mooncake client in a process of its own that contributes a segment and holds it.

The Mooncake benchmark's "data in another process" placement runs this module as a child
process: ``python -m kvpipe.benchmarks._segment_holder MASTER METADATA SEGMENT_BYTES``. It sets
up a client contributing ``SEGMENT_BYTES`` to the store, prints one JSON line
(``{"rc": 0, "hostname": "127.0.0.1:PORT"}``; the hostname is the segment's transport
endpoint), then holds the segment until its standard input closes or it gets SIGTERM, and
closes the client. Because it exits when its standard input closes, it also goes away when
the process that started it dies.

:func:`start_holder` / :func:`stop_holder` start and stop it by PID from the benchmark.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType
from typing import IO, Final

__all__ = ("start_holder", "stop_holder")

_READY_TIMEOUT: Final = 60.0


def start_holder(
    master: str, metadata: str, segment_bytes: int
) -> tuple[subprocess.Popen[bytes], str]:
    """Start a holder process and wait until its segment is mounted.

    Args:
        master: ``host:port`` of the master.
        metadata: The metadata server's URL.
        segment_bytes: Bytes the holder contributes to the store.

    Returns:
        The process and its segment's transport endpoint (``host:port``).

    Raises:
        RuntimeError: The holder failed to set up its client (it is stopped).
    """
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", __name__, master, metadata, str(segment_bytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = _readline(proc.stdout, proc, time.monotonic() + _READY_TIMEOUT)
        ready = json.loads(line)
        if ready.get("rc") != 0:
            raise RuntimeError(f"segment holder: setup returned {ready.get('rc')}")
        return proc, str(ready["hostname"])
    except BaseException:
        stop_holder(proc)
        raise


def _readline(stream: IO[bytes], proc: subprocess.Popen[bytes], deadline: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = stream.readline()
                if not line:
                    raise RuntimeError(f"segment holder exited with {proc.wait()} before ready")
                return line.decode()
    raise RuntimeError("segment holder: not ready in time")


def stop_holder(proc: subprocess.Popen[bytes]) -> None:
    """Stop a holder (by PID): close its standard input, then SIGTERM, then SIGKILL."""
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass
    for stop, wait in ((None, 10.0), (proc.terminate, 5.0), (proc.kill, None)):
        if proc.poll() is not None:
            break
        if stop is not None:
            stop()
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    if proc.stdout is not None:
        proc.stdout.close()


def _stop(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str]) -> int:
    """Set up the client, report, hold the segment until stdin closes or SIGTERM."""
    master, metadata, segment = argv[0], argv[1], int(argv[2])
    signal.signal(signal.SIGTERM, _stop)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", metadata, segment, 16 << 20, "tcp", "", master)
    hostname = client.get_hostname() if rc == 0 else ""
    print(json.dumps({"rc": rc, "hostname": hostname}), flush=True)
    if rc != 0:
        return 1
    try:
        sys.stdin.buffer.read()  # until the benchmark closes it (or dies)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
