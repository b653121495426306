"""The ``tiering`` CLI: config check and schema, inspect on real tiers, doctor, error boundary."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiering import cli
from tiering.backends.file import HEADER_AREA_BYTES, SLOTS_NAME, slot_bytes_for
from tiering.cli import doctor, loading
from tiering.config import build_manager, build_pool, config_json_schema, load_config
from tiering.core.keys import OffloadKey, make_offload_key

REPO_ROOT = Path(__file__).resolve().parents[1]

GOOD_CONFIG = """\
version: 1
model:
  shape: tiny
primary:
  capacity: 64KiB
secondary_tiers:
  - name: nvme
    type: file
    path: ./nvme
    capacity: 1MiB
  - name: db
    type: lmdb
    path: ./db
    capacity: 1MiB
    sync: false
    metasync: false
"""


def write_config(tmp_path: Path, text: str, name: str = "tiering.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def populate(config_path: Path, n_blocks: int) -> dict[OffloadKey, bytes]:
    """Store ``n_blocks`` known blocks through a real manager (write-through to both tiers)."""
    config = load_config(config_path)
    pool = build_pool(config)
    rows = pool.rows_view()
    manager = build_manager(config, pool=pool)
    stored: dict[OffloadKey, bytes] = {}
    try:
        manager.wait_ready()
        keys = [key(i) for i in range(n_blocks)]
        out = manager.prepare_store(keys)
        assert out is not None and out.keys_to_store == keys
        generator = torch.Generator().manual_seed(7)
        for k, slot in zip(keys, out.store_spec.block_ids.tolist(), strict=True):
            payload = torch.randint(
                0, 256, (rows.shape[1],), dtype=torch.uint8, generator=generator
            )
            rows[slot] = payload
            stored[k] = payload.numpy().tobytes()
        manager.complete_store(keys)
        manager.wait_idle()
        assert all(len(tier) == n_blocks for tier in manager.tiers)
    finally:
        manager.shutdown()
    return stored


# -- config check --------------------------------------------------------------------------------


def test_config_check_summarizes_tiers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path, GOOD_CONFIG)
    status, out, err = run(["config", "check", str(config)], capsys)
    assert status == 0, err
    assert f"{config}: OK" in out
    # tiny: 2 layers x 2 x 16 tokens x 2 heads x 16 dims x 2 bytes = 4 KiB per block
    assert "one block is 4 KiB (4096 bytes)" in out
    lines = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert lines["primary"].split()[1:5] == ["cpu", "64", "KiB", "16"]
    # a file slot is a 4 KiB header area plus the payload: 1 MiB / 8 KiB = 128 blocks
    assert lines["nvme"].split()[1:5] == ["file", "1", "MiB", "128"]
    assert lines["db"].split()[1:4] == ["lmdb", "1", "MiB"]
    assert f"path {tmp_path / 'nvme'}" in lines["nvme"]
    assert not (tmp_path / "nvme").exists()  # checking creates nothing
    assert err == ""


def test_config_check_without_a_model_gives_capacities_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    no_model = GOOD_CONFIG.replace("model:\n  shape: tiny\n", "")
    status, out, _err = run(["config", "check", str(write_config(tmp_path, no_model))], capsys)
    assert status == 0
    assert "model: none" in out
    (nvme,) = [line.split() for line in out.splitlines() if line.split()[0] == "nvme"]
    assert nvme[:5] == ["nvme", "file", "1", "MiB", "policy"]  # no block count


def test_config_check_prints_config_warnings_without_source_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small_tier = GOOD_CONFIG.replace("capacity: 64KiB", "capacity: 4MiB")
    status, _out, err = run(["config", "check", str(write_config(tmp_path, small_tier))], capsys)
    assert status == 0
    assert err.startswith("warning: ")
    assert "smaller than the primary" in err
    assert "warnings.warn" not in err


BAD_CONFIGS = {
    "unknown-key": (
        GOOD_CONFIG.replace("  capacity: 64KiB\n", "  capacity: 64KiB\n  polcy: lru\n"),
        "primary.polcy",
        "did you mean 'policy'",
    ),
    "negative-size": (
        GOOD_CONFIG.replace("capacity: 1MiB\n  - name: db", "capacity: -5MiB\n  - name: db"),
        "secondary_tiers[0].capacity",
        "'-5MiB'",
    ),
    "bad-type": (
        GOOD_CONFIG.replace("shape: tiny", "shape: tiny\n  world_size: two"),
        "model.world_size",
        "'two' is not valid: give an integer",
    ),
    "bad-backend-setting": (
        GOOD_CONFIG.replace("sync: false", "sync: maybe"),
        "secondary_tiers[1].sync",
        "true or false",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_config_check_rejects_bad_files_with_the_key_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, key_path, fragment = BAD_CONFIGS[case]
    config = write_config(tmp_path, text, f"{case}.yaml")
    status, out, err = run(["config", "check", str(config)], capsys)
    assert status == 2
    assert out == ""
    assert str(config) in err and key_path in err and fragment in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_config_check_in_a_subprocess_prints_no_traceback(tmp_path: Path) -> None:
    text, key_path, _ = BAD_CONFIGS["negative-size"]
    config = write_config(tmp_path, text, "negative.yaml")
    syntax = write_config(tmp_path, "version: 1\nprimary: [\n", "syntax.yaml")
    for path, expected in ((config, key_path), (syntax, "invalid config YAML")):
        result = subprocess.run(
            [sys.executable, "-m", "tiering.cli", "config", "check", str(path)],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        assert str(path) in result.stderr and expected in result.stderr
        assert "Traceback" not in result.stderr


def test_missing_file_and_bad_arguments_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _out, err = run(["config", "check", str(tmp_path / "absent.yaml")], capsys)
    assert status == 2
    assert "absent.yaml" in err and "Traceback" not in err
    assert run(["inspect"], capsys)[0] == 2  # --config is required
    assert run([], capsys)[0] == 2  # no command: usage
    assert run(["--help"], capsys)[0] == 0


def test_unexpected_errors_are_one_line_unless_debug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: object) -> None:
        raise RuntimeError("something no one planned for")

    monkeypatch.setattr(loading, "load_config", broken)
    config = str(write_config(tmp_path, GOOD_CONFIG))
    status, _out, err = run(["config", "check", config], capsys)
    assert status == 3
    assert err.strip() == (
        "tiering: unexpected RuntimeError: something no one planned for "
        "(run with --debug for the traceback)"
    )
    with pytest.raises(RuntimeError, match="no one planned"):
        cli.main(["--debug", "config", "check", config])


def test_config_check_json_gives_each_check_and_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small_primary = GOOD_CONFIG.replace("capacity: 64KiB", "capacity: 4MiB")  # a ConfigWarning
    config = write_config(tmp_path, small_primary)
    status, out, err = run(["config", "check", "--json", str(config)], capsys)
    assert status == 0, err
    document = json.loads(out)
    assert set(document) == {
        "json_version", "command", "config", "exit_code", "counts", "checks", "model", "tiers"
    }  # fmt: skip
    assert (document["json_version"], document["command"]) == (1, "config check")
    assert (document["config"], document["exit_code"]) == (str(config), 0)
    checks = document["checks"]
    assert [(c["name"], c["status"], c["tier"]) for c in checks] == [
        ("config", "WARN", None),  # each tier is smaller than the primary
        ("config", "WARN", None),
        ("model identity", "WARN", None),  # a built-in shape: the architecture alone
        ("tier nvme directory", "OK", "nvme"),
        ("tier db directory", "OK", "db"),
    ]
    assert "'nvme'" in checks[0]["message"] and "smaller than the primary" in checks[0]["message"]
    assert "'db'" in checks[1]["message"]
    assert "architecture alone" in checks[2]["message"]
    assert document["counts"] == {"OK": 2, "WARN": 3, "FAIL": 0}
    assert document["model"] == {
        "shape": "tiny", "config_json": None, "name": "tiny", "world_size": 1,
        "identity": {"source": "architecture", "weights": None},
        "block_size_factor": 1, "block_bytes": 4096,
    }  # fmt: skip
    tiers = {tier["name"]: tier for tier in document["tiers"]}
    assert tiers["primary"] == {
        "name": "primary", "type": "cpu", "capacity_bytes": 4 << 20, "capacity_blocks": 1024,
        "policy": "lru", "write_policy": None, "path": None,
    }  # fmt: skip
    assert tiers["nvme"]["capacity_blocks"] == 128
    assert tiers["nvme"]["path"] == str(tmp_path / "nvme")
    assert tiers["db"]["write_policy"] == "write_through"
    assert out == json.dumps(document, indent=2, sort_keys=True) + "\n"
    assert not (tmp_path / "nvme").exists()  # checking creates nothing


def test_config_check_json_of_a_bad_config_exits_2_with_the_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, key_path, fragment = BAD_CONFIGS["unknown-key"]
    config = write_config(tmp_path, text)
    status, out, err = run(["config", "check", "--json", str(config)], capsys)
    assert status == 2
    document = json.loads(out)
    assert document["exit_code"] == 2 and document["counts"] == {"OK": 0, "WARN": 0, "FAIL": 1}
    ((check),) = document["checks"]
    assert (check["name"], check["status"]) == ("config", "FAIL")
    assert key_path in check["message"] and fragment in check["message"]
    assert (document["model"], document["tiers"]) == (None, [])
    assert len(err.strip().splitlines()) == 1 and key_path in err  # stderr as without --json


def test_doctor_json_has_the_texts_checks_and_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = GOOD_CONFIG.replace("capacity: 1MiB\n  - name: db", "capacity: 1000TiB\n  - name: db")
    config = str(write_config(tmp_path, huge))
    status, out, _err = run(["doctor", "--config", config], capsys)
    text = doctor_lines(out)
    json_status, out, _err = run(["doctor", "--config", config, "--json"], capsys)
    assert status == json_status == 1
    document = json.loads(out)
    assert (document["command"], document["config"], document["exit_code"]) == (
        "doctor", config, 1
    )  # fmt: skip
    checks = {c["name"]: c for c in document["checks"]}
    assert {name: c["status"] for name, c in checks.items()} == {
        name: verdict for name, (verdict, _detail) in text.items()
    }
    assert checks["tier nvme space"]["status"] == "FAIL"
    assert "capacity 1000 TiB" in checks["tier nvme space"]["message"]
    assert checks["tier nvme space"]["tier"] == "nvme" and checks["torch"]["tier"] is None
    assert checks["torch"]["message"] == torch.__version__
    assert document["counts"]["FAIL"] == sum(c["status"] == "FAIL" for c in checks.values())


def test_doctor_json_without_config(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _err = run(["doctor", "--json"], capsys)
    document = json.loads(out)
    assert status == document["exit_code"] == 0 and document["config"] is None
    assert "O_DIRECT (temp dir)" in {c["name"] for c in document["checks"]}


# -- exit codes and logging ----------------------------------------------------------------------


def test_help_and_docs_list_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _err = run(["--help"], capsys)
    assert status == 0
    epilog = out[out.index("exit status:") :]
    listed = [int(line.split()[0]) for line in epilog.splitlines()[1:] if line[2:3].isdigit()]
    assert listed == [code for code, _ in cli.EXIT_CODES] == [0, 1, 2, 3, 130]
    docs = (REPO_ROOT / "docs" / "cli.md").read_text()
    table = docs[docs.index("## Exit status") :].split("\n## ")[0]
    rows = [line.split("|")[1].strip(" `") for line in table.splitlines() if line.startswith("| `")]
    assert rows == [str(code) for code, _ in cli.EXIT_CODES]


def corrupt_file_tier(tmp_path: Path) -> Path:
    config = write_config(tmp_path, GOOD_CONFIG)
    populate(config, 3)
    flip_payload_byte(tmp_path / "nvme" / SLOTS_NAME, slot=0, block_bytes=4096)
    return config


def tiering_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiering.cli", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )


def test_log_level_sends_tierings_records_to_stderr(tmp_path: Path) -> None:
    config = str(corrupt_file_tier(tmp_path))
    inspect = ["inspect", "--config", config, "--tier", "nvme", "--json"]
    # The file backend logs the corrupt block it read (a WARNING) through the CLI's handler.
    default = tiering_cli(*inspect)
    assert default.returncode == 1, default.stderr
    (line,) = [line for line in default.stderr.splitlines() if "corrupt block" in line]
    assert line.startswith("tiering: WARNING: tiering.backends.file: file backend ")
    quiet = tiering_cli("--log-level", "ERROR", *inspect)
    assert quiet.returncode == 1 and quiet.stderr == ""
    assert json.loads(quiet.stdout)["corrupt"] == json.loads(default.stdout)["corrupt"] == 1


def test_a_bad_log_level_is_a_usage_error_naming_the_levels(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run(["--log-level", "loud", "doctor"], capsys)
    assert status == 2 and out == ""
    assert "--log-level: invalid level 'loud': give one of debug, info, warning, error, " in err
    assert "critical" in err


def test_main_leaves_the_tiering_logger_as_it_found_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = logging.getLogger("tiering")
    before = (logger.level, logger.propagate, list(logger.handlers))
    config = str(write_config(tmp_path, GOOD_CONFIG))
    assert run(["--log-level", "debug", "config", "check", config], capsys)[0] == 0
    assert (logger.level, logger.propagate, list(logger.handlers)) == before


# -- config schema -------------------------------------------------------------------------------


def test_config_schema_is_sorted_json(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _err = run(["config", "schema"], capsys)
    assert status == 0
    schema = json.loads(out)
    assert schema == config_json_schema()
    assert out == json.dumps(schema, indent=2, sort_keys=True) + "\n"
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert {"version", "primary", "secondary_tiers"} <= set(schema["properties"])


# -- inspect -------------------------------------------------------------------------------------


def flip_payload_byte(slots_file: Path, slot: int, block_bytes: int) -> None:
    offset = slot * slot_bytes_for(block_bytes) + HEADER_AREA_BYTES + 100
    with open(slots_file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def tree_state(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: its bytes and modification time (ns)."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_inspect_counts_and_verifies_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, GOOD_CONFIG)
    populate(config, 5)

    status, out, err = run(["inspect", "--config", str(config), "--json"], capsys)
    assert status == 0, err
    report = json.loads(out)
    assert report["block_bytes"] == 4096
    assert report["corrupt"] == 0
    by_name = {tier["name"]: tier for tier in report["tiers"]}
    for name in ("nvme", "db"):
        tier = by_name[name]
        assert (tier["blocks"], tier["verified"], tier["corrupt"]) == (5, 5, 0), tier
        assert tier["healthy"] is True
        assert tier["capacity_bytes"] == 1 << 20
    assert by_name["nvme"]["usage_bytes"] == 5 * slot_bytes_for(4096)
    assert by_name["nvme"]["capacity_blocks"] == 128
    assert err == ""  # no progress bar: stderr is not a terminal

    # One flipped payload bit in the file tier: reported (not removed), non-zero exit.
    flip_payload_byte(tmp_path / "nvme" / SLOTS_NAME, slot=2, block_bytes=4096)
    before = tree_state(tmp_path)
    status, out, _err = run(["inspect", "--config", str(config), "--no-progress"], capsys)
    assert status == 1
    assert "tier nvme (file" in out and "5 blocks" in out
    assert "verified 4, corrupt 1, missing 0" in out
    assert "verified 5, corrupt 0, missing 0" in out  # the lmdb tier

    # Inspecting changed nothing: the corrupt block is still there; only nvme is inspected.
    status, out, _err = run(
        ["inspect", "--config", str(config), "--tier", "nvme", "--json"], capsys
    )
    assert status == 1
    (tier,) = json.loads(out)["tiers"]
    assert (tier["name"], tier["blocks"], tier["verified"], tier["corrupt"]) == ("nvme", 5, 4, 1)
    assert tree_state(tmp_path) == before


def test_inspect_reports_corruption_from_a_subprocess(tmp_path: Path) -> None:
    config = write_config(tmp_path, GOOD_CONFIG)
    populate(config, 3)
    flip_payload_byte(tmp_path / "nvme" / SLOTS_NAME, slot=0, block_bytes=4096)
    result = subprocess.run(
        [sys.executable, "-m", "tiering.cli", "inspect", "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["corrupt"] == 1
    assert "Traceback" not in result.stderr


def test_inspect_before_anything_is_stored_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, GOOD_CONFIG)
    status, out, _err = run(["inspect", "--config", str(config)], capsys)
    assert status == 0
    assert out.count("0 blocks") == 2 and "nothing stored yet" in out
    assert not (tmp_path / "nvme").exists() and not (tmp_path / "db").exists()


def test_inspect_unknown_tier_names_the_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, GOOD_CONFIG)
    status, out, err = run(["inspect", "--config", str(config), "--tier", "ssd"], capsys)
    assert status == 2 and out == ""
    assert "no tier named 'ssd'; tiers: nvme, db" in err


# -- doctor --------------------------------------------------------------------------------------


def doctor_lines(out: str) -> dict[str, tuple[str, str]]:
    """Check name -> (verdict, detail), from doctor's output."""
    lines = {}
    for line in out.splitlines()[:-1]:
        verdict, rest = line.split(maxsplit=1)
        assert verdict in ("OK", "WARN", "FAIL"), line
        name, detail = rest.split("  ", 1)
        lines[name.strip()] = (verdict, detail.strip())
    return lines


def test_doctor_gives_a_verdict_per_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_config(tmp_path, GOOD_CONFIG)
    status, out, err = run(["doctor", "--config", str(config)], capsys)
    assert status == 0, out + err
    checks = doctor_lines(out)
    for name in ("python", "torch", "cuda", "pinned memory", "lmdb", "xxhash", "cpus"):
        assert name in checks, name
    assert checks["python"][0] == "OK"
    assert checks["torch"] == ("OK", torch.__version__)
    assert checks["cuda"][0] == ("OK" if torch.cuda.is_available() else "WARN")
    assert checks["cpus"][1].startswith(f"{len(os.sched_getaffinity(0))} usable")
    assert checks["tier nvme space"][0] == "OK"
    assert checks["tier db space"][0] == "OK"
    assert checks["tier nvme O_DIRECT"][0] in ("OK", "WARN")  # WARN: o_direct is not asked for
    assert out.splitlines()[-1].startswith(f"{len(checks)} checks: 0 FAIL")


def test_doctor_fails_when_a_tier_does_not_fit_on_its_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    huge = GOOD_CONFIG.replace("capacity: 1MiB\n  - name: db", "capacity: 1000TiB\n  - name: db")
    status, out, _err = run(["doctor", "--config", str(write_config(tmp_path, huge))], capsys)
    assert status == 1
    verdict, detail = doctor_lines(out)["tier nvme space"]
    assert verdict == "FAIL" and "capacity 1000 TiB" in detail


def test_doctor_without_config_probes_the_temp_dir(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _err = run(["doctor"], capsys)
    assert status == 0
    assert "O_DIRECT (temp dir)" in doctor_lines(out)


def test_o_direct_probe_round_trips_or_says_why(tmp_path: Path) -> None:
    works, why = doctor.probe_o_direct(tmp_path)
    assert why
    assert list(tmp_path.iterdir()) == []  # the probe file is removed either way
    if works:
        assert "round-trip" in why


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (64 << 30, "64 GiB")],
)
def test_format_bytes(num_bytes: int, text: str) -> None:
    assert cli.format_bytes(num_bytes) == text
