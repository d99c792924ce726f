"""NVFP4 bit helpers of the CuTe DSL kernels (docs/format.md section 3): e2m1 encode /
decode, e4m3 block-scale decode and the flush's block-scale steps. A packed word holds
elements 8w .. 8w + 7, element k in bits [4k + 3 : 4k].

The software routines are written once against an `ops` namespace and run two ways:
`DSL_OPS` traces them inside a `cute.kernel`, `NUMPY_OPS` runs them on numpy uint32 /
float32 arrays, which tests compare bit for bit with quant/. Both wrap uint32 arithmetic
mod 2**32 and round FP32 products and quotients to nearest; every shift is < 32 (PTX
clamps larger shifts, C does not).
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

# FP32 1/6 as formats.nvfp4_encode rounds it (Python float -> FP32, nearest).
ONE_SIXTH = 1.0 / 6.0
# Second-level scale: amax_live / g <= 168 = 1.3125 * 2**7 (formats.nvfp4_global_scale).
NVFP4_MANT_LIMIT, NVFP4_E_OFF = 0x280000, 7
# The software e2m1 -> f16 decode writes e2m1 value * 2**-6 (see e2m1x8_f16x2_soft).
SOFT_DECODE_FACTOR = 2.0**6
# Element order of the f16 halves the software decode returns for one word: words
# (0, 2), (4, 6), (1, 3), (5, 7), the first element of each pair in bits [15:0].
SOFT_DECODE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
HW_DECODE_ORDER = (0, 1, 2, 3, 4, 5, 6, 7)


def e2m1_code_rn(x_bits, ops):
    """FP32 bits -> e2m1 code, nearest-even, satfinite, NaN -> 0x7 (quant/minifloat.py
    `encode`), by one FP32 addition. With k = min(max(E, 0), 3), E the exponent of |x|,
    the e2m1 grid below 2**(k + 1) is the multiples of 2**(k - 1), as is the FP32 grid of
    M + |x| in [M, 2 M) for M = 2**(22 + k): the nearest-even sum rounds |x| onto it (ties
    to the even code), and its bits minus M's plus 2 k are the code. k = 3 (|x| >= 8,
    infinities) and sums that leave [M, 2 M) give 8 or more: satfinite to 7."""
    u, sel = ops.u, ops.sel
    a = x_bits & u(0x7FFFFFFF)
    k = ops.umin(ops.umax(a >> u(23), u(127)), u(130)) - u(127)
    m = (k + u(127 + 22)) << u(23)
    count = ops.bits(ops.fadd(ops.f32(a), ops.f32(m))) - m
    code = ops.umin(count + (k << u(1)), u(7)) | ((x_bits >> u(28)) & u(8))
    return sel(a > u(0x7F800000), u(7), code)


def e2m1x8_rn_soft_words(vals, ops):
    """Eight FP32 values (elements 0..7 of a word) -> packed word, element k in nibble k."""
    word = e2m1_code_rn(ops.bits(vals[0]), ops)
    for k in range(1, 8):
        word = word | (e2m1_code_rn(ops.bits(vals[k]), ops) << ops.u(4 * k))
    return word


def e2m1x8_f16x2_soft(w, ops):
    """Packed word (8 e2m1 codes) -> four f16x2 words in SOFT_DECODE_ORDER, each half
    equal to its e2m1 value * 2**-6. A code's 3 magnitude bits at bits [4:2] of a byte,
    its sign at bit 7, make the e4m3 code of value * 2**-6 (exponent bias 7 against 1; the
    e2m1 subnormal 0.5 lands on an e4m3 subnormal), never NaN; `cvt.rn.f16x2.e4m3x2`
    converts each half-word exactly."""
    u = ops.u
    even = ((w << u(2)) & u(0x1C1C1C1C)) | ((w << u(4)) & u(0x80808080))
    odd = ((w >> u(2)) & u(0x1C1C1C1C)) | (w & u(0x80808080))
    return [ops.e4m3x2_f16x2(v, half) for v in (even, odd) for half in (0, 1)]


def e4m3_value(code, ops):
    """e4m3fn code (8 bits in a uint32) -> FP32 value, exact; 0x7F / 0xFF -> NaN. Normal
    codes rebias in place; subnormal ones are (1 + m/8) * 2**-6 minus 2**-6 (exact)."""
    u, sel = ops.u, ops.sel
    c = code & u(0x7F)
    sub = (c >> u(3)) == u(0)
    b = (c << u(20)) + u(120 << 23) + sel(sub, u(1 << 23), u(0))
    mag = ops.f32(b) - sel(sub, ops.f(2.0**-6), ops.f(0.0))
    mag = sel(c == u(0x7F), ops.f(math.nan), mag)
    return sel((code & u(0x80)) != u(0), -mag, mag)


def block_scale_input(bamax, ig, ops):
    """t = (bamax * ig) * fp32(1/6): two FP32 products in this order (formats.nvfp4_encode),
    `bamax` a block's max |x|, ig = 2**-E of the second-level scale. Its e4m3 code
    (nearest, satfinite) is the stored block scale s."""
    return (bamax * ig) * ops.f(ONE_SIXTH)


def block_recip(s, g, ops):
    """r = 1 / (e4m3(s) * g), IEEE round-to-nearest; 0 when the product is 0. The codes of
    a block are e2m1(x * r). e4m3(s) * g is exact (g a power of two)."""
    d = e4m3_value(s, ops) * g
    return ops.sel(d == ops.f(0.0), ops.f(0.0), ops.rcp(d))


# ---------------------------------------------------------------------------------------
# numpy ops (CPU twins)


def _np_u(x):
    return np.asarray(x, dtype=np.uint32) if not isinstance(x, int) else np.uint32(x)


def _np_rcp(d):
    with np.errstate(divide="ignore"):  # d == 0 is selected away (r = 0)
        return np.float32(1.0) / d


def _np_fadd(x, y):
    with np.errstate(invalid="ignore"):  # NaN inputs (selected away by the caller)
        return np.add(np.float32(x), np.float32(y), dtype=np.float32)


def _np_e4m3x2_f16x2(w, half):
    # cvt.rn.f16x2.e4m3x2 of half-word `half` of w: both e4m3 codes exactly as f16.
    w = np.asarray(w, dtype=np.uint32) >> np.uint32(16 * half)
    out = []
    for k in range(2):
        v = e4m3_value((w >> np.uint32(8 * k)) & np.uint32(0xFF), NUMPY_OPS)
        out.append(np.asarray(v, dtype=np.float32).astype(np.float16).view(np.uint16).astype(np.uint32))
    return out[0] | (out[1] << np.uint32(16))


NUMPY_OPS = SimpleNamespace(
    u=_np_u, f=np.float32, sel=np.where, umin=np.minimum, umax=np.maximum,
    bits=lambda f: np.asarray(f, dtype=np.float32).view(np.uint32),
    f32=lambda b: np.asarray(b, dtype=np.uint32).view(np.float32),
    fadd=_np_fadd, rcp=_np_rcp, e4m3x2_f16x2=_np_e4m3x2_f16x2,
)


# ---------------------------------------------------------------------------------------
# CuTe DSL ops and hardware forms (the DSL is optional: the numpy twins run without it)

try:
    import cutlass
    from cutlass import Float32, Uint32
    from cutlass.cutlass_dsl import dsl_user_op

    from .bits import inline_ptx as _inline_ptx
    from .bits import sel as _sel
except ImportError:  # pragma: no cover - CPU twins only
    pass
else:

    def _rcp_rn(d):
        # Lowers to rcp.rn.f32 (IEEE-rounded reciprocal, = div.rn.f32 1/d; checked in
        # the compile tests): never the approximate forms.
        return Float32(1.0) / d

    @dsl_user_op
    def _fadd_rn(x, y, *, loc=None, ip=None) -> Float32:
        # `add.rn.f32`: the explicit rounding keeps ptxas from contracting it with the
        # product that made x into one fma (the encoders round that product first).
        args = [Float32(x), Float32(y)]
        return _inline_ptx("add.rn.f32 $0, $1, $2;", "=f,f,f", args, [Float32], loc=loc, ip=ip)

    def _cvt_part_f16x2(cvt: str, width: int):
        """`cvt` (a conversion to f16x2) of part `part` of a word split into 32 // width
        parts of `width` bits, part 0 the lowest."""
        names = ", ".join(f"p{i}" for i in range(32 // width))

        @dsl_user_op
        def op(w, part: int, *, loc=None, ip=None) -> Uint32:
            ptx = f"{{\n\t.reg .b{width} {names};\n\tmov.b32 {{{names}}}, $1;\n\t{cvt} $0, p{part};\n\t}}"
            return _inline_ptx(ptx, "=r,r", [Uint32(w)], [Uint32], loc=loc, ip=ip)

        return op

    # Two e4m3 codes (sm_89+) or two e2m1 codes (sm_100a / sm_103a) -> f16x2, exact, the
    # first (lower) code in the low half.
    _e4m3x2_f16x2 = _cvt_part_f16x2("cvt.rn.f16x2.e4m3x2", 16)
    _e2m1x2_f16x2 = _cvt_part_f16x2("cvt.rn.f16x2.e2m1x2", 8)

    DSL_OPS = SimpleNamespace(
        u=Uint32, f=Float32, sel=_sel, umin=cutlass.min, umax=cutlass.max,
        bits=lambda f: Float32(f).bitcast(Uint32),
        f32=lambda b: Uint32(b).bitcast(Float32),
        fadd=_fadd_rn, rcp=_rcp_rn, e4m3x2_f16x2=_e4m3x2_f16x2,
    )

    # sm_90a: the software encode (eight FP32 values -> packed word) and decode.
    e2m1x8_rn_soft = functools.partial(e2m1x8_rn_soft_words, ops=DSL_OPS)
    e2m1x8_f16x2_sw = functools.partial(e2m1x8_f16x2_soft, ops=DSL_OPS)

    @dsl_user_op
    def e2m1x8_rn_hw(vals, *, loc=None, ip=None) -> Uint32:
        """sm_100a / sm_103a: eight FP32 values -> packed e2m1 word (nearest): four
        `cvt.rn.satfinite.e2m1x2.f32 q, a, b` with a = element 2j + 1 (high nibble), b =
        element 2j (low nibble)."""
        vals = list(vals)
        return _inline_ptx(
            "{\n\t.reg .b8 q0, q1, q2, q3;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 q0, $1, $2;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 q1, $3, $4;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 q2, $5, $6;\n\t"
            "cvt.rn.satfinite.e2m1x2.f32 q3, $7, $8;\n\t"
            "mov.b32 $0, {q0, q1, q2, q3};\n\t}",
            "=r,f,f,f,f,f,f,f,f", [Float32(vals[k ^ 1]) for k in range(8)], [Uint32], loc=loc, ip=ip,
        )

    def e2m1x8_f16x2_hw(w) -> list:
        """sm_100a / sm_103a: packed word -> four f16x2 words in element order (true values)."""
        return [_e2m1x2_f16x2(w, j) for j in range(4)]


__all__ = [
    "ONE_SIXTH", "NVFP4_MANT_LIMIT", "NVFP4_E_OFF", "SOFT_DECODE_FACTOR", "SOFT_DECODE_ORDER",
    "HW_DECODE_ORDER", "e2m1_code_rn", "e2m1x8_rn_soft_words", "e2m1x8_f16x2_soft", "e4m3_value",
    "block_scale_input", "block_recip", "NUMPY_OPS", "DSL_OPS", "e2m1x8_rn_soft", "e2m1x8_rn_hw",
    "e2m1x8_f16x2_sw", "e2m1x8_f16x2_hw",
]
