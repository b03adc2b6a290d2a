"""Prometheus metrics for pipelines: :class:`PipelineMetrics` (``pip install 'kvpipe[metrics]'``).

Counters and gauges are read from :meth:`Pipeline.statistics` at scrape time; latency
histograms are fed by an observer on each pipeline (:meth:`Pipeline.add_observer`). Every
series carries the labels ``pipeline`` (``namespace/rank`` unless given) and ``backend``;
see ``docs/embedding.md`` ("Metrics").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, cast, final

from ._errors import ConfigError, Unsupported
from .actors import ObservationKind, Observer
from .pipeline import Pipeline

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Histogram
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

__all__ = ("REQUEST_BUCKETS", "SLICE_BUCKETS", "PipelineMetrics")

#: Histogram buckets (seconds) of one slice's backend call.
SLICE_BUCKETS: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0
)  # fmt: skip
#: Histogram buckets (seconds) of a whole call (write, read, lookup, locate, flush).
REQUEST_BUCKETS: Final = (*SLICE_BUCKETS, 60.0)

#: ``statistics().counters`` exported as their own counters (0 until they first count).
#: Counters not listed here are exported too, once they appear.
_COUNTERS: Final = {
    "blocks_written": "Blocks newly stored by writes.",
    "bytes_written": "Payload bytes of the blocks newly stored.",
    "blocks_skipped": "Leading blocks a write found already stored and skipped.",
    "blocks_read": "Blocks loaded into the cache by reads: the sum of their results' loaded.",
    "bytes_read": "Payload bytes loaded into the cache.",
    "bytes_gathered": "Bytes gathered from the cache into staging for writes.",
    "blocks_flushed": "Blocks recorded in the residency index by flush_index.",
    "blocks_refetched": (
        "Blocks fetched a second time: a slice's first block that failed verification and "
        "those after it."
    ),
    "blocks_failed_verify": "Fetched blocks that failed verification.",
    "corrupt_blocks_deleted": "Blocks deleted from the store after failing verification twice.",
    "blocks_stored_past_a_failure": "Blocks the store reported stored after a failed one.",
    "probe_errors": "Failed exists probes (dedup for writes, stored prefix for reads).",
    "deadline_guard_expired": "Calls with no outcome by deadline + deadline_slack (should be 0).",
    "observer_errors": "Exceptions raised by observers (not propagated).",
}
#: ``statistics()`` fields exported as gauges of the same name.
_GAUGES: Final = {
    "queue_capacity": "Bound of every actor's inbox.",
    "staging_in_use_bytes": "Staging leased now.",
    "staging_capacity_bytes": "Size of the staging pool.",
    "staging_waiters": "Slices waiting for staging.",
    "threads_running": "kvpipe worker threads running.",
    "slice_blocks": "Blocks per slice in use.",
}
_TIMEOUTS: Final = ("slice_timeout", "total_timeout")
_SLICE_OUTCOMES: Final = ("complete", "incomplete", *_TIMEOUTS, "backend_error")
_KINDS: Final = ("write", "read", "lookup", "locate", "flush")
_BASE: Final = ("pipeline", "backend")


@dataclass(eq=False)
class _Tracked:
    """One pipeline: its labels, its observer, and the histogram children it created."""

    pipe: Pipeline
    label: str
    backend: str
    observer: Observer = field(init=False)
    children: dict[tuple[str, str], Histogram] = field(default_factory=dict)


@final
class PipelineMetrics:
    """Prometheus metrics of one or more pipelines, in a registry a server can mount.

    Args:
        pipes: A pipeline, several, or a mapping ``{label: pipeline}``; more can be added
            with :meth:`add`. Without a mapping, a pipeline's ``pipeline`` label is
            ``namespace/rank``.
        registry: Where the metrics are registered (default: a new
            ``prometheus_client.CollectorRegistry``, in :attr:`registry`). Pass
            ``prometheus_client.REGISTRY`` to join the process-wide default registry.
        namespace: Prefix of every metric name (``kvpipe_blocks_written_total``).

    Raises:
        Unsupported: ``prometheus_client`` is not installed.
        ConfigError: Two pipelines would get the same ``pipeline`` label (nothing stays
            registered or attached).
        ValueError: The registry already holds metrics of these names
            (``prometheus_client``'s duplicate check; use one ``PipelineMetrics`` per registry
            and :meth:`add` pipelines to it).

    Attach it in the event loop that runs the pipelines. Scraping (:meth:`exposition`, or the
    registry's own exporters) only reads, so it may run in another thread, for example
    ``prometheus_client.start_http_server(port, registry=metrics.registry)``.
    """

    def __init__(
        self,
        pipes: Pipeline | Iterable[Pipeline] | Mapping[str, Pipeline] = (),
        *,
        registry: CollectorRegistry | None = None,
        namespace: str = "kvpipe",
    ) -> None:
        try:
            from prometheus_client import CollectorRegistry, Histogram
        except ImportError as exc:
            raise Unsupported(
                "kvpipe.PipelineMetrics needs the prometheus-client package: "
                "pip install 'kvpipe[metrics]'"
            ) from exc

        self._prefix = f"{namespace}_" if namespace else ""
        self._tracked: dict[Pipeline, _Tracked] = {}
        labels = (*_BASE, "op", "outcome")
        self._slice = Histogram(
            "slice_seconds",
            "Seconds of one slice's backend call (put_blocks / get_blocks), by outcome.",
            labels,
            namespace=namespace,
            buckets=SLICE_BUCKETS,
            registry=None,
        )
        self._request = Histogram(
            "request_seconds",
            "Seconds from a call (write, read, lookup, locate, flush) to its outcome.",
            labels,
            namespace=namespace,
            buckets=REQUEST_BUCKETS,
            registry=None,
        )
        #: The registry holding these metrics (mount it, or pass it to an exporter).
        self.registry: CollectorRegistry = registry if registry is not None else CollectorRegistry()
        self.registry.register(cast("Collector", self))
        self._registered = True
        if isinstance(pipes, Pipeline):
            pipes = (pipes,)
        items = pipes.items() if isinstance(pipes, Mapping) else ((None, p) for p in pipes)
        try:
            for label, pipe in items:
                self.add(pipe, label=label)
        except BaseException:
            # Leave nothing behind: no observer on the pipelines added so far, and nothing in
            # the registry (a shared one would refuse the next PipelineMetrics as duplicated).
            self.close()
            raise

    def add(self, pipe: Pipeline, *, label: str | None = None) -> None:
        """Export ``pipe`` too, under ``pipeline=label`` (default ``namespace/rank``).

        Its counters keep being exported after it closes (they stay as they were), until
        :meth:`remove`.

        Raises:
            ConfigError: ``label`` is taken by another pipeline, ``pipe`` is exported
                under another label already, or ``pipe`` is not a :class:`kvpipe.Pipeline`.
        """
        if not isinstance(pipe, Pipeline):
            raise ConfigError("pipes", f"expected a kvpipe.Pipeline, got {type(pipe).__name__}")
        known = self._tracked.get(pipe)
        if known is not None:
            if label is not None and label != known.label:
                raise ConfigError(
                    "label", f"already exported as pipeline={known.label!r} (remove it first)"
                )
            return
        label = label if label is not None else f"{pipe.scope.namespace}/{pipe.scope.rank}"
        if any(t.label == label for t in self._tracked.values()):
            raise ConfigError("label", f"another pipeline is exported as pipeline={label!r}")
        tracked = _Tracked(pipe, label, pipe.store.name)
        tracked.observer = self._observer(tracked)
        self._tracked[pipe] = tracked
        pipe.add_observer(tracked.observer)

    def remove(self, pipe: Pipeline) -> None:
        """Stop exporting ``pipe``: its series disappear, its observer is detached."""
        tracked = self._tracked.pop(pipe, None)
        if tracked is None:
            return
        pipe.remove_observer(tracked.observer)
        for op, outcome in tracked.children:
            hist = self._slice if op.endswith("_slice") else self._request
            hist.remove(tracked.label, tracked.backend, op.removesuffix("_slice"), outcome)

    def close(self) -> None:
        """Stop exporting every pipeline and unregister from the registry (once: closing
        again does nothing)."""
        for pipe in list(self._tracked):
            self.remove(pipe)
        if self._registered:
            self._registered = False
            self.registry.unregister(cast("Collector", self))

    def _observer(self, tracked: _Tracked) -> Observer:
        children = tracked.children
        slice_hist, request_hist = self._slice, self._request
        label, backend = tracked.label, tracked.backend

        def observe(kind: ObservationKind, seconds: float, outcome: str) -> None:
            child = children.get((kind, outcome))
            if child is None:
                if kind in ("write_slice", "read_slice"):
                    child = slice_hist.labels(label, backend, kind[:-6], outcome)
                else:
                    child = request_hist.labels(label, backend, kind, outcome)
                children[(kind, outcome)] = child
            child.observe(seconds)

        return observe

    def exposition(self) -> tuple[bytes, str]:
        """The metrics page of :attr:`registry`: the body and its ``Content-Type``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def describe(self) -> Iterator[Metric]:
        """The metric families (for the registry's duplicate check)."""
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        """Every family, from each pipeline's statistics now plus the histograms."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            UnknownMetricFamily,
        )

        p = self._prefix
        tracked = list(self._tracked.values())
        snapshots = [(t, t.pipe.statistics()) for t in tracked]

        def counter(name: str, doc: str, *extra: str) -> CounterMetricFamily:
            return CounterMetricFamily(p + name, doc, labels=(*_BASE, *extra))

        def gauge(name: str, doc: str, *extra: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(p + name, doc, labels=(*_BASE, *extra))

        names = dict(_COUNTERS)
        for _, s in snapshots:
            names.update({n: f"kvpipe counter {n}." for n in s.counters if n not in names})
        for name, doc in names.items():
            fam = counter(name, doc)
            for t, s in snapshots:
                fam.add_metric([t.label, t.backend], s.counters.get(name, 0))
            yield fam

        slices = counter("slices", "Slices by direction (op) and outcome.", "op", "outcome")
        timeouts = counter(
            "timeouts", "Slices whose backend call ran out of time, by kind.", "op", "outcome"
        )
        restarts = counter("restarts", "Actor restarts after a crash.", "actor")
        open_ = gauge("open", "1 while the pipeline accepts calls.")
        in_flight = gauge("in_flight_requests", "Calls accepted and not finished.", "kind")
        depth = gauge("queue_depth", "Items waiting in an actor's inbox.", "actor")
        plain = {name: gauge(name, doc) for name, doc in _GAUGES.items()}
        backend = UnknownMetricFamily(
            p + "backend_statistic",
            "The store's own statistics() values.",
            labels=(*_BASE, "statistic"),
        )
        for t, s in snapshots:
            base = [t.label, t.backend]
            by_op = {(op, o): 0 for op in ("write", "read") for o in _SLICE_OUTCOMES}
            for key, n in s.slices.items():
                op, outcome = ("read", key[5:]) if key.startswith("read_") else ("write", key)
                by_op[(op, outcome)] = n
            for (op, outcome), n in sorted(by_op.items()):
                slices.add_metric([*base, op, outcome], n)
                if outcome in _TIMEOUTS:
                    timeouts.add_metric([*base, op, outcome], n)
            for actor in sorted({*s.queue_depths, *s.restarts}):
                restarts.add_metric([*base, actor], s.restarts.get(actor, 0))
            open_.add_metric(base, 1 if s.open else 0)
            for kind in _KINDS:
                in_flight.add_metric([*base, kind], s.in_flight.get(kind, 0))
            for actor, n in sorted(s.queue_depths.items()):
                depth.add_metric([*base, actor], n)
            for name, family in plain.items():
                family.add_metric(base, getattr(s, name))
            for stat, value in sorted(s.backend.items()):
                backend.add_metric([*base, stat], float(value))
        yield from (slices, timeouts, restarts, open_, in_flight, depth, *plain.values(), backend)
        yield from self._slice.collect()
        yield from self._request.collect()
