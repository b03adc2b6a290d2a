"""The documentation's Python snippets run as a user copies them, so the docs cannot rot.

Every ```python block of README.md, docs/*.md and docs/integrations/*.md is run here, in the
context its page sets up, or accounted for:

- README.md's snippet (a 512 MiB cache): run by tests/test_examples.py, in a subprocess.
- docs/embedding.md: one Python session, the blocks in page order (the page says so).
- docs/backends.md's example backends: ``SQLiteStore`` through the conformance suite, with
  the page's own test module and command; the two sketches (a token-indexed SDK, a
  registered-memory transport) round-trip a pipeline over small fakes of the client they
  assume.
- docs/backends.md's ``MooncakeStore`` block: a script, on a Mooncake started on 127.0.0.1
  for the test (tests/backends/mooncake_fixtures.py), its addresses put in place of the
  block's as a user puts those ``kvpipe mooncake-up`` printed. Skipped, saying so, only
  where the ``mooncake`` package is not installed.
- Every other block: a script of its own. One that needs a GPU is skipped, saying so.

A ``print`` whose comment gives its output (on its line, or the comment line right after it)
must print exactly that line, unless the comment says "e.g.". Temporary directories the
snippets make go under the test's ``tmp_path``.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import ctypes
import importlib.util
import io
import logging
import os
import re
import subprocess
import sys
import tempfile
import tokenize
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpipe
from kvpipe.backends.mooncake_local import LocalMooncake
from tests.backends.mooncake_fixtures import mooncake  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
DOCS = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted((REPO / "docs" / "integrations").glob("*.md")),
]
_FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
_BACKEND_CLASS = re.compile(r"^class (\w+)\(kvpipe\.StorageBackend\)", re.M)


@dataclass(frozen=True)
class Snippet:
    """One ```python block: its page (relative to the repository), its fence's line, code."""

    page: str
    line: int
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"

    def compiled(self) -> Any:
        """The code, compiled at its own lines of its page (tracebacks quote the page)."""
        return compile("\n" * self.line + self.code, str(REPO / self.page), "exec")


def _snippets(page: Path) -> list[Snippet]:
    text = page.read_text()
    return [
        Snippet(str(page.relative_to(REPO)), text.count("\n", 0, m.start()) + 1, m.group(1))
        for m in _FENCE.finditer(text)
    ]


SNIPPETS = [s for page in DOCS for s in _snippets(page)]


def _kind(s: Snippet) -> str:
    if s.page == "README.md":
        return "readme"
    if s.page == "docs/embedding.md":
        return "session"
    if _BACKEND_CLASS.search(s.code):
        return "backend"
    if "BackendConformance" in s.code:
        return "conformance"
    if "MooncakeStore(" in s.code:
        return "mooncake"
    return "script"


def _needs_hardware(code: str) -> str | None:
    if "MooncakeStore(" in code:
        return "needs a Mooncake master (kvpipe mooncake-up)"
    if re.search(r"cuda|import torch", code, re.I):
        return "needs a CUDA GPU: not run here"
    return None


def _stated_outputs(code: str) -> list[str]:
    """What the comments of ``print(...)`` lines say they print."""
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string[1:].strip()
    lines = code.splitlines()
    stated = []
    for n, line in enumerate(lines, start=1):
        if not line.lstrip().startswith("print("):
            continue
        comment = comments.get(n)
        if comment is None and n < len(lines) and lines[n].lstrip().startswith("#"):
            comment = comments.get(n + 1)
        if comment and "e.g." not in comment:
            stated.append(comment)
    return stated


def _run(s: Snippet, namespace: dict[str, Any]) -> list[str]:
    """Run a snippet in ``namespace``; check the output its comments state. Returns the
    lines it printed (stripped)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(s.compiled(), namespace)
    printed = [line.strip() for line in out.getvalue().splitlines()]
    for want in _stated_outputs(s.code):
        assert want in printed, f"{s}: says it prints {want!r}; it printed {printed}"
    return printed


@pytest.fixture
def user_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A fresh namespace, its temporary files under tmp_path, kvpipe's log level put back."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    logger = logging.getLogger("kvpipe")
    level = logger.level
    try:
        yield {"__name__": "__main__"}
    finally:
        logger.setLevel(level)


def test_every_snippet_is_run_somewhere() -> None:
    """A new block lands in a kind this module runs: a new example backend needs a fake of
    the client it assumes (below), README.md's snippet is the first and only one."""
    assert SNIPPETS, "no ```python blocks found: did the fence style change?"
    kinds = {str(s): _kind(s) for s in SNIPPETS}
    assert list(kinds.values()).count("readme") == 1, kinds  # what test_examples.py runs
    assert list(kinds.values()).count("conformance") == 1, kinds
    assert list(kinds.values()).count("mooncake") == 1, kinds  # the addresses replaced below
    named = {m.group(1) for s in SNIPPETS for m in _BACKEND_CLASS.finditer(s.code)}
    assert named == {"SQLiteStore", *_SKETCH_CLIENTS}, named


def test_the_embedding_page_runs_in_one_session(user_session: dict[str, Any]) -> None:
    """docs/embedding.md: "Run them in order in one Python session"."""
    for s in SNIPPETS:
        if _kind(s) == "session":
            # Skipping one block would break the later ones: keep such a block out of the
            # session (a page of its own, or a fence other than ```python).
            assert _needs_hardware(s.code) is None, f"{s}: {_needs_hardware(s.code)}"
            _run(s, user_session)


class _LookupsFailStore(kvpipe.MemoryStore):
    """A memory store whose ``exists`` fails the whole call (a store that cannot answer a
    probe): ``lookup`` raises ``BackendError``; writes still store (their probe is skipped)."""

    async def exists(self, batch: Any) -> Any:
        raise kvpipe.BackendError("memory", "exists", "the index is unreachable")


def test_the_lifecycle_snippet_serves_a_request_whose_lookup_failed(
    user_session: dict[str, Any],
) -> None:
    """docs/embedding.md's ``handle_request``, the code a server copies, when ``lookup``
    raises one of its documented errors: the request is served without the stored prefix
    (computed from block 0, then offloaded), as the page's section 6 says to, instead of the
    error failing the request."""
    for s in SNIPPETS:
        if _kind(s) == "session":
            _run(s, user_session)
            if "async def handle_request" in s.code:
                break
    handle_request = user_session["handle_request"]
    allocator = user_session["BlockAllocator"](user_session["NUM_BLOCKS"])
    free = len(allocator.free)

    async def serve() -> tuple[int, kvpipe.WriteResult]:
        config = kvpipe.PipelineConfig(staging_bytes=64 << 20)
        store = _LookupsFailStore()
        async with store, kvpipe.open_pipeline(user_session["cache"], store, config=config) as pipe:
            result: tuple[int, kvpipe.WriteResult] = await handle_request(
                pipe, allocator, np.arange(16 * 3 + 5)
            )
            return result

    loaded, w = asyncio.run(serve())
    assert (loaded, w.written, w.complete) == (0, 3, True), w
    assert len(allocator.free) == free


def test_the_tensor_parallel_snippet_counts_a_rank_whose_lookup_failed_as_zero(
    user_session: dict[str, Any],
) -> None:
    """docs/embedding.md's ``load_common`` (section 5), with both ranks holding a 6-block
    prefix: it reads the agreed blocks into the block ids each rank allocated for the
    request. When one rank's ``exists`` fails the whole call (its ``lookup`` raises
    ``BackendError``), that rank counts as 0 in the agreement: the request gets 0 (computed
    from block 0) instead of the error failing it, and no rank reads."""
    for s in SNIPPETS:
        if _kind(s) == "session":
            _run(s, user_session)
            if "async def load_common" in s.code:
                break
    load_common = user_session["load_common"]
    layout = user_session["layout"]
    tokens = np.arange(16 * 6 + 3)
    allocated = [np.arange(100, 107), np.arange(200, 207)]  # what each rank's allocator gave

    async def serve(rank1_lookups_fail: bool) -> tuple[int, list[kvpipe.KVCache]]:
        config = kvpipe.PipelineConfig(staging_bytes=64 << 20)
        caches = [kvpipe.create_kv_cache(layout, 256) for _ in range(2)]
        for r, cache in enumerate(caches):
            for rows in cache.byte_rows:
                rows[:6] = np.arange(6, dtype=np.uint8)[:, None] + 10 * (r + 1)
        stores = [
            kvpipe.MemoryStore(),
            _LookupsFailStore() if rank1_lookups_fail else kvpipe.MemoryStore(),
        ]
        async with contextlib.AsyncExitStack() as stack:
            pipes = []
            for r, (cache, store) in enumerate(zip(caches, stores, strict=True)):
                await stack.enter_async_context(store)
                pipes.append(
                    await stack.enter_async_context(
                        kvpipe.open_pipeline(cache, store, config=config, rank=r, world_size=2)
                    )
                )
            for p in pipes:  # both ranks stored the prefix
                assert (await p.write(tokens, np.arange(7))).complete
            assert await pipes[0].lookup(tokens) == 6
            loaded: int = await load_common(pipes, allocated, tokens)
        return loaded, caches

    loaded, caches = asyncio.run(serve(rank1_lookups_fail=False))
    assert loaded == 6
    for r, (cache, ids) in enumerate(zip(caches, allocated, strict=True)):
        for rows in cache.byte_rows:  # into the blocks the rank allocated, nowhere else
            assert (rows[ids[:6]] == rows[:6]).all(), r
            assert not np.delete(rows, [*range(6), *ids[:6]], axis=0).any(), r
    loaded, caches = asyncio.run(serve(rank1_lookups_fail=True))
    assert loaded == 0
    for cache in caches:  # no rank read
        for rows in cache.byte_rows:
            assert not rows[6:].any()


@pytest.mark.parametrize("snippet", [s for s in SNIPPETS if _kind(s) == "script"], ids=str)
def test_a_script_runs_as_written(snippet: Snippet, user_session: dict[str, Any]) -> None:
    reason = _needs_hardware(snippet.code)
    if reason:
        pytest.skip(f"{snippet}: {reason}")
    _run(snippet, user_session)


#: The addresses docs/backends.md's MooncakeStore block stands for ``kvpipe mooncake-up``'s.
_SNIPPET_MASTER = "127.0.0.1:50051"
_SNIPPET_METADATA = "http://127.0.0.1:8080/metadata"


@pytest.mark.skipif(
    importlib.util.find_spec("mooncake") is None,
    reason="the mooncake package is not installed (pip install kvpipe[mooncake])",
)
def test_the_mooncake_block_runs_on_a_local_mooncake(
    mooncake: LocalMooncake,  # noqa: F811
    user_session: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/backends.md's MooncakeStore block on a master and metadata server of 127.0.0.1,
    with the environment ``kvpipe mooncake-up`` tells every client to set: it writes 20
    blocks, reads all 20 back and prints the count and the store's statistics."""
    (s,) = [s for s in SNIPPETS if _kind(s) == "mooncake"]
    for address in (_SNIPPET_MASTER, _SNIPPET_METADATA):
        assert s.code.count(f'"{address}"') == 1, f"{s}: not one {address!r}: update the test"
    code = s.code.replace(f'"{_SNIPPET_MASTER}"', f'"{mooncake.master_address}"').replace(
        f'"{_SNIPPET_METADATA}"', f'"{mooncake.metadata_url}"'
    )
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    printed = _run(Snippet(s.page, s.line, code), user_session)
    assert len(printed) == 1, f"{s}: printed {printed}"
    loaded, _, stats = printed[0].partition(" ")
    statistics = ast.literal_eval(stats)
    assert loaded == "20", printed
    assert (statistics["blocks_put"], statistics["blocks_got"]) == (20, 20), statistics


def _backend_class(name: str) -> type[kvpipe.StorageBackend]:
    (s,) = [s for s in SNIPPETS if f"class {name}(kvpipe.StorageBackend)" in s.code]
    namespace: dict[str, Any] = {"__name__": "docs_backend"}
    exec(s.compiled(), namespace)
    cls = namespace[name]
    assert issubclass(cls, kvpipe.StorageBackend)
    return cls


def test_the_sqlite_store_passes_the_conformance_suite_as_the_page_runs_it(
    tmp_path: Path,
) -> None:
    """The page's test module over the page's SQLiteStore (its ``sqlite_store.py``), run by
    the page's own command."""
    (backend,) = [s for s in SNIPPETS if "class SQLiteStore(" in s.code]
    (suite,) = [s for s in SNIPPETS if _kind(s) == "conformance"]
    name = re.search(r"^# (test_\w+\.py)$", suite.code, re.M)
    module = re.search(r"^from (\w+) import SQLiteStore", suite.code, re.M)
    assert name and module, suite
    page = (REPO / suite.page).read_text()
    command = re.search(rf"^python -m pytest (.*{re.escape(name.group(1))}.*)$", page, re.M)
    assert command, f"{suite.page}: no `python -m pytest ... {name.group(1)}` command"
    (tmp_path / f"{module.group(1)}.py").write_text(backend.code)
    (tmp_path / name.group(1)).write_text(suite.code)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([path] if path else [])])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *command.group(1).split(), "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert re.search(r"\b\d+ passed\b", proc.stdout), proc.stdout[-3000:]


class FakeTokenSDK:
    """The blocking token-indexed client the sketch assumes: a block is stored under its
    namespace and every token from 0 to its end; each call counts leading blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.data: dict[tuple[str, tuple[int, ...]], bytes] = {}

    def _names(
        self, ns: str, tokens: np.ndarray, first: int, n: int
    ) -> list[tuple[str, tuple[int, ...]]]:
        ends = [min((first + i + 1) * self.block_size, len(tokens)) for i in range(n)]
        return [(ns, tuple(tokens[:end].tolist())) for end in ends]

    def write(
        self, ns: str, task: str, tokens: np.ndarray, first: int, values: list[memoryview], _: float
    ) -> int:
        for name, value in zip(self._names(ns, tokens, first, len(values)), values, strict=True):
            self.data[name] = bytes(value)
        return len(values)

    def read(
        self, ns: str, task: str, tokens: np.ndarray, first: int, bufs: list[memoryview], _: float
    ) -> int:
        names = self._names(ns, tokens, first, len(bufs))
        for i, (name, buf) in enumerate(zip(names, bufs, strict=True)):
            if name not in self.data:
                return i
            buf[:] = self.data[name]
        return len(bufs)

    def query(self, ns: str, task: str, tokens: np.ndarray, first: int, n: int) -> int:
        names = self._names(ns, tokens, first, n)
        return next((i for i, name in enumerate(names) if name not in self.data), n)


class FakeRegisteredClient:
    """The blocking registered-memory client the sketch assumes (Mooncake's calls): moves
    bytes only from and to memory it was given with ``register_buffer``."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.registered: dict[int, int] = {}

    def _check(self, ptr: int, size: int) -> None:
        assert any(p <= ptr and ptr + size <= p + n for p, n in self.registered.items())

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        del self.registered[ptr]
        return 0

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self._check(ptr, size)
            self.data[key] = ctypes.string_at(ptr, size)
        return [0] * len(keys)

    def batch_get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        got = []
        for key, ptr, size in zip(keys, ptrs, sizes, strict=True):
            self._check(ptr, size)
            value = self.data.get(key)
            if value is not None:
                ctypes.memmove(ptr, value, len(value))
            got.append(-704 if value is None else len(value))
        return got

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [int(key in self.data) for key in keys]

    def remove(self, key: str) -> int:
        self.data.pop(key, None)
        return 0


_SKETCH_CLIENTS: dict[str, Callable[[int], object]] = {
    "TokenIndexedStore": FakeTokenSDK,
    "RegisteredMemoryStore": lambda block_size: FakeRegisteredClient(),
}


@pytest.mark.parametrize("name", sorted(_SKETCH_CLIENTS))
async def test_a_backend_sketch_round_trips_a_pipeline(name: str) -> None:
    """Written, looked up, flushed, then read into other blocks by a second pipeline (the
    partial tail too, several slices): every byte back."""
    layout = kvpipe.CacheLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)
    store = _backend_class(name)(_SKETCH_CLIENTS[name](layout.block_size))
    src, dst = kvpipe.create_kv_cache(layout, 32), kvpipe.create_kv_cache(layout, 32)
    rng = np.random.default_rng(7)
    for rows in src.byte_rows:
        rows[:] = rng.integers(0, 256, rows.shape, dtype=np.uint8)
    tokens = np.arange(16 * 10 + 5)
    config = kvpipe.PipelineConfig(slice_block_num=4, staging_bytes=4 << 20)
    async with kvpipe.open_pipeline(src, store, config=config) as pipe:
        w = await pipe.write(tokens, np.arange(11), include_partial=True)
        assert (w.written, w.complete) == (11, True), w
        assert await pipe.lookup(tokens, include_partial=True) == 11
        assert await pipe.flush_index(tokens) == 10
    async with kvpipe.open_pipeline(dst, store, config=config) as pipe:
        r = await pipe.read(tokens, np.arange(20, 31), include_partial=True, require_all=True)
        assert r.loaded == 11
        assert [loc.block for loc in await pipe.locate(tokens)] == list(range(10))
    for a, b in zip(src.byte_rows, dst.byte_rows, strict=True):
        assert np.array_equal(a[:11], b[20:31])
