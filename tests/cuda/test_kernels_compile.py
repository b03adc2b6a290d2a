"""CI compiles every kernel in ``ext/`` with NVRTC for sm_80 and sm_90, warnings as errors
(no GPU needed), and with ``nvcc`` where it is installed; the disk cache of compiled
kernels; the clear errors when NVRTC or the sources are missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvpipe
from kvpipe.cuda import _nvrtc
from kvpipe.cuda._kernels import KERNELS
from kvpipe.cuda._nvrtc import (
    WERROR,
    compile_source,
    ext_dir,
    kernel_sources,
    load_kernels,
    nvrtc_version,
    supported_archs,
    target_arch,
)

SOURCES = kernel_sources()
NVCC = shutil.which("nvcc")


def test_ext_has_the_copy_kernels() -> None:
    assert [p.name for p in SOURCES] == ["kvpipe_copy.cu"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_kernel_compiles_with_nvrtc_warnings_as_errors(source: Path, arch: str) -> None:
    image = compile_source(source.read_bytes(), source.name, arch)
    assert image[:4] == b"\x7fELF"
    for name in KERNELS:
        assert name.encode() in image


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_compiles_to_ptx_for_newer_devices(arch: str) -> None:
    src = ext_dir() / "kvpipe_copy.cu"
    ptx = compile_source(src.read_bytes(), src.name, arch, "ptx")
    assert ptx.endswith(b"\0")
    for name in KERNELS:
        assert f".entry {name}".encode() in ptx


def test_a_warning_fails_the_compile() -> None:
    src = b'extern "C" __global__ void k(int* p) { int unused = 3; p[0] = 1; }'
    with pytest.raises(kvpipe.DeviceError, match="never referenced") as info:
        compile_source(src, "warn.cu", "sm_80")
    assert info.value.call == "nvrtcCompileProgram"


class NoWerror:
    """NVRTC as 13.0 is: ``-Werror=all-warnings`` is an unrecognized option (seen on the H200
    machine, NVRTC 13.0.88); everything else is the real NVRTC."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.compiles: list[list[bytes]] = []
        self.refused: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def nvrtcCompileProgram(self, prog: Any, n: int, opts: list[bytes]) -> Any:
        self.compiles.append(list(opts))
        if WERROR.encode() in opts:
            self.refused.add(int(prog))
            return (self.real.nvrtcResult.NVRTC_ERROR_INVALID_OPTION,)
        return self.real.nvrtcCompileProgram(prog, n, opts)

    def nvrtcDestroyProgram(self, prog: Any) -> Any:
        self.refused.discard(int(prog))  # the next program may get the same handle
        return self.real.nvrtcDestroyProgram(prog)


@pytest.fixture
def old_nvrtc(monkeypatch: pytest.MonkeyPatch) -> NoWerror:
    fake = NoWerror(_nvrtc._nvrtc())
    real_output = _nvrtc._output

    def output(nvrtc: Any, prog: Any, what: str) -> bytes:
        if what == "ProgramLog" and int(prog) in fake.refused:
            return f"nvrtc: error: unrecognized option {WERROR} found\n\0".encode()
        return real_output(nvrtc, prog, what)

    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: fake)
    monkeypatch.setattr(_nvrtc, "_output", output)
    return fake


def test_an_nvrtc_without_werror_compiles_without_it(old_nvrtc: NoWerror) -> None:
    src = ext_dir() / "kvpipe_copy.cu"
    image = compile_source(src.read_bytes(), src.name, "sm_90")
    assert image[:4] == b"\x7fELF"
    assert [WERROR.encode() in opts for opts in old_nvrtc.compiles] == [True, False]


def test_an_nvrtc_without_werror_still_fails_on_a_warning(old_nvrtc: NoWerror) -> None:
    src = b'extern "C" __global__ void k(int* p) { int unused = 3; p[0] = 1; }'
    with pytest.raises(kvpipe.DeviceError, match="never referenced") as info:
        compile_source(src, "warn.cu", "sm_80")
    assert info.value.code == "WARNING"
    assert len(old_nvrtc.compiles) == 2


def test_another_invalid_option_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nvrtc, "OPTIONS", (*_nvrtc.OPTIONS, "--no-such-option"))
    with pytest.raises(kvpipe.DeviceError, match="no-such-option") as info:
        compile_source(b"", "empty.cu", "sm_90")
    assert info.value.code == "NVRTC_ERROR_INVALID_OPTION"


def test_a_compile_error_carries_the_log() -> None:
    with pytest.raises(kvpipe.DeviceError, match=r"broken\.cu") as info:
        compile_source(b"this is not C++", "broken.cu", "sm_90")
    assert info.value.code == "NVRTC_ERROR_COMPILATION"


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_kernel_compiles_with_nvcc(source: Path, arch: str, tmp_path: Path) -> None:
    assert NVCC is not None
    out = tmp_path / "k.cubin"
    proc = subprocess.run(
        [NVCC, "-std=c++17", "-Werror", "all-warnings", f"-arch={arch}", "-cubin", "-o",
         str(out), str(source)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr.lower()
    assert out.read_bytes()[:4] == b"\x7fELF"


# ---------------------------------------------------------------- architectures


def test_target_arch() -> None:
    supported = (75, 80, 86, 89, 90, 100, 120)
    assert target_arch((8, 0), supported) == ("sm_80", "cubin")
    assert target_arch((9, 0), supported) == ("sm_90", "cubin")
    assert target_arch((8, 7), supported) == ("compute_86", "ptx")  # not in the list
    assert target_arch((13, 0), supported) == ("compute_120", "ptx")  # newer than NVRTC
    with pytest.raises(kvpipe.Unsupported):
        target_arch((6, 1), supported)


def test_nvrtc_knows_the_targets_ci_uses() -> None:
    assert nvrtc_version()[0] >= 12
    assert {80, 90} <= set(supported_archs())


# ---------------------------------------------------------------- the disk cache


def test_cache_is_keyed_and_reused(tmp_path: Path) -> None:
    first = load_kernels((8, 0), cache_dir=tmp_path)
    assert not first.cached and first.path.is_file() and first.arch == "sm_80"
    again = load_kernels((8, 0), cache_dir=tmp_path)
    assert again.cached and again.image == first.image and again.path == first.path
    other = load_kernels((9, 0), cache_dir=tmp_path)
    assert other.path != first.path and not other.cached
    assert first.path.name.startswith("kvpipe_copy-sm_80-")


def test_cache_key_follows_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = tmp_path / "ext"
    ext.mkdir()
    src = (ext_dir() / "kvpipe_copy.cu").read_bytes()
    (ext / "kvpipe_copy.cu").write_bytes(src)
    monkeypatch.setenv("KVPIPE_EXT_DIR", str(ext))
    a = load_kernels((8, 0), cache_dir=tmp_path / "c")
    (ext / "kvpipe_copy.cu").write_bytes(src + b"\n// changed\n")
    b = load_kernels((8, 0), cache_dir=tmp_path / "c")
    assert a.path != b.path and not b.cached


def test_a_corrupt_cache_file_is_recompiled(tmp_path: Path) -> None:
    first = load_kernels((8, 0), cache_dir=tmp_path)
    first.path.write_bytes(b"garbage")
    again = load_kernels((8, 0), cache_dir=tmp_path)
    assert not again.cached and again.image == first.image
    assert first.path.read_bytes() == first.image


def test_an_unwritable_cache_still_compiles(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    image = load_kernels((8, 0), cache_dir=blocker / "sub")
    assert image.image[:4] == b"\x7fELF" and not image.cached


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVPIPE_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _nvrtc.kernel_cache_dir() == tmp_path / "kvpipe" / "kernels"
    monkeypatch.setenv("KVPIPE_KERNEL_CACHE", str(tmp_path / "k"))
    assert _nvrtc.kernel_cache_dir() == tmp_path / "k"


# ---------------------------------------------------------------- clear errors


def test_missing_nvrtc_is_unsupported_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import cuda.bindings

    monkeypatch.delattr(cuda.bindings, "nvrtc", raising=False)
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # the import fails
    with pytest.raises(kvpipe.Unsupported, match="pip install nvidia-cuda-nvrtc"):
        load_kernels((8, 0))


def test_missing_libnvrtc_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLib:
        def nvrtcVersion(self) -> None:
            raise RuntimeError("Failure finding libnvrtc.so. Install it")

    monkeypatch.setattr(_nvrtc, "_nvrtc", lambda: NoLib())
    with pytest.raises(kvpipe.Unsupported, match="nvidia-cuda-nvrtc"):
        nvrtc_version()


def test_missing_sources_are_unsupported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVPIPE_EXT_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(kvpipe.Unsupported, match="KVPIPE_EXT_DIR"):
        load_kernels((8, 0))
    monkeypatch.setenv("KVPIPE_EXT_DIR", str(tmp_path))
    with pytest.raises(kvpipe.Unsupported, match="not found"):
        load_kernels((8, 0))


def test_compiling_never_writes_into_shared_bytes_objects() -> None:
    """NVRTC fills buffers kvpipe allocates; ``b" " * 1`` would be CPython's shared one-byte
    object, and writing into it changed every ``b" "`` in the process."""
    for arch in ("sm_80", "sm_90"):
        for source in kernel_sources():
            compile_source(source.read_bytes(), source.name, arch)
    assert b" " == bytes([32]) and b"x" == bytes([120])
