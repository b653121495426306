"""RedisBackend over TLS to a real redis-server: a CA of the test's own, server and client
certificates made with the openssl CLI, mutual TLS required by the server."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_helpers import make_redis_backend, require_redis

from tiering.backends.base import Outcome
from tiering.backends.redis import RedisBackend
from tiering.errors import BackendError
from tiering.testing.redis_servers import RedisServer, free_port

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             cwd=directory)  # fmt: skip


def _make_cert(directory: Path, name: str, ca: str) -> None:
    (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
             cwd=directory)  # fmt: skip


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, int, Path]]:
    require_redis()
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed (it makes the test certificates)")
    certs = tmp_path_factory.mktemp("certs")
    _make_ca(certs, "ca")
    _make_ca(certs, "other-ca")
    _make_cert(certs, "server", "ca")
    _make_cert(certs, "client", "ca")
    tls_port = free_port()
    server = RedisServer(
        tmp_path_factory.mktemp("redis-tls"),
        extra=[
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(certs / "server.pem"),
            "--tls-key-file", str(certs / "server.key"),
            "--tls-ca-cert-file", str(certs / "ca.pem"),
            "--tls-auth-clients", "yes",
        ],
    )  # fmt: skip
    server.start()
    try:
        yield server, tls_port, certs
    finally:
        server.stop()


def _backend(tls_port: int, certs: Path, **options: object) -> RedisBackend:
    settings: dict[str, object] = {
        "url": f"rediss://127.0.0.1:{tls_port}/0",
        "tls_ca_file": certs / "ca.pem",
        "tls_cert_file": certs / "client.pem",
        "tls_key_file": certs / "client.key",
        **options,
    }
    return RedisBackend(
        capacity_bytes=1 << 30, block_bytes=4096, fingerprint=b"tls-test-fp-0001", **settings
    )


@pytest.mark.asyncio
async def test_mutual_tls_round_trip(tls_server: tuple[RedisServer, int, Path]) -> None:
    server, tls_port, certs = tls_server
    keys = [bytes([i]) * 32 + b"\0\0\0\0" for i in range(4)]
    values = [memoryview(bytearray([i]) * 4096) for i in range(4)]
    async with _backend(tls_port, certs) as backend:
        assert await backend.put(keys, values) == [Outcome.OK] * 4
        out = [memoryview(bytearray(4096)) for _ in range(4)]
        assert await backend.get(keys, out) == [Outcome.OK] * 4
        assert out == values
    # the same blocks, seen through the plain port: TLS changed the transport, not the data
    async with make_redis_backend(server, fingerprint=b"tls-test-fp-0001") as plain:
        assert await plain.contains(keys) == [True] * 4


@pytest.mark.asyncio
async def test_tls_failures_are_clear_errors_at_open(
    tls_server: tuple[RedisServer, int, Path],
) -> None:
    _, tls_port, certs = tls_server
    no_client_cert = _backend(tls_port, certs, tls_cert_file=None, tls_key_file=None)
    with pytest.raises(BackendError, match=f"cannot use redis at rediss://127.0.0.1:{tls_port}"):
        await no_client_cert.open()
    wrong_ca = _backend(tls_port, certs, tls_ca_file=certs / "other-ca.pem")
    with pytest.raises(BackendError, match="certificate verify failed"):
        await wrong_ca.open()
    plain_to_tls_port = _backend(
        tls_port,
        certs,
        url=f"redis://127.0.0.1:{tls_port}/0",
        tls_ca_file=None,
        tls_cert_file=None,
        tls_key_file=None,
        connect_timeout_s=2.0,
        timeout_s=2.0,
    )
    with pytest.raises(BackendError, match="cannot use redis"):
        await plain_to_tls_port.open()
