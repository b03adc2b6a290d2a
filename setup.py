"""Builds kvpipe's one C extension (everything else is in pyproject.toml).

``kvpipe.backends.file._fileio`` reads batches of block files without holding the GIL. It is
optional: where it cannot be compiled (no C compiler), the file store reads through Python's
``os`` calls instead, slower for small blocks.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpipe.backends.file._fileio",
            ["kvpipe/backends/file/_fileio.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror"],
            optional=True,
        )
    ]
)
