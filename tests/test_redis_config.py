"""``type: redis`` from YAML: settings parsed and checked by the config, the backend built from
them, a manager storing into and promoting from it; and ``tiering`` without the redis package."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tiering.backends.redis import RedisBackend, RedisSettings
from tiering.config import build_backend, build_manager, build_pool, load_config, parse_config
from tiering.core.keys import make_offload_key
from tiering.errors import ConfigError
from tiering.testing.redis_servers import RedisClusterProcesses, RedisServer

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures


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
    header_name, _ = backend.redis_keys(b"k" * 8)
    assert header_name.startswith(b"prod/llama3:" + (b"f" * 16).hex().encode() + b":{")
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
        import tiering, tiering.config, tiering.backends.registry
        from tiering.config import load_config
        from tiering.errors import ConfigError
        path = {str(_write(tmp_path, "- {type: memory, capacity: 1MiB}"))!r}
        load_config(path)
        try:
            tiering.backends.registry.get_backend("redis")
        except tiering.errors.ConfigurationError as exc:
            print("ERROR", exc)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "pip install 'tiering[redis]'" in run.stdout


def _payload(key: bytes, row_bytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "big"))
    return torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("deployment", ["standalone", "cluster"])
def test_manager_stores_into_and_promotes_from_a_redis_tier(
    deployment: str,
    redis_standalone: RedisServer,
    redis_cluster: RedisClusterProcesses,
) -> None:
    """build_manager with a redis tier: blocks the CPU tier evicts land in Redis and come back
    bit-exact through a promotion (today's tiers; the shared-tier mode is the next step)."""
    target = redis_standalone if deployment == "standalone" else redis_cluster
    tier: dict[str, object] = {"type": "redis", "capacity": "16MiB", "key_prefix": "mgr"}
    tier.update(
        {"url": target.url} if isinstance(target, RedisServer) else {"cluster_nodes": target.seeds}
    )
    row_bytes = 64 << 10
    config = parse_config(
        {"version": 1, "primary": {"capacity": 4 * row_bytes}, "secondary_tiers": [tier]},
        env={},
    )
    pool = build_pool(config, block_bytes=row_bytes)
    manager = build_manager(config, block_bytes=row_bytes, fingerprint=b"m" * 16, pool=pool)
    try:
        manager.wait_ready()
        assert [type(t.backend) for t in manager.tiers] == [RedisBackend]
        rows = pool.rows_view()
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
        for key in keys:
            out = manager.prepare_store([key])
            assert out is not None
            (slot,) = out.store_spec.block_ids.tolist()
            rows[slot] = _payload(key, row_bytes)
            manager.complete_store([key])
        manager.wait_idle()
        fillers = [make_offload_key(bytes([100 + i]) * 32, 0) for i in range(4)]
        out = manager.prepare_store(fillers)  # evicts both from the CPU tier
        assert out is not None and set(out.evicted_keys) == set(keys)
        manager.complete_store(fillers)
        manager.wait_idle()
        for key in keys:
            assert manager.locate(key) == "REDIS"
            assert manager.lookup(key) is None  # a promotion starts
            manager.wait_idle()
            assert manager.lookup(key) is True
            spec = manager.prepare_load([key])
            (slot,) = spec.block_ids.tolist()
            assert torch.equal(rows[slot], _payload(key, row_bytes))
            manager.complete_load([key])
        assert manager.tiers[0].metrics.promoted_blocks == 2
    finally:
        manager.shutdown()
        pool.close()
