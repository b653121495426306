"""A manager's metrics in Prometheus: read at scrape time, or exported for several processes.

One process (the usual case): :class:`TieringCollector` is a ``prometheus_client`` collector
that reads the manager's counters when Prometheus scrapes (:mod:`tiering.observability.metrics`),
so the protocol's hot path pays nothing. Register it in a registry and serve that registry
(:func:`start_metrics_server`, or the engine's own ``/metrics``).

Several processes (an engine that runs one scheduler per data-parallel rank, each with its own
manager, and serves ``/metrics`` from another process): ``prometheus_client``'s multi-process
mode. Set ``PROMETHEUS_MULTIPROC_DIR`` to an empty directory shared by the processes *before*
they start (``prometheus_client`` reads it when first imported; vLLM sets it itself when it
runs several API server processes). Each process with a manager runs a
:class:`MultiprocessExporter`, which copies the counters into ``prometheus_client`` metrics
(memory-mapped files in that directory) on a timer; the serving process serves
:func:`multiprocess_registry`, which sums them. Counters and histograms add up across
processes; gauges are summed over live processes (``livesum``): call
``prometheus_client.multiprocess.mark_process_dead(pid)`` when a process exits for good.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client import values as prometheus_values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from tiering.errors import ConfigurationError
from tiering.observability.metrics import (
    CATALOGUE,
    LATENCY_BUCKETS_S,
    ManagerLike,
    latency_records,
    read_samples,
)

__all__ = [
    "MULTIPROC_DIR_ENV",
    "MetricsServer",
    "MultiprocessExporter",
    "TieringCollector",
    "multiprocess_registry",
    "start_metrics_server",
]

#: The environment variable that puts ``prometheus_client`` in multi-process mode.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_BASE_LABELS = ("tier", "medium")


def _cumulative_buckets(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (the last one above every bound) as Prometheus' cumulative ``le``
    buckets."""
    out, running = [], 0
    for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), counts, strict=True):
        running += count
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
    return out


def _add_to_histogram(series: Any, bucket_deltas: list[int], sum_delta_s: float) -> None:
    """Add counts already sorted into :data:`LATENCY_BUCKETS_S` to one ``prometheus_client``
    histogram series (the same buckets). ``prometheus_client`` has only ``observe(value)``,
    one sample at a time, and the tiers keep counts, not samples (fixed memory): so its
    per-bucket values and its sum are increased directly (``Histogram._buckets`` / ``_sum``,
    stable since prometheus_client 0.4; tests/test_metrics.py checks the exported counts)."""
    buckets = series._buckets
    # The last bucket counts values above every bound: prometheus_client's own +Inf bucket.
    assert len(buckets) == len(bucket_deltas), "histogram buckets differ from the tiers'"
    for bucket, delta in zip(buckets, bucket_deltas, strict=True):
        if delta:
            bucket.inc(delta)
    series._sum.inc(sum_delta_s)


class TieringCollector(Collector):
    """Reads ``manager``'s counters at each scrape. ``constant_labels`` (e.g.
    ``{"engine": "0"}``) are added to every series.

    Latency histograms are the tiers' own bucket counts (cumulative since each tier was built),
    so any number of collectors may read one manager.
    """

    def __init__(self, manager: ManagerLike, constant_labels: dict[str, str] | None = None) -> None:
        self.manager = manager
        self.constant_labels = dict(constant_labels or {})

    def collect(self) -> Iterator[Metric]:
        extra_names = tuple(self.constant_labels)
        extra_values = tuple(self.constant_labels.values())
        families: dict[str, Any] = {}
        for spec in CATALOGUE:
            label_names = [*_BASE_LABELS, *spec.labels, *extra_names]
            if spec.kind == "counter":
                families[spec.name] = CounterMetricFamily(spec.name, spec.help, labels=label_names)
            elif spec.kind == "gauge":
                families[spec.name] = GaugeMetricFamily(spec.name, spec.help, labels=label_names)
            else:
                families[spec.name] = HistogramMetricFamily(
                    spec.name, spec.help, labels=label_names
                )
        for sample in read_samples(self.manager):
            families[sample.name].add_metric([*sample.labels, *extra_values], sample.value)
        latency = families["tiering_job_latency_seconds"]
        for labels, record in latency_records(self.manager):
            counts = list(record.bucket_counts)  # one copy: the buckets agree with each other
            latency.add_metric(
                [*labels, *extra_values], _cumulative_buckets(counts), sum_value=record.total_s
            )
        yield from families.values()

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are known only at scrape: skip registration-time checks


class MultiprocessExporter:
    """Copies ``manager``'s counters into ``prometheus_client`` metrics every ``interval_s``
    (on a thread of its own), for multi-process mode; see the module docstring.

    Needs ``PROMETHEUS_MULTIPROC_DIR`` set before ``prometheus_client`` was imported in this
    process (:class:`ConfigurationError` otherwise). ``update()`` copies once, now; ``close()``
    copies a last time and stops the thread. One exporter per process.
    """

    def __init__(
        self,
        manager: ManagerLike,
        *,
        interval_s: float | None = 5.0,
        constant_labels: dict[str, str] | None = None,
    ) -> None:
        # prometheus_client chose its value class (memory or mmapped files) at import.
        if prometheus_values.ValueClass is prometheus_values.MutexValue:
            raise ConfigurationError(
                f"multi-process metrics need {MULTIPROC_DIR_ENV} set to a directory before the "
                "process starts (prometheus_client reads it when first imported)"
            )
        self.manager = manager
        self.constant_labels = dict(constant_labels or {})
        extra = tuple(self.constant_labels)
        self._metrics: dict[str, Any] = {}
        for spec in CATALOGUE:
            names = [*_BASE_LABELS, *spec.labels, *extra]
            if spec.kind == "counter":
                self._metrics[spec.name] = PromCounter(spec.name, spec.help, names, registry=None)
            elif spec.kind == "gauge":
                self._metrics[spec.name] = PromGauge(
                    spec.name, spec.help, names, registry=None, multiprocess_mode="livesum"
                )
            else:
                self._metrics[spec.name] = PromHistogram(
                    spec.name, spec.help, names, registry=None, buckets=LATENCY_BUCKETS_S
                )
        self._copied: dict[tuple[str, tuple[str, ...]], float] = {}
        # Per latency series: the bucket counts and the sum copied so far.
        self._copied_latency: dict[tuple[str, ...], tuple[list[int], float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s is not None:
            self._thread = threading.Thread(
                target=self._run, args=(interval_s,), name="tiering-metrics", daemon=True
            )
            self._thread.start()

    def update(self) -> None:
        """Copy the counters now (what changed since the last copy)."""
        extra = tuple(self.constant_labels.values())
        with self._lock:
            for sample in read_samples(self.manager):
                metric = self._metrics[sample.name].labels(*sample.labels, *extra)
                if isinstance(metric, PromGauge):
                    metric.set(sample.value)
                    continue
                key = (sample.name, sample.labels)
                delta = sample.value - self._copied.get(key, 0)
                if delta > 0:
                    metric.inc(delta)
                    self._copied[key] = sample.value
            latency = self._metrics["tiering_job_latency_seconds"]
            for labels, record in latency_records(self.manager):
                counts, total_s = list(record.bucket_counts), record.total_s
                copied, copied_s = self._copied_latency.get(labels, ([0] * len(counts), 0.0))
                deltas = [now - before for now, before in zip(counts, copied, strict=True)]
                if any(deltas):
                    _add_to_histogram(latency.labels(*labels, *extra), deltas, total_s - copied_s)
                    self._copied_latency[labels] = (counts, total_s)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.update()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.update()


def multiprocess_registry(path: str | None = None) -> CollectorRegistry:
    """A registry that sums the metrics every process wrote to ``path`` (default
    ``$PROMETHEUS_MULTIPROC_DIR``), for the process that serves ``/metrics``."""
    path = path or os.environ.get(MULTIPROC_DIR_ENV)
    if not path or not os.path.isdir(path):
        raise ConfigurationError(
            f"multi-process metrics need a directory: {MULTIPROC_DIR_ENV}={path!r} is not one"
        )
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return registry


@dataclass
class MetricsServer:
    """An HTTP endpoint serving ``/metrics`` (any path answers) on its own thread."""

    address: str
    port: int
    _server: Any
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_metrics_server(
    registry: CollectorRegistry, *, port: int = 0, address: str = "127.0.0.1"
) -> MetricsServer:
    """Serve ``registry`` over HTTP on ``address:port`` (port 0: any free port; see
    :attr:`MetricsServer.port`). Raises :class:`ConfigurationError` naming the address if it
    cannot listen there."""
    try:
        server, thread = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot serve metrics on {address}:{port}: {exc.strerror or exc}; give a free port "
            "(metrics.port) or another address (metrics.address)"
        ) from None
    return MetricsServer(address, int(server.server_address[1]), server, thread)
