"""ARC as vLLM 0.33 documents it (``vllm.v1.kv_offload.cpu.policies.arc``): ``arc_vllm``.

The same lists as :class:`~tiering.policies.arc.ARCPolicy` (T1 used once, T2 used at least
twice, ghosts B1 and B2, target ``p`` of T1), with vLLM's rules where they differ from the
paper's variant, so that a user who moves from vLLM's CPU manager to tiering's drop-in sees the
hit ratio they had:

- Adaptation happens when a key is *missed* (:meth:`note_misses`, before the eviction that
  makes room for it): a B1 ghost raises ``p`` by ``max(1, |B2| / |B1|)``, a B2 ghost lowers
  it by ``max(1, |B1| / |B2|)``, and the ghost stays (moved to its list's newest end) until
  the key is inserted. A use (:meth:`touch`) of a ghost is ignored, as vLLM ignores the
  ghosts among a finished request's keys.
- :meth:`insert` always puts a key in T1 (dropping its ghost); a later reuse promotes it:
  :meth:`touch` moves a key of T1 to T2, pinned or not (vLLM moves a ready one; a key being
  written is never touched by the drop-in, which touches only the keys a request reused).
- :meth:`evict` takes from T1 while ``|T1| >= int(p)`` (a tie goes to T1), else from T2; a
  list with nothing evictable left gives way to the other. Every victim leaves a ghost, B1 for
  T1's, B2 for T2's, even when a full T1 evicts (the paper keeps none then), and each ghost
  list is trimmed to ``capacity`` after an eviction.
- :meth:`refresh` (a request's own new blocks at its end) keeps each key in its list, as its
  most recent: a store is not a reuse.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    check_touch_keys,
    protected_set,
)
from tiering.policies.arc import ARCPolicy, ghost_hit_target

__all__ = ["VLLMARCPolicy"]


class VLLMARCPolicy(ARCPolicy):
    """vLLM 0.33's ARC variant over tiering's pinned-key lists; see the module docstring."""

    name = "arc_vllm"

    def __iter__(self) -> Iterator[bytes]:
        # The order successive evict(1) calls take keys in, with every key evictable.
        t1, t2 = iter(self._t1), iter(self._t2)
        t1_left, t2_left = len(self._t1), len(self._t2)
        target = int(self._target_t1_size)
        while t1_left and t2_left:
            if t1_left >= target:
                t1_left -= 1
                yield next(t1)
            else:
                t2_left -= 1
                yield next(t2)
        yield from t1
        yield from t2

    def insert(self, key: bytes, evictable: bool = True) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        if key in self._t2 or not self._t1.add_new(key, evictable):
            raise KeyError(key)
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if not self._t1.add_all(keys, evictable):
            raise KeyError("insert_new: a key was held already or listed twice")
        b1, b2 = self._b1, self._b2
        if b1 or b2:
            for key in keys:
                b1.pop(key, None)
                b2.pop(key, None)

    def note_misses(self, keys: Sequence[bytes]) -> None:
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        if self._b1 or self._b2:
            for key in reversed(keys):
                self._adapt_to_ghost(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        # A use promotes a pinned key of T1 too (vLLM: a ready one; a load pins a ready key),
        # keeping its pin; the touch below then orders it in T2.
        t1, t2 = self._t1, self._t2
        if t1.size:
            for key in keys:
                if key in t1 and not t1.is_evictable(key):
                    t1.discard(key)
                    t2.add(key, False)
        super().touch(keys)  # ghosts are ignored: vLLM adapts at a miss, not at a request's end

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        if type(n) is not int or n < 0:
            check_evict_count(n)
        guard = protected if type(protected) is set else protected_set(protected)
        if n == 0:
            return []
        t1, t2 = self._t1, self._t2
        if n > t1.evictable_count:  # of T1 and T2 together (partners)
            return None  # hopeless: fail before any search
        # One victim at a time, as vLLM: from T1 while |T1| (less its victims) >= int(p), else
        # from T2, else T1 again. In runs: T1 until |T1| < int(p) or it has no victim left,
        # then T2, then the rest of T1.
        first_t1 = max(0, min(n, t1.size - int(self._target_t1_size) + 1))
        try:
            to_b1 = t1.take(first_t1, guard) if first_t1 else []
            # T1 ran out of victims: vLLM's scan of T1 is spent, T2 must give the rest.
            t1_spent = len(to_b1) < first_t1
            to_b2 = t2.take(n - len(to_b1), guard)
            short = n - len(to_b1) - len(to_b2)
            more_b1 = t1.take(short, guard) if short and not t1_spent else []
        except BaseException:
            t1.end_search(undo=True)
            t2.end_search(undo=True)
            raise
        found_all = len(more_b1) == short
        t1.end_search(undo=not found_all)
        t2.end_search(undo=not found_all)
        if not found_all:
            return None
        b1, b2, capacity = self._b1, self._b2, self.capacity
        for key in to_b1:
            b1[key] = None
        for key in more_b1:
            b1[key] = None
        for key in to_b2:
            b2[key] = None
        while len(b1) > capacity:
            b1.popitem(last=False)
        while len(b2) > capacity:
            b2.popitem(last=False)
        return to_b1 + to_b2 + more_b1

    def _adapt_to_ghost(self, key: bytes) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1 or key in b2:
            from_b1 = key in b1
            self._target_t1_size = ghost_hit_target(
                self._target_t1_size, from_b1, len(b1), len(b2), self.capacity, 0.0
            )
            (b1 if from_b1 else b2).move_to_end(key)
