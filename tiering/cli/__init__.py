"""The ``tiering`` command line: check a config, print its schema, inspect tiers, check the machine.

Subcommands (each sets ``func(args) -> int``, the exit status)::

    tiering config check FILE        validate a YAML config; summary of tiers and capacities
    tiering config schema            the config's JSON Schema
    tiering inspect --config FILE    read each secondary tier, count and verify every block
    tiering doctor [--config FILE]   what this machine supports (OK / WARN / FAIL per check)
    tiering wipe --config FILE       delete tiering's own files from each tier's directory
    tiering replay ...               (added by :mod:`tiering.replay` when it is installed)
    tiering policy-study ...         (likewise)
    tiering --version

Errors are reported at this boundary: a bad config or any :class:`~tiering.errors.TieringError`
or ``OSError`` prints its message (never a traceback) and exits 2; anything unexpected prints a
one-line summary and exits 3 (``--debug`` re-raises it instead). :data:`EXIT_CODES` lists every
exit status (``tiering --help`` prints it; docs/cli.md too). ``--log-level`` sends the
``tiering`` loggers' records at that level and above to stderr while the command runs.
``doctor --json`` and ``config check --json`` print one JSON object (:func:`checks_document`,
documented in docs/cli.md) instead of text, with the same exit status.

The package is a module per command, and a parser that imports none of them:

- :mod:`tiering.cli.parser`: every command and option (``--help`` of each), no command's code;
- :mod:`tiering.cli.config_cmd`: ``config check`` and ``config schema`` (the config layer only);
- :mod:`tiering.cli.inspect_cmd`: ``inspect`` (opens the backends read-only);
- :mod:`tiering.cli.doctor`: ``doctor`` (imports torch and the copy engine to probe them);
- :mod:`tiering.cli.wipe`: ``wipe``;
- :mod:`tiering.cli.checks`, :mod:`tiering.cli.config_checks`, :mod:`tiering.cli.loading`,
  :mod:`tiering.cli.output`, :mod:`tiering.cli.exits`: what the commands share.

A command's module is imported only when it runs (:class:`tiering.cli.parser.Handler`), so
``tiering --version`` and ``--help`` import no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator, Sequence

from tiering.cli.checks import checks_document
from tiering.cli.exits import (
    EXIT_CODES,
    EXIT_ERROR,
    EXIT_FINDINGS,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_UNEXPECTED,
)
from tiering.cli.output import format_bytes
from tiering.cli.parser import LOG_LEVELS, build_parser, parse_arguments
from tiering.errors import TieringError

__all__ = [
    "EXIT_CODES",
    "EXIT_ERROR",
    "EXIT_FINDINGS",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_UNEXPECTED",
    "LOG_LEVELS",
    "build_parser",
    "checks_document",
    "format_bytes",
    "main",
]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    try:
        args = parse_arguments(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    with _logging_to_stderr(args.log_level):
        return _run(args)


@contextlib.contextmanager
def _logging_to_stderr(level: int) -> Iterator[None]:
    """Send the ``tiering`` loggers' records at ``level`` and above to stderr while a command
    runs, then put the logger back as it was (``main`` may run many times in one process)."""
    logger = logging.getLogger("tiering")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tiering: %(levelname)s: %(name)s: %(message)s"))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the command's stderr is the one place its records go
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _run(args: argparse.Namespace) -> int:
    try:
        status: int = args.func(args)
        return status
    except KeyboardInterrupt:
        print("tiering: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (TieringError, OSError) as exc:
        if args.debug:
            raise
        print(f"tiering: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if args.debug:
            raise
        print(
            f"tiering: unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    raise SystemExit(main())
