"""Run a real Mooncake Store on this machine, on 127.0.0.1 only (tests, demo, ``mooncake-up``).

Starts ``mooncake_http_metadata_server`` and ``mooncake_master`` on free loopback ports and
stops them by PID. The master's built-in metadata server is not used: it binds every
interface whatever host it is given.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import final

from .._errors import Unsupported

__all__ = ("LocalMooncake", "find_binary", "free_port")

_INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (CPU hosts; GPU hosts: "
    "mooncake-transfer-engine), and apt-get install libibverbs1"
)
#: Times :meth:`LocalMooncake.start` starts a master that exits before listening.
_MASTER_STARTS = 3


def find_binary(name: str) -> str:
    """Path of a Mooncake command: on ``PATH``, or beside this Python interpreter.

    Raises:
        Unsupported: It is not installed.
    """
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise Unsupported(f"{name} not found; {_INSTALL_HINT}")
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listens(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` has a socket listening on TCP ``port`` (from ``/proc``);
    ``None`` where that cannot be told (no ``/proc``)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return None if not os.path.isdir("/proc/self/fd") else False
    except OSError:
        return None
    sockets = set()
    for fd in fds:
        try:
            sockets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local remote state ... inode (index 9)
            if (
                len(fields) > 9
                and fields[3] == "0A"  # LISTEN
                and int(fields[1].rpartition(":")[2], 16) == port
                and f"socket:[{fields[9]}]" in sockets
            ):
                return True
    return False


def _wait_port(port: int, deadline: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until ``proc`` itself listens on ``port``: a port picked free may be taken by
    another process before ``proc`` binds it (``proc`` then runs on, listening nowhere, or
    exits), and a connection that other listener accepts says nothing about ``proc``."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode} before listening")
        listens = _listens(proc.pid, port)
        if listens:
            return
        if listens is None:  # no /proc: a connection is the best sign there is
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return
            except OSError:
                pass
        time.sleep(0.02)
    raise TimeoutError(f"{proc.args!r} does not listen on 127.0.0.1:{port}")


@final
class LocalMooncake:
    """A metadata server and a master on 127.0.0.1 (context manager; blocking calls).

    Args:
        master_args: Extra ``mooncake_master`` flags (e.g. ``--client_ttl=2``).
        start_timeout: Seconds to wait for each process to listen.
        log_dir: Where the processes' output goes (a temporary directory by default).
    """

    def __init__(
        self,
        master_args: Sequence[str] = (),
        start_timeout: float = 15.0,
        log_dir: str | None = None,
    ) -> None:
        self.metadata_port = free_port()
        self.rpc_port = free_port()
        self.metrics_port = free_port()
        self.master_args = tuple(master_args)
        self.start_timeout = start_timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvpipe-mooncake-")
        self._own_log_dir = log_dir is None
        self.metadata: subprocess.Popen[bytes] | None = None
        self.master: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC endpoint."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the HTTP metadata server."""
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with open(os.path.join(self.log_dir, f"{name}.log"), "ab") as log:
            return subprocess.Popen(
                [find_binary(name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self) -> LocalMooncake:
        """Start both processes and wait until they listen.

        Raises:
            Unsupported: Mooncake is not installed.
            RuntimeError, TimeoutError: A process died or did not listen in time.
        """
        try:
            self.metadata = self._spawn(
                "mooncake_http_metadata_server",
                ["--host", "127.0.0.1", "--port", str(self.metadata_port)],
            )
            _wait_port(self.metadata_port, time.monotonic() + self.start_timeout, self.metadata)
            for attempt in range(_MASTER_STARTS):
                try:
                    self.start_master()
                    break
                except RuntimeError:  # likely a port taken after it was picked: fresh ones
                    if attempt == _MASTER_STARTS - 1:
                        raise
                    self.rpc_port, self.metrics_port = free_port(), free_port()
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """(Re)start the master on the same port (a restarted master has lost every key)."""
        self.master = self._spawn(
            "mooncake_master",
            [
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                *self.master_args,
            ],
        )
        _wait_port(self.rpc_port, time.monotonic() + self.start_timeout, self.master)

    def kill_master(self) -> None:
        """SIGKILL the master (failure testing) and wait for it to be gone."""
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)
            self.master.wait()

    def stop(self) -> None:
        """Stop both processes (by PID) and remove the default log directory."""
        for proc in (self.master, self.metadata):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.master = self.metadata = None
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
