"""``kvpipe store-info``: reports what a file store holds, finds corrupt files."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpipe.cli import main
from tests.cli.modes import kvpipe_bound_by_modes


def _demo_store(root: Path) -> dict[str, object]:
    rc = main(
        [
            "demo",
            "--layout",
            "tiny",
            "--requests",
            "6",
            "--store-dir",
            str(root),
            "--keep-store",
            "--json",
        ]
    )
    assert rc == 0
    return {}


def test_reports_blocks_and_namespaces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "store"
    main(
        [
            "demo",
            "--layout",
            "tiny",
            "--requests",
            "6",
            "--store-dir",
            str(root),
            "--keep-store",
            "--json",
        ]
    )
    demo = json.loads(capsys.readouterr().out)
    assert main(["store-info", str(root), "--verify", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["blocks"] == demo["written"] == report["catalog_blocks"]
    assert report["namespaces"] == {"kvpipe-demo-tiny": demo["written"]}
    assert report["corrupt"] == [] and report["untracked"] == 0 and report["temp_files"] == 0


def test_finds_a_corrupt_file_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    main(
        [
            "demo",
            "--layout",
            "tiny",
            "--requests",
            "3",
            "--store-dir",
            str(root),
            "--keep-store",
            "--json",
        ]
    )
    capsys.readouterr()
    victim = next(p for p in (root / "blocks").rglob("*.kvb"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = sorted(os.walk(root))
    assert main(["store-info", str(root), "--json"]) == 0  # headers only: not detected
    capsys.readouterr()
    assert main(["store-info", str(root), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "payload checksum mismatch" in out and victim.name in out
    assert sorted(os.walk(root)) == before  # inspection changes nothing


def test_missing_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["store-info", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("kind", ["empty", "other files"])
def test_a_directory_that_is_not_a_store_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    if kind == "other files":
        (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    before = sorted(os.walk(tmp_path))
    assert main(["store-info", str(tmp_path)]) == 2
    assert "not a kvpipe store" in capsys.readouterr().err
    assert sorted(os.walk(tmp_path)) == before


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[tuple[Path, Callable[[], None]]]:
    """A directory for a store, and what makes it unwritable to this process: a read-only
    remount of a tmpfs (as root, who may write any file), else its mode bits."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = False
    if os.geteuid() == 0:
        cmd = ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(mnt)]
        if shutil.which("mount") is None or subprocess.run(cmd, check=False).returncode:
            pytest.skip("root, and cannot mount a tmpfs here to make read-only")
        mounted = True

    def seal() -> None:
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        else:
            for path in sorted(mnt.rglob("*"), reverse=True):
                path.chmod(path.stat().st_mode & ~0o222)

    try:
        yield mnt, seal
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        else:
            for path in mnt.rglob("*"):
                path.chmod(path.stat().st_mode | 0o200)


def test_inspects_a_store_it_cannot_write(
    unwritable: tuple[Path, Callable[[], None]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A store on a read-only file system, or one whose files are another user's: the
    catalog is read read-only, and nothing is created or changed."""
    mnt, seal = unwritable
    root = mnt / "store"
    _demo_store(root)
    capsys.readouterr()
    assert main(["store-info", str(root), "--json"]) == 0
    writable = json.loads(capsys.readouterr().out)
    files = sorted(p.name for p in root.iterdir())
    seal()
    assert main(["store-info", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == writable
    assert report["blocks"] == report["catalog_blocks"] > 0
    assert sorted(p.name for p in root.iterdir()) == files


def _sql(path: Path, *statements: str) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    try:
        for statement in statements:
            db.execute(statement)
    finally:
        db.close()


@pytest.mark.parametrize(
    "damage", ["garbage", "empty", "directory", "another database", "tables lost"]
)
def test_a_catalog_that_cannot_be_read_is_reported_with_the_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    """A damaged catalog (overwritten, or a directory in its place): the blocks are still
    reported, with the catalog's error, and the exit code is 1; it was a traceback. An
    SQLite database without the catalog's tables (another program's, or a catalog that lost
    some) was given them, turned to WAL and reported as a sound, empty catalog (exit 0)."""
    root = tmp_path / "store"
    _demo_store(root)
    capsys.readouterr()
    assert main(["store-info", str(root), "--json"]) == 0
    blocks = json.loads(capsys.readouterr().out)["blocks"]
    catalog = root / "catalog.sqlite3"
    held_before = catalog.read_bytes()
    catalog.unlink()
    if damage == "garbage":
        catalog.write_bytes(b"not a database" * 1000)
    elif damage == "empty":  # a store that crashed as it made its catalog; it was given one
        catalog.write_bytes(b"")
    elif damage == "another database":
        _sql(catalog, "CREATE TABLE other (x)", "INSERT INTO other VALUES (1)")
    elif damage == "tables lost":  # the store's own catalog, which lost two of its tables
        catalog.write_bytes(held_before)
        _sql(catalog, "DROP TABLE blocks", "DROP TABLE meta")
    else:
        catalog.mkdir()
    before = sorted(os.walk(root))
    mtime = catalog.stat().st_mtime_ns
    held = catalog.read_bytes() if catalog.is_file() else None
    assert main(["store-info", str(root), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["blocks"] == blocks > 0 and report["corrupt"] == []
    assert report["catalog_error"] and report["catalog_blocks"] == 0
    assert main(["store-info", str(root)]) == 1
    out = capsys.readouterr().out
    assert "unreadable" in out
    assert sorted(os.walk(root)) == before  # inspection changes nothing
    assert (catalog.read_bytes() if catalog.is_file() else None) == held
    assert catalog.stat().st_mtime_ns == mtime


def test_a_catalog_in_rollback_journal_mode_is_read_unchanged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A catalog not in WAL mode (a copy made with SQLite's .backup, say) is read as it is;
    store-info turned it to WAL, rewriting its header."""
    root = tmp_path / "store"
    _demo_store(root)
    capsys.readouterr()
    catalog = root / "catalog.sqlite3"
    _sql(catalog, "PRAGMA journal_mode=DELETE")
    held, mtime, files = catalog.read_bytes(), catalog.stat().st_mtime_ns, sorted(os.walk(root))
    assert main(["store-info", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["blocks"] == report["catalog_blocks"] > 0 and report["catalog_error"] is None
    assert catalog.read_bytes() == held and catalog.stat().st_mtime_ns == mtime
    assert sorted(os.walk(root)) == files


@pytest.mark.parametrize("closed", [".", "blocks"])
def test_a_store_it_may_not_read_is_a_one_line_permission_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], closed: str
) -> None:
    """Another user's store (its root is made 0700): store-info said "not a kvpipe store
    (no catalog.sqlite3, no blocks/ directory)" of the root it could not list, and died
    with a PermissionError traceback on a blocks/ directory it could not list."""
    root = tmp_path / "store"
    _demo_store(root)
    capsys.readouterr()
    (root / closed).chmod(0)
    try:
        proc = kvpipe_bound_by_modes("store-info", str(root))
    finally:
        (root / closed).chmod(0o700)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvpipe store-info: error: {root}")
    assert "permission denied" in lines[0].lower() and "not a kvpipe store" not in lines[0]
