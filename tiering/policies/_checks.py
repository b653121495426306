"""Argument checks shared by the built-in policies: bad input raises before any state changes."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from collections.abc import Set as AbstractSet

from tiering.errors import InvalidKeyError

__all__ = ["check_evict_count", "check_insert_key", "check_touch_keys", "protected_set"]

_NOTHING: frozenset[bytes] = frozenset()


def check_insert_key(key: object) -> None:
    """Raise :class:`InvalidKeyError` unless ``key`` is ``bytes``."""
    if type(key) is not bytes:
        raise InvalidKeyError(f"policy keys must be bytes, got {type(key).__name__}: {key!r:.80}")


def check_touch_keys(keys: Sequence[bytes], method: str = "touch") -> None:
    """Reject a single key passed where a sequence of keys is expected (by ``method``)."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidKeyError(
            f"{method}() takes a sequence of keys, got a single {type(keys).__name__}: {keys!r:.80}"
        )


def check_evict_count(n: object) -> None:
    """Raise ``ValueError`` unless ``n`` is an int >= 0."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"the number of victims must be an int >= 0, got {n!r}")


def protected_set(protected: Collection[bytes]) -> AbstractSet[bytes]:
    """``protected`` with O(1) membership tests (copied into a set only if it is not one)."""
    if isinstance(protected, (set, frozenset)):
        return protected
    if not protected:
        return _NOTHING
    if isinstance(protected, (bytes, bytearray, str)):
        raise InvalidKeyError(
            f"protected must be a collection of keys, got a single {type(protected).__name__}"
        )
    if isinstance(protected, AbstractSet):
        return protected
    return frozenset(protected)
