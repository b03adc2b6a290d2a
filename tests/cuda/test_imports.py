"""Only ``kvpipe/cuda/`` imports cuda-python, and lazily: importing kvpipe or kvpipe.cuda (and
reaching its engine names) loads no ``cuda`` module."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvpipe
import kvpipe.cuda
from kvpipe.cuda import DeviceProbe

PACKAGE = Path(kvpipe.__file__).parent
IMPORTS_CUDA = re.compile(r"^\s*(from\s+cuda[\s.]|import\s+cuda[\s.])", re.MULTILINE)


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter beside the package."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )


def test_only_kvpipe_cuda_imports_cuda_python() -> None:
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if IMPORTS_CUDA.search(path.read_text()) and path.parent.name != "cuda"
    ]
    assert offenders == []


def test_importing_the_device_path_loads_no_cuda_module() -> None:
    code = (
        "import sys, kvpipe, kvpipe.cuda\n"
        "from kvpipe.cuda import CudaEngine, CudaOptions, Driver, open_cuda_engine\n"
        "import kvpipe.cuda._nvrtc, kvpipe.cuda._kernels, kvpipe.cuda._pinned\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'cuda'))\n"
    )
    out = _python(code)
    assert out.stdout.strip() == "[]"


def test_probing_without_the_driver_library_imports_no_cuda_module() -> None:
    """Where ``libcuda.so.1`` does not load (made so in a fresh interpreter, GPU host or not),
    the probe says so without importing cuda-python (tens of ms, and ~8,000 objects every
    full garbage collection traverses)."""
    code = (
        "import ctypes, sys\n"
        "real = ctypes.CDLL\n"
        "def cdll(name, *args, **kwargs):\n"
        "    if name == 'libcuda.so.1':\n"
        "        raise OSError(name + ': not here')\n"
        "    return real(name, *args, **kwargs)\n"
        "ctypes.CDLL = cdll\n"
        "from kvpipe.cuda import probe_device\n"
        "probe = probe_device()\n"
        "print(probe.available, probe.note, sorted(m for m in sys.modules if m[:5] == 'cuda.'))\n"
    )
    assert _python(code).stdout.strip() == "False no CUDA driver: libcuda.so.1: not here []"


def test_the_probe_imports_cuda_python_only_where_the_driver_library_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # importing it raises ImportError

    def absent(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(kvpipe.cuda.ctypes, "CDLL", absent)
    probe = kvpipe.cuda.probe_device.__wrapped__()
    assert probe == DeviceProbe(
        False, 0, "no CUDA driver: libcuda.so.1: cannot open shared object file"
    )
    monkeypatch.setattr(kvpipe.cuda.ctypes, "CDLL", lambda name: None)
    probe = kvpipe.cuda.probe_device.__wrapped__()
    assert not probe.available and probe.note.startswith("cuda-python not importable")
