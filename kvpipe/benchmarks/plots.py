"""PNG plots of the issue-7 scenarios (``kvpipe bench --plot DIR``).

matplotlib is an optional extra (``pip install 'kvpipe[plots]'``); this module imports it
only when called, and :func:`require_matplotlib` raises a clear error without it.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ("PlotsUnavailable", "plot_all", "require_matplotlib")


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> Any:
    """The ``matplotlib.pyplot`` module, with the non-interactive Agg backend.

    Raises:
        PlotsUnavailable: matplotlib is not installed (install the ``plots`` extra).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        # Its INFO notes (e.g. one per categorical axis) would flood a bench run's output
        # wherever the root logger passes INFO on (Paddle's import configures it so).
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotsUnavailable(
            "--plot needs matplotlib: install the 'plots' extra "
            f"(pip install 'kvpipe[plots]') ({exc})"
        ) from exc
    return plt


def _memory(plt: Any, records: list[dict[str, Any]], path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = [
        ("gbps_median", "pipeline"),
        ("nocheck_gbps_median", "pipeline, no checksums"),
        ("plain1_gbps_median", "plain x1"),
        ("plain2_gbps_median", "plain x2"),
    ]
    sizes = [r["block_size"] for r in records]
    width = 0.8 / len(names)
    for ax, op in zip(axes, ("write", "read"), strict=True):
        for i, (key, label) in enumerate(names):
            xs = [j + i * width for j in range(len(sizes))]
            ax.bar(xs, [r[op][key] for r in records], width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], sizes)
        ax.set_title(f"memory store: {op}")
        ax.set_ylabel("GB/s (median)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sweeps(plt: Any, records: list[dict[str, Any]], path: str) -> None:
    sweeps = list(dict.fromkeys(r["sweep"] for r in records))
    fig, axes = plt.subplots(2, len(sweeps), figsize=(4.5 * len(sweeps), 7), squeeze=False)
    for col, sweep in enumerate(sweeps):
        recs = [r for r in records if r["sweep"] == sweep]
        xs = [str(r["x"]) for r in recs]
        top, bottom = axes[0][col], axes[1][col]
        for op in ("write", "read"):
            top.plot(xs, [r[op]["gbps_median"] for r in recs], marker="o", label=op)
            for q, style in (("p50", "-"), ("p99", "--")):
                bottom.plot(
                    xs,
                    [r[op]["latency_ms"][q] for r in recs],
                    style,
                    marker="o",
                    label=f"{op} {q}",
                )
        top.set_title(sweep)
        top.set_ylabel("GB/s (median)")
        bottom.set_ylabel("request latency, ms")
        bottom.set_yscale("log")
        bottom.set_xlabel(sweep)
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _scaling(plt: Any, result: dict[str, Any], path: str) -> None:
    points = result["points"]
    factors = [p["factor"] for p in points]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for op in ("write", "read"):
        secs = [p[f"{op}_seconds"] for p in points]
        left.plot(factors, secs, marker="o", label=op)
        left.plot(factors, [secs[0] * f / factors[0] for f in factors], ":", color="grey")
    left.set_xscale("log", base=2)
    left.set_yscale("log", base=2)
    left.set_xlabel("workload (x the 1x blocks)")
    left.set_ylabel("seconds (dotted: linear)")
    left.legend()
    right.bar([f"{f}x" for f in factors], [p["pipeline_peak_mib"] for p in points])
    right.set_ylabel("pipeline peak RSS growth, MiB")
    right.set_title("peak memory of the pipeline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _lag(plt: Any, records: list[dict[str, Any]], path: str) -> None:
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["phase"] for r in records]
    width = 0.27
    for i, q in enumerate(("p50", "p99", "max")):
        xs = [j + i * width for j in range(len(names))]
        ax.bar(xs, [max(r["lag_ms"][q], 1e-3) for r in records], width, label=q)
    ax.axhline(2, color="orange", linestyle="--", linewidth=1, label="goal p99 2 ms")
    ax.axhline(10, color="red", linestyle="--", linewidth=1, label="goal max 10 ms")
    ax.set_xticks([j + width for j in range(len(names))], names, rotation=15)
    ax.set_yscale("log")
    ax.set_ylabel("1 ms ticker lateness, ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _overhead(plt: Any, result: dict[str, Any], path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = result["per_2mib_block"]
    xs = [str(p["slice_block_num"]) for p in rows]
    for key, label in (
        ("write_pct", "write: actors"),
        ("read_pct", "read: actors"),
        ("write_with_threads_pct", "write: actors + thread calls"),
        ("read_with_threads_pct", "read: actors + thread calls"),
    ):
        ax.plot(xs, [max(p[key], 1e-2) for p in rows], marker="o", label=label)
    ax.axhline(2, color="red", linestyle="--", linewidth=1, label="goal 2 %")
    ax.set_yscale("log")
    ax.set_xlabel("slice_block_num (requests of 64 blocks)")
    ax.set_ylabel("% of a 2 MiB block's gather time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


_PLOTTERS: dict[str, Any] = {
    "memory": _memory,
    "sweeps": _sweeps,
    "scaling": _scaling,
    "lag": _lag,
    "overhead": _overhead,
}


def plot_all(results: dict[str, Any], directory: str) -> dict[str, list[str]]:
    """Write ``<scenario>.png`` into ``directory`` for every scenario in ``results`` that
    has a plot; returns the file names per scenario.

    Raises:
        PlotsUnavailable: matplotlib is not installed.
    """
    plt = require_matplotlib()
    os.makedirs(directory, exist_ok=True)
    out: dict[str, list[str]] = {}
    for scenario, plot in _PLOTTERS.items():
        if results.get(scenario):
            name = f"{scenario}.png"
            plot(plt, results[scenario], os.path.join(directory, name))
            out[scenario] = [name]
    return out
