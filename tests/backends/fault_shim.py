"""Runs Python code in a child process with ``fault_shim.c`` preloaded: the C extension's
libc calls wrapped, to hit a race window or a failure deterministically (see the C file for
the knobs). Skips the test where no C compiler is at hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

__all__ = ("run_with_faults",)

_SOURCE = Path(__file__).with_name("fault_shim.c")


def _build(where: Path) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the fault injector")
    lib = where / "fault_shim.so"
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(_SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"the fault injector did not build: {done.stderr.strip()}")
    return lib


def run_with_faults(where: Path, code: str, **knobs: str) -> Any:
    """Run ``code`` in a child Python with the injector preloaded and ``knobs`` (environment
    variables) set; what it printed last, as JSON."""
    lib = _build(where)
    env = {**os.environ, **knobs, "LD_PRELOAD": str(lib)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
