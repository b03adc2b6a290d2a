"""The public API surface: ``kvpipe.__all__``, the names the issue fixes, ``py.typed``, and a
light import (no CUDA or Paddle at import time)."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import kvpipe

ISSUE_NAMES = [
    "CacheLayout",
    "KVCache",
    "create_kv_cache",
    "MemoryStore",
    "PipelineConfig",
    "open_pipeline",
    "Residency",
    "WriteResult",
    "ReadResult",
    "SliceOutcome",
    "IncompleteRead",
    "PipelineClosed",
    "RequestError",
    "ConfigError",
    "KVPipeError",
    "StorageBackend",
]


def test_all_is_sorted_tuple_of_unique_names() -> None:
    assert isinstance(kvpipe.__all__, tuple)
    assert list(kvpipe.__all__) == sorted(kvpipe.__all__)
    assert len(set(kvpipe.__all__)) == len(kvpipe.__all__)
    assert all(isinstance(n, str) for n in kvpipe.__all__)


def test_every_name_resolves() -> None:
    for name in kvpipe.__all__:
        assert getattr(kvpipe, name) is not None, name


def test_star_import_gives_exactly_all() -> None:
    ns: dict[str, object] = {}
    exec("from kvpipe import *", ns)
    assert {k for k in ns if k != "__builtins__"} == set(kvpipe.__all__)


@pytest.mark.parametrize("name", ISSUE_NAMES)
def test_issue_names_present(name: str) -> None:
    assert name in kvpipe.__all__
    assert hasattr(kvpipe, name)


def test_kinds_of_public_names() -> None:
    assert inspect.isclass(kvpipe.CacheLayout)
    assert inspect.isclass(kvpipe.KVCache)
    assert callable(kvpipe.create_kv_cache)
    assert callable(kvpipe.open_pipeline)
    assert inspect.isabstract(kvpipe.StorageBackend)
    assert issubclass(kvpipe.MemoryStore, kvpipe.StorageBackend)
    assert {"GPU", "CPU", "EVICTED"} <= {m.name for m in kvpipe.Residency}


def test_version() -> None:
    assert isinstance(kvpipe.__version__, str)
    assert kvpipe.__version__.count(".") >= 1


def test_py_typed_exists() -> None:
    assert (Path(kvpipe.__file__).parent / "py.typed").is_file()


def test_import_does_not_load_cuda_or_paddle() -> None:
    code = (
        "import sys, kvpipe\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('cuda', 'paddle', 'torch'))\n"
        "print(kvpipe.__file__)\n"
        "print(repr(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(kvpipe.__file__).parent.parent,
    )
    imported, heavy = out.stdout.strip().splitlines()
    assert Path(imported) == Path(kvpipe.__file__)
    assert heavy == "[]"


def test_the_cli_and_the_pipeline_import_without_pytest() -> None:
    """``make run`` installs kvpipe without its test extras: nothing it imports needs pytest."""
    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "import kvpipe, kvpipe.cli, kvpipe.testing.scenarios\n"
        "try:\n"
        "    kvpipe.testing.BackendConformance\n"
        "except ImportError:\n"
        "    print('conformance needs pytest')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "conformance needs pytest", out.stderr


def test_the_fault_injector_is_where_the_docs_say() -> None:
    """docs/reliability.md: ``kvpipe.testing.FaultyStore`` wraps any backend, driven by a
    ``FaultPlan`` (both were only in ``kvpipe.testing.faults``: AttributeError)."""
    import kvpipe.testing
    from kvpipe.testing import faults

    assert kvpipe.testing.FaultyStore is faults.FaultyStore
    assert kvpipe.testing.FaultPlan is faults.FaultPlan
    assert {"FaultyStore", "FaultPlan"} <= set(kvpipe.testing.__all__)


#: Packages only the extras bring (test, paddle, mooncake, metrics, plots, bench), and what
#: those pull in: nothing `make run` imports (the CLI, every bench scenario's module, the
#: integrations) may need one of them at import time.
_NOT_BASE = (
    "pytest",
    "hypothesis",
    "trio",
    "sniffio",
    "paddle",
    "mooncake",
    "prometheus_client",
    "matplotlib",
    "uvicorn",
    "h11",
    "nvidia",
)


def test_make_runs_imports_need_only_the_base_dependencies() -> None:
    """``make run`` installs the base dependencies alone. The FastDeploy integration once
    imported sniffio (which anyio no longer brings) and broke ``make run`` on a fresh clone
    while ``make test`` (whose extras bring it) stayed green."""
    code = (
        "import sys\n"
        f"for name in {_NOT_BASE!r}: sys.modules[name] = None\n"
        "import kvpipe, kvpipe.cli, kvpipe.cli.bench, kvpipe.integrations.fastdeploy\n"
        "import kvpipe.benchmarks.integration, kvpipe.benchmarks.server\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
