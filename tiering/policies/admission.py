"""A frequency gate for writes into a secondary tier: keep one-hit blocks off flash.

Every block a write-through tier is offered is written, so NVMe endurance is spent on blocks
that never come back (a long one-off document, a conversation that ends). The gate admits a
block only once it has been *looked up* (missed in the CPU tier) at least ``min_count`` times
recently, the frequency TinyLFU estimates (Einziger et al., 2017):

- a count-min sketch of 4 rows of ``width`` 8-bit counters (``width`` a power of two, at least
  the tier's capacity in blocks times 8 is a good size); a key's estimate is its smallest
  counter, never below its true count since the last aging;
- aging: after ``10 * width`` records every counter is halved, so old popularity fades (O(width)
  once per ``10 * width`` records: O(1) amortized per record).

Memory: ``4 * width`` bytes. Keys are ``bytes`` (block hashes); their first 8 bytes, mixed by
four odd multipliers (a product's top bits, which pick the slot, depend on every bit of the
key's 8 bytes), index the rows, so the gate is deterministic across processes.

A secondary tier configured with ``admission_min_count`` holds one, sized by
:func:`default_width` unless ``admission_width`` says otherwise; the policy study sizes its
model of the tier the same way.
"""

from __future__ import annotations

__all__ = ["MAX_MIN_COUNT", "FrequencyGate", "default_width"]

_ROWS = 4
_MULTIPLIERS = (
    0x9E3779B97F4A7C15,
    0xC2B2AE3D27D4EB4F,
    0x165667B19E3779F9,
    0xD6E8FEB86659FD93,
)
_M0, _M1, _M2, _M3 = _MULTIPLIERS
_MASK64 = (1 << 64) - 1
_MAX_COUNT = 255
#: The largest ``min_count`` a gate can reach (its counters saturate there).
MAX_MIN_COUNT = _MAX_COUNT


def default_width(capacity_blocks: int) -> int:
    """The sketch width for a tier of ``capacity_blocks``: 8 counters per block, at least 64."""
    return max(64, 8 * capacity_blocks)


class FrequencyGate:
    """Admits a key once its recent lookups reach ``min_count`` (see the module docstring)."""

    __slots__ = ("_rows", "_shift", "_since_aging", "_aging_period", "min_count", "width")

    def __init__(self, width: int, min_count: int = 2) -> None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an int >= 1, got {width!r}")
        if (
            isinstance(min_count, bool)
            or not isinstance(min_count, int)
            or not 1 <= min_count <= MAX_MIN_COUNT
        ):
            raise ValueError(f"min_count must be an int in [1, {MAX_MIN_COUNT}], got {min_count!r}")
        bits = max(4, (width - 1).bit_length())
        self.width = 1 << bits
        self._shift = 64 - bits
        self.min_count = min_count
        self._rows = [bytearray(self.width) for _ in range(_ROWS)]
        self._since_aging = 0
        self._aging_period = 10 * self.width

    def record(self, key: bytes) -> None:
        """Count one lookup of ``key``."""
        # Unrolled over the four rows: the manager records every lookup past the primary.
        base = int.from_bytes(key[:8], "little")
        shift = self._shift
        r0, r1, r2, r3 = self._rows
        s = ((base * _M0) & _MASK64) >> shift
        if r0[s] < _MAX_COUNT:
            r0[s] += 1
        s = ((base * _M1) & _MASK64) >> shift
        if r1[s] < _MAX_COUNT:
            r1[s] += 1
        s = ((base * _M2) & _MASK64) >> shift
        if r2[s] < _MAX_COUNT:
            r2[s] += 1
        s = ((base * _M3) & _MASK64) >> shift
        if r3[s] < _MAX_COUNT:
            r3[s] += 1
        self._since_aging += 1
        if self._since_aging >= self._aging_period:
            self._age()

    def estimate(self, key: bytes) -> int:
        """Lookups of ``key`` since the last aging (halved by each aging), never fewer."""
        base = int.from_bytes(key[:8], "little")
        shift = self._shift
        r0, r1, r2, r3 = self._rows
        return min(
            r0[((base * _M0) & _MASK64) >> shift],
            r1[((base * _M1) & _MASK64) >> shift],
            r2[((base * _M2) & _MASK64) >> shift],
            r3[((base * _M3) & _MASK64) >> shift],
        )

    def admits(self, key: bytes) -> bool:
        """Whether ``key`` has been looked up ``min_count`` times recently."""
        return self.estimate(key) >= self.min_count

    def _age(self) -> None:
        self._rows = [bytearray(row.translate(_HALF)) for row in self._rows]  # one C pass
        self._since_aging = 0


_HALF = bytes(i >> 1 for i in range(256))
