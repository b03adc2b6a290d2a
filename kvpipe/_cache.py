"""KV caches: the caller's tensors, seen by kvpipe as rows of bytes per block.

A :class:`KVCache` keeps one tensor per ``(role, layer)`` in contract order and, for a host
cache, a ``uint8`` view ``[num_blocks, role_block_nbytes]`` aliasing each (no copy). CUDA
tensors (Paddle, PyTorch, DLPack) make a *device cache*: only their base addresses are kept
and the CUDA engine (:mod:`kvpipe.cuda`) moves their blocks.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, cast, final

import numpy as np
import numpy.typing as npt

from ._device_tensors import DeviceTensor, device_tensor, dtype_name, parse_device
from ._errors import LayoutError, Unsupported
from ._hostcopy import RowGroups
from ._layout import CacheLayout, RoleSpec, numpy_dtype
from ._plan import CopySegment

__all__ = ("KVCache", "create_kv_cache")

ByteRows = npt.NDArray[np.uint8]
_PAGE = 4096


def _check_tensor(
    spec: RoleSpec,
    layer: int,
    dtype: str,
    shape: tuple[int, ...],
    contiguous: bool,
    num_blocks: int,
) -> None:
    """Refuse a tensor for ``spec``'s ``layer`` of another dtype or shape, or not row-major."""
    want = (num_blocks, *spec.block_shape)
    if dtype != spec.dtype:
        raise LayoutError(f"{spec.name}[{layer}]: dtype {dtype}, expected {spec.dtype}")
    if shape != want:
        raise LayoutError(f"{spec.name}[{layer}]: shape {list(shape)}, expected {list(want)}")
    if not contiguous:
        raise LayoutError(f"{spec.name}[{layer}]: tensor is not C-contiguous")


def _numpy_rows(spec: RoleSpec, layer: int, arr: npt.NDArray[Any], num_blocks: int) -> ByteRows:
    shape = tuple(arr.shape)
    _check_tensor(spec, layer, str(arr.dtype), shape, arr.flags.c_contiguous, num_blocks)
    if not arr.flags.writeable:
        raise LayoutError(f"{spec.name}[{layer}]: tensor is read-only")
    rows: ByteRows = arr.reshape(num_blocks, -1).view(np.uint8)
    return rows


def _data_ptr_rows(spec: RoleSpec, layer: int, t: Any, num_blocks: int) -> ByteRows:
    """Rows aliasing a CPU tensor that exposes ``data_ptr()`` (Paddle, PyTorch)."""
    shape = tuple(int(d) for d in t.shape)
    _check_tensor(spec, layer, dtype_name(t.dtype), shape, t.is_contiguous(), num_blocks)
    nbytes = num_blocks * spec.block_nbytes
    if nbytes == 0:
        return np.empty((num_blocks, 0), dtype=np.uint8)
    raw = (ctypes.c_uint8 * nbytes).from_address(int(t.data_ptr()))
    rows: ByteRows = np.ctypeslib.as_array(raw).reshape(num_blocks, spec.block_nbytes)
    return rows


def _rows_for(spec: RoleSpec, layer: int, t: Any, num_blocks: int) -> ByteRows:
    """Rows aliasing a host tensor: numpy, Paddle, one with ``data_ptr()``, DLPack or an array."""
    if isinstance(t, np.ndarray):
        return _numpy_rows(spec, layer, t, num_blocks)
    if type(t).__module__.startswith("paddle"):
        if not t.place.is_cpu_place():  # a GPU one makes a device cache: not here
            raise Unsupported(
                f"{spec.name}[{layer}] is a Paddle tensor on {t.place}; kvpipe reaches CPU "
                "and CUDA GPU tensors only"
            )
        return _data_ptr_rows(spec, layer, t, num_blocks)
    device = getattr(t, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise Unsupported(f"{spec.name}[{layer}] lives on {device}; only CPU tensors here")
    if hasattr(t, "data_ptr") and hasattr(t, "is_contiguous"):
        return _data_ptr_rows(spec, layer, t, num_blocks)
    if hasattr(t, "__dlpack__") or hasattr(t, "__array_interface__"):
        try:
            arr = np.from_dlpack(t) if hasattr(t, "__dlpack__") else np.asarray(t)
        except (RuntimeError, TypeError, BufferError) as exc:
            raise LayoutError(f"{spec.name}[{layer}]: cannot import tensor: {exc}") from exc
        return _numpy_rows(spec, layer, arr, num_blocks)
    raise LayoutError(f"{spec.name}[{layer}]: unsupported tensor type {type(t).__name__}")


def _device_pointers(
    layout: CacheLayout, infos: Sequence[DeviceTensor | None], num_blocks: int
) -> tuple[str, list[int]]:
    """Check device tensors against ``layout`` (contract order); their device and pointers."""
    if any(info is None for info in infos):
        raise LayoutError("a cache cannot mix host and device tensors")
    devices = sorted({info.device for info in infos if info is not None})
    if len(devices) != 1:
        raise LayoutError(f"a cache's tensors must be on one device, got {devices}")
    pointers = []
    for (role, layer), info in zip(layout.tensor_order(), infos, strict=True):
        assert info is not None
        _check_tensor(layout.role(role), layer, info.dtype, info.shape, info.contiguous, num_blocks)
        if info.pointer == 0:
            raise LayoutError(f"{role}[{layer}]: null device pointer")
        pointers.append(info.pointer)
    return devices[0], pointers


def _check_disjoint(
    order: Sequence[tuple[str, int]], starts: Sequence[int], extents: Sequence[int]
) -> None:
    """Refuse tensors whose memory overlaps (``starts`` all in one address space; empty
    extents overlap nothing): a read would write one's blocks over the other's."""
    spans = sorted(
        (start, start + extent, i)
        for i, (start, extent) in enumerate(zip(starts, extents, strict=True))
        if extent > 0
    )
    # Sorted by start, some two spans overlap exactly when some span starts before the end
    # of the one just before it (if span i overlaps a later span j, span i + 1 starts no
    # later than j, so before the end of i).
    for before, after in itertools.pairwise(spans):
        if after[0] < before[1]:
            (role_a, layer_a), (role_b, layer_b) = (order[i] for i in sorted((before[2], after[2])))
            raise LayoutError(
                f"{role_a}[{layer_a}] and {role_b}[{layer_b}] share memory (the same tensor "
                "twice, or overlapping views of one buffer): a read would write one over the "
                "other; give each (role, layer) a tensor of its own"
            )


def _framework_of(t: Any) -> str:
    module = type(t).__module__
    for name in ("paddle", "torch"):
        if module.startswith(name):
            return name
    return "numpy"


def _leading_dim(t: Any) -> int:
    shape = getattr(t, "shape", None)
    if shape is None or len(shape) == 0:
        raise LayoutError(f"tensor of type {type(t).__name__} has no shape")
    return int(shape[0])


@final
class KVCache:
    """The caller's KV cache: one tensor per ``(role, layer)``, in contract order, no two
    sharing memory.

    Build one with :func:`create_kv_cache`, :func:`kvpipe.create_host_cache` or
    :meth:`from_tensors`.
    kvpipe never resizes or reallocates the tensors; it reads and writes whole blocks of them.
    """

    __slots__ = (
        "_device",
        "_framework",
        "_freed",
        "_groups",
        "_layout",
        "_num_blocks",
        "_order",
        "_pointers",
        "_release",
        "_rows",
        "_tensors",
    )

    def __init__(
        self,
        layout: CacheLayout,
        tensors: Sequence[Any],
        rows: Sequence[ByteRows],
        framework: str,
        *,
        device: str = "cpu",
        pointers: Sequence[int] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._layout = layout
        self._tensors = tuple(tensors)
        self._rows = tuple(rows)
        self._framework = framework
        self._device = device
        self._order = {rl: i for i, rl in enumerate(layout.tensor_order())}
        if pointers is None:
            pointers = [int(r.ctypes.data) for r in self._rows]
        self._pointers = tuple(int(p) for p in pointers)
        self._num_blocks = _leading_dim(self._tensors[0]) if self._tensors else 0
        self._release = release
        self._freed = False
        self._groups: RowGroups | None = None

    @classmethod
    def from_tensors(
        cls,
        layout: CacheLayout,
        tensors: Sequence[Any] | Mapping[tuple[str, int], Any],
    ) -> KVCache:
        """Wrap caller-owned tensors (numpy, Paddle, PyTorch, DLPack) without copying them.

        Host tensors give a host cache; CUDA tensors (Paddle GPU, PyTorch CUDA, DLPack with a
        CUDA device) give a device cache (:attr:`device` ``"cuda:N"``), all on one device.

        Args:
            layout: The layout the tensors follow.
            tensors: Either a sequence in contract order (layer-major; roles key, value,
                key_scale, value_scale, indexer) or a mapping ``{(role, layer): tensor}``.

        Raises:
            LayoutError: ``layout`` is not a layout or ``tensors`` not a sequence or mapping
                of tensors; a tensor is missing, extra, or has the wrong dtype, shape,
                contiguity, or number of blocks; host and device tensors are mixed, or
                the tensors are on several devices; or two tensors share memory (the same
                tensor for two roles or layers, or overlapping views of one buffer: a read
                would write one over the other), the message naming both.
            Unsupported: A tensor lives on a device kvpipe cannot reach.
        """
        if not isinstance(layout, CacheLayout):
            raise LayoutError(f"layout must be a kvpipe.CacheLayout, got {type(layout).__name__}")
        order = layout.tensor_order()
        if isinstance(tensors, str | bytes) or not isinstance(tensors, Iterable):
            raise LayoutError(
                "tensors must be a sequence of tensors in contract order or a mapping "
                f"{{(role, layer): tensor}}, got {type(tensors).__name__}"
            )
        if isinstance(tensors, Mapping):
            extra = set(tensors) - set(order)
            if extra:
                # Sorted by repr: the keys may be of types that do not compare.
                raise LayoutError(f"unexpected tensors for this layout: {sorted(extra, key=repr)}")
            missing = [rl for rl in order if rl not in tensors]
            if missing:
                raise LayoutError(f"missing tensors: {missing[:4]}")
            seq = [tensors[rl] for rl in order]
        else:
            seq = list(tensors)
            if len(seq) != len(order):
                raise LayoutError(
                    f"expected {len(order)} tensors in contract order, got {len(seq)}"
                )
        num_blocks = _leading_dim(seq[0])
        if num_blocks <= 0:
            raise LayoutError("a cache needs at least one block")
        framework = _framework_of(seq[0])
        infos = [None if isinstance(t, np.ndarray) else device_tensor(t) for t in seq]
        extents = [num_blocks * layout.role(role).block_nbytes for role, _ in order]
        if any(info is not None for info in infos):
            device, pointers = _device_pointers(layout, infos, num_blocks)
            _check_disjoint(order, pointers, extents)  # all on one device
            kind = framework if framework != "numpy" else "dlpack"
            return cls(layout, seq, (), kind, device=device, pointers=pointers)
        rows = [
            _rows_for(layout.role(role), layer, t, num_blocks)
            for (role, layer), t in zip(order, seq, strict=True)
        ]
        _check_disjoint(order, [int(r.ctypes.data) for r in rows], extents)  # all host memory
        return cls(layout, seq, rows, "paddle" if framework == "paddle" else "numpy")

    @property
    def layout(self) -> CacheLayout:
        """The layout of this cache."""
        return self._layout

    @property
    def num_blocks(self) -> int:
        """Blocks per tensor."""
        return self._num_blocks

    @property
    def framework(self) -> str:
        """``"numpy"`` or ``"paddle"`` (host caches); ``"paddle"``, ``"torch"`` or
        ``"dlpack"`` (device caches)."""
        return self._framework

    @property
    def device(self) -> str:
        """``"cpu"`` for a host cache, ``"cuda:N"`` for a device cache."""
        return self._device

    @property
    def pointers(self) -> tuple[int, ...]:
        """Base address of each tensor, in contract order (device addresses for a device
        cache)."""
        return self._pointers

    @property
    def byte_rows(self) -> tuple[ByteRows, ...]:
        """``uint8`` views ``[num_blocks, role_block_nbytes]`` aliasing each tensor, in order.

        Raises:
            Unsupported: A device cache (its memory is not addressable from the host).
            LayoutError: The cache was freed.
        """
        if self._freed:
            raise LayoutError("this cache was freed")
        if self._device != "cpu":
            raise Unsupported(
                f"a device cache ({self._device}) has no host byte rows; the CUDA engine "
                "moves its blocks"
            )
        return self._rows

    def row_groups(self, segments: tuple[CopySegment, ...]) -> RowGroups:
        """:attr:`byte_rows` grouped for the copies of ``segments`` (made once).

        Raises:
            Unsupported, LayoutError: As :attr:`byte_rows`.
        """
        rows = self.byte_rows
        groups = self._groups
        if groups is None or (groups.segments is not segments and groups.segments != segments):
            groups = self._groups = RowGroups(segments, rows)
        return groups

    @property
    def freed(self) -> bool:
        """Whether :meth:`free` has run."""
        return self._freed

    def free(self) -> None:
        """Release what kvpipe allocated for this cache (the pinned memory of
        :func:`create_host_cache`) and drop its references to the tensors. Idempotent. The
        cache and any view of its tensors must not be used afterwards."""
        if self._freed:
            return
        self._freed = True
        self._rows = ()
        self._groups = None
        self._tensors = ()
        release, self._release = self._release, None
        if release is not None:
            release()

    def tensors(self) -> list[Any]:
        """The tensors in contract order (layer-major, roles in ``ROLE_ORDER``)."""
        return list(self._tensors)

    def __getitem__(self, key: tuple[str, int]) -> Any:
        try:
            return self._tensors[self._order[key]]
        except KeyError:
            raise KeyError(f"no tensor {key!r}; layout roles are {self._layout.roles}") from None

    def names(self, rank: int = 0, device_id: int = 0) -> list[str]:
        """Conventional names, in contract order (``key_caches_{l}_rank{r}.device{d}``...)."""
        return [
            CacheLayout.tensor_name(role, layer, rank, device_id)
            for role, layer in self._layout.tensor_order()
        ]

    def __repr__(self) -> str:
        return (
            f"KVCache({self._layout.kind}, layers={self._layout.num_layers}, "
            f"blocks={self._num_blocks}, framework={self._framework}, device={self._device})"
        )


def create_kv_cache(
    layout: CacheLayout,
    num_blocks: int,
    framework: Literal["numpy", "paddle"] = "numpy",
    device: str = "cpu",
) -> KVCache:
    """Allocate a zeroed cache for ``layout`` with ``num_blocks`` blocks per tensor.

    Args:
        layout: The layout to allocate.
        num_blocks: Blocks per tensor (> 0).
        framework: ``"numpy"`` or ``"paddle"`` (needs the ``paddle`` extra).
        device: ``"cpu"``, or ``"gpu:N"`` / ``"cuda:N"`` for per-(role, layer) tensors on
            a GPU (``framework="paddle"`` with a CUDA build of Paddle).

    Raises:
        LayoutError: ``layout`` is not a layout, ``num_blocks`` is not positive, or
            ``framework`` or ``device`` is unknown.
        Unsupported: Paddle is not installed, or a GPU was asked for and this framework or
            build cannot allocate there (numpy; a CPU-only Paddle).
    """
    if not isinstance(layout, CacheLayout):
        raise LayoutError(f"layout must be a kvpipe.CacheLayout, got {type(layout).__name__}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise LayoutError(f"num_blocks must be a positive int, got {num_blocks!r}")
    ordinal = parse_device(device)
    specs = [layout.role(role) for role, _ in layout.tensor_order()]
    if framework == "numpy":
        if ordinal is not None:
            raise Unsupported(
                f"device {device!r}: numpy allocates host memory only; use framework='paddle'"
            )
        return KVCache.from_tensors(layout, _zeros_on_pages(specs, num_blocks))
    if framework == "paddle":
        try:
            import paddle
        except ImportError as exc:
            raise Unsupported("framework='paddle' needs `pip install kvpipe[paddle]`") from exc
        if ordinal is not None and not paddle.device.is_compiled_with_cuda():
            raise Unsupported(f"device {device!r}: this Paddle build has no CUDA support")
        where = "cpu" if ordinal is None else f"gpu:{ordinal}"
        tensors = [
            paddle.zeros([num_blocks, *s.block_shape], dtype=cast(Any, s.dtype), device=where)
            for s in specs
        ]
        return KVCache.from_tensors(layout, tensors)
    raise LayoutError(f"unknown framework {framework!r}; expected 'numpy' or 'paddle'")


def _zeros_on_pages(specs: Sequence[RoleSpec], num_blocks: int) -> list[npt.NDArray[Any]]:
    """Zeroed ``[num_blocks, *block_shape]`` arrays of ``specs`` in one buffer, each starting
    on a page.

    Page-aligned like staging slots, so copies between them are aligned; in one buffer at
    equal steps, so ``_hostcopy.RowGroups`` copies them as one 3-D view per run of blocks.
    """
    sizes = [num_blocks * spec.block_nbytes for spec in specs]
    steps = [-(-n // _PAGE) * _PAGE for n in sizes]
    total = sum(steps) + _PAGE
    try:
        raw = np.zeros(total, np.uint8)  # calloc: pages are mapped when first touched
    except ValueError:  # beyond what one numpy array can address
        raise LayoutError(f"a cache of {num_blocks} blocks ({total} bytes) is too large") from None
    at = -raw.ctypes.data % _PAGE
    out = []
    for spec, nbytes, step in zip(specs, sizes, steps, strict=True):
        array = raw[at : at + nbytes].view(numpy_dtype(spec.dtype))
        out.append(array.reshape(num_blocks, *spec.block_shape))
        at += step
    return out
