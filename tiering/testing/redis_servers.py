"""Real ``redis-server`` processes for tests and benchmarks: one server, or a Redis Cluster.

Servers listen on free loopback ports and keep their files in a directory the caller owns (a
temp dir). They persist nothing (``save ""``, no AOF), so a killed server comes back empty. On
Linux every server is started with a parent-death signal, so a test run that dies does not leave
servers behind; :meth:`RedisServer.stop` and :meth:`RedisClusterProcesses.stop` end them
normally (a fixture's teardown).

``redis-server`` and ``redis-cli`` are found on ``PATH`` (and in ``/usr/sbin``, ``/usr/bin``);
:func:`find_redis_server` says whether they are there. Nothing here imports ``redis`` (the
Python client): the harness talks RESP over a plain socket and runs ``redis-cli`` only to create
a cluster.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "RedisClusterProcesses",
    "RedisServer",
    "RedisServerError",
    "find_redis_cli",
    "find_redis_server",
    "free_port",
]

_SEARCH_DIRS = ("/usr/sbin", "/usr/bin", "/usr/local/bin")


class RedisServerError(RuntimeError):
    """A server could not be started, or a cluster could not be formed (says why)."""


def _find(program: str) -> str | None:
    found = shutil.which(program)
    if found:
        return found
    for directory in _SEARCH_DIRS:
        candidate = Path(directory) / program
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def find_redis_server() -> str | None:
    """The path of ``redis-server``, or None if it is not installed."""
    return _find("redis-server")


def find_redis_cli() -> str | None:
    """The path of ``redis-cli``, or None if it is not installed."""
    return _find("redis-cli")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _encode_command(args: Sequence[str | bytes]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg.encode() if isinstance(arg, str) else arg
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port``, its files in ``directory``.

    ``password`` sets ``requirepass`` (the default user's password). ``maxmemory_bytes`` and
    ``maxmemory_policy`` bound its memory. ``cluster=True`` makes it a cluster node (its bus
    on a port of its own). ``extra`` are more ``--name value`` arguments.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        maxmemory_bytes: int | None = None,
        maxmemory_policy: str = "allkeys-lru",
        cluster: bool = False,
        extra: Sequence[str] = (),
    ) -> None:
        self.directory = Path(directory)
        self._ports_free_to_change = port is None
        self.port = port if port is not None else free_port()
        self.bus_port = free_port() if cluster else None
        self.password = password
        self.maxmemory_bytes = maxmemory_bytes
        self.maxmemory_policy = maxmemory_policy
        self.cluster = cluster
        self.extra = tuple(extra)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        """``127.0.0.1:port``."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:port/0`` (no credentials: they never go in a URL here)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.directory / f"redis-{self.port}.log"

    def _arguments(self) -> list[str]:
        args = [
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
            "--maxmemory-policy", self.maxmemory_policy,
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.maxmemory_bytes is not None:
            args += ["--maxmemory", str(self.maxmemory_bytes)]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-port", str(self.bus_port),
                "--cluster-config-file", f"nodes-{self.port}.conf",
                "--cluster-node-timeout", "2000",
                # A cache loses only a dead master's share of the keys, never the whole cluster.
                "--cluster-require-full-coverage", "no",
                "--cluster-allow-reads-when-down", "yes",
            ]  # fmt: skip
        return [*args, *self.extra]

    def start(self, timeout_s: float = 20.0) -> None:
        """Start the server (again, after :meth:`kill`: same port) and wait until it answers.

        The first start of a server whose ports were picked here retries with other ports if
        something took them in the meantime (another test run on the machine).
        """
        if self.running:
            return
        for attempt in range(3 if self._ports_free_to_change else 1):
            try:
                self._start_once(timeout_s)
            except RedisServerError:
                if not self._ports_free_to_change or attempt == 2 or not self._clashed():
                    raise
                self.port = free_port()
                self.bus_port = free_port() if self.cluster else None
                continue
            self._ports_free_to_change = False
            return

    def _clashed(self) -> bool:
        return "Address already in use" in self._tail()

    def _start_once(self, timeout_s: float) -> None:
        binary = find_redis_server()
        if binary is None:
            raise RedisServerError("redis-server is not installed (apt-get install redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, *self._arguments()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,  # it logs to log_path
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RedisServerError(
                    f"redis-server on port {self.port} exited with {self.process.returncode}: "
                    f"{self._tail()}"
                )
            try:
                self.command("PING")
                return
            except RedisServerError:  # an error reply (LOADING, ...) is an answer too
                return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RedisServerError(f"redis-server on port {self.port} did not answer in {timeout_s}s")

    def _tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()
            return " | ".join(lines[-5:])
        return "(no log)"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self, *args: str | bytes, timeout_s: float = 5.0) -> bytes | int | list[object]:
        """Send one command (authenticating first if the server has a password); its reply.

        Errors come back as :class:`RedisServerError`, except NOAUTH-free replies of simple
        types: ``+OK`` -> b"OK", ``:1`` -> 1, bulk -> bytes, arrays -> lists.
        """
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout_s) as sock:
            reader = sock.makefile("rb")
            if self.password is not None:
                sock.sendall(_encode_command(["AUTH", self.password]))
                _read_reply(reader)
            sock.sendall(_encode_command(args))
            return _read_reply(reader)

    def info(self, section: str = "") -> dict[str, str]:
        """``INFO [section]`` as a dict of its ``name:value`` lines."""
        raw = self.command("INFO", section) if section else self.command("INFO")
        assert isinstance(raw, bytes)
        fields = {}
        for line in raw.decode().splitlines():
            name, sep, value = line.partition(":")
            if sep and not line.startswith("#"):
                fields[name] = value
        return fields

    def kill(self) -> None:
        """SIGKILL the server (a crash: it keeps nothing) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def pause(self) -> None:
        """SIGSTOP the server: it holds its connections and answers nothing (a hung node)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """End the server (SIGTERM, then SIGKILL after 10 s) and reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()


def _read_reply(reader: object) -> bytes | int | list[object]:
    readline = reader.readline  # type: ignore[attr-defined]
    read = reader.read  # type: ignore[attr-defined]
    line: bytes = readline()
    if not line:
        raise ConnectionError("the server closed the connection")
    kind, body = line[:1], line[1:-2]
    if kind == b"+":
        return body
    if kind == b"-":
        raise RedisServerError(body.decode(errors="replace"))
    if kind == b":":
        return int(body)
    if kind == b"$":
        size = int(body)
        if size < 0:
            return b""
        data: bytes = read(size + 2)
        return data[:-2]
    if kind == b"*":
        count = int(body)
        return [_read_reply(reader) for _ in range(max(count, 0))]
    raise RedisServerError(f"unexpected reply {line!r:.80}")


class RedisClusterProcesses:
    """``masters`` cluster-enabled servers in ``directory``, joined with ``redis-cli --cluster
    create`` (no replicas), every slot covered.

    The nodes allow reads and writes to the slots that are up when one node is down
    (``cluster-require-full-coverage no``), as a cache deployment should.
    """

    def __init__(
        self,
        directory: Path,
        *,
        masters: int = 3,
        password: str | None = None,
        maxmemory_bytes: int | None = None,
    ) -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 masters, got {masters}")
        self.directory = Path(directory)
        self.password = password
        self.nodes = [
            RedisServer(
                self.directory / f"node{i}",
                password=password,
                maxmemory_bytes=maxmemory_bytes,
                cluster=True,
            )
            for i in range(masters)
        ]

    @property
    def seeds(self) -> str:
        """``host:port,host:port,...`` of every node (the backend's ``cluster_nodes``)."""
        return ",".join(node.address for node in self.nodes)

    def start(self, timeout_s: float = 60.0) -> None:
        """Start every node, create the cluster, and wait until every node says it is ok."""
        cli = find_redis_cli()
        if cli is None:
            raise RedisServerError("redis-cli is not installed (apt-get install redis-tools)")
        for node in self.nodes:
            node.start()
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        create = subprocess.run(
            [cli, *auth, "--cluster", "create", *(n.address for n in self.nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )  # fmt: skip
        if create.returncode != 0:
            raise RedisServerError(
                f"redis-cli --cluster create failed ({create.returncode}): "
                f"{create.stdout.decode(errors='replace')[-800:]}"
                f"{create.stderr.decode(errors='replace')[-400:]}"
            )
        self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 60.0) -> None:
        """Wait until every running node reports ``cluster_state:ok`` and knows every node."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = []
            for node in self.nodes:
                if not node.running:
                    continue
                try:
                    raw = node.command("CLUSTER", "INFO")
                except (OSError, RedisServerError):
                    states.append(False)
                    continue
                text = raw.decode() if isinstance(raw, bytes) else ""
                states.append("cluster_state:ok" in text)
                states.append(f"cluster_known_nodes:{len(self.nodes)}" in text)
            if all(states):
                return
            if time.monotonic() > deadline:
                raise RedisServerError(f"the cluster in {self.directory} is not ok after "
                                       f"{timeout_s}s")  # fmt: skip
            time.sleep(0.05)

    def node_for_slot(self, slot: int) -> RedisServer:
        """The node that serves hash slot ``slot`` (from ``CLUSTER SLOTS`` of a live node)."""
        for node in self.nodes:
            if not node.running:
                continue
            ranges = node.command("CLUSTER", "SLOTS")
            assert isinstance(ranges, list)
            for entry in ranges:
                assert isinstance(entry, list)
                start, end, primary = entry[0], entry[1], entry[2]
                assert isinstance(start, int) and isinstance(end, int)
                assert isinstance(primary, list)
                if start <= slot <= end:
                    port = primary[1]
                    return next(n for n in self.nodes if n.port == port)
        raise RedisServerError(f"no running node knows slot {slot}")

    def move_slot(self, slot: int, target: RedisServer) -> int:
        """Reshard hash slot ``slot`` and its keys to ``target``, the steps ``redis-cli
        --cluster reshard`` takes: the slot IMPORTING on the target and MIGRATING on its
        master, its keys moved with ``MIGRATE``, then ``SETSLOT NODE`` on every running node.
        Returns how many keys moved.

        The cluster is first let settle (every node agreeing on each master's epoch and
        slots), so that the target's new epoch is the greatest: a node's gossip sent before it
        let the slot go then carries a smaller epoch and cannot take the slot back (with a
        stale epoch it could, and a slot flips between two masters for a while). It is let
        settle again before returning, so callers see one slot table."""
        self.wait_settled()
        source = self.node_for_slot(slot)
        if source is target:
            raise ValueError(f"slot {slot} is served by {target.address} already")
        ids = {}
        for node in (source, target):
            raw = node.command("CLUSTER", "MYID")
            assert isinstance(raw, bytes)
            ids[node.port] = raw.decode()
        target.command("CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source.port])
        source.command("CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target.port])
        auth = ["AUTH", self.password] if self.password else []
        moved = 0
        while True:
            keys = source.command("CLUSTER", "GETKEYSINSLOT", str(slot), "100")
            assert isinstance(keys, list)
            if not keys:
                break
            names = [k for k in keys if isinstance(k, bytes)]
            source.command("MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", *auth,
                           "KEYS", *names)  # fmt: skip
            moved += len(names)
        for node in (target, source, *self.nodes):  # the two ends first, as redis-cli does
            if node.running:
                node.command("CLUSTER", "SETSLOT", str(slot), "NODE", ids[target.port])
        self.wait_settled()
        return moved

    def wait_settled(self, timeout_s: float = 60.0) -> None:
        """Wait until every running node gives the same masters, each with the same config
        epoch (all distinct) and slots, in ``CLUSTER NODES``."""
        deadline = time.monotonic() + timeout_s
        while True:
            views = {self._config_view(node) for node in self.nodes if node.running}
            if len(views) == 1:
                (view,) = views
                epochs = [epoch for _, epoch, _ in view]
                if len(set(epochs)) == len(epochs):
                    return
            if time.monotonic() > deadline:
                raise RedisServerError(f"the cluster in {self.directory} has not settled "
                                       f"after {timeout_s}s: {sorted(views)}")  # fmt: skip
            time.sleep(0.02)

    @staticmethod
    def _config_view(node: RedisServer) -> tuple[tuple[str, int, str], ...]:
        """(id, config epoch, slots) of each master ``node`` knows, from ``CLUSTER NODES``;
        migrations in progress (``[slot->-id]``) are left out: only the node itself lists them."""
        raw = node.command("CLUSTER", "NODES")
        assert isinstance(raw, bytes)
        masters = []
        for line in raw.decode().splitlines():
            fields = line.split()
            if len(fields) < 8 or "master" not in fields[2].split(","):
                continue
            slots = " ".join(f for f in fields[8:] if not f.startswith("["))
            masters.append((fields[0], int(fields[6]), slots))
        return tuple(sorted(masters))

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
