"""Builds kvpipe's two C extensions (everything else is in pyproject.toml). Both are
optional: where they cannot be compiled (no C compiler), kvpipe does the same in Python.

- ``kvpipe.backends.file._fileio`` reads batches of block files without holding the GIL;
  without it the file store reads through Python's ``os`` calls, slower for small blocks.
- ``kvpipe._digests`` hashes a slice's block values (XXH3-64, from the vendored
  ``ext/xxhash/xxhash.h``) with the GIL released once; without it each value is hashed by
  python-xxhash, one GIL round trip per value.
"""

import platform

from setuptools import Extension, setup

# xxHash's run-time choice of vector unit builds for x86 only, with baseline flags.
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

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
            ["kvpipe/_digests.c", *(["ext/xxhash/xxh_x86dispatch.c"] if X86 else [])],
            include_dirs=["ext/xxhash"],
            define_macros=[("XXHASH_X86_DISPATCH", "1")] if X86 else [],
            # also what puts the headers in an sdist
            depends=["ext/xxhash/xxhash.h", "ext/xxhash/xxh_x86dispatch.h"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        ),
    ]
)
