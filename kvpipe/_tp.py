"""Tensor parallelism: what every rank holds is the minimum of what each rank holds."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from ._errors import RequestError
from ._results import ReadResult, WriteResult

__all__ = ("common_prefix",)


def common_prefix(per_rank: Iterable[int | WriteResult | ReadResult]) -> int:
    """The number of blocks every rank of a tensor-parallel group holds.

    Each rank runs its own pipeline (``rank`` / ``world_size``) over its shard of the cache,
    so a prefix is usable only as far as the shortest rank got. Pass one value per rank, all
    for the same sequence and the same ``start_block``: ``lookup`` counts, or ``WriteResult``
    (``skipped + written``) / ``ReadResult`` (``loaded``) objects; counts may be numpy
    integers (an array gathered from the ranks, say).

    Raises:
        RequestError: No value was given, or a count is negative.
    """
    counts = []
    for value in per_rank:
        if isinstance(value, WriteResult):
            counts.append(value.skipped + value.written)
        elif isinstance(value, ReadResult):
            counts.append(value.loaded)
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0:
            counts.append(int(value))  # numpy integers too: counts gathered across ranks
        else:
            raise RequestError(f"not a block count or a result: {value!r}")
    if not counts:
        raise RequestError("common_prefix needs one value per rank, got none")
    return min(counts)
