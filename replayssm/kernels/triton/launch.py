"""Launch-time helpers shared by the Triton launchers (no kernels here)."""

from __future__ import annotations

import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Launchers use it to pick tile sizes: the interpreter pays per program and per op, so
    it gets a few large programs; the GPU gets many small ones."""
    return bool(triton.knobs.runtime.interpret)


def int32_pattern(value: int) -> int:
    """A uint32 value as the int32 with the same bits (kernel scalars are int32, so every
    seed shares one compiled variant)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= (1 << 31) else value
