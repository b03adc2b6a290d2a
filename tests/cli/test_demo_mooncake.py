"""``kvpipe demo --store mooncake``: the demo on a real Mooncake it starts and stops itself."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from kvpipe.backends.mooncake_local import LocalMooncake
from kvpipe.cli import main, mooncake_up

from .test_demo import run_terminated

# Real time: the demo against a real Mooncake master it starts.
pytestmark = pytest.mark.slow

#: A small workload on the tiny layout: 8 requests of 5-9 blocks sharing 3 blocks.
SMALL = [
    "--layout", "tiny", "--requests", "8", "--blocks-per-request", "5-9",
    "--shared-prefix-blocks", "3", "--slice-block-num", "2", "--staging-mib", "1",
]  # fmt: skip


def test_demo_on_mooncake_verifies_every_block_and_stops_mooncake(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[LocalMooncake] = []

    class Recorded(LocalMooncake):
        def start(self) -> LocalMooncake:
            started.append(self)
            return super().start()

    monkeypatch.setattr(mooncake_up, "LocalMooncake", Recorded)
    code = main(["demo", "--store", "mooncake", *SMALL, "--json"])
    s: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert code == 0 and s["ok"] is True and s["store"] == "mooncake"
    n = s["blocks_requested"]
    assert s["verified"] == s["read"] == n and s["mismatched"] == 0
    assert s["skipped"] == 3 * (8 - 1)  # the shared prefix, found stored by every later one
    assert s["written"] == s["distinct_blocks"] == s["store_statistics"]["blocks_put"]
    assert s["store_statistics"]["blocks_got"] == n
    assert s["store_statistics"]["distrusted_keys"] == 0
    for phase in (s["writes"], s["reads"]):
        assert phase["incomplete"] == phase["timeouts"] == phase["restarts"] == 0
    # one Mooncake was started, and it is stopped: its processes reaped, its port closed
    (server,) = started
    assert server.master is None and server.metadata is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.rpc_port), timeout=0.5).close()


def test_sigterm_stops_the_mooncake_it_started(tmp_path: Path) -> None:
    """SIGTERM killed ``kvpipe demo --store mooncake`` on the spot, and the master and
    metadata server it started (in sessions of their own, so a signal to the demo's
    process group missed them too) ran on, orphaned, holding their ports."""
    at = "kvpipe.cli.demo:_write_all"
    proc, kids = run_terminated(tmp_path, at, "demo", "--store", "mooncake", *SMALL)
    try:
        assert len(kids) == 2, proc.stdout
        assert proc.returncode == 143, (proc.returncode, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1] == "kvpipe demo: terminated"
        assert [pid for pid in kids if os.path.exists(f"/proc/{pid}")] == []
        assert list(tmp_path.iterdir()) == []  # the processes' log directory too
    finally:
        for pid in kids:  # only after a failure: the children of the demo run above
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
