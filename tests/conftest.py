"""Fixtures shared by test modules: real Redis servers (see tiering.testing.redis_servers).

The session's standalone server and 3-master cluster are started on first use and torn down at
the end of the session; tests that kill or reconfigure servers start their own. Each test that
uses the shared servers gets them flushed afterwards (tests run one at a time).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tiering.testing.redis_servers import (
    RedisClusterProcesses,
    RedisServer,
    find_redis_cli,
    find_redis_server,
)

NO_REDIS = (
    "redis-server/redis-cli are not installed (apt-get install redis-server redis-tools; "
    ".ci/run installs them)"
)


def require_redis() -> None:
    """Skip the calling test if redis-server or redis-cli cannot be found."""
    if find_redis_server() is None or find_redis_cli() is None:
        pytest.skip(NO_REDIS)


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
