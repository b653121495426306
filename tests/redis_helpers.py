"""Helpers for the Redis backend tests: backends on the test servers, raw clients beside them."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode

from tiering.backends.redis import RedisBackend
from tiering.testing.redis_servers import (
    RedisClusterProcesses,
    RedisServer,
    find_redis_cli,
    find_redis_server,
)

Target = RedisServer | RedisClusterProcesses

NO_REDIS = (
    "redis-server/redis-cli are not installed (apt-get install redis-server redis-tools; "
    ".ci/run installs them)"
)


def require_redis() -> None:
    """Skip the calling test if redis-server or redis-cli cannot be found."""
    if find_redis_server() is None or find_redis_cli() is None:
        pytest.skip(NO_REDIS)


def target_options(target: Target) -> dict[str, Any]:
    """The backend options that point at ``target``."""
    if isinstance(target, RedisClusterProcesses):
        return {"cluster_nodes": target.seeds}
    return {"url": target.url}


def prefix_for(path: Path) -> str:
    """A key prefix of its own for each test directory (tests share the session's servers)."""
    return "t" + hashlib.sha256(str(path).encode()).hexdigest()[:16]


def make_redis_backend(
    target: Target,
    *,
    block_bytes: int = 4096,
    capacity_bytes: int = 64 << 20,
    fingerprint: bytes = b"redis-test-fp-01",
    **options: Any,
) -> RedisBackend:
    return RedisBackend(
        capacity_bytes=capacity_bytes,
        block_bytes=block_bytes,
        fingerprint=fingerprint,
        **{**target_options(target), **options},
    )


def raw_client(target: Target, password: str | None = None) -> Any:
    """A synchronous redis-py client on ``target``, for writing behind a backend's back."""
    if isinstance(target, RedisClusterProcesses):
        nodes = [ClusterNode("127.0.0.1", n.port) for n in target.nodes if n.running]
        return redis.RedisCluster(startup_nodes=nodes, password=password)
    return redis.Redis(port=target.port, password=password)
