"""CuTe DSL kernels: the decode kernels (the hot path), one kernel family for every format,
and the bookkeeping kernels.

- `decode.Decode`: the non-flush step (read copy + ring replay, ring append), one warp
  per (row, head) on the tensor cores.
- `flush.Flush`: the flush (fold 16 tokens into the FP16 checkpoint on the tensor cores,
  stochastic rounding, re-derive the read copy).
- `pending`: pending mode's step (`PendingStep`, every row's T tokens in one pass over
  the read copy) and the launchers of it and of the fold (`flush.PendingFold`).
- `bookkeeping.Bookkeeping`: initialize (the checkpoint and read copy from prefill
  states, the flush's encoders) and clear (rings and positions), one launch each.
- `read_copy.Fp8` / `read_copy.Nvfp4`: the format strategies the kernels take (loads,
  row dots, encoders, scale handling); the arch picks their conversion instructions.
- `args`: the kernels' argument structs and their one spec.
- `config`: `StepConfig`, the launch variants of a step, chosen by rule.
- `launch`: compile cache, `compile_all`, `warmup` and the per-step launcher.
- `arch`: the compute-capability table and the $REPLAYSSM_ARCH override.

Importing this package does not import the CuTe DSL; the kernel modules do.
"""

from .arch import ARCH_ENV, ARCHS, SUPPORTED, arch_for, check_arch

__all__ = ["ARCH_ENV", "ARCHS", "SUPPORTED", "arch_for", "check_arch"]
