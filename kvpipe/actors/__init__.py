"""The pipeline's actors, one per module, and their supervisor.

A device cache's requests: ``scheduler`` → ``slicer`` → (write) ``swapper`` → ``writer``;
(read) ``reader`` → ``swapper``. A host cache's: ``scheduler`` → ``writer`` or ``reader``
(whole requests; each runs its slices itself).
"""

from ._base import Actor, ActorContext, PipelineHooks
from ._channels import SliceJob
from ._observe import Metrics, ObservationKind, Observer, Observers
from .reader import Reader
from .scheduler import Scheduler
from .slicer import Slicer
from .supervisor import ChildSpec, Supervisor
from .swapper import Swapper
from .writer import Writer

__all__ = (
    "Actor",
    "ActorContext",
    "ChildSpec",
    "Metrics",
    "ObservationKind",
    "Observer",
    "Observers",
    "PipelineHooks",
    "Reader",
    "Scheduler",
    "SliceJob",
    "Slicer",
    "Supervisor",
    "Swapper",
    "Writer",
)
