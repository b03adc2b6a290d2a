"""Running ``kvpipe`` as a process that file modes bind, to test permission errors as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def kvpipe_bound_by_modes(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvpipe ARGV`` as a process that file modes bind: this one's user when it is not
    root; root without its capabilities (``setpriv``), who may then open only what the owner
    bits allow, else the calling test is skipped."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        prefix = [setpriv or "setpriv", "--inh-caps=-all", "--bounding-set=-all"]
        probe = subprocess.run([*prefix, "true"], capture_output=True, check=False)
        if setpriv is None or probe.returncode:
            pytest.skip("root, and cannot drop its capabilities here (setpriv)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPIPE_", "AS_WRITE_"))}
    return subprocess.run(
        [*prefix, sys.executable, "-m", "kvpipe", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
