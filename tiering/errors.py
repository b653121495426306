"""The exception hierarchy of ``tiering``.

Every error the library raises on purpose derives from :class:`TieringError`, so an engine can
catch one base class at its boundary. Subclasses also derive from the matching builtin
(``ValueError``, ``TypeError``, ``KeyError``) so that generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "BackendError",
    "ConfigError",
    "ConfigurationError",
    "CorruptBlockError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "LayoutError",
    "ProtocolError",
    "TieringError",
    "UnsafeFileError",
]


class TieringError(Exception):
    """Base class of every error raised by ``tiering``."""


class ConfigurationError(TieringError, ValueError):
    """A setting or a combination of settings cannot work (e.g. block sizes that do not align)."""


class ConfigError(ConfigurationError):
    """A configuration file is invalid: names the file, the dotted key path and the bad value."""


class LayoutError(TieringError, ValueError):
    """Registered KV-cache tensors do not match each other or the declared cache config."""


class InvalidArgumentError(TieringError, TypeError, ValueError):
    """A call got an argument of the wrong type or value.

    The message names the argument and what would be valid; the call changed nothing. It derives
    from both ``TypeError`` and ``ValueError`` so that generic handlers of either keep working.
    """


class InvalidKeyError(InvalidArgumentError):
    """A key has the wrong type or shape (offload keys are ``bytes``)."""


class ProtocolError(TieringError, KeyError):
    """A manager call breaks the protocol (loading a missing key, completing an unprepared load).

    The call that raises it changes nothing.
    """

    def __str__(self) -> str:  # KeyError quotes its argument; a protocol error is a sentence.
        return str(self.args[0]) if self.args else ""


class BackendError(TieringError, OSError):
    """A storage backend failed an operation (I/O error, closed backend, ...)."""


class CorruptBlockError(BackendError):
    """A stored block failed verification (header, key, layout fingerprint or checksum)."""


class UnsafeFileError(BackendError):
    """A file that ``tiering`` would share data through (a ``/dev/shm`` pool) is owned by another
    user or open to group or others: joining it would let that user read or change every block.

    The message names the file, its owner and mode, and what is expected.
    """
