"""``kvpipe bench`` smoke run: every scenario end to end, tiny sizes, no timing asserts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvpipe.benchmarks.device import DeviceBenchConfig
from kvpipe.cli import main


def test_file_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(
        [
            "bench",
            "--sizes",
            "256KiB",
            "--mib",
            "4",
            "--rounds",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    data, none = results["file"]  # both durabilities by default
    assert (data["durability"], none["durability"]) == ("data", "none")
    for rec in (data, none):
        assert rec["block_size"] == "256KiB" and rec["blocks"] >= 16
        for op, contenders in (
            ("write", ("raw1", "raw4", "direct4")),
            ("read_hot", ("raw1", "raw4", "hand1", "hand2")),  # O_DIRECT: cold only
            ("read_cold", ("raw1", "raw4", "direct4", "hand1", "hand2")),
        ):
            assert rec[op]["rounds"] == 1
            assert rec[op]["gbps_median"] > 0 and rec[op]["ratio_median"] > 0
            for c in contenders:  # every contender ran, and the best one sets the ratio
                assert rec[op][f"{c}_gbps_median"] > 0
                assert rec[op][f"ratio_vs_{c}"] >= rec[op]["ratio_median"]
        assert "hand1_gbps_median" not in rec["write"]
        assert "direct4_gbps_median" not in rec["read_hot"]
    # one store for the warm-up and the recorded round: "data" writes past the cache
    assert data["direct_writes"] == 2 * data["blocks"]
    assert none["direct_writes"] == 0
    text = md.read_text()
    assert "| 256KiB | data | read, page cache |" in text
    assert "| 256KiB | none | read, evicted |" in text
    assert list(tmp_path.glob("kvpipe-bench-*")) == []  # cleaned up
    assert "pipeline over the file store vs plain file I/O" in capsys.readouterr().out


def test_file_bench_with_cached_writes(tmp_path: Path) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    args = ["bench", "--sizes", "256KiB", "--mib", "4", "--rounds", "1", "--durability", "data"]
    args += ["--cached-writes", "--dir", str(tmp_path), "--json", str(out), "--markdown", str(md)]
    assert main(args) == 0
    (rec,) = json.loads(out.read_text())["file"]
    assert rec["cached_writes"] is True and rec["direct_writes"] == 0  # through the cache
    assert "file store threads=4, cached_writes=True;" in md.read_text()


def test_mooncake_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    rc = main(
        [
            "bench",
            "--scenario",
            "mooncake",
            "--sizes",
            "256KiB",
            "--mib",
            "4",
            "--rounds",
            "1",
            "--slice-mib",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(md),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    assert "file" not in results
    local, remote = results["mooncake"]
    assert (local["placement"], remote["placement"]) == ("local", "remote")
    # the data was where the placement says (the benchmark checks every round's keys against
    # its segment's endpoint): a segment of another process for "remote". Endpoints alone can
    # coincide: the remote holder may get the port the local client had before it closed.
    assert local["segment_pid"] == os.getpid() != remote["segment_pid"]
    for rec in (local, remote):
        assert rec["block_size"] == "256KiB" and rec["blocks"] >= 16
        assert rec["value_bytes"] == rec["block_bytes"] + 48
        assert rec["pipeline"]["slice_block_num"] == (1 << 20) // rec["value_bytes"]
        for op, baseline in (("write", "put_from"), ("write", "upsert_from"), ("read", "get_into")):
            assert rec[op]["rounds"] == 1
            assert rec[op]["gbps_median"] > 0 and rec[op][f"{baseline}_gbps_median"] > 0
            assert rec[op]["ratio_median"] > 0
        assert rec["write"]["ratio_vs_put_from"] > 0 and rec["write"]["ratio_vs_upsert_from"] > 0
        for op in ("write", "read"):  # the hand loop ran (and checked its own bytes)
            assert rec[op]["loop_gbps_median"] > 0
            assert rec[op]["ratio_vs_loop"] > 0 and rec[op]["loop_vs_direct"] > 0
    text = md.read_text()
    assert "| 256KiB | this process | write |" in text
    assert "| 256KiB | another process | read |" in text
    assert "io_threads=2" in text
    assert "direct client" in capsys.readouterr().out


def test_new_scenarios_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """memory, sweeps, scaling, lag and overhead end to end at smoke sizes: structure and
    sanity only (no timing assertions)."""
    out, md, doc = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "perf.md"
    scenarios = ("memory", "sweeps", "scaling", "lag", "overhead")
    doc.write_text(
        "# Perf\n\nprose stays\n\n<!-- kvpipe-bench:lag -->\nold\n<!-- /kvpipe-bench:lag -->\n"
    )
    argv = ["bench", "--smoke", "--sizes", "256KiB", "--mib", "4", "--dir", str(tmp_path)]
    for s in scenarios:
        argv += ["--scenario", s]
    rc = main([*argv, "--json", str(out), "--markdown", str(md), "--doc", str(doc)])
    assert rc == 0
    results = json.loads(out.read_text())
    assert set(results["seconds"]) == set(scenarios)

    (mem,) = results["memory"]
    assert mem["block_size"] == "256KiB" and mem["blocks"] >= 16
    for op in ("write", "read"):
        rec = mem[op]
        assert rec["rounds"] == 1
        for key in ("gbps_median", "nocheck_gbps_median", "plain1_gbps_median", "ratio_median"):
            assert rec[key] > 0

    sweeps = results["sweeps"]
    assert {r["sweep"] for r in sweeps} == {"slice_block_num", "block_size", "concurrency"}
    assert [r["x"] for r in sweeps if r["sweep"] == "slice_block_num"] == [1, 4, 16, 64]
    for r in sweeps:
        for op in ("write", "read"):
            lat = r[op]["latency_ms"]
            assert r[op]["gbps_median"] > 0 and lat["n"] >= 1
            assert 0 < lat["p50"] <= lat["p99"] <= lat["max"]
    assert all("ratio_median" in r["write"] for r in sweeps if r["sweep"] == "block_size")

    points = results["scaling"]["points"]
    assert [p["factor"] for p in points] == [1, 4, 16]
    assert [p["blocks"] for p in points] == [4, 16, 64]
    for p in points:
        assert p["write_seconds"] > 0 and p["read_seconds"] > 0
        assert p["pipeline_peak_mib"] >= 0 and p["rss_before_mib"] > 0

    lag = {r["phase"]: r for r in results["lag"]}
    assert set(lag) == {
        "idle",
        "plain copies",
        "raw file writes",
        "memory write",
        "memory read",
        "file write",
        "file read",
    }
    for r in lag.values():
        q = r["lag_ms"]
        assert q["n"] >= 1 and 0 <= q["p50"] <= q["p99"] <= q["max"]
    assert lag["memory write"]["gbps"] > 0 and lag["file read"]["gbps"] > 0

    ov = results["overhead"]
    for who in ("pipeline", "plain", "one_hop", "actors", "one_hop_floor"):
        assert set(ov["fixed_us"][who]) == {"write", "read"}
    assert ov["reference"]["gather_2mib_us"] > 0 and ov["reference"]["thread_hop_us"] > 0
    assert [p["slice_block_num"] for p in ov["per_2mib_block"]] == [1, 4, 16, 64]

    text = md.read_text()
    for heading in ("## memory", "## sweeps", "## scaling", "## lag", "## overhead"):
        assert heading in text
    updated = doc.read_text()
    assert "prose stays" in updated and "old" not in updated
    assert "| memory write | " in updated and "--scenario lag" in updated
    assert list(tmp_path.glob("kvpipe-bench-*")) == []  # cleaned up
    assert "kvpipe bench: lag" in capsys.readouterr().out


def test_plot_smoke(tmp_path: Path) -> None:
    """--plot writes one PNG per scenario (or says which extra is missing)."""
    pytest.importorskip("matplotlib")
    img = tmp_path / "img"
    rc = main(["bench", "--smoke", "--scenario", "overhead", "--plot", str(img)])
    assert rc == 0
    assert [p.name for p in img.iterdir()] == ["overhead.png"]
    assert (img / "overhead.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rc = main(["bench", "--smoke", "--scenario", "overhead", "--plot", str(tmp_path)])
    assert rc == 2
    assert "plots" in capsys.readouterr().err


def test_integration_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The FastDeploy adapter from 4 threads vs the pipeline on its loop, at smoke sizes:
    structure, sanity and the generated section only (no timing assertions)."""
    pytest.importorskip("paddle")
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    doc.write_text(
        "# Perf\n\n<!-- kvpipe-bench:integration -->\n<!-- /kvpipe-bench:integration -->\n"
    )
    argv = ["bench", "--scenario", "integration", "--smoke", "--mib", "4", "--dir", str(tmp_path)]
    assert main([*argv, "--json", str(out), "--doc", str(doc)]) == 0
    rec = json.loads(out.read_text())["integration"]
    assert rec["threads"] == 4 and rec["store"] == "file" and rec["blocks"] >= 4
    for op in ("write", "read"):
        assert rec[op]["rounds"] == 1
        assert rec[op]["gbps_median"] > 0 and rec[op]["direct_gbps_median"] > 0
        assert rec[op]["ratio_median"] > 0
    hop = rec["hop_us"]
    assert hop["calls"] == 4 * 20 and 0 < hop["p50"] <= hop["p99"]
    text = doc.read_text()
    assert (
        "| write |" in text
        and "Thread hop" in text
        and "kvpipe bench --scenario integration" in text
    )
    assert list(tmp_path.glob("kvpipe-bench-*")) == []  # store directories removed
    assert "adapter GB/s" in capsys.readouterr().out


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_store_threads_below_one_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    """``--store-threads 0`` ran on the default thread count (the option ignored), and a
    negative count went to the file store."""
    from kvpipe.cli import bench

    ran: list[str] = []

    async def scenario(name: str, *_: object) -> list[object]:
        ran.append(name)
        return []

    monkeypatch.setattr(bench, "_run_scenario", scenario)
    rc = main(["bench", "--scenario", "file", "--store-threads", threads])
    err = capsys.readouterr().err
    assert (rc, ran) == (2, []), err
    assert f"--store-threads must be >= 1, got {threads}" in err


def test_help_shows_a_list_default_as_typed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the help's own line breaks aside
    assert "block sizes (default: 256KiB 2MiB 8MiB)" in out and "['" not in out, out


def test_device_bench_without_a_gpu_says_why(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no GPU is usable, ``--scenario device`` is a usage error naming the probe's
    reason (the scenario itself runs in tests/benchmarks/test_device.py on the driver's
    test double, and on a GPU with ``kvpipe bench --scenario device``)."""
    from kvpipe.cli import bench
    from kvpipe.cuda import DeviceProbe

    monkeypatch.setattr(bench, "probe_device", lambda: DeviceProbe(False, 0, "no driver here"))
    rc = main(["bench", "--scenario", "device", "--smoke"])
    assert rc == 2
    assert "needs a CUDA GPU: no driver here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "threads", "checksums"),
    [([], 4, True), (["--device-threads", "8", "--no-checksums"], 8, False)],
)
def test_device_bench_options_reach_its_config(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], threads: int, checksums: bool
) -> None:
    """``--device-threads`` sets the copy threads, the requests in flight and the plain
    loop's threads; ``--no-checksums`` the pipeline's verification."""
    from kvpipe.cli import bench
    from kvpipe.cuda import DeviceProbe

    seen: list[DeviceBenchConfig] = []

    async def run(cfg: DeviceBenchConfig, tick: object) -> dict[str, object]:
        seen.append(cfg)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench, "probe_device", lambda: DeviceProbe(True, 1, "a GPU"))
    monkeypatch.setattr(bench, "run_device_bench", run)
    with pytest.raises(RuntimeError, match="stop here"):
        main(["bench", "--scenario", "device", *argv])
    [cfg] = seen
    assert (cfg.threads, cfg.concurrency, cfg.verify_checksums) == (threads, threads, checksums)


def test_device_threads_below_one_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpipe.cli import bench
    from kvpipe.cuda import DeviceProbe

    monkeypatch.setattr(bench, "probe_device", lambda: DeviceProbe(True, 1, "a GPU"))
    assert main(["bench", "--scenario", "device", "--device-threads", "0"]) == 2
    assert "--device-threads must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option",
    [
        ["--json", "{missing}/r.json"],
        ["--markdown", "{missing}/r.md"],
        ["--doc", "{missing}/performance.md"],
        ["--dir", "{missing}"],
        ["--scaling-dir", "{missing}"],
    ],
)
def test_an_unusable_path_is_refused_before_the_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    option: list[str],
) -> None:
    """A path the run would write (or measure) that cannot be used is a usage error before
    any scenario runs: it was a traceback (exit 1) after the whole run, its results lost."""
    from kvpipe.cli import bench

    ran: list[str] = []

    async def scenario(name: str, *_: object) -> list[object]:
        ran.append(name)
        return []

    monkeypatch.setattr(bench, "_run_scenario", scenario)
    flag, value = option[0], option[1].format(missing=tmp_path / "nope")
    rc = main(["bench", "--scenario", "memory", "--smoke", flag, value])
    err = capsys.readouterr().err
    assert (rc, ran) == (2, []), err
    assert f"{flag} {value}" in err and "Traceback" not in err


def test_mooncake_bench_checks_each_rounds_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline read that reports success but moves nothing after the warm-up round is
    caught: every contender reads into a cleared buffer and is checked right after. Only the
    buffers as the last round left them were checked, so the warm-up's bytes vouched for
    every later round."""
    from kvpipe.benchmarks import mooncake

    real = mooncake._move
    reads = [0]

    async def only_first_read_moves(pipe: Any, cfg: Any, n: int, r: int, *, write: bool) -> float:
        if not write:
            reads[0] += 1
            if reads[0] > 1:
                return 0.001
        return await real(pipe, cfg, n, r, write=write)

    monkeypatch.setattr(mooncake, "_move", only_first_read_moves)
    args = ["bench", "--scenario", "mooncake", "--sizes", "256KiB", "--mib", "4", "--rounds", "1"]
    args += ["--slice-mib", "1", "--placement", "local", "--json", str(tmp_path / "r.json")]
    with pytest.raises(RuntimeError, match="pipeline read back different bytes"):
        main(args)


@pytest.mark.parametrize("rate", ["nan", "inf", "-inf", "0", "-5"])
def test_a_server_rate_that_is_not_a_positive_number_is_refused(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, rate: str
) -> None:
    """``--server-rate nan`` passed its ``<= 0`` check (NaN compares false both ways) and
    ``inf`` too, and either went to the client process as its rate; both are refused now,
    in one line, before anything runs."""
    from kvpipe.cli import bench

    ran: list[str] = []

    async def scenario(name: str, *_: object) -> list[object]:
        ran.append(name)
        return []

    monkeypatch.setattr(bench, "_run_scenario", scenario)
    rc = main(["bench", "--scenario", "memory", f"--server-rate={rate}"])
    captured = capsys.readouterr()
    assert (rc, ran, captured.out) == (2, [], ""), captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvpipe bench: error: --server-rate must be a finite number > 0")
