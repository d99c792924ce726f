"""Triton kernels: `materialize.py` (the FP32 state of a slot after its decoded tokens)
and `copy_slots.py` (slot copies and host staging). They run under the Triton interpreter
on CPU (TRITON_INTERPRET=1) as well as compiled on CUDA.

Import the modules lazily, after the environment is settled: `triton.jit` picks
interpreter or compiler when a kernel is defined. Launchers are imported from their
modules (`from replayssm.kernels.triton.materialize import materialize`); this package
re-exports nothing, so module and launcher names never shadow each other.
"""
