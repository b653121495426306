"""Real Redis servers for the Redis tests (see tiering.testing.redis_servers), as a pytest
plugin: a test module names it in ``pytest_plugins = ["redis_fixtures"]`` (not a conftest.py:
tests/integrations has one, and two top-level ``conftest`` modules collide for mypy).

The session's standalone server and 3-master cluster are started on first use and torn down at
the end of the session; tests that kill or reconfigure servers start their own. Each test that
uses the shared servers gets them flushed afterwards (tests run one at a time).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_helpers import require_redis

from tiering.testing.redis_servers import RedisClusterProcesses, RedisServer


@pytest.fixture(scope="session")
def redis_standalone_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-standalone"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RedisClusterProcesses]:
    require_redis()
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_standalone(redis_standalone_session: RedisServer) -> Iterator[RedisServer]:
    """The session's standalone server, flushed after the test."""
    yield redis_standalone_session
    redis_standalone_session.command("FLUSHALL")


@pytest.fixture
def redis_cluster(
    redis_cluster_session: RedisClusterProcesses,
) -> Iterator[RedisClusterProcesses]:
    """The session's cluster, every node flushed after the test."""
    yield redis_cluster_session
    for node in redis_cluster_session.nodes:
        node.command("FLUSHALL")
