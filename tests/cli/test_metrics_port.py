"""``kvpipe demo --metrics-port``: the run's metrics are served on 127.0.0.1 while it runs
(and ``--metrics-linger`` seconds after), and they agree with the demo's own summary."""

from __future__ import annotations

import json
import socket

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.cli import main

SMALL = [
    "--layout", "tiny", "--requests", "8", "--blocks-per-request", "5-9",
    "--shared-prefix-blocks", "3", "--slice-block-num", "2", "--store", "memory",
]  # fmt: skip


async def fetch(port: int, path: str = "/metrics") -> tuple[str, str]:
    """GET ``path`` from 127.0.0.1:port; the status line and the body."""
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body.decode()


def samples(page: str) -> dict[tuple[str, str], float]:
    """``(name, pipeline label)`` → value, for samples without other labels."""
    out = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if set(s.labels) == {"pipeline", "backend"}:
                out[(s.name, s.labels["pipeline"])] = s.value
    return out


async def test_demo_serves_its_metrics_on_the_port(
    free_tcp_port: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*SMALL, "--json", "--metrics-port", str(free_tcp_port), "--metrics-linger", "3"]
    code: int | None = None
    final: dict[tuple[str, str], float] = {}
    pages = 0

    async def run() -> None:
        nonlocal code
        code = await anyio.to_thread.run_sync(main, ["demo", *argv])

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(60):
            while code is None:
                try:
                    status, body = await fetch(free_tcp_port)
                except OSError:  # not listening yet, or already gone
                    await anyio.sleep(0.02)
                    continue
                assert status.split()[1:] == ["200", "OK"], status
                pages += 1
                got = samples(body)
                if got.get(("kvpipe_open", "read")) == 0:  # both phases done: final numbers
                    final = got
                    break
                await anyio.sleep(0.02)
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert pages >= 1 and final, "never saw the page after the run"
    assert final[("kvpipe_blocks_written_total", "write")] == summary["written"] > 0
    assert final[("kvpipe_blocks_skipped_total", "write")] == summary["skipped"] > 0
    assert final[("kvpipe_blocks_read_total", "read")] == summary["read"] > 0
    assert final[("kvpipe_blocks_written_total", "read")] == 0
    assert final[("kvpipe_bytes_written_total", "write")] == summary["writes"]["bytes"]


def test_a_taken_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["demo", *SMALL, "--json", "--metrics-port", str(port)]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_a_bad_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *SMALL, "--metrics-port", "70000"]) == 2
    assert "--metrics-port must be in [0, 65535]" in capsys.readouterr().err


def test_a_linger_without_a_port_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``--metrics-linger`` alone used to be ignored without a word: the demo ran (exit 0)
    and served nothing, so a user who asked for the page to linger got neither."""
    assert main(["demo", *SMALL, "--json", "--metrics-linger", "3"]) == 2
    captured = capsys.readouterr()
    assert "--metrics-linger needs --metrics-port" in captured.err
    assert captured.out == ""  # refused before anything ran


@pytest.mark.parametrize("linger", ["inf", "nan", "-1", "-inf"])
def test_a_linger_that_is_not_a_finite_number_of_seconds_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, linger: str
) -> None:
    """``--metrics-linger inf`` passed the ``>= 0`` check and kept the page up forever
    after the run; it is refused, in one line, before anything runs, as ``-1`` and ``nan``
    are."""
    from kvpipe.cli import demo

    async def phases(*_: object) -> int:
        raise AssertionError("the demo ran")

    monkeypatch.setattr(demo, "_run_phases", phases)
    argv = ["demo", *SMALL, "--json", "--metrics-port", "0", f"--metrics-linger={linger}"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvpipe demo: error: --metrics-linger must be a finite number")
