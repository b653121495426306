"""`tiering replay`: reproducible numbers, LRU hits checked by an independent computation."""

from __future__ import annotations

import fcntl
import io
import json
import os
import struct
import sys
import termios
import urllib.request
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tiering.cli import main as cli_main
from tiering.config import TieringConfig, parse_config
from tiering.core.hashing import PrefixHasher
from tiering.errors import ConfigError
from tiering.observability.kv_events import END_SEQ, BlockStored, EventBatch, decode_batch
from tiering.policies import available_policies
from tiering.replay import ReplayOptions, policy_study, run_replay
from tiering.replay.progress import ProgressBar
from tiering.replay.runner import ReplayStep, format_report
from tiering.replay.traces import builtin_trace

TIMING_KEYS = {"wall_s", "load_ms", "store_ms", "store_job_ms", "load_job_ms"}
TIMING_KEYS |= {"write_gbps", "read_gbps"}


def config(tmp_path: Path, shape: str, cpu: str, tiers: list[dict[str, Any]]) -> TieringConfig:
    return parse_config(
        {
            "version": 1,
            "model": {"shape": shape},
            "hashing": {"hash_block_size": 16},
            "primary": {"capacity": cpu, "policy": "lru"},
            "secondary_tiers": tiers,
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )


def without_timing(report: Any) -> Any:
    if isinstance(report, dict):
        return {k: without_timing(v) for k, v in report.items() if k not in TIMING_KEYS}
    return report


def independent_lru_hit_tokens(capacity: int, requests: list[Any], block: int) -> int:
    """The manager protocol with LRU, written plainly: hit prefix, touch, store the rest."""
    hasher = PrefixHasher(block)
    cache: OrderedDict[bytes, None] = OrderedDict()
    saved = 0
    for request in requests:
        keys = hasher.hash_blocks(request.token_ids, request.extra_keys)
        limit = min(len(keys), (len(request.token_ids) - 1) // block)
        hit = 0
        while hit < limit and keys[hit] in cache:
            hit += 1
        saved += hit * block
        for key in reversed(keys[:hit]):
            cache.move_to_end(key)
        to_store = [k for k in dict.fromkeys(keys[hit:]) if k not in cache]
        shortfall = len(cache) + len(to_store) - capacity
        if len(to_store) > capacity:
            continue
        if shortfall > 0:
            protected = set(keys[hit:])
            victims = [k for k in cache if k not in protected][:shortfall]
            if len(victims) < shortfall:
                continue
            for victim in victims:
                del cache[victim]
        for key in to_store:
            cache[key] = None
    return saved


def test_lru_hits_agree_with_an_independent_computation(tmp_path: Path) -> None:
    cfg = config(tmp_path, "tiny", "400KiB", [])  # 100 blocks of 4 KiB
    options = ReplayOptions(trace="chat", scale="tiny", seed=3, engine_blocks=512, progress=False)
    report = run_replay(cfg, options)
    requests = builtin_trace("chat", scale="tiny", seed=3)
    expected = independent_lru_hit_tokens(100, requests, 16)
    assert report["prefill_tokens_saved"] == expected
    assert 0 < expected < report["prompt_tokens"]
    assert report["verify_failures"] == 0


def test_same_seed_same_numbers_with_file_and_lmdb_tiers(tmp_path: Path) -> None:
    tiers: list[dict[str, Any]] = [
        {"name": "nvme", "type": "file", "capacity": "3MiB", "path": "nvme"},
        {"name": "lmdb", "type": "lmdb", "capacity": "2MiB", "path": "lmdb", "sync": False},
    ]
    reports = []
    for run in range(2):
        cfg = config(tmp_path / f"run{run}", "tiny-hybrid", "1MiB", tiers)
        options = ReplayOptions(
            trace="mixed",
            scale="tiny",
            seed=1,
            engine_blocks=1024,
            max_requests=120,
            progress=False,
        )
        reports.append(run_replay(cfg, options))
    first, second = (without_timing(r) for r in reports)
    first.pop("config"), second.pop("config")
    assert first == second
    tiers_report = reports[0]["tiers"]
    assert tiers_report["NVME"]["blocks_served"] > 0  # promotions really happened
    assert tiers_report["NVME"]["evictions"] > 0 and tiers_report["CPU"]["blocks_served"] > 0
    assert reports[0]["verify_failures"] == 0


def test_policy_study_bounds_policies_by_belady() -> None:
    requests = builtin_trace("chat", scale="tiny", seed=0)
    hasher = PrefixHasher(16)
    keys = [hasher.hash_blocks(r.token_ids, r.extra_keys) for r in requests]
    rows = policy_study(keys, [50, 200], ["lru", "arc"])
    for capacity in (50, 200):
        by_policy = {r["policy"]: r for r in rows if r["capacity_blocks"] == capacity}
        assert set(by_policy) == {"lru", "arc", "belady"}
        for name in ("lru", "arc"):
            assert by_policy[name]["block_hit_ratio"] <= by_policy["belady"]["block_hit_ratio"]
        lru, belady = by_policy["lru"]["prefix_hit_ratio"], by_policy["belady"]["prefix_hit_ratio"]
        assert belady > lru  # the chat trace leaves LRU a gap at both sizes
        assert (
            by_policy["lru"]["lru_belady_gap_closed"],
            by_policy["belady"]["lru_belady_gap_closed"],
        ) == (0.0, 1.0)
        arc = by_policy["arc"]["prefix_hit_ratio"]
        assert by_policy["arc"]["lru_belady_gap_closed"] == round((arc - lru) / (belady - lru), 4)


def test_cli_replay_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(
        "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
        "secondary_tiers:\n  - {type: file, capacity: 1MiB, path: nvme}\n"
        "replay: {trace: agent, scale: tiny, engine_blocks: 512, max_requests: 40}\n"
    )
    assert cli_main(["replay", "--config", str(path), "--json", "--policy-study"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 40
    assert set(report["tiers"]) == {"CPU", "FILE"}
    # By default every registered policy, as `tiering policy-study`.
    studied = {row["policy"] for row in report["policy_study"]}
    assert studied == {*available_policies(), "belady"}


REPLAY_CONFIG = (
    "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
    "secondary_tiers:\n  - {type: file, capacity: 1MiB, path: nvme}\n"
    "replay: {trace: agent, scale: tiny, engine_blocks: 512, max_requests: 40}\n"
)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--policy-study", "--sizes", "0.1,lots"], "--sizes: 'lots' is not a number"),
        (["--policy-study", "--sizes", "0.1,2"], "--sizes: '2' is not a fraction in (0, 1]"),
        (["--policy-study", "--policies", "lru,lfu"], "--policies: unknown eviction policy 'lfu'"),
        (["--plot", "no/such/dir/plot.png"], "--plot"),
        (["--plot", "plot.txt"], "--plot"),
    ],
    ids=["sizes-text", "sizes-range", "policies", "plot-dir", "plot-suffix"],
)
def test_replay_options_are_checked_before_the_replay_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    """A bad option fails at once, before any tier is built: no report is thrown away."""
    path = tmp_path / "tiering.yaml"
    path.write_text(REPLAY_CONFIG)
    status = cli_main(["replay", "--config", str(path), "--json", *options])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert not (tmp_path / "nvme").exists()  # the replay never started


def test_plot_without_matplotlib_fails_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    path = tmp_path / "tiering.yaml"
    path.write_text(REPLAY_CONFIG)
    status = cli_main(["replay", "--config", str(path), "--plot", str(tmp_path / "p.png")])
    assert status == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "nvme").exists()


def test_report_columns_add_up_and_latencies_are_per_job(tmp_path: Path) -> None:
    tiers: list[dict[str, Any]] = [
        {"name": "nvme", "type": "file", "capacity": "3MiB", "path": "nvme"},
        {"name": "lmdb", "type": "lmdb", "capacity": "2MiB", "path": "lmdb", "sync": False},
    ]
    cfg = config(tmp_path, "tiny-hybrid", "1MiB", tiers)
    options = ReplayOptions(
        trace="mixed", scale="tiny", seed=1, engine_blocks=1024, max_requests=120, progress=False
    )
    report = run_replay(cfg, options)
    media = report["tiers"].values()
    assert report["blocks_loaded"] > 0
    served = sum(t["blocks_served"] for t in media) + report["blocks_loaded_new"]
    assert served == report["blocks_loaded"]
    prefix = sum(t["usable_prefix_tokens"] for t in media) + report["usable_prefix_tokens_new"]
    assert prefix == report["prefill_tokens_saved"]
    assert all(set(t["load_job_ms"]) == {"p50", "p90", "p99"} for t in media)
    assert report["started_with_data"] == {}
    text = format_report(report)
    assert "legend:" in text and "note: tiers started" not in text
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert f"{report['blocks_loaded']:,}" in total
    assert f"{report['prefill_tokens_saved']:,}" in total

    held = {m: report["tiers"][m]["blocks_held"] for m in ("NVME", "LMDB")}
    again = run_replay(cfg, options)  # the same tiers, not emptied
    assert again["started_with_data"] == held
    assert again["tiers"]["NVME"]["blocks_at_start"] == held["NVME"] > 0
    assert (
        f"note: tiers started with data from an earlier run (NVME {held['NVME']:,} blocks, "
        f"LMDB {held['LMDB']:,} blocks)"
    ) in format_report(again)


def test_refused_stores_are_in_the_table(tmp_path: Path) -> None:
    cfg = config(tmp_path, "tiny", "16KiB", [])  # 4 blocks: smaller than most requests
    options = ReplayOptions(trace="chat", scale="tiny", seed=0, max_requests=20, progress=False)
    report = run_replay(cfg, options)
    cpu = report["tiers"]["CPU"]
    assert cpu["stores_refused"] > 0 and cpu["blocks_refused"] >= cpu["stores_refused"]
    text = format_report(report)
    row = next(line for line in text.splitlines() if line.startswith("CPU"))
    assert row.split()[-1] == f"{cpu['blocks_refused']:,}"
    assert (
        f"CPU refused {cpu['stores_refused']:,} stores ({cpu['blocks_refused']:,} blocks)" in text
    )


def test_a_scrape_and_a_subscriber_see_a_replays_activity_per_tier(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "version": 1,
            "model": {"shape": "tiny"},
            "primary": {"capacity": "256KiB"},
            "secondary_tiers": [
                {"name": "nvme", "type": "file", "capacity": "1MiB", "path": "nvme"},
                {"name": "lmdb", "type": "lmdb", "capacity": "2MiB", "path": "lmdb"},
            ],
            "metrics": {"port": 0},
            "events": {
                "enabled": True,
                "endpoint": "tcp://127.0.0.1:*",
                "replay_endpoint": "tcp://127.0.0.1:*",
            },
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )
    scraped: dict[tuple[str, str], float] = {}
    batches: list[EventBatch] = []

    def at_the_end(step: ReplayStep) -> None:
        if step.index != step.total - 1:
            return
        url = step.observability.metrics_url
        assert url is not None
        with urllib.request.urlopen(url) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                for sample in family.samples:
                    if "tier" in sample.labels and set(sample.labels) == {"tier", "medium"}:
                        scraped[(sample.name, sample.labels["tier"])] = sample.value
        publisher = step.observability.publisher
        assert publisher is not None and publisher.replay_endpoint is not None
        publisher.flush()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        seqs = []
        while True:
            assert dealer.poll(5000), "the replay never ended"
            _, _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            seqs.append(int.from_bytes(seq, "big"))
            batches.append(decode_batch(payload))
        dealer.close()
        assert seqs == list(range(len(seqs)))

    options = ReplayOptions(trace="agent", scale="tiny", max_requests=40, progress=False)
    report = run_replay(cfg, options, on_request=at_the_end)
    block = report["block_bytes"]
    stored: dict[str | None, int] = {}
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                owner = event.ownership if event.medium == "STORAGE" else "CPU"
                stored[owner] = stored.get(owner, 0) + len(event.block_hashes)
    cpu = report["tiers"]["CPU"]
    promoted = sum(report["tiers"][m]["promoted_blocks"] for m in ("NVME", "LMDB"))
    # The CPU tier stores what the engine wrote and what the tiers promoted.
    assert stored["CPU"] == cpu["bytes_stored"] // block + promoted > 0
    assert scraped[("tiering_used_blocks", "primary")] == cpu["blocks_held"]
    # The primary's own counters: every block made ready there, every block the engine loaded.
    assert scraped[("tiering_stored_blocks_total", "primary")] == stored["CPU"]
    assert scraped[("tiering_loaded_blocks_total", "primary")] == report["blocks_loaded"] > 0
    lookups = scraped[("tiering_lookups_total", "primary")]
    hits = scraped[("tiering_lookup_hits_total", "primary")]
    misses = scraped[("tiering_lookup_misses_total", "primary")]
    assert lookups >= hits + misses and hits > 0 and misses > 0
    for name, medium in (("nvme", "NVME"), ("lmdb", "LMDB")):
        tier = report["tiers"][medium]
        assert stored[name] == tier["bytes_written"] // block > 0
        assert scraped[("tiering_stored_blocks_total", name)] == stored[name]
        assert scraped[("tiering_written_bytes_total", name)] == tier["bytes_written"]
        assert scraped[("tiering_promoted_blocks_total", name)] == tier["promoted_blocks"]
        assert scraped[("tiering_used_blocks", name)] == tier["blocks_held"]
    assert report["tiers"]["NVME"]["promoted_blocks"] > 0
    assert report["metrics_url"].startswith("http://127.0.0.1:")


def test_progress_draws_on_a_terminal_only() -> None:
    main_fd, terminal_fd = os.openpty()
    # A terminal of 80 columns (a new pseudo-terminal has none).
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    with os.fdopen(terminal_fd, "w") as terminal:
        with ProgressBar(3, "replay", stream=terminal) as bar:
            for _ in range(3):
                bar.update()
    # The kernel hands pty writes to the reader asynchronously: read until the closed
    # terminal side says end-of-file (EIO), not once.
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    drawn = b"".join(chunks).decode()
    assert "replay" in drawn and "3/3" in drawn
    pipe = io.StringIO()
    with ProgressBar(3, "replay", stream=pipe) as bar:
        bar.update(3)
    assert pipe.getvalue() == ""


def test_an_engine_too_small_for_the_longest_prompt_fails_before_anything_is_written(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "long.jsonl"  # Mooncake's format: 512-token ids
    rows = [
        {"timestamp": 0, "input_length": 1000, "output_length": 4, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 40_000, "output_length": 4, "hash_ids": list(range(79))},
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tier = {"name": "nvme", "type": "file", "capacity": "1MiB", "path": str(tmp_path / "nvme")}
    cfg = config(tmp_path, "tiny", "64KiB", [tier])
    # 40,000 tokens in 16-token blocks: 2,500 engine blocks, and block 0 is the null block.
    options = ReplayOptions(trace=str(trace), engine_blocks=2500, progress=False)
    with pytest.raises(ConfigError, match=r"request 'line2' has 40,000 prompt tokens") as info:
        run_replay(cfg, options)
    assert "--engine-blocks 2501 or more" in str(info.value)
    assert not (tmp_path / "nvme").exists()  # no manager was built, no tier opened
    report = run_replay(cfg, ReplayOptions(trace=str(trace), engine_blocks=2501, progress=False))
    assert report["requests"] == 2
    # A file is not made from a scale and a seed: the header does not name any.
    header = format_report(report).splitlines()[0]
    assert header.startswith(f"tiering replay: 2 requests of trace {str(trace)!r}, model tiny,")
