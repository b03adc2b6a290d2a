"""Only ``kvpipe/cuda/`` imports cuda-python, and lazily: importing kvpipe or kvpipe.cuda (and
reaching its engine names) loads no ``cuda`` module."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import kvpipe

PACKAGE = Path(kvpipe.__file__).parent
IMPORTS_CUDA = re.compile(r"^\s*(from\s+cuda[\s.]|import\s+cuda[\s.])", re.MULTILINE)


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
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    assert out.stdout.strip() == "[]"
