"""Warp-level tensor-core MMAs (`mma.sync`, D = A B + C) as DSL scalars: A four Uint32
words, B two, C and D four Float32.

Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k*"), lane = 4 g + q:

- m16n8k32 e4m3 (sm_89+), four codes a word: a0 (row g, k 4q..4q+3), a1 (row g + 8, same
  k), a2 (row g, k 16 + 4q..), a3 (row g + 8, k 16 + 4q..); b0 (k 4q.., col g), b1 (k
  16 + 4q.., col g); C/D: c0, c1 (row g, cols 2q, 2q + 1), c2, c3 (row g + 8, same cols).
- m16n8k16 f16 / bf16 (sm_80+), two values a word, the lower k in the low half: a0 (row
  g, k 2q, 2q + 1), a1 (row g + 8, same k), a2 (row g, k 2q + 8, 2q + 9), a3 (row g + 8,
  same k); b0 (k 2q, 2q + 1, col g), b1 (k 2q + 8, 2q + 9, col g). Products are exact.
- m16n8k8 tf32 (sm_80+), FP32 bit patterns of which the tensor core reads the top 19
  bits (bf16 values are exact): a0 (row g, k q), a1 (row g + 8, k q), a2 (row g, k q +
  4), a3 (row g + 8, k q + 4); b0 (k q, col g), b1 (k q + 4, col g).

The reductions are sums over k, so a kernel may assign its data to k in any order as long
as A and B agree; the kernels use that to give every lane 16-byte loads and stores.
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from .bits import inline_ptx


def _mma(shape: str, ab: str):
    ptx = f"mma.sync.aligned.{shape}.row.col.f32.{ab}.{ab}.f32"
    ptx += " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
    constraints = "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4)

    @dsl_user_op
    def mma(a, b, c, *, loc=None, ip=None) -> list:
        args = [Uint32(v) for v in a] + [Uint32(v) for v in b] + [Float32(v) for v in c]
        return inline_ptx(ptx, constraints, args, [Float32] * 4, loc=loc, ip=ip)

    return mma


mma_e4m3_16x8x32 = _mma("m16n8k32", "e4m3")
mma_f16_16x8x16 = _mma("m16n8k16", "f16")
mma_bf16_16x8x16 = _mma("m16n8k16", "bf16")
mma_tf32_16x8x8 = _mma("m16n8k8", "tf32")

__all__ = ["mma_e4m3_16x8x32", "mma_f16_16x8x16", "mma_bf16_16x8x16", "mma_tf32_16x8x8"]
