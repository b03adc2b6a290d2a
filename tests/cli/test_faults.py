"""``kvpipe faults``: the short, seed-fixed CI run on every store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpipe.cli import main
from kvpipe.testing.scenarios import SCENARIOS

from .test_demo import run_terminated


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, object]]:
    code = main(["--log-level", "critical", "faults", "--seed", "3", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow  # real time: fault scenarios with real deadlines
def test_every_scenario_on_the_memory_store(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _run(capsys, "--store", "memory", "--all")
    assert code == 0 and report["ok"] is True
    names = [s["scenario"] for s in report["scenarios"]]  # type: ignore[index]
    assert "hang_slice" in names and "crash_loop" in names and len(names) == 14


@pytest.mark.slow  # real time: a writer process killed mid-write
def test_file_store_with_the_process_kill(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, report = _run(
        capsys,
        "--store",
        "file",
        "--dir",
        str(tmp_path),
        "--scenario",
        "kill_mid_write",
        "--scenario",
        "corrupt_reads",
        "--scenario",
        "late",
    )
    assert code == 0, report
    rows = {s["scenario"]: s for s in report["scenarios"]}  # type: ignore[index, union-attr]
    assert set(rows) == {"kill_mid_write", "corrupt_reads", "late"}
    assert rows["kill_mid_write"]["blocks_written"] > 0
    assert list(tmp_path.iterdir()) == []  # cleaned up


@pytest.mark.slow  # real time: a real Mooncake master
def test_mooncake_with_a_real_master(capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _run(
        capsys,
        "--store",
        "mooncake",
        "--scenario",
        "hang_slice",
        "--scenario",
        "partial_puts",
        "--scenario",
        "corrupt_reads",
    )
    assert code == 0, report


def test_an_unknown_scenario_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["faults", "--scenario", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown scenario" in err and "--list" in err


@pytest.mark.parametrize("what", ["missing", "a file"])
def test_a_dir_that_is_not_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, what: str
) -> None:
    # It was a FileNotFoundError (NotADirectoryError) traceback and exit 1.
    path = tmp_path / "nope"
    if what == "a file":
        path.write_text("x")
    assert main(["faults", "--store", "file", "--dir", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"--dir {path}: not a directory" in err and "Traceback" not in err


def test_list_names_every_scenario_and_runs_none(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["faults", "--list", "--scenario", "nope"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.splitlines()}
    assert listed == {s.name for s in SCENARIOS} | {"kill_mid_write"}, out


@pytest.mark.parametrize("store", ["memory", "mooncake"])
def test_the_process_kill_on_another_store_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], store: str
) -> None:
    # It ran nothing (or only the other scenarios) and exited 0: "all held".
    assert main(["faults", "--store", store, "--scenario", "kill_mid_write"]) == 2
    err = capsys.readouterr().err
    assert "kill_mid_write" in err and "--store file" in err


def test_a_mooncake_that_does_not_start_is_a_message_not_a_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was the RuntimeError's traceback out of main (demo and mooncake-up said it in a line).
    from kvpipe.backends.mooncake_local import LocalMooncake

    stopped: list[bool] = []

    def refuse(self: LocalMooncake) -> LocalMooncake:
        raise RuntimeError("['mooncake_master'] exited with 1 before listening")

    monkeypatch.setattr(LocalMooncake, "start", refuse)
    monkeypatch.setattr(LocalMooncake, "stop", lambda self: stopped.append(True))
    assert main(["faults", "--store", "mooncake", "--scenario", "late"]) == 2
    captured = capsys.readouterr()
    assert "Mooncake did not start" in captured.err and "exited with 1" in captured.err
    assert captured.out == "" and stopped


def test_sigterm_removes_the_stores_it_made(tmp_path: Path) -> None:
    """SIGTERM killed the run on the spot, leaving its kvpipe-faults-* directory of file
    stores in the temporary directory; it now ends as Ctrl-C does: exit 143, cleaned up."""
    at = "kvpipe.cli.faults:run_scenario"
    proc, _ = run_terminated(tmp_path, at, "faults", "--store", "file", "--scenario", "baseline")
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines() == ["kvpipe faults: terminated"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("store", ["memory", "mooncake"])
def test_a_dir_for_another_store_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store: str
) -> None:
    """``--store memory --dir /mnt/nvme/x`` ran every scenario in memory and said all held,
    the directory never used (only an empty temporary directory made in it and removed):
    the user believed that disk tested. As ``kvpipe demo`` refuses an option of another
    store, ``--dir`` without ``--store file`` is refused, in one line, before anything runs."""
    from kvpipe.cli import faults

    async def scenario(*_: object) -> object:
        raise AssertionError("a scenario ran")

    monkeypatch.setattr(faults, "run_scenario", scenario)
    assert main(["faults", "--store", store, "--scenario", "late", "--dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert lines == [f"kvpipe faults: error: --dir is for --store file, not --store {store}"]
    assert list(tmp_path.iterdir()) == []
