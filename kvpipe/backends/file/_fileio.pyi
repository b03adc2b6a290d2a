from collections.abc import Sequence

NOT_REGULAR: int
NOT_CACHED: int
MAX_VIEWS: int
ABANDONED: int
UNSYNCED: int

def read_files(
    dir_fd: int, paths: Sequence[bytes], views: Sequence[Sequence[memoryview]], direct: bool, /
) -> list[int]: ...
def read_cached_files(
    dir_fd: int, paths: Sequence[bytes], views: Sequence[Sequence[memoryview]], /
) -> list[int]: ...
def open_cached(dir_fd: int, path: bytes, /) -> tuple[int, int]: ...
def file_sizes(dir_fd: int, paths: Sequence[bytes], stop_at_missing: bool, /) -> list[int]: ...
def write_files(
    dir_fd: int,
    dirs: Sequence[bytes],
    temps: Sequence[bytes],
    names: Sequence[bytes],
    chunks: Sequence[Sequence[bytes | memoryview]],
    durability: int,
    direct: bool,
    abandoned: bytearray,
    spares: Sequence[bytes | None] | None = None,
    /,
) -> list[int]: ...
