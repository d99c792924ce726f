"""Launch-time facts shared by the Triton launchers (no kernels here). Every Triton kernel
launches through Triton's own launcher (`kernel[grid](...)`)."""

from __future__ import annotations

import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1).

    Launchers use it to pick tile sizes: the interpreter pays per program and per op, so
    it gets a few large programs; the GPU gets many small ones."""
    return bool(triton.knobs.runtime.interpret)
