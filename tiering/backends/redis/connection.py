"""How the Redis backend connects: its settings made into clients, and what open says on failure.

At open, wrong credentials, an unreachable server and a cluster that says it is down raise
:class:`~tiering.errors.BackendError` saying which and where (a password variable that is not
set raises :class:`~tiering.errors.ConfigurationError`). The password is read from the
environment at open, never kept in the settings.
"""

from __future__ import annotations

import os

from redis.exceptions import AuthenticationError, RedisError

from tiering.backends.redis.nodes import ClientOptions, RedisNodes, parse_seeds
from tiering.backends.redis.settings import RedisSettings
from tiering.errors import BackendError, ConfigurationError

__all__ = ["make_nodes", "open_error", "where"]


def where(settings: RedisSettings) -> str:
    """The deployment, for messages: the url without credentials, or the cluster's seeds."""
    return (settings.url or "").split("@")[-1] or f"cluster {settings.cluster_nodes}"


def make_nodes(settings: RedisSettings) -> RedisNodes:
    """The (not yet connected) nodes of the deployment ``settings`` name."""
    s = settings
    return RedisNodes(
        standalone_url=s.url,
        seeds=parse_seeds(s.cluster_nodes) if s.cluster_nodes is not None else [],
        options=ClientOptions(
            username=s.username,
            password=_password(s),
            db=s.db,
            tls=s.uses_tls,
            tls_ca_file=None if s.tls_ca_file is None else str(s.tls_ca_file),
            tls_cert_file=None if s.tls_cert_file is None else str(s.tls_cert_file),
            tls_key_file=None if s.tls_key_file is None else str(s.tls_key_file),
            connect_timeout_s=s.connect_timeout_s,
            timeout_s=s.timeout_s,
            max_connections=2 * s.pipelines_per_node + 32,
        ),
        pipelines_per_node=s.pipelines_per_node,
        retry_interval_s=s.retry_interval_s,
    )


def _password(settings: RedisSettings) -> str | None:
    """The password in the variable ``password_env`` names (None: no password configured)."""
    if settings.password_env is None:
        return None
    password = os.environ.get(settings.password_env)
    if not password:
        raise ConfigurationError(
            f"password_env names {settings.password_env!r}, which is not set (or empty) in "
            "this process's environment"
        )
    return password


def open_error(
    exc: BaseException, settings: RedisSettings, nodes: RedisNodes
) -> BackendError | None:
    """What open raises for ``exc`` (from connecting to ``nodes`` or recovering their keys): a
    :class:`BackendError` saying what is wrong and where, or None to raise ``exc`` itself."""
    s = settings
    if isinstance(exc, AuthenticationError) and s.password_env is None:
        return BackendError(
            f"redis at {nodes.where} needs credentials, and none are configured (name "
            f"the environment variable that holds the password in password_env): {exc}"
        )
    if isinstance(exc, AuthenticationError):
        who = f"user {s.username!r}" if s.username else "the default user"
        return BackendError(
            f"redis at {nodes.where} rejected the credentials ({who}, the password in "
            f"${s.password_env}): {exc}"
        )
    if isinstance(exc, RedisError | OSError):
        return BackendError(f"cannot use redis at {nodes.where}: {type(exc).__name__}: {exc}")
    return None
