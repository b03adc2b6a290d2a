from collections.abc import Sequence

NOT_REGULAR: int
MAX_VIEWS: int

def read_files(
    dir_fd: int, paths: Sequence[bytes], views: Sequence[Sequence[memoryview]], direct: bool, /
) -> list[int]: ...
def regular_files(dir_fd: int, paths: Sequence[bytes], stop_at_missing: bool, /) -> list[bool]: ...
