"""The examples run as users run them: as scripts, in a subprocess of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PD_EXAMPLE = REPO / "examples" / "pd_disaggregation.py"
REQUESTS = 6


@pytest.mark.slow  # real time: prefill and decode processes
@pytest.mark.parametrize("store", ["mooncake", "file"])
def test_pd_disaggregation_example_verifies_every_request(store: str, tmp_path: Path) -> None:
    """Prefill and decode processes over a Mooncake the example starts itself, or over a
    shared file-store directory: exit code 0 and a table saying every request verified."""
    args = [sys.executable, str(PD_EXAMPLE), "--requests", str(REQUESTS)]
    shared = tmp_path / "kv"
    if store == "file":
        args += ["--store", "file", "--dir", str(shared)]
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}
    env["COLUMNS"] = "120"  # rich: the table on one line per request
    proc = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    output = f"stdout:\n{proc.stdout}\nstderr (tail):\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, output
    assert f"all requests verified: {REQUESTS}/{REQUESTS} byte-exact" in proc.stdout, output
    rows = [line.strip("│ ").split("│") for line in proc.stdout.splitlines() if line[:1] == "│"]
    assert [int(row[0]) for row in rows] == list(range(REQUESTS)), output
    for row in rows:
        blocks, partial, loaded, verified = (cell.strip() for cell in row[1:5])
        assert int(partial) > 0 and loaded == blocks and verified == "yes", row
    if store == "file":
        assert any(p.is_file() for p in shared.rglob("*")), "nothing was stored in --dir"


def test_the_readme_snippet_runs_and_prints_what_it_says(tmp_path: Path) -> None:
    """The README's "Use" snippet, run as a user pastes it: it prints what its comments say
    and leaves nothing behind in the directory it runs in."""
    readme = (REPO / "README.md").read_text()
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0]
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}
    proc = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["41", "40", "41"], proc.stdout
    assert list(tmp_path.iterdir()) == []
