"""Triton kernels. The bookkeeping ones -- `initialize.py` (with `head_amax.py`),
`clear.py`, `prepare.py` -- are bit-exact with `replayssm.reference` (same quantizers, same
random hash: `bits.py`) and run under the Triton interpreter on CPU (TRITON_INTERPRET=1)
as well as compiled on CUDA.

Import the modules lazily, after the environment is settled: `triton.jit` picks
interpreter or compiler when a kernel is defined. Launchers are imported from their
modules (`from replayssm.kernels.triton.clear import clear`); this package re-exports
nothing, so module and launcher names never shadow each other.
"""
