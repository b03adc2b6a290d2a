"""Run-time compilation of the kernels in ``ext/`` with NVRTC, cached on disk.

Warnings are errors (a log that mentions one fails the compile too). Images go to CUBIN for
an architecture NVRTC knows, else to PTX that the driver finishes. The cache
(:func:`kernel_cache_dir`) is keyed by the source's hash, the architecture, the NVRTC version
and the options; files are written atomically, so concurrent processes at worst compile twice.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, final

from .._errors import DeviceError, Unsupported
from ._driver import checked

__all__ = (
    "OPTIONS",
    "WERROR",
    "KernelImage",
    "compile_source",
    "ext_dir",
    "kernel_cache_dir",
    "kernel_sources",
    "load_kernels",
    "nvrtc_version",
    "supported_archs",
    "target_arch",
)

#: Warnings as errors; dropped for an NVRTC that does not know it (13.0), the log check stays.
WERROR: Final = "-Werror=all-warnings"
#: Options every compile uses (the architecture is added per target).
OPTIONS: Final = ("-std=c++17", WERROR)

Kind = Literal["cubin", "ptx"]
_MISSING = "NVRTC is not available ({}); install it with `pip install nvidia-cuda-nvrtc`"


def ext_dir() -> Path:
    """Where the kernel sources live: ``$KVPIPE_EXT_DIR``, else ``ext/`` beside the package
    (a source checkout), else ``<prefix>/share/kvpipe/ext`` (an installed wheel).

    Raises:
        Unsupported: None of them exists.
    """
    env = os.environ.get("KVPIPE_EXT_DIR")
    if env:
        candidates = [Path(env)]
    else:
        candidates = [
            Path(__file__).resolve().parents[2] / "ext",
            Path(sys.prefix) / "share" / "kvpipe" / "ext",
        ]
    for path in candidates:
        if path.is_dir():
            return path
    raise Unsupported(f"kernel sources not found at {candidates[0]} (set KVPIPE_EXT_DIR)")


def kernel_sources() -> list[Path]:
    """Every ``*.cu`` file of :func:`ext_dir`, sorted."""
    return sorted(ext_dir().glob("*.cu"))


def _nvrtc() -> Any:
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise Unsupported(_MISSING.format(exc)) from exc
    return nvrtc


def _call(nvrtc: Any, name: str, *args: Any) -> tuple[Any, ...]:
    """The outputs of ``nvrtc.<name>(*args)``; :class:`DeviceError` when it fails."""
    return checked(name, getattr(nvrtc, name)(*args), nvrtc.nvrtcResult.NVRTC_SUCCESS)


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor).

    Raises:
        Unsupported: NVRTC cannot be loaded.
    """
    nvrtc = _nvrtc()
    try:
        major, minor = _call(nvrtc, "nvrtcVersion")
    except DeviceError:
        raise
    except Exception as exc:  # the bindings raise when libnvrtc cannot be found
        raise Unsupported(_MISSING.format(str(exc).split(".")[0])) from exc
    return int(major), int(minor)


def supported_archs() -> tuple[int, ...]:
    """Architectures NVRTC can emit CUBIN for, e.g. ``(75, 80, 86, ..., 120)``."""
    nvrtc = _nvrtc()
    nvrtc_version()
    (archs,) = _call(nvrtc, "nvrtcGetSupportedArchs")
    return tuple(int(a) for a in archs)


def target_arch(capability: tuple[int, int], supported: tuple[int, ...]) -> tuple[str, Kind]:
    """The ``--gpu-architecture`` value and output kind for a device.

    A known architecture compiles to CUBIN (``sm_XY``); a newer one to PTX for the newest
    known architecture below it (``compute_XY``), which the driver compiles at load time.

    Raises:
        Unsupported: The device is older than every architecture NVRTC supports.
    """
    cc = capability[0] * 10 + capability[1]
    if cc in supported:
        return f"sm_{cc}", "cubin"
    older = [a for a in supported if a < cc]
    if not older:
        raise Unsupported(f"compute capability {capability} is not supported by this NVRTC")
    return f"compute_{max(older)}", "ptx"


def compile_source(source: bytes, filename: str, arch: str, kind: Kind = "cubin") -> bytes:
    """Compile CUDA C++ ``source`` with NVRTC; warnings are errors.

    Raises:
        Unsupported: NVRTC is missing.
        DeviceError: The compile failed (the message carries NVRTC's log).
    """
    nvrtc = _nvrtc()
    nvrtc_version()
    options = [*OPTIONS, f"--gpu-architecture={arch}"]
    while True:
        (prog,) = _call(nvrtc, "nvrtcCreateProgram", source, filename.encode(), 0, [], [])
        try:
            opts = [o.encode() for o in options]
            result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
            log = _output(nvrtc, prog, "ProgramLog").rstrip(b"\0").decode(errors="replace").strip()
            err = result[0] if isinstance(result, tuple) else result
            if _lacks_werror(nvrtc, err, log) and WERROR in options:
                options.remove(WERROR)  # this NVRTC has no such option: the log check stays
                continue
            where = f"{filename} for {arch}:\n{log}"
            if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise DeviceError("nvrtcCompileProgram", err.name, where)
            if "warning" in log.lower():
                raise DeviceError("nvrtcCompileProgram", "WARNING", where)
            return _output(nvrtc, prog, "CUBIN" if kind == "cubin" else "PTX")
        finally:
            nvrtc.nvrtcDestroyProgram(prog)


def _lacks_werror(nvrtc: Any, err: Any, log: str) -> bool:
    """Whether NVRTC refused the compile for not knowing :data:`WERROR`."""
    return err == nvrtc.nvrtcResult.NVRTC_ERROR_INVALID_OPTION and f"option {WERROR}" in log


def _output(nvrtc: Any, prog: Any, what: str) -> bytes:
    """``nvrtcGet<what>`` of ``prog`` (``CUBIN``, ``PTX``, ``ProgramLog``), sized first."""
    (size,) = _call(nvrtc, f"nvrtcGet{what}Size", prog)
    buf = bytes(int(size))
    _call(nvrtc, f"nvrtcGet{what}", prog, buf)
    return buf


def kernel_cache_dir() -> Path:
    """``$KVPIPE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/kvpipe/kernels``, else
    ``~/.cache/kvpipe/kernels``."""
    env = os.environ.get("KVPIPE_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvpipe" / "kernels"


@final
@dataclass(frozen=True, slots=True)
class KernelImage:
    """A compiled module: the bytes ``cuModuleLoadData`` takes, and where they came from.

    Attributes:
        image: CUBIN (ELF) or NUL-terminated PTX.
        arch: ``sm_XY`` or ``compute_XY``.
        kind: ``"cubin"`` or ``"ptx"``.
        path: The cache file.
        cached: Whether it was read from the cache rather than compiled now.
    """

    image: bytes
    arch: str
    kind: Kind
    path: Path
    cached: bool


def _looks_valid(data: bytes, kind: Kind) -> bool:
    if kind == "cubin":
        return data[:4] == b"\x7fELF"
    return data.endswith(b"\0") and b".entry" in data


def load_kernels(
    capability: tuple[int, int], *, source: str = "kvpipe_copy.cu", cache_dir: Path | None = None
) -> KernelImage:
    """The compiled module for ``source`` on a device of ``capability``, from the disk cache
    or compiled now (and cached). Blocking: call it from a worker thread.

    Raises:
        Unsupported: NVRTC or the source is missing, or the device is too old.
        DeviceError: The compile failed.
    """
    src_path = ext_dir() / source
    if not src_path.is_file():
        raise Unsupported(f"kernel source {src_path} not found")
    text = src_path.read_bytes()
    version = nvrtc_version()
    arch, kind = target_arch(capability, supported_archs())
    parts = (text, arch.encode(), kind.encode(), repr(version).encode(), *map(str.encode, OPTIONS))
    digest = hashlib.sha256(b"".join(part + b"\0" for part in parts))
    directory = cache_dir if cache_dir is not None else kernel_cache_dir()
    path = directory / f"{src_path.stem}-{arch}-{digest.hexdigest()[:32]}.{kind}"
    try:
        data = path.read_bytes()
        if _looks_valid(data, kind):
            return KernelImage(data, arch, kind, path, cached=True)
    except OSError:
        pass
    image = compile_source(text, src_path.name, arch, kind)
    _store(path, image)
    return KernelImage(image, arch, kind, path, cached=False)


def _store(path: Path, data: bytes) -> None:
    """Write atomically; a cache that cannot be written is not an error (compile next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return
