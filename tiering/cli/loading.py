"""Loading a command's config: its warnings go to stderr, one line each."""

from __future__ import annotations

import sys
import warnings

from tiering.config import ConfigWarning, TieringConfig, load_config


def load_config_file(path: str, warnings_out: list[str] | None = None) -> TieringConfig:
    """Load a config; its :class:`ConfigWarning` s go to stderr as one line each (and, as
    text, to ``warnings_out`` if given)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        config = load_config(path)
    for warning in caught:
        if issubclass(warning.category, ConfigWarning):
            print(f"warning: {warning.message}", file=sys.stderr)
            if warnings_out is not None:
                warnings_out.append(str(warning.message))
        else:  # not ours: let the normal machinery show it
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    return config
