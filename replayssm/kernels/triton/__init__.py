"""Triton bookkeeping kernels: prefill initialization, slot clearing and the per-step
decode plan. Bit-exact with `replayssm.reference` (same quantizers, same random hash,
see `bits.py`); they run under the Triton interpreter on CPU (TRITON_INTERPRET=1, set
before this package is imported) and compiled on CUDA.

Import this package lazily: `triton.jit` picks interpreter or compiler when a kernel is
defined, so the environment must be settled first (`replayssm.kernels` does so).
"""

from .clear import clear
from .initialize import initialize
from .prepare import PlanScratch, prepare_decode

__all__ = ["clear", "initialize", "prepare_decode", "PlanScratch"]
