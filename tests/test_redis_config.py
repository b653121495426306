"""``type: redis`` from YAML: settings parsed and checked by the config, the backend built from
them; and ``tiering`` without the redis package installed."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiering.backends.redis import RedisBackend, RedisSettings
from tiering.config import build_backend, load_config
from tiering.errors import ConfigError


def _write(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "tiering.yaml"
    path.write_text(
        "version: 1\nprimary:\n  capacity: 64MiB\nsecondary_tiers:\n"
        + textwrap.indent(textwrap.dedent(tiers), "  ")
    )
    return path


def test_redis_tier_from_yaml(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """\
        - name: shared
          type: redis
          capacity: 8GiB
          write_policy: write_through
          cluster_nodes: 10.0.0.1:6379,10.0.0.2:6379
          username: engine
          password_env: TIERING_REDIS_PASSWORD
          tls: true
          tls_ca_file: certs/ca.pem
          key_prefix: prod/llama3
          ttl_s: 86400
          shared: true
          timeout_s: 2.5
        """,
    )
    config = load_config(path)
    (tier,) = config.secondary_tiers
    assert tier.type == "redis" and tier.path is None
    settings = tier.settings
    assert isinstance(settings, RedisSettings)
    assert settings.cluster_nodes == "10.0.0.1:6379,10.0.0.2:6379"
    assert settings.tls_ca_file == tmp_path / "certs" / "ca.pem"  # relative to the file
    assert settings.shared and settings.ttl_s == 86400.0 and settings.timeout_s == 2.5
    backend = build_backend(tier, block_bytes=4096, fingerprint=b"f" * 16)
    assert isinstance(backend, RedisBackend)
    assert backend.settings == settings
    assert backend.capacity_bytes == 8 << 30
    assert backend.redis_key(b"k" * 8).startswith(b"prod/llama3:" + (b"f" * 16).hex().encode())
    assert not backend.is_open  # building does no I/O


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (
            "- {type: redis, capacity: 1GiB, url: 'redis://:pw@h:6379/0'}",
            "secondary_tiers[0]: url contains a password",
        ),
        ("- {type: redis, capacity: 1GiB}", "exactly one of url"),
        (
            "- {type: redis, capacity: 1GiB, url: 'redis://h', key_prefx: a}",
            "did you mean 'key_prefix'",
        ),
        ("- {type: redis, capacity: 1GiB, url: 'redis://h', path: x}", "takes no path"),
        ("- {type: redis, capacity: 1GiB, url: 'redis://h', ttl_s: 0}", "ttl_s"),
    ],
)
def test_bad_redis_tiers_name_file_line_and_key(tmp_path: Path, tier: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        load_config(_write(tmp_path, tier))
    assert str(info.value).startswith(str(tmp_path / "tiering.yaml") + ":")
    assert ":pw@" not in str(info.value)  # a secret in a URL is never echoed


def test_tiering_works_without_the_redis_package(tmp_path: Path) -> None:
    """Blocked ``redis`` import: tiering and its other backends work; type: redis says what
    to install."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["redis"] = None  # as if it were not installed
        import tiering, tiering.config, tiering.registry
        from tiering.config import load_config
        from tiering.errors import ConfigError
        path = {str(_write(tmp_path, "- {type: memory, capacity: 1MiB}"))!r}
        load_config(path)
        try:
            tiering.registry.get_backend("redis")
        except tiering.errors.ConfigurationError as exc:
            print("ERROR", exc)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "pip install 'tiering[redis]'" in run.stdout
