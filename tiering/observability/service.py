"""A config's ``metrics`` and ``events`` sections, running for one manager.

:class:`Observability` starts what the config asks for: the Prometheus endpoint
(``metrics.port``) and the KV event publisher (``events.endpoint``). The caller drives
:meth:`Observability.step` from the thread that calls the manager (after each scheduler step,
or each request of a replay): it takes the manager's events and hands them to the publisher.
"""

from __future__ import annotations

import os
from types import TracebackType

from prometheus_client import CollectorRegistry

from tiering.config import TieringConfig
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.kv_events import KVEventPublisher
from tiering.observability.prometheus import (
    MULTIPROC_DIR_ENV,
    MetricsServer,
    MultiprocessExporter,
    TieringCollector,
    multiprocess_registry,
    start_metrics_server,
)

__all__ = ["Observability"]


class Observability:
    """The metrics endpoint and event publisher ``config`` asks for, for ``manager``.

    With ``PROMETHEUS_MULTIPROC_DIR`` set, metrics go through a
    :class:`~tiering.observability.prometheus.MultiprocessExporter` and the endpoint (if any)
    serves every process's; otherwise a collector reads the manager at each scrape.
    """

    def __init__(self, config: TieringConfig, manager: TieringOffloadingManager) -> None:
        self.manager = manager
        self.registry: CollectorRegistry | None = None
        self.exporter: MultiprocessExporter | None = None
        self.server: MetricsServer | None = None
        self.publisher: KVEventPublisher | None = None
        self._take_events = config.events.enabled
        try:
            if config.metrics.enabled:
                if os.environ.get(MULTIPROC_DIR_ENV):
                    self.exporter = MultiprocessExporter(manager)
                    if config.metrics.port is not None:
                        self.registry = multiprocess_registry()
                else:
                    self.registry = CollectorRegistry()
                    self.registry.register(TieringCollector(manager))
            if self.registry is not None and config.metrics.port is not None:
                self.server = start_metrics_server(
                    self.registry, port=config.metrics.port, address=config.metrics.address
                )
            events = config.events
            if events.endpoint is not None:
                self.publisher = KVEventPublisher(
                    events.endpoint,
                    replay_endpoint=events.replay_endpoint,
                    topic=events.topic,
                    buffer_steps=events.buffer_steps,
                    hash_format=events.hash_format,
                    tier_names={t.medium: t.name for t in manager.tiers},
                )
        except BaseException:
            self.close()
            raise

    @property
    def metrics_url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def step(self) -> None:
        """Publish the manager's events since the last step (dropped with no publisher, so
        recorded events never pile up)."""
        if self._take_events:
            events = self.manager.take_events()
            if self.publisher is not None:
                self.publisher.publish(events)

    def close(self) -> None:
        """Send what is queued, then stop the publisher, exporter and endpoint (call
        :meth:`step` once more first to publish the last events)."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        if self.server is not None:
            self.server.close()
            self.server = None

    def __enter__(self) -> Observability:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
