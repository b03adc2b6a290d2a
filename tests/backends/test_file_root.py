"""What a FileStore accepts as its root: a non-empty str or os.PathLike[str] naming a
directory (made when missing). Anything else is refused clearly, before the disk is touched."""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import anyio
import pytest

import kvpipe
from kvpipe.backends.file import FileStore, inspect_store


def test_an_empty_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (``Path("")`` is ``Path(".")``: a deliberate current directory, and accepted.)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(kvpipe.ConfigError, match="root: is empty"):
        FileStore("")
    assert os.listdir(tmp_path) == []  # the current directory did not become a store


@pytest.mark.parametrize("kind", ["bytes", "int", "None", "bytes PathLike"])
def test_a_root_that_is_not_a_str_path_is_refused_before_touching_the_disk(
    kind: str, tmp_path: Path
) -> None:
    where = tmp_path / "store"

    class BytesPath(os.PathLike[bytes]):
        def __fspath__(self) -> bytes:
            return os.fsencode(where)

    root = {
        "bytes": os.fsencode(where),
        "int": 3,
        "None": None,
        "bytes PathLike": BytesPath(),
    }[kind]
    with pytest.raises(TypeError, match=r"a store root must be a str or os\.PathLike\[str\]"):
        FileStore(root)  # type: ignore[arg-type]
    assert not where.exists()


async def test_a_root_that_is_a_regular_file_says_so(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.write_bytes(b"not a store")
    with pytest.raises(kvpipe.BackendError, match="exists and is a regular file"):
        async with FileStore(root):
            pass
    assert root.read_bytes() == b"not a store"


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_a_store_that_failed_to_open_is_freed_by_reference_counting(
    tmp_path: Path, no_cyclic_gc: None
) -> None:
    """A pipeline's open fails on a bad root: the error passed through a worker thread's
    frames (the event loop's await of its result); none of them may keep the store, and
    what the caller gave it, in a reference cycle."""
    root = tmp_path / "store"
    root.write_bytes(b"not a store")
    store = FileStore(root)
    ref = weakref.ref(store)
    cache = kvpipe.create_kv_cache(
        kvpipe.CacheLayout.gqa(
            num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16"
        ),
        num_blocks=2,
    )
    try:
        async with kvpipe.open_pipeline(cache, store):
            pass
    except kvpipe.BackendError as exc:
        assert "exists and is a regular file" in str(exc)
    else:
        raise AssertionError("the pipeline opened over a regular file")
    del store
    # The worker thread lets go of its last call just after handing back the result: by
    # the time it has run another.
    await anyio.to_thread.run_sync(int)
    assert ref() is None, "the store is held in a reference cycle"


def test_inspecting_a_directory_that_is_not_a_store_says_so(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    with pytest.raises(FileNotFoundError, match="not a kvpipe store"):
        inspect_store(str(tmp_path / "etc"))
