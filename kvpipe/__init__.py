"""kvpipe: move LLM KV-cache blocks between an inference server's cache and storage.

Supervised anyio actors gather blocks into bounded staging, write them to a backend in
sliced, deadline-bounded calls that always leave a contiguous stored prefix, and read them
back verified. See ``docs/architecture.md`` and ``docs/embedding.md``.
"""

from ._cache import KVCache as KVCache
from ._cache import create_kv_cache as create_kv_cache
from ._config import PipelineConfig as PipelineConfig
from ._errors import ActorCrashed as ActorCrashed
from ._errors import BackendError as BackendError
from ._errors import ConfigError as ConfigError
from ._errors import DeviceError as DeviceError
from ._errors import IncompleteRead as IncompleteRead
from ._errors import KVPipeError as KVPipeError
from ._errors import LayoutError as LayoutError
from ._errors import OperationTimeout as OperationTimeout
from ._errors import PipelineClosed as PipelineClosed
from ._errors import RequestError as RequestError
from ._errors import Unsupported as Unsupported
from ._errors import WrongEventLoop as WrongEventLoop
from ._layout import CacheLayout as CacheLayout
from ._results import ActorCrash as ActorCrash
from ._results import BlockLocation as BlockLocation
from ._results import Holder as Holder
from ._results import PipelineStatistics as PipelineStatistics
from ._results import ReadResult as ReadResult
from ._results import Residency as Residency
from ._results import ResidencyEntry as ResidencyEntry
from ._results import SliceOutcome as SliceOutcome
from ._results import WriteResult as WriteResult
from ._tp import common_prefix as common_prefix
from .actors import Observer as Observer
from .actors import PipelineHooks as PipelineHooks
from .backends import BlockStatus as BlockStatus
from .backends import FileStore as FileStore
from .backends import GetBatch as GetBatch
from .backends import KeyBatch as KeyBatch
from .backends import MemoryStore as MemoryStore
from .backends import MooncakeStore as MooncakeStore
from .backends import PutBatch as PutBatch
from .backends import StorageBackend as StorageBackend
from .backends import ValueClient as ValueClient
from .cuda._hostcache import create_host_cache as create_host_cache
from .metrics import PipelineMetrics as PipelineMetrics
from .pipeline import Pipeline as Pipeline
from .pipeline import open_pipeline as open_pipeline

__version__ = "0.1.0"

__all__ = (
    "ActorCrash",
    "ActorCrashed",
    "BackendError",
    "BlockLocation",
    "BlockStatus",
    "CacheLayout",
    "ConfigError",
    "DeviceError",
    "FileStore",
    "GetBatch",
    "Holder",
    "IncompleteRead",
    "KVCache",
    "KVPipeError",
    "KeyBatch",
    "LayoutError",
    "MemoryStore",
    "MooncakeStore",
    "Observer",
    "OperationTimeout",
    "Pipeline",
    "PipelineClosed",
    "PipelineConfig",
    "PipelineHooks",
    "PipelineMetrics",
    "PipelineStatistics",
    "PutBatch",
    "ReadResult",
    "RequestError",
    "Residency",
    "ResidencyEntry",
    "SliceOutcome",
    "StorageBackend",
    "Unsupported",
    "ValueClient",
    "WriteResult",
    "WrongEventLoop",
    "common_prefix",
    "create_host_cache",
    "create_kv_cache",
    "open_pipeline",
)
