"""Test support for kvpipe and for users' own backends (needs pytest).

- :class:`BackendConformance`: the conformance suite every backend passes.
"""

from .conformance import BackendConformance, Batches

__all__ = ("BackendConformance", "Batches")
