"""Warp-level tensor-core MMAs (`mma.sync`) as DSL scalars, for the decode kernels.

Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k*"), with lane = 4 g + q
(g = lane // 4 the group, q = lane % 4 the thread in the group):

- m16n8k32, e4m3 x e4m3 -> f32 (sm_89+): A (16 x 32) in four words of four codes:
  a0 (row g, k 4q..4q+3), a1 (row g + 8, same k), a2 (row g, k 16 + 4q..), a3 (row
  g + 8, k 16 + 4q..); B (32 x 8) in two words: b0 (k 4q.., col g), b1 (k 16 + 4q..,
  col g); C/D (16 x 8): c0, c1 (row g, cols 2q, 2q + 1), c2, c3 (row g + 8, same cols).
- m16n8k16, f16 x f16 or bf16 x bf16 -> f32 (sm_80+): A (16 x 16) in four words of two
  values (low half the lower k): a0 (row g, k 2q, 2q + 1), a1 (row g + 8, same k), a2
  (row g, k 2q + 8, 2q + 9), a3 (row g + 8, same k); B (16 x 8) in two words: b0 (k 2q,
  2q + 1, col g), b1 (k 2q + 8, 2q + 9, col g); C/D as above. Products are exact in FP32.
- m16n8k8, tf32 x tf32 -> f32 (sm_80+): a0 (row g, k q), a1 (row g + 8, k q), a2 (row g,
  k q + 4), a3 (row g + 8, k q + 4); b0 (k q, col g), b1 (k q + 4, col g); C/D as above.
  The tensor core reads the top 19 bits of each f32 operand (tf32); bf16 values are
  exact.

Both reductions are sums over k, so a kernel may assign its data to k (and its rows to
m, its columns to n) in any order, as long as A and B agree; the kernels use that to give
every lane 16-byte loads and stores.
"""

from __future__ import annotations

from cutlass import Float32, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from .bits import inline_ptx


def _mma(ptx: str, a, b, c, loc, ip):
    return inline_ptx(
        ptx + " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4),
        [*a, *b, *c], [Float32] * 4, loc=loc, ip=ip,
    )


@dsl_user_op
def mma_e4m3_16x8x32(a, b, c, *, loc=None, ip=None) -> list:
    """D = A B + C: `a` four Uint32 words, `b` two, `c` four Float32; returns four Float32."""
    return _mma(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32",
        [Uint32(v) for v in a], [Uint32(v) for v in b], [Float32(v) for v in c], loc, ip,
    )


@dsl_user_op
def mma_f16_16x8x16(a, b, c, *, loc=None, ip=None) -> list:
    """D = A B + C, f16 operands (`a` four words, `b` two), FP32 `c`; four Float32."""
    return _mma(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        [Uint32(v) for v in a], [Uint32(v) for v in b], [Float32(v) for v in c], loc, ip,
    )


@dsl_user_op
def mma_bf16_16x8x16(a, b, c, *, loc=None, ip=None) -> list:
    """D = A B + C, bf16 operands (`a` four words, `b` two), FP32 `c`; four Float32."""
    return _mma(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        [Uint32(v) for v in a], [Uint32(v) for v in b], [Float32(v) for v in c], loc, ip,
    )


@dsl_user_op
def mma_tf32_16x8x8(a, b, c, *, loc=None, ip=None) -> list:
    """D = A B + C with A, B given as f32 bit patterns (Uint32; the tensor core uses
    their tf32 part); returns four Float32."""
    return _mma(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
        [Uint32(v) for v in a], [Uint32(v) for v in b], [Float32(v) for v in c], loc, ip,
    )


__all__ = ["mma_e4m3_16x8x32", "mma_f16_16x8x16", "mma_bf16_16x8x16", "mma_tf32_16x8x8"]
