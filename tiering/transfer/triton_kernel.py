"""The page-copy kernel of the ``triton`` strategy (imported only when that strategy is built:
``triton`` is optional; see :mod:`tiering.transfer.triton_copy`)."""

# No ``from __future__ import annotations`` and no annotations on the pointer and size
# parameters: a compiling Triton (3.6 on an H100) resolves a kernel's annotations as globals
# and refuses any that is not a constexpr (``base: Any`` failed there); the interpreter the
# CPU tests use never looked. ``tests/test_transfer_strategies.py`` compiles it for sm_90.
from typing import Any

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["copy_chunks", "interpreted_copy_chunks"]


@triton.jit(do_not_specialize=["num_chunks"])  # one compiled kernel for every job size
def copy_chunks(  # type: ignore[no-untyped-def]
    base,
    table,
    num_chunks,
    BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """Program ``p`` copies chunks ``p, p + P, ...`` (``P`` programs): chunk ``c`` is
    ``table[2, c]`` words from word ``table[0, c]`` to word ``table[1, c]``, both counted from
    ``base`` (either may be negative). Every offset and length is a multiple of ``ALIGN``."""
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for chunk in range(program, num_chunks, programs):
        src = base + tl.multiple_of(tl.load(table + chunk), ALIGN)
        dst = base + tl.multiple_of(tl.load(table + num_chunks + chunk), ALIGN)
        words = tl.multiple_of(tl.load(table + 2 * num_chunks + chunk), ALIGN)
        for start in range(0, words, BLOCK):
            offsets = start + lanes
            mask = offsets < words
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def interpreted_copy_chunks() -> Any:
    """The same kernel run by Triton's interpreter (numpy over real addresses, CPU tensors)."""
    return InterpretedFunction(copy_chunks.fn)
