"""Triton kernels: `materialize.py` (the FP32 state of a slot after its decoded tokens) and
`copy_slots.py` (slot copies and host staging), compiled on CUDA or interpreted on the CPU
(TRITON_INTERPRET=1). Import the modules lazily, after the environment is settled:
`triton.jit` picks interpreter or compiler when a kernel is defined.
"""

from __future__ import annotations

import triton


def interpreting() -> bool:
    """True under Triton's CPU interpreter (TRITON_INTERPRET=1). It pays per program and per
    op, so launchers give it a few large programs; the GPU gets many small ones."""
    return bool(triton.knobs.runtime.interpret)
