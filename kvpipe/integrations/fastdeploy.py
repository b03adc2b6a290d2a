"""FastDeploy drop-in: kvpipe as the cache transfer manager's storage backend.

The manager calls its backend synchronously from worker threads, in one of two shapes (see
``docs/integrations/fastdeploy.md``): :class:`KVPipeAttentionStore` (``attention_store``, a
kvpipe pipeline over the per-layer Paddle caches) and :class:`KVPipeStorage` (``file`` /
``mooncake``, keys and host pointers on a kvpipe store). Each instance owns one event-loop
thread; calls hop onto it and never hold the caller past their ``timeout`` plus
:data:`HOP_SLACK`, but to let a copy into or out of the caches still running then end
(nothing touches them after a call returned). Storage failures come back as FastDeploy's
counts and codes with one WARNING; programming errors (wrong types, shapes) raise.

Prefill→decode via storage (``FD_PD_TRANSFER_VIA_STORAGE=1``): the prefill side's ``write``
includes the partial last block (key suffix ``:partial:N``); the decode side's ``read``
includes it and requires every block, reporting anything less as the honest loaded count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import (
    BackendError,
    CacheLayout,
    ConfigError,
    IncompleteRead,
    KVCache,
    KVPipeError,
    LayoutError,
    Pipeline,
    PipelineClosed,
    PipelineConfig,
    RequestError,
    Residency,
    StorageBackend,
    WrongEventLoop,
    open_pipeline,
)
from .. import FileStore as _FileStore
from .._device_tensors import device_tensor, parse_device
from .._lograte import LogLimiter
from .._validate import check_start_block
from ._fd_storage import KVPipeStorage
from ._portal import HOP_SLACK, LoopThread, default_store_dir, store_from_url

__all__ = ("HOP_SLACK", "KVPipeAttentionStore", "KVPipeStorage")

log = logging.getLogger("kvpipe.integrations.fastdeploy")

_NS_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _namespace(namespace: str, model_version: str) -> str:
    """kvpipe's namespace for FastDeploy's (namespace, model version): both are in every key,
    and two different pairs never make one namespace.

    ``namespace.model_version`` where that is a kvpipe namespace and ``namespace`` has no
    ``.`` (it then ends at the first one); otherwise a cleaned prefix and a hash of the pair
    itself (``("a.b", "c")`` and ``("a", "b.c")`` joined alike would share every block).
    """
    raw = f"{namespace}.{model_version}"
    if "." not in namespace and _NS_OK.fullmatch(raw):
        return raw
    clean = re.sub(r"[^A-Za-z0-9._-]", "-", raw).lstrip("._-")[:100] or "ns"
    pair = json.dumps([str(namespace), str(model_version)]).encode()
    return f"{clean}.{hashlib.blake2b(pair, digest_size=6).hexdigest()}"


def _env_int(name: str, raw: str) -> int:
    """Environment variable ``name``'s integer value (empty: 0).

    Raises:
        ConfigError: It is not an integer (``field``: ``name``).
    """
    try:
        return int(raw.strip() or 0)
    except ValueError:
        raise ConfigError(name, f"expected an integer, got {raw!r}") from None


def _start_index(start: Any) -> int:
    """A write's or read's start block index as an int: an int or a numpy integer, not a
    bool, as ``query`` (:func:`kvpipe._validate.check_start_block`) takes it.

    Raises:
        RequestError: Anything else, or a negative index.
    """
    if isinstance(start, bool) or not isinstance(start, int | np.integer) or start < 0:
        raise RequestError(f"start block index must be an int >= 0, got {start!r}")
    return int(start)


def infer_layout(
    key_cache: Sequence[Any],
    val_cache: Sequence[Any],
    layer_num: int,
    block_token_size: int,
    *,
    key_scales: Sequence[Any] | None = None,
    rope_dim: int = 64,
) -> CacheLayout:
    """The kvpipe layout of FastDeploy's per-layer caches.

    ``key_cache[l]`` is ``[num_blocks, kv_heads, block_size, head_dim]``; ``val_cache`` is
    empty for MLA (``[num_blocks, 1, block_size, kv_lora_rank + rope_dim]``); uint8 caches
    with scale tensors are block-wise fp8.

    Raises:
        TypeError: ``key_cache`` or ``val_cache`` is not a list (or tuple) of tensors.
        LayoutError: The tensors disagree with ``layer_num`` / ``block_token_size`` or with
            each other (the message names the shapes; a ``ValueError``).
    """
    if not isinstance(key_cache, (list, tuple)) or not isinstance(val_cache, (list, tuple)):
        raise TypeError("key_cache and val_cache must be lists of per-layer tensors")
    shapes = [tuple(int(d) for d in t.shape) for t in key_cache]
    if len(key_cache) != layer_num or (val_cache and len(val_cache) != layer_num):
        raise LayoutError(
            f"expected {layer_num} per-layer tensors (layer_num), got {len(key_cache)} key and "
            f"{len(val_cache)} value tensors"
        )
    if not shapes or any(len(s) != 4 for s in shapes):
        raise LayoutError(
            f"key caches must be [num_blocks, heads, block_size, dim], got {shapes[:2]}"
        )
    _, heads, block_size, dim = shapes[0]
    if block_size != block_token_size:
        raise LayoutError(
            f"key cache shape {shapes[0]} has block size {block_size}, but block_token_size is "
            f"{block_token_size}"
        )
    dtype = str(key_cache[0].dtype).removeprefix("paddle.")
    if not val_cache:
        if heads != 1 or dim <= rope_dim:
            raise LayoutError(
                f"MLA cache shape {shapes[0]}: expected [n, 1, bs, lora + {rope_dim}]"
            )
        return CacheLayout.mla(
            num_layers=layer_num,
            kv_lora_rank=dim - rope_dim,
            rope_dim=rope_dim,
            block_size=block_size,
            dtype=dtype,
        )
    vshapes = [tuple(int(d) for d in t.shape) for t in val_cache]
    if vshapes != shapes:
        raise LayoutError(
            f"value cache shapes {vshapes[:2]} differ from key cache shapes {shapes[:2]}"
        )
    return CacheLayout.gqa(
        num_layers=layer_num,
        num_kv_heads=heads,
        head_dim=dim,
        block_size=block_size,
        dtype=dtype,
        fp8_scales=bool(key_scales),
        # FastDeploy's scales are of paddle's default dtype (float32, or the model's)
        scale_dtype=str(key_scales[0].dtype).removeprefix("paddle.") if key_scales else "bfloat16",
    )


class _FirstBlocks:
    """The first ``num_blocks`` blocks of a cache tensor that has more, in place: its memory
    (``data_ptr()``), not a copy, as :meth:`kvpipe.KVCache.from_tensors` reads a tensor.

    FastDeploy's MTP draft layer (``num_extra_cache_layer``) has ``num_gpu_block_expand_ratio``
    times the model's blocks; the manager's block ids are the model's, which index the same
    blocks of it (MTP copies the request's block table), and the blocks past them are its
    own. Its block ``b`` starts at the same offset as in a tensor of the model's count.
    """

    __slots__ = ("_tensor", "device", "dtype", "shape")

    def __init__(self, tensor: Any, num_blocks: int) -> None:
        self._tensor = tensor
        self.shape = (num_blocks, *(int(d) for d in tensor.shape[1:]))
        self.dtype = tensor.dtype
        on = device_tensor(tensor)
        index = parse_device(on.device) if on is not None else None
        self.device = SimpleNamespace(type="cpu" if index is None else "cuda", index=index)

    def data_ptr(self) -> int:
        return int(self._tensor.data_ptr())

    def is_contiguous(self) -> bool:
        return bool(self._tensor.is_contiguous())


@dataclass
class _Open:
    """A pipeline over one set of tensors: how to close it, and the calls using it."""

    pipe: Pipeline
    leave: Callable[[], None]
    users: int = 0
    retired: bool = False


class KVPipeAttentionStore:
    """FastDeploy's ``AttentionStore`` on a kvpipe pipeline (``kvcache_storage_backend =
    "attention_store"``).

    Keywords are FastDeploy's (unknown ones are logged at DEBUG and ignored);
    ``AS_NAMESPACE``, ``AS_POD_NAME`` and ``AS_MODEL_VERSION`` override theirs. kvpipe's own,
    keyword-only: ``store`` (a :class:`kvpipe.StorageBackend`; default: ``KVPIPE_STORE``,
    else a file store under ``~/.cache/kvpipe/fastdeploy``), ``config`` (default
    ``PipelineConfig.from_env()``, so ``AS_WRITE_SLICE_*`` apply), ``pd_via_storage``
    (default ``FD_PD_TRANSFER_VIA_STORAGE``), ``rope_dim`` (MLA), ``close_timeout`` (positive
    seconds; default ``config.close_timeout``), ``cache_sets`` (default 1: the server's
    caches; see below), and ``device_driver`` (tests only: :func:`kvpipe.open_pipeline`'s
    stand-in for the CUDA driver).

    One pipeline is opened per distinct set of tensors, and kept for the ``cache_sets`` sets
    used most recently: a call with one more set closes the pipeline of the least recently
    used one once the calls using it are done (FastDeploy replaces its caches when the
    model's weights are cleared and updated; the old pipeline held the old tensors, and so
    their memory, and its staging). :meth:`close` closes them all.

    ``gpu_block_ids[i]`` is the cache block of sequence block ``start + i``, as FastDeploy's
    manager passes them (it slices off the blocks before the start index).
    """

    def __init__(
        self,
        namespace: str = "default_ns",
        pod_name: str = "default_pod",
        model_version: str = "v0",
        shard_id: int = 0,
        shard_num: int = 1,
        layer_num: int = 1,
        block_token_size: int = 64,
        bytes_per_shard_layer_per_block: int = 1024,
        device_id: int = 0,
        dp_id: int = 0,
        splitwise_role: str = "mixed",
        *,
        store: StorageBackend | None = None,
        config: PipelineConfig | None = None,
        pd_via_storage: bool | None = None,
        rope_dim: int = 64,
        close_timeout: float | None = None,
        cache_sets: int = 1,
        device_driver: Any = None,
        **unknown: Any,
    ) -> None:
        if isinstance(cache_sets, bool) or not isinstance(cache_sets, int) or cache_sets < 1:
            raise ConfigError("cache_sets", f"must be an int >= 1, got {cache_sets!r}")
        # as PipelineConfig.close_timeout; also how long a call given up waits for its copy
        # to end (LoopThread.call's settle), which 0 or less would skip
        if close_timeout is not None and (
            isinstance(close_timeout, bool)
            or not isinstance(close_timeout, numbers.Real)
            or not 0 < close_timeout < math.inf
        ):
            raise ConfigError(
                "close_timeout", f"must be a finite number > 0 (or None), got {close_timeout!r}"
            )
        if unknown:
            log.debug("KVPipeAttentionStore: ignoring unknown keywords %s", sorted(unknown))
        env = os.environ
        self.namespace = env.get("AS_NAMESPACE", namespace)
        self.pod_name = env.get("AS_POD_NAME", pod_name)
        if _env_int("ENABLE_EP_DP_IN_FD", env.get("ENABLE_EP_DP_IN_FD", "1")):
            self.pod_name = f"{self.pod_name}_{splitwise_role}_{dp_id}"
        self.model_version = env.get("AS_MODEL_VERSION", model_version)
        for name, value, low in (
            ("layer_num", layer_num, 1),
            ("block_token_size", block_token_size, 1),  # a divisor: 0 raised in query
            ("shard_num", shard_num, 1),
            ("shard_id", shard_id, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ConfigError(name, f"must be an int >= {low}, got {value!r}")
        if shard_id >= shard_num:
            raise ConfigError("shard_id", f"shard {shard_id} is not below shard_num {shard_num}")
        self.layer_num, self.block_token_size = int(layer_num), int(block_token_size)
        self.shard_id, self.shard_num = int(shard_id), int(shard_num)
        self.splitwise_role = splitwise_role
        self.rope_dim = rope_dim
        if pd_via_storage is None:
            flag = env.get("FD_PD_TRANSFER_VIA_STORAGE", "").strip().lower()
            pd_via_storage = flag in ("1", "true", "yes", "on")
        #: write includes the partial last block (prefill side of PD via storage)
        self.include_partial_on_write = pd_via_storage and splitwise_role == "prefill"
        #: read includes it and requires every block (decode side)
        self.all_or_nothing_read = pd_via_storage and splitwise_role == "decode"
        self._short_tokens_warned = False  # read: the one WARNING of too few tokens
        #: FastDeploy calls again for every request whatever failed the last one (a store
        #: down or closed, a handoff that never arrives): those lines are bounded
        #: (:mod:`kvpipe._lograte`), per instance: another's never hide this one's.
        self._repeats = LogLimiter(log)
        #: each calling thread's last query: (task id, token ids), for its read (see read)
        self._asked = threading.local()
        self.config = config or PipelineConfig.from_env(node_id=self.pod_name)
        #: write's deadline when the environment sets one: FastDeploy's AttentionStore.write
        #: takes AS_WRITE_TOTAL_TIMEOUT over the timeout the manager passes
        self._write_timeout: float | None = None
        if config is None and any(
            env.get(name, "").strip() for name in ("KVPIPE_TOTAL_TIMEOUT", "AS_WRITE_TOTAL_TIMEOUT")
        ):
            self._write_timeout = self.config.total_timeout
        self.kvpipe_namespace = _namespace(self.namespace, self.model_version)
        if store is None:
            url = env.get("KVPIPE_STORE", "").strip()
            store = store_from_url(url) if url else _FileStore(default_store_dir())
        self.store = store
        self.cache_sets = cache_sets
        self._device_driver = device_driver
        #: the open pipelines by tensor set, least recently used first
        self._pipes: OrderedDict[tuple[Any, ...], _Open] = OrderedDict()
        self._pipes_lock = threading.Lock()  # _pipes and the _Open entries
        self._open_lock = threading.Lock()  # held while a pipeline opens
        if close_timeout is None:
            close_timeout = self.config.close_timeout
        self._loop = LoopThread(
            "kvpipe-fastdeploy-as", float(close_timeout), holds="FastDeploy's caches"
        )
        try:
            self._loop.enter(store)
        except BaseException:
            self._loop.close()
            raise

    def close(self) -> None:
        """Close the pipelines and the store, stop the loop thread (idempotent). A call made
        after it, or one it cuts off, answers nothing (0 blocks, no record) with one
        WARNING, as when the store fails.

        Returns within ``close_timeout`` plus twice :data:`HOP_SLACK`. Should work in the
        loop not have ended by then (a copy into or out of the caches, which cancelling
        does not interrupt; the store's own bounded close), it returns all the same with
        an ERROR saying that the caches may still be read or written, and must not be
        freed or reused until the loop thread has ended (logged at WARNING); the pipelines
        over them, and so the tensors, are kept until then."""
        if self._loop.close(self._let_go):
            self._let_go()

    def _let_go(self) -> None:
        """Forget the pipelines, once nothing in the loop uses them."""
        with self._pipes_lock:
            self._pipes.clear()  # nothing keeps the tensors alive

    def __enter__(self) -> KVPipeAttentionStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _gave_up(self, what: str, task_id: str, kind: str, message: str, *args: Any) -> int:
        """0, after one WARNING (repeats bounded per ``what`` and ``kind``) that call
        ``what`` of ``task_id`` failed: ``message % args``."""
        self._repeats.log(
            logging.WARNING, f"{what}:{kind}", "kvpipe %s %s: " + message, what, task_id, *args
        )
        return 0

    def _take(self, ident: tuple[Any, ...] | None) -> _Open | None:
        """The open pipeline for ``ident`` (``None``: the most recently used), counted as in
        use until :meth:`_put_back`; ``None`` when there is none."""
        with self._pipes_lock:
            if ident is None:
                ident = next(reversed(self._pipes), None)
            entry = self._pipes.get(ident) if ident is not None else None
            if entry is not None:
                self._pipes.move_to_end(ident)  # type: ignore[arg-type]
                entry.users += 1
            return entry

    def _put_back(self, entry: _Open) -> None:
        with self._pipes_lock:
            entry.users -= 1
            leave = entry.retired and entry.users == 0
        if leave:
            entry.leave()

    def _open(
        self,
        ident: tuple[Any, ...],
        key_cache: Sequence[Any],
        val_cache: Sequence[Any],
        scales: Sequence[Any] | None,
        timeout: float,
    ) -> _Open:
        """The pipeline over these tensors (``ident``), counted as in use (:meth:`_put_back`),
        opened unless another call opened it meanwhile; opening one more than ``cache_sets``
        retires the least recently used. Opening (staging registered with the store) is
        bounded by the call's ``timeout``.

        Raises:
            LayoutError: The tensors do not make a cache of the inferred layout (as
                :meth:`kvpipe.KVCache.from_tensors` refuses them: wrong dtype or shape, or
                two of them sharing memory, such as one tensor for key and value).
            TimeoutError: The pipeline did not open within ``timeout`` (another thread's
                opening included).
        """
        deadline = time.monotonic() + timeout
        if not self._open_lock.acquire(timeout=max(0.0, timeout)):
            raise TimeoutError("another call is still opening the pipeline")
        try:
            entry = self._take(ident)
            if entry is None:
                layout = infer_layout(
                    key_cache,
                    val_cache,
                    self.layer_num,
                    self.block_token_size,
                    key_scales=scales,
                    rope_dim=self.rope_dim,
                )
                ordered: list[Any] = []
                n = self.layer_num
                for layer in range(n):
                    ordered.append(key_cache[layer])
                    if val_cache:
                        ordered.append(val_cache[layer])
                    if scales:
                        ordered += [scales[layer], scales[n + layer]]
                # the draft layers of MTP may have more blocks than the model's: their
                # first ones are those the block ids name (a layer with fewer is refused)
                blocks = int(key_cache[0].shape[0])
                ordered = [
                    _FirstBlocks(t, blocks) if t.shape and int(t.shape[0]) > blocks else t
                    for t in ordered
                ]
                try:
                    cache = KVCache.from_tensors(layout, ordered)
                except LayoutError as exc:
                    raise LayoutError(f"FastDeploy caches do not fit {layout.kind}: {exc}") from exc
                pipe, leave = self._loop.enter(
                    open_pipeline(
                        cache,
                        self.store,
                        config=self.config,
                        namespace=self.kvpipe_namespace,
                        rank=self.shard_id,
                        world_size=self.shard_num,
                        device_driver=self._device_driver,
                    ),
                    wait=deadline - time.monotonic(),
                )
                entry = _Open(pipe, leave, users=1)
                retired: list[_Open] = []
                with self._pipes_lock:
                    if self._loop.closed:  # close() cleared the pipes meanwhile: not kept
                        raise PipelineClosed("the store is closed")
                    self._pipes[ident] = entry
                    while len(self._pipes) > self.cache_sets:
                        _, old = self._pipes.popitem(last=False)
                        old.retired = True
                        if old.users == 0:
                            retired.append(old)
                for old in retired:
                    log.info("kvpipe: caches replaced; closing the pipeline over the old ones")
                    old.leave()
        finally:
            self._open_lock.release()
        return entry

    def _on_pipe(
        self,
        what: str,
        task_id: str,
        key_cache: Sequence[Any],
        val_cache: Sequence[Any],
        scales: Sequence[Any] | None,
        gpu_block_ids: Sequence[int],
        start: int,
        timeout: float,
        fn: Callable[[Pipeline, list[int], float], Awaitable[int]],
    ) -> int:
        """``fn(pipeline, block ids, seconds left of timeout)``'s count, run as :meth:`_call`
        runs it, over the pipeline of these tensors (opened by the first call on them),
        counted as in use meanwhile; 0 (after one WARNING) when it did not open in time or
        the store failed while it opened.

        The block ids are the pipeline's (``[i]`` = sequence block ``i``) for FastDeploy's
        ``gpu_block_ids``, which begin at sequence block ``start``; blocks before it are not
        moved (placeholder 0).
        """
        begun = time.monotonic()
        tensors = [*key_cache, *val_cache, *(scales or ())]
        ident = tuple((t.data_ptr(), tuple(t.shape), str(t.dtype)) for t in tensors)
        entry = self._take(ident)
        opened = entry is None
        if entry is None:
            try:
                entry = self._open(ident, key_cache, val_cache, scales, timeout)
            except (TimeoutError, BackendError, PipelineClosed, OSError, ConfigError) as exc:
                if isinstance(exc, ConfigError) and exc.field != "store":
                    raise  # a wrong setting: raised, as programming errors are
                # ConfigError on "store": the store refused the staging (down, say), a store
                # failure like any other
                kind = f"open:{type(exc).__name__}"
                return self._gave_up(what, task_id, kind, "opening the pipeline failed: %r", exc)
        try:
            if opened:  # the call gets what is left of its timeout
                timeout -= time.monotonic() - begun
                if timeout <= 0:
                    return self._gave_up(
                        what, task_id, "open:timeout", "opening the pipeline took its timeout"
                    )
            block_ids = [0] * start + list(gpu_block_ids)
            return self._call(what, task_id, timeout, fn, entry.pipe, block_ids, timeout)
        finally:
            self._put_back(entry)

    def _on_last_pipe(
        self,
        what: str,
        task_id: str,
        timeout: float,
        fn: Callable[[Pipeline], Awaitable[int]],
        unbound: int = 0,
    ) -> int:
        """``fn(pipeline)``'s count over the most recently used pipeline, run as :meth:`_call`
        runs it; ``unbound`` when no caches are bound yet (0 after one WARNING when closed).

        Raises:
            kvpipe.WrongEventLoop: Called from inside a running event loop (bound or not)."""
        self._loop.check_caller()
        entry = self._take(None)
        if entry is None:
            if self._loop.closed:
                closed = PipelineClosed("the store is closed")
                return self._gave_up(what, task_id, "PipelineClosed", "%r", closed)
            log.debug("kvpipe %s %s: no caches bound yet: %d", what, task_id, unbound)
            return unbound
        try:
            return self._call(what, task_id, timeout, fn, entry.pipe)
        finally:
            self._put_back(entry)

    def _call(self, what: str, task_id: str, timeout: float, fn: Any, *args: Any) -> int:
        """``fn(*args)``'s count; 0 (after one WARNING) when the store failed or the deadline
        passed. A misuse raises: bad arguments, or a call from inside a running event loop
        (:class:`kvpipe.WrongEventLoop`, a ``KVPipeError`` that is no store failure).

        A call given up at ``timeout + HOP_SLACK`` is cancelled and returns once it has ended
        in the loop (within ``close_timeout``): a copy into or out of the caches it started
        runs to its end, and FastDeploy reuses the blocks of a call that answered 0 (it
        recycles a read's blocks at once)."""
        try:
            return int(
                self._loop.call(
                    fn, *args, wait=timeout + HOP_SLACK, settle=self._loop.close_timeout
                )
            )
        except (RequestError, TypeError, WrongEventLoop):
            raise
        except (KVPipeError, OSError, TimeoutError) as exc:
            return self._gave_up(what, task_id, type(exc).__name__, "%r", exc)

    def write(
        self,
        task_id: str,
        key_cache: list[Any],
        val_cache: list[Any],
        token_ids: list[int],
        gpu_block_ids: list[int],
        start_write_block_idx: int,
        timeout: float = 30.0,
        *,
        scale_cache: list[Any] | None = None,
    ) -> int:
        """Store blocks ``start_write_block_idx ..`` from ``gpu_block_ids[0] ..``; return how
        many of them are stored after the call, as a contiguous run (already-stored ones
        included). ``token_ids`` may run past those blocks (the request's tokens); only
        the blocks given are written.

        ``scale_cache`` (block-wise fp8): the ``layer_num`` key scales then the ``layer_num``
        value scales. ``timeout`` is the total deadline, unless ``AS_WRITE_TOTAL_TIMEOUT``
        (or ``KVPIPE_TOTAL_TIMEOUT``) is set: that takes its place, as in FastDeploy's
        ``AttentionStore.write``. Slices follow the config.
        """
        self._loop.check_caller()  # before the arguments: a misuse whatever they are
        start_write_block_idx = _start_index(start_write_block_idx)

        async def run(pipe: Pipeline, block_ids: list[int], timeout: float) -> int:
            r = await pipe.write(
                # only the blocks given: the manager passes the request's tokens, which may
                # run past them (FastDeploy's AttentionStore.write slices them likewise)
                token_ids[: len(block_ids) * self.block_token_size],
                block_ids,
                start_block=start_write_block_idx,
                include_partial=self.include_partial_on_write,
                timeout=timeout,
                request_id=str(task_id),
            )
            # an incomplete write is logged once, by the pipeline (request id = task id)
            return r.skipped + r.written

        return self._on_pipe(
            "write",
            task_id,
            key_cache,
            val_cache,
            scale_cache,
            gpu_block_ids,
            start_write_block_idx,
            timeout if self._write_timeout is None else self._write_timeout,
            run,
        )

    def read(
        self,
        task_id: str,
        key_cache: list[Any],
        val_cache: list[Any],
        token_ids: list[int],
        gpu_block_ids: list[int],
        start_read_block_idx: int,
        timeout: float = 30.0,
        *,
        scale_cache: list[Any] | None = None,
    ) -> int:
        """Load blocks ``start_read_block_idx ..`` into ``gpu_block_ids[0] ..``; return how many
        were loaded (verified).
        On the decode side of PD via storage, every block (the partial one too) is required:
        a shortfall logs one WARNING and returns the honest count.

        Elsewhere, ``token_ids`` may run past the blocks given (only those are read), and
        blocks past the full blocks of ``token_ids`` are not read (the count says so):
        FastDeploy's manager passes ``token_ids[:matched * block_size]`` with the
        ``matched`` blocks a query counted from the start index, so from a start index
        above 0 the tokens end ``start`` blocks short, and the blocks they cover are loaded
        rather than none (one WARNING the first time); tokens that end before the start
        index cover none: 0. Unless the calling thread's last ``query`` was of this
        ``task_id`` with tokens that ``token_ids`` begins (FastDeploy's order: the query has
        the request's tokens): the read then takes those, and loads every block matched."""
        self._loop.check_caller()
        start_read_block_idx = _start_index(start_read_block_idx)
        token_ids = self._asked_tokens(task_id, token_ids)
        gpu_block_ids = self._covered(token_ids, gpu_block_ids, start_read_block_idx)

        async def run(pipe: Pipeline, block_ids: list[int], timeout: float) -> int:
            # only the blocks given, as write: tokens past them are not asked about (the
            # all-or-nothing side reads the partial last block too, so takes them all)
            tokens = token_ids
            if not self.all_or_nothing_read:
                tokens = token_ids[: len(block_ids) * self.block_token_size]
                if len(tokens) // self.block_token_size < start_read_block_idx:
                    return 0  # the tokens end before the start index: they cover none
            try:
                r = await pipe.read(
                    tokens,
                    block_ids,
                    start_block=start_read_block_idx,
                    include_partial=self.all_or_nothing_read,
                    require_all=self.all_or_nothing_read,
                    timeout=timeout,
                    request_id=str(task_id),
                )
            except IncompleteRead as exc:
                partial = exc.result
                # The pipeline already warned of any shortfall but a block not stored (a
                # normal miss to it, a failed handoff here): one WARNING per call either way.
                level = logging.WARNING if partial.stop_reason == "not_stored" else logging.DEBUG
                self._repeats.log(
                    level,
                    f"read:all_or_nothing:{partial.stop_reason}",
                    "kvpipe read %s: all-or-nothing read loaded %d of %d blocks (%s)",
                    task_id,
                    partial.loaded,
                    partial.requested,
                    partial.stop_reason,
                )
                return partial.loaded
            return r.loaded

        return self._on_pipe(
            "read",
            task_id,
            key_cache,
            val_cache,
            scale_cache,
            gpu_block_ids,
            start_read_block_idx,
            timeout,
            run,
        )

    def _asked_tokens(self, task_id: str, token_ids: list[int]) -> list[int]:
        """The token ids of this thread's last query of ``task_id`` when they run past
        ``token_ids`` and begin with them; else ``token_ids``."""
        last = getattr(self._asked, "last", None)
        if last is None or last[0] != task_id:
            return token_ids
        asked = last[1]
        n = len(token_ids)
        if len(asked) <= n:
            return token_ids
        head = asked[:n]
        same = (
            head == token_ids
            if isinstance(head, list) and isinstance(token_ids, list)
            else bool(np.array_equal(np.asarray(head), np.asarray(token_ids)))
        )
        return asked if same else token_ids

    def _covered(self, token_ids: list[int], block_ids: list[int], start: int) -> list[int]:
        """``block_ids`` without those past the full blocks of ``token_ids`` (read
        from block ``start`` on); all of them on the all-or-nothing side."""
        if self.all_or_nothing_read:
            return block_ids
        usable = max(0, len(token_ids) // self.block_token_size - start)
        if len(block_ids) <= usable:
            return block_ids
        log.log(
            logging.DEBUG if self._short_tokens_warned else logging.WARNING,
            "kvpipe read: %d tokens cover blocks up to %d, so %d of the %d blocks from block %d "
            "are read (FastDeploy passes the tokens of the blocks matched, not of the start "
            "index plus them; warned once)",
            len(token_ids),
            len(token_ids) // self.block_token_size,
            usable,
            len(block_ids),
            start,
        )
        self._short_tokens_warned = True
        return list(block_ids[:usable])

    def query(
        self, task_id: str, token_ids: list[int], start_match_block_idx: int, timeout: float = 10.0
    ) -> int:
        """The stored run from block ``start_match_block_idx`` on (the blocks before it are
        not asked about: the server holds them).

        Before the first ``write`` or ``read`` has bound the caches (and so the layout, part
        of every key), nothing can be looked up: 0, except on a decode instance
        (``splitwise_role="decode"``), where it is every block asked about. FastDeploy reads
        only after a query matched something, and a decode instance's first call is a read
        (of what its prefill side wrote): answering 0 there, it would never read, so never
        bind its caches. The read then loads what is stored and returns that count, which
        FastDeploy takes as the truth (``gpu_block_ids[:n]``).

        Never raises for its arguments (a start index past the tokens, no tokens): 0, logged
        at ERROR (repeats bounded). FastDeploy's read and write tasks call it outside the
        handlers that send their done signal, so a raise would leave the engine waiting for
        that signal for good. (A call from inside a running event loop still raises
        ``WrongEventLoop``.)
        """

        self._loop.check_caller()  # raised, never answered 0 for the arguments below
        self._asked.last = (task_id, token_ids)

        async def run(pipe: Pipeline) -> int:
            return await pipe.lookup(
                token_ids,
                start_block=start_match_block_idx,
                include_partial=self.all_or_nothing_read,
                timeout=timeout,
            )

        try:
            unbound = 0
            if self.splitwise_role == "decode":  # checked as lookup checks them
                size = self.block_token_size
                blocks = len(token_ids) // size
                if self.all_or_nothing_read and len(token_ids) % size:
                    blocks += 1  # the partial last block, which the decode side reads too
                unbound = blocks - check_start_block(start_match_block_idx, blocks)
            return self._on_last_pipe("query", task_id, timeout, run, unbound)
        except (RequestError, TypeError) as exc:
            self._repeats.log(  # a manager that keeps asking so: every call (bounded)
                logging.ERROR,
                f"query:{type(exc).__name__}",
                "kvpipe query %s: bad arguments, answering 0: %s",
                task_id,
                exc,
            )
            return 0

    def flush_token_index(
        self, task_id: str, token_ids: list[int], start_block_idx: int, reside_in_gpu: bool
    ) -> None:
        """Record that this pod holds blocks ``start_block_idx ..`` in GPU memory
        (``reside_in_gpu``), or no longer holds them (``Residency.EVICTED``: FastDeploy passes
        ``False`` when they no longer exist on this node, as after a CPU eviction), within
        ``config.lookup_timeout`` (``flush_index``); failures are logged, not raised."""
        residency = Residency.GPU if reside_in_gpu else Residency.EVICTED
        timeout = self.config.lookup_timeout

        async def run(pipe: Pipeline) -> int:
            return await pipe.flush_index(
                token_ids, start_block=start_block_idx, residency=residency, timeout=timeout
            )

        self._on_last_pipe("flush_token_index", task_id, timeout, run)
