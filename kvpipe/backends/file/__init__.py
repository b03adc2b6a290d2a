"""The file store: kvpipe's embedded default backend (see :mod:`.store`)."""

from ._inspect import StoreReport, inspect_store, is_store
from .store import FileStore

__all__ = ("FileStore", "StoreReport", "inspect_store", "is_store")
