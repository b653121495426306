"""The part of ``BackendTests`` that drives a backend the way embedders do: through
:class:`tiering.embed.TierStore`, with blocks given as runs of memory and shorter than the slot.

A backend needs nothing new for it (the facade frames variable-length blocks into the backend's
fixed-size slots and gathers/scatters runs), but it must move those slots bit-exact when they are
driven from another thread's event loop, in batches of mixed lengths, and through a restart.
"""

from __future__ import annotations

import ctypes
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tiering.core.block_format import FRAME_BYTES
from tiering.embed import EmbedError, TierStore
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.shared_tier import SharedTier

if TYPE_CHECKING:
    from tiering.backends.base import StorageBackend

__all__ = ["EmbedTests"]


class EmbedTests:
    """Mixed into ``BackendTests``: runs and lengths through the embedder facade."""

    persistent: ClassVar[bool]
    block_bytes: ClassVar[int]

    if TYPE_CHECKING:

        def new_backend(
            self, tmp_path: Path, *, n_blocks: int | None = None, block_bytes: int | None = None
        ) -> StorageBackend: ...

        @staticmethod
        def make_keys(n: int, tag: str = "k") -> list[bytes]: ...

    def embed_store(self, tmp_path: Path) -> TierStore:
        """An open TierStore over a new backend of this suite (slot = ``block_bytes``)."""
        backend = self.new_backend(tmp_path)
        tier_class = SharedTier if backend.capabilities.shared else SecondaryTier
        store = TierStore([tier_class(backend, name="under-test")])
        store.open()
        return store

    def _payloads(self, lengths: list[int], seed: int) -> list[bytes]:
        rng = random.Random(seed)
        return [rng.randbytes(n) for n in lengths]

    def _lengths(self) -> list[int]:
        most = self.block_bytes - FRAME_BYTES
        return [most, 1, most // 3, 4096 + 7, most - 1]

    def test_embed_runs_and_lengths_round_trip(self, tmp_path: Path) -> None:
        keys = self.make_keys(5, tag="embed")
        lengths = self._lengths()
        payloads = self._payloads(lengths, seed=41)
        store = self.embed_store(tmp_path)
        try:
            # Written as runs of several kinds: raw addresses, buffers, one whole buffer.
            keep: list[Any] = []
            blocks: list[Any] = []
            for i, data in enumerate(payloads):
                if i % 2:
                    blocks.append(bytearray(data))
                    continue
                head = (ctypes.c_ubyte * (len(data) // 2)).from_buffer_copy(data[: len(data) // 2])
                keep.append(head)
                blocks.append(
                    [
                        (ctypes.addressof(head), len(head)),
                        (data[len(head) :], len(data) - len(head)),
                    ]
                )
            assert store.put(keys, blocks) == [True] * 5
            assert store.exists(keys) == 5
            assert store.exists([keys[0], *self.make_keys(1, tag="absent"), keys[1]]) == 1
            # Read into runs split elsewhere, larger than the blocks: the length comes back.
            outs = [(bytearray(b"\xa5" * 100), bytearray(b"\xa5" * self.block_bytes)) for _ in keys]
            got = store.get(keys, [[(a, len(a)), (b, len(b))] for a, b in outs])
            assert got == lengths
            for (a, b), data in zip(outs, payloads, strict=True):
                assert (bytes(a) + bytes(b))[: len(data)] == data
                assert bytes(b)[max(0, len(data) - 100) :] == b"\xa5" * (
                    self.block_bytes - max(0, len(data) - 100)
                ), "bytes past the block's length were written"
        finally:
            store.close()

    def test_embed_refuses_what_does_not_fit(self, tmp_path: Path) -> None:
        keys = self.make_keys(2, tag="fit")
        store = self.embed_store(tmp_path)
        try:
            too_long = bytes(self.block_bytes - FRAME_BYTES + 1)
            try:
                store.put(keys, [b"ok", too_long])
            except EmbedError as exc:
                assert str(self.block_bytes - FRAME_BYTES) in str(exc)
            else:
                raise AssertionError("a block longer than the slot was accepted")
            assert store.exists(keys[:1]) == 0, "a refused call stored something"
            assert store.put(keys, [b"abc", b"defg"]) == [True, True]
            small = bytearray(b"\x11" * 3)
            assert store.get(keys[1:], [small]) == [None], "a block longer than the memory"
            assert small == b"\x11" * 3, "a miss wrote the caller's memory"
            exact = bytearray(10)
            assert store.get(keys[:1], [exact], exact=True) == [None]
            assert store.get(keys[:1], [exact]) == [3] and exact[:3] == b"abc"
        finally:
            store.close()

    def test_embed_lengths_survive_a_restart(self, tmp_path: Path) -> None:
        if not self.persistent:
            return
        keys = self.make_keys(5, tag="restart")
        lengths = self._lengths()
        payloads = self._payloads(lengths, seed=43)
        store = self.embed_store(tmp_path)
        try:
            assert store.put(keys, payloads) == [True] * 5
        finally:
            store.close()
        store = self.embed_store(tmp_path)
        try:
            assert store.exists(keys) == 5
            outs = [bytearray(self.block_bytes) for _ in keys]
            assert store.get(keys, outs) == lengths
            assert [bytes(o[: len(p)]) for o, p in zip(outs, payloads, strict=True)] == payloads
        finally:
            store.close()
