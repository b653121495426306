"""Two engine nodes share one real 3-master Redis Cluster through a shared tier: each node is a
process of its own (tests/workers/shared_node.py) with its own CPU tier and manager, built from
a YAML file. Node A stores a prompt; node B looks it up ("retry later", then a hit) and loads it
bit-exact; salted prompts never hit across nodes; two nodes storing one prompt write each block
once."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_helpers import prefix_for

from tiering.testing.redis_servers import RedisClusterProcesses

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures

WORKER = Path(__file__).parent / "workers" / "shared_node.py"
BLOCK_BYTES = 64 << 10  # the worker's row size
HANG_S = 120.0  # a hang guard only: no answer takes anywhere near this long


class Node:
    """One engine node process; :meth:`call` sends a command and returns its reply."""

    def __init__(self, config: Path, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), str(config), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")  # the process ended

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def reply(self) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=HANG_S)
        except queue.Empty:
            self.process.kill()
            line = ""
        if not line:
            _, stderr = self.process.communicate(timeout=HANG_S)
            pytest.fail(f"the node process gave no answer: {stderr[-3000:]}")
        answer: dict[str, Any] = json.loads(line)
        assert "error" not in answer, answer
        return answer

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.reply()

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(timeout=HANG_S)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        _, stderr = self.process.communicate()
        assert self.process.returncode == 0, stderr[-3000:]


@pytest.fixture(scope="module")
def nodes(
    redis_cluster_session: RedisClusterProcesses, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Node]]:
    """Three engine nodes for the module, built from one YAML file (a CPU tier of 64 blocks, the
    shared cluster): ``a`` and ``c`` standalone, ``b`` step-driven. Each test uses prompts of
    its own, and the nodes' answers never expire within the module (so no answer depends on
    time); ``stats`` are deltas since the node's previous ``stats``."""
    folder = tmp_path_factory.mktemp("shared-nodes")
    config = folder / "tiering.yaml"
    config.write_text(
        f"""\
version: 1
primary:
  capacity: {64 * BLOCK_BYTES}
secondary_tiers:
  - name: shared
    type: redis
    capacity: 1GiB
    shared: true
    cluster_nodes: {redis_cluster_session.seeds}
    key_prefix: {prefix_for(folder)}
    existence_cache_seconds: 3600
"""
    )
    started = {name: Node(config, mode) for name, mode in
               (("a", "standalone"), ("b", "step_driven"), ("c", "standalone"))}  # fmt: skip
    try:
        yield started
    finally:
        for node in started.values():
            node.close()


def _stats(node: Node) -> dict[str, Any]:
    return node.call("stats")


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["b", "c"], ids=["step_driven", "standalone"])
def test_node_b_finds_what_node_a_stored(nodes: dict[str, Node], reader: str) -> None:
    a, b = nodes["a"], nodes[reader]
    prompt = 1 if reader == "b" else 2
    keys = a.call("keys", prompt=prompt, blocks=8)["keys"]
    assert b.call("keys", prompt=prompt, blocks=8)["keys"] == keys  # the same hashing everywhere
    _stats(a), _stats(b)
    assert a.call("store", keys=keys)["stored"] == keys
    a.call("settle")
    assert _stats(a)["tier"]["stored_blocks"] == 8

    assert b.call("lookup", keys=keys, req="r1")["answers"] == ["RETRY"] * 8
    if reader == "b":  # step-driven: within a step nothing applies, still "retry later"
        assert b.call("lookup", keys=keys, req="r1")["answers"] == ["RETRY"] * 8
    b.call("settle")  # the check, then the promotion of what it found
    assert b.call("lookup", keys=keys, req="r1")["answers"] == ["HIT"] * 8
    assert b.call("load", keys=keys)["exact"] is True
    tier = _stats(b)["tier"]
    assert tier["existence_checks"] == 1 and tier["checked_keys"] == 8
    assert tier["check_hits"] == 8 and tier["promoted_blocks"] == 8
    assert tier["stored_blocks"] == 0 and tier["promotion_failures"] == 0

    other = b.call("keys", prompt=100 + prompt, blocks=3)["keys"]  # stored by nobody
    assert b.call("lookup", keys=other, req="r2")["answers"] == ["RETRY"] * 3
    b.call("settle")
    assert b.call("lookup", keys=other, req="r2")["answers"] == ["MISS"] * 3
    assert _stats(b)["tier"]["cached_misses"] == 3


@pytest.mark.slow
def test_salted_prompts_do_not_hit_across_nodes(nodes: dict[str, Node]) -> None:
    a, b = nodes["a"], nodes["b"]
    salted = a.call("keys", prompt=5, blocks=4, salt="tenant-a")["keys"]
    a.call("store", keys=salted)
    a.call("settle")
    other_salt = b.call("keys", prompt=5, blocks=4, salt="tenant-b")["keys"]
    unsalted = b.call("keys", prompt=5, blocks=4)["keys"]
    same_salt = b.call("keys", prompt=5, blocks=4, salt="tenant-a")["keys"]
    assert same_salt == salted and not set(salted) & (set(other_salt) | set(unsalted))
    for keys in (other_salt, unsalted, same_salt):
        assert b.call("lookup", keys=keys, req="r")["answers"] == ["RETRY"] * 4
    b.call("settle")
    assert b.call("lookup", keys=other_salt, req="r")["answers"] == ["MISS"] * 4
    assert b.call("lookup", keys=unsalted, req="r")["answers"] == ["MISS"] * 4
    assert b.call("lookup", keys=same_salt, req="r")["answers"] == ["HIT"] * 4  # same tenant
    assert b.call("load", keys=same_salt)["exact"] is True


@pytest.mark.slow
def test_two_nodes_storing_one_prompt_write_each_block_once(nodes: dict[str, Node]) -> None:
    a, c, b = nodes["a"], nodes["c"], nodes["b"]
    keys = a.call("keys", prompt=9, blocks=8)["keys"]
    before = [_stats(node)["backend"] for node in (a, c)]
    for node in (a, c):  # both store it at once: both send every block
        node.send("store", keys=keys)
    assert a.reply()["stored"] == keys and c.reply()["stored"] == keys
    for node in (a, c):
        node.send("settle")
    a.reply(), c.reply()
    after = [_stats(node) for node in (a, c)]
    assert [s["tier"]["stored_blocks"] for s in after] == [8, 8]  # both told: the store has it

    def grew(name: str) -> int:
        return sum(s["backend"].get(name, 0) - old.get(name, 0)
                   for s, old in zip(after, before, strict=True))  # fmt: skip

    assert grew("bytes_written") == 8 * BLOCK_BYTES, "every block is written exactly once"
    assert grew("put_skipped_present") == 8, "and skipped by the other node"
    assert b.call("lookup", keys=keys, req="r")["answers"] == ["RETRY"] * 8
    b.call("settle")
    assert b.call("lookup", keys=keys, req="r")["answers"] == ["HIT"] * 8
    assert b.call("load", keys=keys)["exact"] is True
