"""CuTe DSL decode kernels (the hot path).

- `decode_warp.DecodeFp8Warp` / `DecodeNvfp4Warp`: the non-flush step (read copy + ring
  replay, ring append), one warp per (row, head) on the tensor cores (the default, and
  the batch-1 PDL variant); `decode_fp8.DecodeFp8` / `decode_nvfp4.DecodeNvfp4Sm90`,
  `Sm100`: the same as SIMT kernels ($REPLAYSSM_FP8_DECODE / $REPLAYSSM_NVFP4_DECODE =
  simt, or $REPLAYSSM_PDL_KERNEL=simt for the PDL variant alone);
  `decode_fp8_mma.DecodeFp8Mma` session 2's tensor-core FP8 kernel (opt-in,
  $REPLAYSSM_FP8_DECODE=mma: slower, docs/perf-notes-cute.md).
- `flush_fp8.FlushFp8Sm90` / `FlushFp8Sm100`: the flush (fold 16 tokens into the FP16
  checkpoint on the tensor cores, stochastic rounding, re-derive the read copy); they
  differ only in the two conversions (integer and round-toward-zero steps on sm_90a,
  `cvt.rs` / `cvt.rn ... e4m3x2` on sm_100a/sm_103a).
- `decode_nvfp4`, `flush_nvfp4`, `launch_nvfp4`: the NVFP4 read copy.
- `launch`: compile cache keyed by (kernel, arch, heads, groups, sm_90a e4m3 encode, FP8
  non-flush variant), `compile_all`, `warmup`
  and the per-step launcher.
- `arch`: the compute-capability table and the $REPLAYSSM_ARCH override.

Importing this package does not import the CuTe DSL; `launch` (and the kernel modules) do.
"""

from .arch import ARCH_ENV, ARCHS, SUPPORTED, arch_for, check_arch

__all__ = ["ARCH_ENV", "ARCHS", "SUPPORTED", "arch_for", "check_arch"]
