"""``kvpipe demo`` and the command line around it: in-process, and as ``python -m kvpipe``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from rich.progress import Progress

import kvpipe
from kvpipe.cli import _console as ui
from kvpipe.cli import _reportable, build_parser, main
from kvpipe.cli import demo as demo_cmd
from kvpipe.cli._console import UsageError
from tests.cli.modes import kvpipe_bound_by_modes

#: A small workload on the tiny layout: 8 requests of 5-9 blocks sharing 3 blocks.
SMALL = [
    "--layout", "tiny", "--requests", "8", "--blocks-per-request", "5-9",
    "--shared-prefix-blocks", "3", "--slice-block-num", "2", "--staging-mib", "1",
]  # fmt: skip


def run_json(
    capsys: pytest.CaptureFixture[str], *args: str, log_level: str = "warning"
) -> tuple[int, dict[str, Any]]:
    code = main(["--log-level", log_level, "demo", *args, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_demo_json_numbers_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    code, s = run_json(capsys, *SMALL)
    assert code == 0 and s["ok"] is True
    n = s["blocks_requested"]
    assert s["requests"] == 8 and s["partial_requests"] > 0
    assert s["written"] + s["skipped"] == n
    assert s["verified"] == s["read"] == n and s["mismatched"] == 0
    # the first request stores the shared prefix; every later one finds it stored
    assert s["skipped"] == 3 * (8 - 1) > 0
    assert s["written"] == s["distinct_blocks"] == s["store_statistics"]["blocks_written"]
    for phase in (s["writes"], s["reads"]):
        assert phase["incomplete"] == phase["timeouts"] == phase["restarts"] == 0
        assert phase["stop_reasons"] == {}
    assert set(s["writes"]["slices"]) == {"complete"}
    assert set(s["reads"]["slices"]) == {"read_complete"}
    assert s["writes"]["bytes"] == s["written"] * s["block_bytes"]
    assert s["reads"]["bytes"] == s["read"] * s["block_bytes"]


def test_demo_is_deterministic_for_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    counts = ("blocks_requested", "written", "skipped", "partial_requests", "distinct_blocks")
    _, a = run_json(capsys, *SMALL, "--seed", "5")
    _, b = run_json(capsys, *SMALL, "--seed", "5")
    assert [a[k] for k in counts] == [b[k] for k in counts]


@pytest.mark.parametrize("layout", sorted(demo_cmd.PRESETS))
def test_every_layout_round_trips(capsys: pytest.CaptureFixture[str], layout: str) -> None:
    args = ["--layout", layout, "--requests", "3", "--blocks-per-request", "2-3"]
    code, s = run_json(capsys, *args, "--shared-prefix-blocks", "1", "--staging-mib", "32")
    assert code == 0 and s["verified"] == s["blocks_requested"] and s["skipped"] == 2


def test_llama3_8b_blocks_are_two_mib() -> None:
    assert demo_cmd.PRESETS["llama3-8b"].layout().block_nbytes == 2 << 20


def test_plan_workload_shares_the_prefix_and_nothing_else() -> None:
    layout = demo_cmd.PRESETS["tiny"].layout()
    work = demo_cmd.plan_workload(
        layout, requests=6, blocks_per_request=(4, 6), shared_prefix_blocks=2, concurrency=2, seed=1
    )
    bs = layout.block_size
    prefix = work.requests[0].tokens[: 2 * bs]
    owned: set[int] = set()
    for req in work.requests:
        assert (req.tokens[: 2 * bs] == prefix).all()
        assert list(req.src_ids[:2]) == list(work.requests[0].src_ids[:2])
        assert 4 <= len(req.src_ids) <= 6
        assert len(req.src_ids) == -(-len(req.tokens) // bs)
        assert (len(req.tokens) % bs != 0) == req.partial
        own = {int(b) for b in req.src_ids[2:]}
        assert not own & owned
        owned |= own
    assert len(owned) + 2 == work.src_blocks
    assert work.dst_blocks == 2 * 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slice-block-num", "0"], "slice_block_num"),
        (["--staging-mib", "0"], "staging_bytes"),
        (["--shared-prefix-blocks", "9"], "--shared-prefix-blocks"),
        (["--requests", "0"], "--requests"),
        (["--concurrency", "0"], "--concurrency"),
    ],
)
def test_bad_values_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["demo", *SMALL, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpipe demo: error: ")
    assert message in lines[0] and "Traceback" not in captured.err


@pytest.mark.parametrize("mib", ["0", "-64"])
def test_a_segment_below_one_mib_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, mib: str
) -> None:
    # 0 ran on a 1024 MiB segment (the option ignored); -64 gave Mooncake a negative size.
    def no_mooncake(segment_bytes: int) -> None:
        raise AssertionError(f"a Mooncake started with a {segment_bytes} B segment")

    monkeypatch.setattr(demo_cmd, "mooncake_store", no_mooncake)
    assert main(["demo", *SMALL, "--store", "mooncake", "--segment-mib", mib]) == 2
    err = capsys.readouterr().err
    assert f"--segment-mib must be >= 1, got {mib}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["--layout", "nope"],
        ["--blocks-per-request", "9-5"],
        ["--blocks-per-request", "x"],
        ["--seed", "-1"],
        [],
    ],
)
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    argv = ["demo", *args] if args else []  # no subcommand at all is a usage error too
    assert main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"]) == 0
    assert "--shared-prefix-blocks" in capsys.readouterr().out


def test_incomplete_writes_exit_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a store with room for a few blocks: writes stop short, reads find less — exit 1
    @contextlib.asynccontextmanager
    async def small_store(args: object) -> AsyncIterator[kvpipe.StorageBackend]:
        yield kvpipe.MemoryStore(capacity_bytes=10_000)

    monkeypatch.setattr(demo_cmd, "open_store", small_store)
    code, s = run_json(capsys, *SMALL, log_level="critical")
    assert code == 1 and s["ok"] is False
    assert s["writes"]["incomplete"] > 0 and s["verified"] < s["blocks_requested"]
    assert s["writes"]["stop_reasons"] == {"incomplete_slice": s["writes"]["incomplete"]}


@pytest.mark.parametrize(
    "argv",
    [["--log-level", "info", "demo", *SMALL], ["demo", "--log-level", "info", *SMALL]],
    ids=["log-level before the command", "log-level after it"],
)
def test_human_summary_and_logging_restored(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    logger = logging.getLogger("kvpipe")
    before = (logger.level, list(logger.handlers), logger.propagate)
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "skipped by dedup" in captured.out and "OK: all" in captured.out
    assert "INFO" in captured.err and "kvpipe." in captured.err  # kvpipe's log, on stderr
    assert (logger.level, list(logger.handlers), logger.propagate) == before


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["demo"], "WARNING"),
        (["--log-level", "error", "demo"], "ERROR"),
        (["demo", "--log-level", "debug"], "DEBUG"),
        (["--log-level", "error", "faults", "--log-level", "info"], "INFO"),
    ],
)
def test_log_level_before_or_after_the_command(argv: list[str], level: str) -> None:
    assert build_parser().parse_args(argv).log_level == level


def test_logs_off_a_terminal_are_one_line_per_record() -> None:
    # rich wrapped a record at 80 columns and padded every line: the request id and the
    # reason of a stopped write ended up on different lines of a log file.
    import io

    from rich.console import Console

    out = io.StringIO()
    message = "write req-17 incomplete: 16 of 32 blocks stored; stopped at slice 2: " + "x" * 80
    with ui.logging_to(Console(file=out), "INFO"):
        logging.getLogger("kvpipe.requests").warning("%s", message)
        logging.getLogger("kvpipe.writer").debug("below the level")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].endswith(f" WARNING kvpipe.requests: {message}")


def test_errors_inside_task_groups_are_reported() -> None:
    err = kvpipe.PipelineClosed("closed")
    assert _reportable(ExceptionGroup("g", [ExceptionGroup("h", [err])])) is err
    assert _reportable(ExceptionGroup("g", [err, RuntimeError("bug")])) is None
    assert isinstance(_reportable(UsageError("x")), UsageError)


def test_the_store_directory_goes_but_no_directory_of_the_user(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo removes the store directory it made, and ./kvpipe-data when it made that
    too; it removed a --store-dir's parent (and a ./kvpipe-data it found) when empty."""
    mine = tmp_path / "mine"
    mine.mkdir()
    code, _ = run_json(capsys, *SMALL, "--store-dir", str(mine / "store"))
    assert code == 0 and mine.is_dir() and list(mine.iterdir()) == []
    monkeypatch.chdir(mine)
    code, _ = run_json(capsys, *SMALL)  # ./kvpipe-data/demo-PID, both made by the demo
    assert code == 0 and list(mine.iterdir()) == []
    (mine / "kvpipe-data").mkdir()
    code, _ = run_json(capsys, *SMALL)
    assert code == 0 and list(mine.iterdir()) == [mine / "kvpipe-data"]


def test_python_dash_m_kvpipe() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPIPE_", "AS_WRITE_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "kvpipe", "demo", *SMALL],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "OK: all" in proc.stdout and "skipped by dedup" in proc.stdout
    # not a terminal: no progress bar redraws, no colour codes, nothing on stderr
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout
    assert proc.stderr == ""


async def test_a_finished_phase_bar_keeps_its_rate() -> None:
    """The write bar's GB/s stays the write phase's own while the read phase runs (it kept
    falling before: its clock ran on). Virtual time: rich's progress reads our clock."""
    now = 0.0
    progress = Progress(ui._ByteRateColumn(), get_time=lambda: now, disable=True)
    tally = ui.PhaseTally(progress, progress.add_task("write", total=4, nbytes=0), 1000)

    async def job() -> None:
        nonlocal now
        now += 2.0
        progress.update(tally.task, advance=4, nbytes=4 * 10**9)

    layout = kvpipe.CacheLayout.gqa(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
    cache = kvpipe.create_kv_cache(layout, 4)
    async with kvpipe.open_pipeline(cache, kvpipe.MemoryStore()) as pipe:
        await demo_cmd._timed(tally, pipe, job())
    column, task = ui._ByteRateColumn(), progress.tasks[0]
    assert column.render(task).plain == "2 GB/s"
    now += 10.0  # the read phase
    assert column.render(task).plain == "2 GB/s"


#: ``python -c`` body: ``kvpipe ARGV[2:]``, with the process sending itself SIGTERM (as
#: ``kill PID``, systemd or a container runtime would) when the async function ``ARGV[1]``
#: (``module:name``) of the command is called, which then runs on; it prints the PIDs of its
#: children first (``--store mooncake``: the master and metadata server).
TERMINATED_MIDWAY = """
import glob, importlib, os, signal, sys
from kvpipe.cli import main
module, name = sys.argv[1].split(":")
module = importlib.import_module(module)
original = getattr(module, name)
async def terminated_midway(*args, **kwargs):
    kids = [p for f in glob.glob("/proc/self/task/*/children") for p in open(f).read().split()]
    print("children", *kids, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    return await original(*args, **kwargs)
setattr(module, name, terminated_midway)
sys.exit(main(sys.argv[2:]))
"""


def run_terminated(
    cwd: Path, at: str, *argv: str
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """``kvpipe ARGV`` as a process SIGTERMed as ``at`` is called, and its children's PIDs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPIPE_", "AS_WRITE_"))}
    env["TMPDIR"] = str(cwd)  # temporary directories (Mooncake's logs, faults' stores)
    proc = subprocess.run(
        [sys.executable, "-c", TERMINATED_MIDWAY, at, *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
        check=False,
    )
    kids = [
        int(p)
        for line in proc.stdout.splitlines()
        if line.startswith("children")
        for p in line.split()[1:]
    ]
    return proc, kids


def test_sigterm_cleans_up_like_ctrl_c(tmp_path: Path) -> None:
    """SIGTERM (``kill PID``) killed the demo on the spot: its store directory
    ./kvpipe-data/demo-PID stayed behind, full of blocks. It now ends the run as Ctrl-C
    does, cleaning up, with exit code 143 and one line on stderr."""
    proc, _ = run_terminated(tmp_path, "kvpipe.cli.demo:_write_all", "demo", *SMALL)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines() == ["kvpipe demo: terminated"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_store_dir_that_cannot_be_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str
) -> None:
    """It was exit 1 ("failed", as a verification that found bad blocks) with the file
    store's open error, after the header was printed and the cache filled."""
    (tmp_path / "f").write_text("x")
    path = tmp_path / "f" if where == "a file" else tmp_path / "f" / "store"
    assert main(["demo", *SMALL, "--store-dir", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvpipe demo: error: --store-dir {path}: not a directory")
    assert (tmp_path / "f").read_text() == "x"


def test_the_default_store_is_fresh_even_where_a_killed_run_left_one(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default store was ./kvpipe-data/demo-PID. A run killed with SIGKILL (the OOM
    killer, ``kill -9``) leaves its directory; PIDs repeat (a container starts the same
    processes in the same order), and a later run of the same PID reused it: every write
    found its block stored (0 written), the reads verified the dead run's blocks, "OK",
    and the directory, found existing, was kept. Each run now makes a store of its own."""
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / "kvpipe-data" / f"demo-{os.getpid()}"
    code, _ = run_json(capsys, *SMALL, "--store-dir", str(stale), "--keep-store")
    assert code == 0
    left = sorted(p.relative_to(stale) for p in stale.rglob("*"))
    code, s = run_json(capsys, *SMALL)
    assert code == 0
    assert s["written"] == s["distinct_blocks"] and s["store_statistics"]["blocks_written"] > 0
    assert Path(s["store_dir"]).parent == stale.parent and Path(s["store_dir"]) != stale
    assert list((tmp_path / "kvpipe-data").iterdir()) == [stale]  # its own store is gone
    assert sorted(p.relative_to(stale) for p in stale.rglob("*")) == left  # the stale one kept


def test_a_store_dir_made_with_its_parents_goes_with_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A --store-dir whose parents were missing too: the file store made them all, the demo
    removed the last one only (deep/a stayed behind). The parents it made go too; none that
    was there before."""
    code, _ = run_json(capsys, *SMALL, "--store-dir", str(tmp_path / "deep" / "a" / "store"))
    assert code == 0 and list(tmp_path.iterdir()) == []
    (tmp_path / "deep").mkdir()
    code, _ = run_json(capsys, *SMALL, "--store-dir", str(tmp_path / "deep" / "a" / "store"))
    assert code == 0 and list(tmp_path.iterdir()) == [tmp_path / "deep"]
    assert list((tmp_path / "deep").iterdir()) == []


@pytest.mark.parametrize("where", ["in it", "under it"])
def test_a_store_dir_it_may_not_write_is_a_usage_error(tmp_path: Path, where: str) -> None:
    """A --store-dir in (or under) a directory this user may not write: exit 1, "failed"
    as a verification that found bad blocks, after the header and the cache fill, with the
    name of the file store's probe file (``.direct-probe.PID.XXXX``: Permission denied)."""
    sealed = tmp_path / "sealed"
    sealed.mkdir()
    path = sealed if where == "in it" else sealed / "store"
    sealed.chmod(0o555)
    try:
        proc = kvpipe_bound_by_modes("demo", *SMALL, "--store-dir", str(path))
    finally:
        sealed.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvpipe demo: error: --store-dir {path}: ")
    assert "may not" in lines[0] and ".direct-probe" not in lines[0]
    assert list(sealed.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--store", "memory", "--store-dir", "{tmp}/store"], "--store-dir"),
        (["--store", "memory", "--keep-store"], "--keep-store"),
        (["--store", "memory", "--durability", "full"], "--durability"),
        (["--store", "file", "--segment-mib", "64"], "--segment-mib"),
    ],
)
def test_an_option_of_another_store_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], option: str
) -> None:
    """``--store memory --store-dir /mnt/nvme/x`` ran on memory and said OK, the directory
    never touched: the user believed the disk tested. An option the chosen store does not
    use is refused, as --metrics-linger without --metrics-port is."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["demo", *SMALL, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvpipe demo: error: {option} ")
    assert list(tmp_path.iterdir()) == []


#: ``python -c`` body: ``kvpipe ARGV[1:]``, Ctrl-C'd (SIGINT to the main thread) as the
#: demo's source cache starts filling, in the fill's first draw of random bytes; at exit,
#: after every thread is joined, it prints how many draws ran of how many tensors to fill.
INTERRUPTED_IN_FILL = """
import atexit, signal, sys, threading
import numpy as np
import kvpipe
from kvpipe.cli import main

draws, tensors = [], []
real_rng, real_cache = np.random.default_rng, kvpipe.create_kv_cache

class Rng:
    def __init__(self, rng):
        self._rng = rng
    def __getattr__(self, name):
        return getattr(self._rng, name)
    def bytes(self, n):
        if not draws:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        draws.append(n)
        return self._rng.bytes(n)

def cache(layout, num_blocks, *args, **kwargs):
    made = real_cache(layout, num_blocks, *args, **kwargs)
    tensors.append(len(made.byte_rows))
    return made

np.random.default_rng = lambda *a, **k: Rng(real_rng(*a, **k))
kvpipe.create_kv_cache = cache
atexit.register(lambda: print("draws", len(draws), "tensors", tensors[0], flush=True))
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_source_cache_fills_stops_the_fill(tmp_path: Path) -> None:
    """The source cache was filled in one worker thread that Ctrl-C could not stop: the
    command said "interrupted" but the process stayed until every byte was drawn (seconds
    for a large cache), and a second Ctrl-C killed it in the middle of its exit. The fill
    now runs in chunks, cancellation checked between them: Ctrl-C ends the current one."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPIPE_", "AS_WRITE_"))}
    proc = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IN_FILL, "demo", *SMALL],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert proc.stderr.strip().splitlines() == ["kvpipe demo: interrupted"]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("draws")]
    _, draws, _, tensors = line.split()
    assert int(tensors) == 4  # the tiny layout: 2 layers, keys and values
    assert int(draws) == 1, line  # the chunk in flight, no more
    assert list(tmp_path.iterdir()) == []
