"""The ``tiering`` command starts light: ``--version``, ``--help`` and the config commands import
no torch, and a command's module loads only when that command runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiering import cli
from tiering.cli.parser import REPLAY_COMMANDS, build_parser, parse_arguments

REPO_ROOT = Path(__file__).resolve().parents[1]

# Runs ``main`` in a fresh interpreter; its last line says what that imported.
SCRIPT = """\
import json, sys
from tiering.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print(json.dumps({
    "status": status,
    "torch": "torch" in sys.modules,
    "commands": sorted(
        name for name in sys.modules
        if name in ("tiering.cli.config_cmd", "tiering.cli.doctor", "tiering.cli.inspect_cmd",
                    "tiering.cli.wipe", "tiering.replay")
    ),
}))
"""


def run_fresh(argv: list[str]) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
        check=True,
    )
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize(
    "argv",
    [["--version"], ["--help"], ["config", "--help"], ["inspect", "--help"], ["doctor", "--help"]],
)
def test_version_and_help_import_no_torch_and_no_command(argv: list[str]) -> None:
    assert run_fresh(argv) == {"status": 0, "torch": False, "commands": []}


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "schema"],
        ["config", "check", "examples/tiering.yaml"],
    ],
)
def test_the_config_commands_import_no_torch(argv: list[str]) -> None:
    assert run_fresh(argv) == {"status": 0, "torch": False, "commands": ["tiering.cli.config_cmd"]}


def test_a_command_loads_its_module_when_it_runs() -> None:
    report = run_fresh(["wipe", "--config", "no-such-file.yaml"])
    assert report["status"] == cli.EXIT_ERROR
    assert report["commands"] == ["tiering.cli.wipe"]


def test_the_light_parser_lists_the_replay_commands_as_the_full_one_does() -> None:
    light, full = build_parser(load_replay=False), build_parser()
    assert light.format_help() == full.format_help()
    assert "replay" in REPLAY_COMMANDS and "policy-study" in REPLAY_COMMANDS


def test_a_replay_command_is_parsed_by_the_full_parser() -> None:
    args = parse_arguments(["replay", "--config", "tiering.yaml", "--max-requests", "3"])
    assert (args.command, str(args.config), args.max_requests) == ("replay", "tiering.yaml", 3)
    assert args.func.__module__ == "tiering.replay.runner"


def test_unknown_arguments_are_refused_as_argparse_refuses_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["wipe", "--config", "x.yaml", "--bogus", "1"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "tiering: error: unrecognized arguments: --bogus 1"
