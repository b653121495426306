"""The ``tiering`` argument parser: every command and option, no command's code.

The parser imports nothing heavy (no torch, no backend, no manager): each command's handler is
named by module and function (:class:`Handler`) and imported only when that command runs, so
``tiering --version``, ``--help`` and a command's own ``--help`` answer at once. The replay
lab's commands (``replay``, ``policy-study``) are defined by :mod:`tiering.replay` itself: the
light parser lists them by name and help line, and :func:`parse_arguments` parses again with
the full parser (:func:`build_parser`) when one of them is named.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tiering.cli.exits import EXIT_CODES, EXIT_ERROR

#: ``--log-level`` values, quietest last.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

#: The replay lab's commands and their help lines, worded as :mod:`tiering.replay` words them
#: (tests/test_cli_light.py checks): the light parser lists them without importing it.
REPLAY_COMMANDS = {
    "replay": "replay a trace through a tiered store built from a YAML config",
    "policy-study": "compare eviction policies and Belady's bound on a trace (metadata only)",
}


@dataclass(frozen=True)
class Handler:
    """A command's handler, ``function`` of ``module``: the module (and what it imports) loads
    when the command runs, not when the parser is built."""

    module: str
    function: str

    def __call__(self, args: argparse.Namespace) -> int:
        handler = getattr(importlib.import_module(self.module), self.function)
        status: int = handler(args)
        return status


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_replay(subparsers: Any) -> None:
    """Let :mod:`tiering.replay` add its subcommand, if that module exists."""
    try:
        replay_mod = importlib.import_module("tiering.replay")
    except ModuleNotFoundError as exc:
        if exc.name == "tiering.replay":
            return  # not written yet / not installed
        error: Exception = exc
    except Exception as exc:  # a broken replay module must not break the other subcommands
        error = exc
    else:
        for name in ("configure_parser", "configure_study_parser"):  # replay, policy-study
            configure = getattr(replay_mod, name, None)
            if callable(configure):
                configure(subparsers)
        return
    message = f"replay is unavailable: {type(error).__name__}: {error}"

    def unavailable(args: argparse.Namespace) -> int:
        print(f"tiering: {message}", file=sys.stderr)
        return EXIT_ERROR

    stub = subparsers.add_parser("replay", help="(unavailable) " + message)
    stub.add_argument("rest", nargs=argparse.REMAINDER)
    stub.set_defaults(func=unavailable)


def _version() -> str:
    try:
        return importlib.metadata.version("tiering")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _log_level(text: str) -> int:
    """A ``--log-level`` value (any case) as a :mod:`logging` level."""
    name = text.strip().lower()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid level {text!r}: give one of {', '.join(LOG_LEVELS)}"
        )
    return int(getattr(logging, name.upper()))


def _exit_codes_epilog() -> str:
    lines = ["exit status:"]
    for code, meaning in EXIT_CODES:
        lines += textwrap.wrap(
            meaning, width=88, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7
        )
    return "\n".join(lines)


def _list_replay(subparsers: Any) -> None:
    """List the replay lab's commands without importing :mod:`tiering.replay` (if it exists):
    :func:`parse_arguments` parses again with the full parser when one is named."""
    if importlib.util.find_spec("tiering.replay") is None:
        return  # not written yet / not installed
    for name, help_line in REPLAY_COMMANDS.items():
        subparsers.add_parser(name, help=help_line, add_help=False)


def build_parser(*, load_replay: bool = True) -> argparse.ArgumentParser:
    """The ``tiering`` parser. With ``load_replay=False`` the replay lab's commands are listed,
    not loaded (their options unknown): :func:`parse_arguments` handles that."""
    parser = argparse.ArgumentParser(
        prog="tiering",
        description="Tiered KV-cache store: configs, tiers and this machine.",
        epilog=_exit_codes_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error"
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=logging.WARNING,
        metavar="LEVEL",
        help=f"log records of tiering at this level and above to stderr: {', '.join(LOG_LEVELS)} "
        "(default warning)",
    )
    parser.add_argument("--version", action="version", version=f"tiering {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = commands.add_parser("config", help="check a config file or print its schema")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION")
    check = config_commands.add_parser(
        "check", help="validate a YAML config and summarize its tiers"
    )
    check.add_argument("file", metavar="FILE", help="the YAML config")
    check.add_argument(
        "--json", action="store_true", help="print one JSON object (docs/cli.md), not text"
    )
    check.set_defaults(func=Handler("tiering.cli.config_cmd", "cmd_config_check"))
    schema = config_commands.add_parser("schema", help="print the config's JSON Schema")
    schema.set_defaults(func=Handler("tiering.cli.config_cmd", "cmd_config_schema"))
    config.set_defaults(func=lambda _args: _usage(config))

    inspect = commands.add_parser(
        "inspect",
        help="count and verify the blocks of each secondary tier (changes nothing)",
        description=(
            "Read each secondary tier of the config without changing anything: report its "
            "blocks, bytes used and capacity, then read every block back and verify it. A "
            "block that fails verification is reported, not removed. A tier written for "
            "another block layout (model, block size) is reported, and its blocks verified "
            "against the layout on disk. A tier that a running engine has open is reported "
            "as in use. Exits 1 if any block was corrupt or unreadable, or a tier holds "
            "another layout or could not be read."
        ),
    )
    inspect.add_argument("--config", required=True, metavar="FILE", help="the YAML config")
    inspect.add_argument("--tier", metavar="NAME", help="only this tier")
    inspect.add_argument("--json", action="store_true", help="print a JSON report")
    inspect.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    inspect.add_argument(
        "--batch-blocks",
        type=_positive_int,
        default=64,
        metavar="N",
        help="blocks read per batch (default 64)",
    )
    inspect.set_defaults(func=Handler("tiering.cli.inspect_cmd", "cmd_inspect"))

    doctor = commands.add_parser(
        "doctor",
        help="check what this machine supports (OK / WARN / FAIL)",
        description=(
            "Check Python, torch, CUDA, pinned memory, LMDB, xxhash, CPUs and /dev/shm; with "
            "--config, also O_DIRECT and free space on each tier's path, and whether each "
            "tier's directory is tiering's and holds the configured layout. Exits 1 on a FAIL."
        ),
    )
    doctor.add_argument("--config", metavar="FILE", help="also check this config's tier paths")
    doctor.add_argument(
        "--json", action="store_true", help="print one JSON object (docs/cli.md), not text"
    )
    doctor.set_defaults(func=Handler("tiering.cli.doctor", "cmd_doctor"))

    wipe = commands.add_parser(
        "wipe",
        help="delete tiering's own files from each tier's directory",
        description=(
            "Delete the files tiering created in each secondary tier's directory (the "
            "directory's tiering marker says it is tiering's), then the directory if that "
            "left it empty. Files tiering did not create are kept and listed. A directory "
            "that is not tiering's is refused, untouched."
        ),
    )
    wipe.add_argument("--config", required=True, metavar="FILE", help="the YAML config")
    wipe.add_argument("--tier", metavar="NAME", help="only this tier")
    wipe.set_defaults(func=Handler("tiering.cli.wipe", "cmd_wipe"))

    if load_replay:
        _add_replay(commands)
    else:
        _list_replay(commands)
    parser.set_defaults(func=lambda _args: _usage(parser))
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_ERROR


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``argv`` parsed as :func:`build_parser`'s parser parses it, importing
    :mod:`tiering.replay` only when one of its commands is named."""
    parser = build_parser(load_replay=False)
    args, extras = parser.parse_known_args(argv)
    if args.command in REPLAY_COMMANDS:
        return build_parser().parse_args(argv)
    if extras:  # as parser.parse_args would say it
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args
