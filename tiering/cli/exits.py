"""The exit statuses of ``tiering``: one meaning per number, listed by ``tiering --help``."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1  # inspect found bad blocks, or doctor found a FAIL
EXIT_ERROR = 2  # bad config, bad arguments, or an I/O error
EXIT_UNEXPECTED = 3  # a bug: an exception that is not a TieringError or OSError
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)

#: Every exit status of ``tiering``, and what it means (printed by ``tiering --help``).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success: nothing wrong found"),
    (
        EXIT_FINDINGS,
        "findings: doctor found a FAIL; inspect found corrupt or unreadable blocks, or a tier "
        "holding another layout or not readable; replay loaded bytes that did not verify",
    ),
    (
        EXIT_ERROR,
        "error: bad arguments, a bad or missing config, an I/O error, or (config check) a "
        "tier directory that would be refused when it opens",
    ),
    (EXIT_UNEXPECTED, "unexpected error: a bug (--debug shows the traceback)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)
