"""The loopback Mooncake launcher: a master that exits before listening is started again on
fresh ports, a few times."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any

import pytest

import kvpipe
from kvpipe.backends import mooncake_local
from kvpipe.backends.mooncake_local import LocalMooncake


def _exits_at_once(name: str, args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])


def _listens(port_of: Any) -> Any:
    """A stand-in process that listens on the port ``port_of()`` names, until terminated."""

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        code = (
            "import socket, time\n"
            f"s = socket.create_server(('127.0.0.1', {port_of()}))\n"
            "time.sleep(60)\n"
        )
        return subprocess.Popen([sys.executable, "-c", code])

    return spawn


@pytest.mark.parametrize("early_exits", [1, 2])
def test_a_master_that_exits_before_listening_is_started_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch, early_exits: int
) -> None:
    server = LocalMooncake(start_timeout=10)
    calls: list[tuple[str, int]] = []
    metadata = _listens(lambda: server.metadata_port)
    master = _listens(lambda: server.rpc_port)

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        calls.append((name, server.rpc_port))
        if name == "mooncake_http_metadata_server":
            return metadata(name, args)
        if sum(n == "mooncake_master" for n, _ in calls) <= early_exits:
            return _exits_at_once(name, args)
        return master(name, args)

    monkeypatch.setattr(server, "_spawn", spawn)
    with server:
        ports = [port for name, port in calls if name == "mooncake_master"]
        assert len(ports) == early_exits + 1 and len(set(ports)) == early_exits + 1
        assert server.master is not None and server.master.poll() is None


def test_a_master_that_never_listens_fails_after_three_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = LocalMooncake(start_timeout=10)
    metadata = _listens(lambda: server.metadata_port)
    starts: list[str] = []

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        starts.append(name)
        return metadata(name, args) if name != "mooncake_master" else _exits_at_once(name, args)

    monkeypatch.setattr(server, "_spawn", spawn)
    with pytest.raises(RuntimeError, match="exited with 1 before listening"):
        server.start()
    assert starts.count("mooncake_master") == mooncake_local._MASTER_STARTS == 3
    assert server.metadata is None  # stopped


def _runs_without_listening(name: str, args: list[str]) -> subprocess.Popen[bytes]:
    """What ``mooncake_http_metadata_server`` does when its port is taken: it logs the bind
    error and runs on, listening nowhere."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_port_another_process_listens_on_is_not_taken_for_the_server_listening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port picked free can be taken before the server binds it (another test's launcher):
    a connection accepted by that other listener does not mean the server is up."""
    server = LocalMooncake(start_timeout=2)
    master = _listens(lambda: server.rpc_port)

    def spawn(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        if name == "mooncake_http_metadata_server":
            return _runs_without_listening(name, args)
        return master(name, args)

    monkeypatch.setattr(server, "_spawn", spawn)
    try:
        with (
            socket.create_server(("127.0.0.1", server.metadata_port)),  # someone else's
            pytest.raises(TimeoutError),
        ):
            server.start()
    finally:
        server.stop()


def test_a_start_without_mooncake_installed_leaves_no_log_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``start`` without the Mooncake commands raises ``Unsupported`` and removes the log
    directory it made (``kvpipe mooncake-up`` on a host without Mooncake left a
    ``/tmp/kvpipe-mooncake-*`` behind at every try)."""

    def missing(name: str) -> str:
        raise kvpipe.Unsupported(f"{name} not found")

    monkeypatch.setattr(mooncake_local, "find_binary", missing)
    server = LocalMooncake()
    with pytest.raises(kvpipe.Unsupported):
        server.start()
    assert not os.path.exists(server.log_dir)
