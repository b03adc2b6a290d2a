"""Builds kvpipe's two C extensions (everything else is in pyproject.toml). Both are
optional: where they cannot be compiled (no C compiler), kvpipe does the same in Python.

- ``kvpipe.backends.file._fileio`` reads batches of block files without holding the GIL;
  without it the file store reads through Python's ``os`` calls, slower for small blocks.
- ``kvpipe._digests`` hashes a slice's block values (XXH3-64, from the vendored
  ``ext/xxhash/xxhash.h``) with the GIL released once; without it each value is hashed by
  python-xxhash, one GIL round trip per value.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpipe.backends.file._fileio",
            ["kvpipe/backends/file/_fileio.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
        Extension(
            "kvpipe._digests",
            ["kvpipe/_digests.c"],
            include_dirs=["ext/xxhash"],
            depends=["ext/xxhash/xxhash.h"],  # also what puts the header in an sdist
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
    ]
)
