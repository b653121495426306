"""The settings of the ``redis`` backend (``type: redis``), checked when they are built.

One of ``url`` (a standalone server) and ``cluster_nodes`` (seed nodes of a Redis Cluster);
credentials come from an environment variable that ``password_env`` names, never from the
configuration itself. docs/config.md lists every field.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from tiering.backends.redis.nodes import parse_seeds
from tiering.errors import ConfigurationError

__all__ = ["RedisSettings"]

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")


@dataclass(frozen=True)
class RedisSettings:
    """Settings of the ``redis`` backend (:class:`RedisBackend`); see docs/config.md."""

    url: str | None = field(
        default=None,
        metadata={"doc": "a standalone server: redis://host:port/db, rediss:// (TLS), unix://"},
    )
    cluster_nodes: str | None = field(
        default=None, metadata={"doc": "a Redis Cluster: seed nodes as 'host:port,host:port'"}
    )
    db: int = field(default=0, metadata={"min": 0, "doc": "database number (standalone only)"})
    username: str | None = field(default=None, metadata={"doc": "ACL user name"})
    password_env: str | None = field(
        default=None,
        metadata={"doc": "name of the environment variable that holds the password"},
    )
    tls: bool = field(default=False, metadata={"doc": "connect with TLS (implied by rediss://)"})
    tls_ca_file: Path | None = field(
        default=None, metadata={"doc": "CA bundle that signs the servers' certificates"}
    )
    tls_cert_file: Path | None = field(
        default=None, metadata={"doc": "client certificate (mutual TLS)"}
    )
    tls_key_file: Path | None = field(default=None, metadata={"doc": "client certificate's key"})
    connect_timeout_s: float = field(
        default=5.0, metadata={"min": 0.001, "doc": "seconds to connect to a node"}
    )
    timeout_s: float = field(
        default=10.0, metadata={"min": 0.001, "doc": "seconds for one pipeline to be answered"}
    )
    key_prefix: str = field(
        default="tiering", metadata={"doc": "first part of every Redis key name"}
    )
    ttl_s: float | None = field(
        default=None, metadata={"min": 0.001, "doc": "expire blocks this long after a put"}
    )
    shared: bool = field(
        default=False,
        metadata={"doc": "many nodes share the namespace: keep no index, enforce no budget"},
    )
    pipeline_bytes: int = field(
        default=2 << 20, metadata={"doc": "values per pipeline (bigger calls are cut)"}
    )
    pipelines_per_node: int = field(
        default=2,
        metadata={"min": 1, "max": 64, "doc": "get pipelines in flight per node (as many puts)"},
    )
    retry_interval_s: float = field(
        default=1.0, metadata={"min": 0.0, "doc": "seconds a failed node is skipped"}
    )

    def __post_init__(self) -> None:
        if (self.url is None) == (self.cluster_nodes is None):
            raise ConfigurationError(
                "give exactly one of url (a standalone server) and cluster_nodes (seed nodes "
                "of a Redis Cluster)"
            )
        if self.url is not None:
            parts = urllib.parse.urlsplit(self.url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise ConfigurationError(
                    f"url {self.url!r}: the scheme must be redis://, rediss:// or unix://"
                )
            if parts.password:
                raise ConfigurationError(
                    "url contains a password: put the password in an environment variable "
                    "and name the variable in password_env"
                )
        if self.cluster_nodes is not None:
            try:
                parse_seeds(self.cluster_nodes)
            except ValueError as exc:
                raise ConfigurationError(f"cluster_nodes: {exc}") from None
            if self.db != 0:
                raise ConfigurationError(f"db: a Redis Cluster has only database 0, got {self.db}")
        if not _PREFIX_RE.fullmatch(self.key_prefix):
            raise ConfigurationError(
                f"key_prefix {self.key_prefix!r}: use 1 to 64 of A-Z a-z 0-9 _ . : / - "
                "(no braces: a hash tag would put every block in one cluster slot)"
            )
        if self.password_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*",
                                                              self.password_env):  # fmt: skip
            raise ConfigurationError(
                f"password_env {self.password_env!r} is not an environment variable name "
                "(give the variable's name, never the password itself)"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigurationError("give tls_cert_file and tls_key_file together (mutual TLS)")
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if not self.uses_tls and any(f is not None for f in files):
            raise ConfigurationError(
                "TLS files are given but TLS is off: set tls: true (or use a rediss:// url)"
            )
        if self.pipeline_bytes < 1:
            raise ConfigurationError(f"pipeline_bytes must be > 0, got {self.pipeline_bytes}")

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url is not None and self.url.startswith("rediss://"))
