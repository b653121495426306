"""What operators see: Prometheus metrics and KV-cache events of a running manager.

It sits above the managers and uses only their public API; the core never imports it.

- :mod:`tiering.observability.metrics`: the catalogue of metrics and a snapshot of a
  manager's counters; :mod:`tiering.observability.prometheus`: those as Prometheus metrics
  (a collector read at scrape time, or a multi-process exporter) and an HTTP endpoint.
- :mod:`tiering.observability.kv_events`: block stored/removed events over ZMQ, in the wire
  format of vLLM's KV event subscribers.
"""
