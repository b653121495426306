"""The Redis backend (``type: redis``): blocks in a Redis server or a Redis Cluster (or Valkey).

Needs the ``redis`` package with its ``hiredis`` parser (``pip install 'tiering[redis]'``);
``import tiering`` works without it, and the registry imports this module only when a tier
asks for ``type: redis``.

The package, a module per idea:

- :mod:`~tiering.backends.redis.backend`: :class:`RedisBackend`, its lifecycle and its calls;
- :mod:`~tiering.backends.redis.settings`: :class:`RedisSettings` (docs/config.md);
- :mod:`~tiering.backends.redis.connection`: the settings made into clients, open's errors;
- :mod:`~tiering.backends.redis.nodes`: the masters, one client each, and which holds a key;
- :mod:`~tiering.backends.redis.value_format`: a block's two strings, their names and checks;
- :mod:`~tiering.backends.redis.pipelines`: a call's commands, by node, in bounded pipelines;
- :mod:`~tiering.backends.redis.puts`, :mod:`~tiering.backends.redis.gets` and
  :mod:`~tiering.backends.redis.reads`: writing and reading blocks;
- :mod:`~tiering.backends.redis.ownership`: the keys held and the budget (``shared``);
- :mod:`~tiering.backends.redis.faults`: what a failed node or command costs (nothing raises);
- :mod:`~tiering.backends.redis.server_stats`: what the masters report;
- :mod:`~tiering.backends.redis.buffers`: the caller's buffers as block views.

Stats
    ``puts``/``gets`` count keys; ``bytes_written``/``bytes_read`` payload bytes of ``OK``
    results. ``extra``: ``node_errors`` (pipelines a node failed), ``node_down_keys`` (keys failed
    at once because their node was down), ``redirections`` (keys answered ``MOVED``, ``ASK``, ...),
    ``oom_rejections``, ``vanished``
    (held keys that Redis no longer had), ``recovered_blocks``, ``recovered_over_capacity``,
    ``put_skipped_present``.
"""

from __future__ import annotations

try:
    import redis.exceptions  # noqa: F401  (the optional extra: say how to install it)
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    raise ModuleNotFoundError(
        "the redis backend needs the redis package: pip install 'tiering[redis]'", name="redis"
    ) from exc

from tiering.backends.redis.backend import RedisBackend
from tiering.backends.redis.server_stats import RedisServerStats
from tiering.backends.redis.settings import RedisSettings
from tiering.backends.redis.value_format import REDIS_OVERHEAD_BYTES as REDIS_OVERHEAD_BYTES
from tiering.backends.redis.value_format import TAIL_BYTES as TAIL_BYTES

__all__ = ["RedisBackend", "RedisServerStats", "RedisSettings"]
