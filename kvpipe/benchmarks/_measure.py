"""Measuring on a noisy shared machine: interleaved rounds, medians of ratios.

The system under test and its baseline run alternately (A B A B …) in one process after a
warm-up round, and the figure reported is the **median of per-round ratios** (each ratio
compares runs made seconds apart, so drift of the machine cancels out), with best-of-N
throughputs beside it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, final

__all__ = ("THROUGHPUT_COPY_THREADS", "Measurement", "Timer", "interleave")

#: ``copy_threads`` of the pipelines in the throughput scenarios (memory, sweeps, scaling,
#: file, Mooncake): as many as the plain x2 contender's threads. The default leaves the event
#: loop a processor of its own on a machine with 2 (one copy thread there); the lag and server
#: scenarios, where the loop's latency is measured, run the default.
THROUGHPUT_COPY_THREADS: Final = 2


@final
class Timer:
    """``async with Timer() as t: ...`` then ``t.seconds``."""

    def __init__(self) -> None:
        self.started = 0.0
        self.seconds = 0.0

    async def __aenter__(self) -> Timer:
        self.started = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started


@final
@dataclass
class Measurement:
    """Per-round seconds of each contender, and the bytes one round moves."""

    nbytes: int
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        """Record one round of ``name``."""
        self.seconds.setdefault(name, []).append(seconds)

    def gbps(self, name: str) -> tuple[float, float]:
        """(median, best) GB/s of ``name``."""
        runs = self.seconds[name]
        return self.nbytes / statistics.median(runs) / 1e9, self.nbytes / min(runs) / 1e9

    def ratio(self, name: str, baselines: Sequence[str]) -> float:
        """Median over rounds of ``speed(name) / speed(best baseline that round)``."""
        ratios = []
        for i, t in enumerate(self.seconds[name]):
            base = min(self.seconds[b][i] for b in baselines)
            ratios.append(base / t)
        return statistics.median(ratios)

    def summary(self, name: str, baselines: Sequence[str]) -> dict[str, Any]:
        """A JSON-ready record of ``name`` against ``baselines``."""
        median, best = self.gbps(name)
        out: dict[str, Any] = {
            "gbps_median": round(median, 3),
            "gbps_best": round(best, 3),
            "rounds": len(self.seconds[name]),
        }
        for b in baselines:
            bm, bb = self.gbps(b)
            out[f"{b}_gbps_median"] = round(bm, 3)
            out[f"{b}_gbps_best"] = round(bb, 3)
        out["ratio_median"] = round(self.ratio(name, baselines), 3)
        return out


async def interleave(
    contenders: Mapping[str, Callable[[], Awaitable[float]]],
    rounds: int,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Run every contender once per round, in order, after one unrecorded warm-up round.

    Each contender returns the seconds its timed part took.
    """
    out: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):
        for name, run in contenders.items():
            seconds = await run()
            if r:
                out[name].append(seconds)
        if on_round is not None:
            on_round(r)
    return out
