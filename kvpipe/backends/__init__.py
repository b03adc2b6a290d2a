"""Storage backends: the contract and the built-in stores."""

from ._base import BlockStatus, GetBatch, KeyBatch, PutBatch, StorageBackend, validate_key
from ._values import ValueClient
from .file import FileStore
from .memory import MemoryStore
from .mooncake import MooncakeStore

__all__ = (
    "BlockStatus",
    "FileStore",
    "GetBatch",
    "KeyBatch",
    "MemoryStore",
    "MooncakeStore",
    "PutBatch",
    "StorageBackend",
    "ValueClient",
    "validate_key",
)
