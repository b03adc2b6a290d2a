"""Device tensors as kvpipe sees them: a device, a base address, a shape, a dtype.

Recognised without importing any framework: Paddle GPU and PyTorch CUDA tensors (through
``data_ptr()``) and any DLPack tensor on a CUDA device (the address is read from its capsule,
released unconsumed). Also the framework's current stream, for ordering when none is passed.
"""

from __future__ import annotations

import ctypes
import importlib
from dataclasses import dataclass
from typing import Any, Final, final

from ._errors import LayoutError, RequestError

__all__ = (
    "DeviceTensor",
    "current_stream",
    "device_tensor",
    "dtype_name",
    "parse_device",
)

_KDL_CUDA: Final = 2
_KDL_CUDA_MANAGED: Final = 13
# (DLDataTypeCode, bits) -> kvpipe dtype name; lanes must be 1.
_DL_DTYPES: Final = {
    (0, 8): "int8",
    (1, 8): "uint8",
    (2, 16): "float16",
    (2, 32): "float32",
    (4, 16): "bfloat16",
    (10, 8): "float8_e4m3fn",
}


class _DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


class _DLManagedTensor(ctypes.Structure):
    _fields_ = (
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    )


@final
@dataclass(frozen=True, slots=True)
class DeviceTensor:
    """A tensor in CUDA device memory.

    Attributes:
        device: ``"cuda:N"``.
        pointer: Address of its first element.
        shape: Its shape.
        dtype: Its dtype's name (``"bfloat16"``; kvpipe names where they exist).
        contiguous: Row-major and dense.
    """

    device: str
    pointer: int
    shape: tuple[int, ...]
    dtype: str
    contiguous: bool


def parse_device(device: str) -> int | None:
    """``"cpu"`` → ``None``; ``"gpu"``, ``"cuda"`` → 0; ``"gpu:N"``, ``"cuda:N"`` → N.

    Raises:
        LayoutError: Anything else.
    """
    if isinstance(device, str):
        if device == "cpu":
            return None
        kind, _, index = device.partition(":")
        if kind in ("gpu", "cuda") and (index == "" or index.isdigit()):
            return int(index or 0)
    raise LayoutError(f"unknown device {device!r}; expected 'cpu', 'gpu:N' or 'cuda:N'")


def dtype_name(dtype: Any) -> str:
    """``paddle.bfloat16`` / ``torch.bfloat16`` / numpy dtype → ``bfloat16``."""
    return str(dtype).rsplit(".", 1)[-1]


def _with_data_ptr(t: Any, index: int) -> DeviceTensor:
    """A Paddle or PyTorch tensor on CUDA device ``index``, through ``data_ptr()``."""
    shape = tuple(int(d) for d in t.shape)
    contiguous = bool(t.is_contiguous())
    return DeviceTensor(f"cuda:{index}", int(t.data_ptr()), shape, dtype_name(t.dtype), contiguous)


def device_tensor(t: Any) -> DeviceTensor | None:
    """Describe ``t`` when it lives in CUDA device memory; ``None`` for anything else.

    Raises:
        LayoutError: A DLPack CUDA tensor whose capsule cannot be read.
    """
    place = getattr(t, "place", None)
    if type(t).__module__.startswith("paddle") and place is not None:
        return _with_data_ptr(t, int(place.gpu_device_id())) if place.is_gpu_place() else None
    device = getattr(t, "device", None)
    if getattr(device, "type", None) == "cuda" and hasattr(t, "data_ptr"):
        return _with_data_ptr(t, int(getattr(device, "index", None) or 0))
    dl_device = getattr(t, "__dlpack_device__", None)
    if dl_device is not None and hasattr(t, "__dlpack__"):
        kind, index = (int(v) for v in dl_device())
        if kind in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            return _from_dlpack(t, index)
    return None


def _from_dlpack(t: Any, index: int) -> DeviceTensor:
    try:
        capsule = t.__dlpack__(stream=-1)  # -1: the producer must not synchronise
    except TypeError:
        capsule = t.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = (ctypes.py_object, ctypes.c_char_p)
    try:
        address = get(capsule, b"dltensor")
    except ValueError as exc:
        raise LayoutError(f"unreadable DLPack capsule from {type(t).__name__}: {exc}") from exc
    dl = _DLManagedTensor.from_address(address).dl_tensor
    shape = tuple(int(dl.shape[i]) for i in range(dl.ndim))
    contiguous = True
    if dl.strides:
        expected = 1
        for i in reversed(range(dl.ndim)):
            if shape[i] != 1 and int(dl.strides[i]) != expected:
                contiguous = False
            expected *= shape[i]
    code, bits, lanes = int(dl.dtype.code), int(dl.dtype.bits), int(dl.dtype.lanes)
    dtype = _DL_DTYPES.get((code, bits), f"dlpack(code={code},bits={bits})")
    if lanes != 1:
        dtype = f"dlpack(code={code},bits={bits},lanes={lanes})"
    pointer = int(dl.data or 0) + int(dl.byte_offset)
    del capsule  # unconsumed: its destructor returns it to the producer
    return DeviceTensor(f"cuda:{index}", pointer, shape, dtype, contiguous)


def current_stream(framework: str, ordinal: int) -> int:
    """The framework's current CUDA stream on device ``ordinal``, as a ``CUstream`` handle.

    Raises:
        RequestError: The framework has no notion of a current stream kvpipe knows; pass
            ``stream=`` explicitly.
    """
    try:
        if framework == "paddle":
            paddle: Any = importlib.import_module("paddle")
            return int(paddle.device.current_stream(f"gpu:{ordinal}").stream_base.cuda_stream)
        if framework == "torch":
            torch: Any = importlib.import_module("torch")
            return int(torch.cuda.current_stream(ordinal).cuda_stream)
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise RequestError(f"cannot get the current {framework} stream: {exc!r}") from exc
    raise RequestError(
        f"a {framework} device cache has no current stream kvpipe can find: pass stream= "
        "(the CUstream the producing kernels run on) to write() and read()"
    )
