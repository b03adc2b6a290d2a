"""The integration scenario's own checks, never a wall time."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvpipe.benchmarks import integration
from kvpipe.benchmarks.integration import IntegrationBenchConfig, run_integration_bench

pytest.importorskip("paddle")


def tiny(tmp_path: Path) -> IntegrationBenchConfig:
    """2 layers (128 KiB blocks), 2 blocks per thread, one recorded round."""
    return IntegrationBenchConfig(
        total_bytes=1 << 20,
        request_blocks=2,
        rounds=1,
        hops=2,
        directory=str(tmp_path),
        layers=2,
    )


async def test_a_failed_adapter_call_is_reported_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The adapter's threads meet at barriers around the timed parts: a thread whose call
    # failed must not leave the others (and the timing thread) waiting for it forever.
    # (The barriers get a timeout here only so that the test ends either way.)
    monkeypatch.setattr(threading, "Barrier", functools.partial(threading.Barrier, timeout=10))
    real = integration.KVPipeAttentionStore.write
    calls = [0]

    def one_write_fails(self: Any, task: str, *args: Any) -> int:
        calls[0] += 1
        if calls[0] == 2:
            return 0  # nothing written
        return int(real(self, task, *args))

    monkeypatch.setattr(integration.KVPipeAttentionStore, "write", one_write_fails)
    with pytest.raises(RuntimeError, match=r"write \S+ incomplete"):
        await run_integration_bench(tiny(tmp_path))
    assert os.listdir(tmp_path) == []


async def test_runs_and_cleans_up(tmp_path: Path) -> None:
    rec = await run_integration_bench(tiny(tmp_path))
    assert rec["blocks"] == 8 and rec["read"]["rounds"] == 1
    assert os.listdir(tmp_path) == []
