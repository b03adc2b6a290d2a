"""``kvpipe mooncake-up``: in-process with ``--once``, and as a process stopped by a signal."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from kvpipe.cli import main

# Real time: real Mooncake servers started, signalled and stopped.
pytestmark = pytest.mark.slow

#: The command as a user runs it, without this test run's kvpipe settings.
COMMAND = [sys.executable, "-m", "kvpipe", "mooncake-up"]


def listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=0.5).close()
    except OSError:
        return False
    return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_if_alive(pid: int) -> None:
    """SIGKILL ``pid`` if it still runs (cleanup after a failed test only)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_once_prints_json_and_stops_everything(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the logs go
    assert main(["mooncake-up", "--once", "--master-arg=--client_ttl=5"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", info["master_address"])
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metadata", info["metadata_url"])
    assert info["env"] == {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    assert info["python"] == (
        f"import kvpipe; store = kvpipe.MooncakeStore({info['master_address']!r}, "
        f"{info['metadata_url']!r})"
    )
    # stopped and reaped: nothing listens, no process left, the temporary logs are gone,
    # and no path to them was printed (it named a directory already deleted)
    assert not listening(info["master_address"])
    assert not any(alive(pid) for pid in info["pids"].values())
    assert info["log_dir"] is None
    assert list(tmp_path.iterdir()) == []


def test_once_with_a_log_dir_prints_it_and_keeps_the_logs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    assert main(["mooncake-up", "--once", "--log-dir", str(logs)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["log_dir"] == str(logs)
    assert sorted(p.name for p in logs.iterdir())  # the processes' logs are still there


def test_a_flag_the_master_rejects_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mooncake-up", "--once", "--master-arg=--no_such_flag=1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "did not start" in captured.err and "no_such_flag" in captured.err


def test_a_log_dir_that_cannot_be_made_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A file in its place was a FileExistsError traceback (exit 1); nothing starts.
    (tmp_path / "logs").write_text("x")
    assert main(["mooncake-up", "--once", "--log-dir", str(tmp_path / "logs")]) == 2
    err = capsys.readouterr().err
    assert f"--log-dir {tmp_path / 'logs'}: " in err and "Traceback" not in err


@contextlib.contextmanager
def mooncake_up(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], queue.Queue[str]]]:
    """``kvpipe mooncake-up`` as a process; its stdout lines arrive on the queue. Whatever
    the test does, the command and the servers it printed are gone afterwards."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    proc = subprocess.Popen(
        [*COMMAND, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    lines: queue.Queue[str] = queue.Queue()
    seen: list[str] = []

    def pump(stream: IO[bytes]) -> None:
        for raw in stream:
            seen.append(raw.decode())
            lines.put(raw.decode())

    assert proc.stdout is not None
    reader = threading.Thread(target=pump, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        reader.join(timeout=10)
        for pid in printed_pids("".join(seen)):
            kill_if_alive(pid)
        if proc.stderr is not None:
            proc.stderr.close()
        proc.stdout.close()


def printed_pids(text: str) -> list[int]:
    """The server PIDs the command printed (text or JSON form)."""
    return [int(p) for p in re.findall(r"(?:pid |\"(?:metadata|master)\": )(\d+)", text)]


def read_until(lines: queue.Queue[str], pattern: str, timeout: float = 60.0) -> str:
    """Everything printed up to and including the first line matching ``pattern``."""
    deadline = time.monotonic() + timeout
    out = ""
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            break
        out += line
        if re.search(pattern, line):
            return out
    raise AssertionError(f"{pattern!r} not printed in {timeout} s; got {out!r}")


def stderr_of(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    return proc.stderr.read().decode()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_runs_until_a_signal_then_stops_the_servers(signum: signal.Signals) -> None:
    with mooncake_up() as (proc, lines):
        text = read_until(lines, r"Ctrl-C")
        master = re.search(r"master:\s+(127\.0\.0\.1:\d+)", text)
        metadata = re.search(r"metadata:\s+(http://127\.0\.0\.1:\d+/metadata)", text)
        assert master and metadata, text
        assert "export MC_TCP_BIND_ADDRESS=127.0.0.1" in text
        assert f"kvpipe.MooncakeStore({master[1]!r}, {metadata[1]!r})" in text
        pids = printed_pids(text)
        assert len(pids) == 2 and all(alive(p) for p in pids)
        assert listening(master[1])
        proc.send_signal(signum)
        assert proc.wait(timeout=30) == 0
        assert f"{signum.name}; stopping" in stderr_of(proc)
        assert not listening(master[1])
        assert not any(alive(p) for p in pids)


def test_a_server_that_dies_stops_the_other_and_fails() -> None:
    with mooncake_up("--json") as (proc, lines):
        info: dict[str, Any] = json.loads(read_until(lines, r"master_address"))
        os.kill(info["pids"]["master"], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        assert "mooncake_master exited with -9" in stderr_of(proc)
        assert not alive(info["pids"]["metadata"])


@pytest.mark.parametrize("failing", ["mooncake_master", "mooncake_http_metadata_server"])
def test_did_not_start_quotes_only_this_runs_log(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    failing: str,
) -> None:
    """The processes append to ``--log-dir``'s logs, and "did not start" quoted the last
    lines of the file: those of an earlier run when this one wrote fewer (or, when the
    metadata server failed, the master's log of an earlier run, this run's master never
    started). It quotes only what this run wrote."""
    from kvpipe.backends.mooncake_local import LocalMooncake

    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("mooncake_master", "mooncake_http_metadata_server"):
        (logs / f"{name}.log").write_text("".join(f"earlier run {i}\n" for i in range(5)))

    def start(self: LocalMooncake) -> LocalMooncake:
        with open(os.path.join(self.log_dir, f"{failing}.log"), "a") as log:
            log.write("this run: unknown flag\n")
        raise RuntimeError(f"['{failing}'] exited with 1 before listening")

    monkeypatch.setattr(LocalMooncake, "start", start)
    monkeypatch.setattr(LocalMooncake, "stop", lambda self: None)
    assert main(["mooncake-up", "--once", "--log-dir", str(logs)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "did not start" in err and "log: this run: unknown flag" in err, err
    assert "earlier run" not in err, err
