"""What a FileStore accepts as its root: a non-empty str or os.PathLike[str] naming a
directory (made when missing). Anything else is refused clearly, before the disk is touched."""

from __future__ import annotations

import os
from pathlib import Path

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


def test_inspecting_a_directory_that_is_not_a_store_says_so(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    with pytest.raises(FileNotFoundError, match="not a kvpipe store"):
        inspect_store(str(tmp_path / "etc"))
