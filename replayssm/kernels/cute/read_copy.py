"""The read-copy formats as strategy objects of the CuTe kernels (format.md sections 3-4):
`Fp8`, `Nvfp4` and `Fp16` (no read copy: the steps read the checkpoint on FP8's lane map)
supply what differs between the formats: their cache tensors' struct (`Args`), for the steps
(decode.py, pending.py) a lane's n-set (`c_word`), row loads and row dots, for the flush and
the fold (flush.py) the checkpoint's rounding and the read copy's re-derivation. sm_90a has
no e2m1 or `cvt.rs` conversions and runs integer steps; sm_100a / sm_103a (`hw`) use the
hardware forms; both give the reference's bits.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32

from ...layout import NVFP4_BLOCK
from .arch import HAS_CVT_RS, check_arch
from . import args as A
from . import bits, bits_nvfp4
from .bits import bf16x2_to_f32x2, e4m3x4_to_f16x2x2, f32x2_to_f16x2, sel
from .bits_nvfp4 import DSL_OPS
from .decode import CTAS_PER_SM
from .mma import mma_f16_16x8x16

# FP8 row scale 2**E with amax <= 448 * 2**E: E = ceil(log2(amax / 448)), 448 = 1.75 * 2**8
# (quant/formats.py fp8_row_scale).
FP8_MANT_LIMIT, FP8_E_OFF = 0x600000, 8


class _Format:
    name = ""
    Args: type = tuple
    step_ctas_per_sm = CTAS_PER_SM  # the step kernels' CTAs of 4 heads an SM (Decode.ctas_per_sm scales it)
    step_ctas_n256 = CTAS_PER_SM  # ... at state dim 256
    flush_round_up_batch = 0  # flush.flush_columns rounds up at batches to this one, above to nearest

    def __init__(self, arch: str, P: int = 64, N: int = 128) -> None:
        self.arch = check_arch(arch)
        self.hw = arch in HAS_CVT_RS
        self.P, self.N = P, N  # the cache geometry, Python ints at trace time
        if N > 128:  # twice the row loads a lane: the step kernels' register bound
            self.step_ctas_per_sm = self.step_ctas_n256
        # Head dim 80: the steps' fifth m-tile, rows 64 + 2 gq, 65 + 2 gq (MMA rows gq, gq + 8).
        self.TAIL = P > 64
        self.ROWS = 10 if self.TAIL else 8  # rows a lane loads
        self.OUT_ROWS = 4 if self.TAIL else 2  # rows a decode lane writes: 8 gq + 2 q, + 1 (and the tail's)
        self.CHUNKS = N // 64  # chunks of a lane's n-set (`c_word`) in a state row: 16 values of each 64
        self.K_STEPS = N // 16
        self.BLOCKS = N // NVFP4_BLOCK  # NVFP4 block scales a state row
        self.WORDS_PER_ROW = N // 8  # packed e2m1 codes of a state row, in 32-bit words

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.arch!r}, P={self.P}, N={self.N})"


class Fp8(_Format):
    """e4m3 codes with one power-of-two FP32 scale a state row (format.md section 3)."""

    name = "fp8"
    Args = A.Fp8Copy
    ctas_per_sm = 1.5  # the flush's persistent grid (docs/design.md)
    flush_round_up_batch = 256  # docs/design.md section 7 ("FP8 flush width")
    stage_one_source = False  # flush.Flush.fold: both sources loaded, picked by a select
    row_amax = True  # the flush reduces a row's amax across its column parts
    sr_voted = False
    step_ctas_n256 = 3  # 4 spills (72 bytes on sm_90a)

    def __init__(self, arch: str, P: int = 64, N: int = 128) -> None:
        super().__init__(arch, P, N)
        # The pending fold's CTAs an SM (grid and register bound): sm_90a 5 (96 registers, 8
        # bytes spilled; design.md section 10), sm_100a / sm_103a 4 (5 spills 40 bytes there).
        self.fold_ctas_per_sm = 4 if self.hw else 5
        # The checkpoint's rounding: sm_90a bits.fp16x2_sr_fma (~8 instructions a value).
        self.fp16x2_sr = bits.fp16x2_sr_hw if self.hw else bits.fp16x2_sr_fma

    def tensors(self, cache, L) -> dict:  # the cache tensors of `Args`, by field
        return {"codes": cache[L.READ_COPY], "scales": cache[L.SCALES]}

    # -- non-flush ------------------------------------------------------------------------
    def c_word(self, c: int, q, h=0):
        """Word (bf16 pair) offset of vector h (0, 1: four words) of chunk c of lane q's
        n-set: n = 64 c + 16 q .. + 15, vector h the values 8 h .. 8 h + 7 of them."""
        return 32 * c + 8 * q + 4 * h

    @cute.jit
    def code_rows(self, copy, slot, hh, gq, q, hint: cutlass.Constexpr):
        """rc[i][c]: row 8 gq + i, bytes 64 c + 16 q .. + 15 (four words)."""
        read_w = cute.recast_ptr(copy.codes, dtype=Uint32)
        head = slot * copy.codes_stride16 * 4 + hh * (self.P * self.N // 4)
        rc_base = (read_w + (head + Int64(gq * (8 * self.N // 4) + 4 * q))).toint()
        rc = []
        for i in cutlass.range_constexpr(8):
            rc.append([bits.ld_global_v4_u32(rc_base + self.N * i + 64 * c, hint) for c in range(self.CHUNKS)])
        if cutlass.const_expr(self.TAIL):  # rows 64 + 2 gq, 65 + 2 gq
            rt_base = (read_w + (head + Int64((64 + 2 * gq) * (self.N // 4) + 4 * q))).toint()
            for i in cutlass.range_constexpr(2):
                rc.append([bits.ld_global_v4_u32(rt_base + self.N * i + 64 * c, hint) for c in range(self.CHUNKS)])
        return rc

    @cute.jit
    def load_rows(self, copy, slot, hh, g, gq, q, hint: cutlass.Constexpr):
        """`code_rows`; the scales of the lane's output rows 8 gq + 2 q, + 1."""
        rc = self.code_rows(copy, slot, hh, gq, q, hint)
        sc_off = slot * copy.scale_stride + hh * self.P + Int64(8 * gq + 2 * q)
        scales = [copy.scales[sc_off], copy.scales[sc_off + 1]]
        if cutlass.const_expr(self.TAIL):  # rows 64 + 2 gq, + 1
            sc_t = slot * copy.scale_stride + hh * self.P + Int64(64 + 2 * gq)
            scales += [copy.scales[sc_t], copy.scales[sc_t + 1]]
        return rc, scales

    @cute.jit
    def row_dots(self, loaded, cw, down, up, gq, q):
        """(rd, inner, outer): rd[mt] the f16 MMA dots of m-tile mt (`code_dots`); R[p] =
        scale[p] (dot 2**e)."""
        rc, scales = loaded
        return [[acc[0], acc[2]] for acc in self.code_dots(rc, cw, down)], up, scales

    @cute.jit
    def code_dots(self, rc, cw, down):
        """The f16 MMA accumulators of the P / 16 m-tiles: the codes of rows 2 mt, 2 mt + 1
        (m-tile 4 the tail) against C' = C down; k-step s takes word s % 4 of chunk s // 4."""
        ch = []
        for c in cutlass.range_constexpr(self.CHUNKS):
            row = []
            for v in cutlass.range_constexpr(8):
                pair = bf16x2_to_f32x2(cw[c][v])
                row.append(f32x2_to_f16x2(pair[0] * down, pair[1] * down))
            ch.append(row)
        accs = []
        for mt in cutlass.range_constexpr(self.P // 16):
            acc = [Float32(0.0)] * 4
            for s in cutlass.range_constexpr(self.K_STEPS):
                c, v = s // 4, s % 4
                lo = self.row_pairs(rc[2 * mt][c], v)
                hi = self.row_pairs(rc[2 * mt + 1][c], v)
                acc = mma_f16_16x8x16([lo[0], hi[0], lo[1], hi[1]], [ch[c][2 * v], ch[c][2 * v + 1]], acc)
            accs.append(acc)
        return accs

    def row_pairs(self, words, v: int):
        """k-step v's f16 pairs of a row's chunk: word v's four codes (elements 4 v .. + 3)."""
        return e4m3x4_to_f16x2x2(words[v])

    # -- pending (cute/pending.py) ---------------------------------------------------------
    @cute.jit
    def pending_loads(self, copy, slot, hh, g, gq, q, hint: cutlass.Constexpr):
        """`code_rows`, and the scales of all eight rows 8 gq .. + 7 (two 16-byte loads)."""
        rc = self.code_rows(copy, slot, hh, gq, q, hint)
        head = copy.scales + (slot * copy.scale_stride + hh * self.P)
        sc = (head + Int64(8 * gq)).toint()
        words = bits.ld_global_v4_u32(sc) + bits.ld_global_v4_u32(sc + 16)
        if cutlass.const_expr(self.TAIL):  # rows 64 + 2 gq, + 1: one 8-byte load
            words = words + bits.ld_global_v2_u32_if((head + Int64(64 + 2 * gq)).toint(), Int32(1))
        return rc, words

    @cute.jit
    def pending_dots(self, loaded, cw, down, gq, q):
        """(acc, rf): acc[mt] the f16 MMA dots of m-tile mt against the tokens' C' (column gq
        token gq's), rf[i] the power-of-two scale of row 8 gq + i: R[p] C_t = rf (up_t acc)."""
        rc, sc = loaded
        return self.code_dots(rc, cw, down), [w.bitcast(Float32) for w in sc]

    # -- flush ----------------------------------------------------------------------------
    def _nothing(self, *args):
        return None

    # NVFP4's hooks (group amax, block scales); none for FP8.
    shared = begin_row = begin_fold = lane_stats = block_scales = before_barrier = after_barrier = _nothing

    @cute.jit
    def store_row(self, copy, slot, hh, pp, col0, q, nq, acc, i, s_amax, ctx, scodes, nt: cutlass.Constexpr):
        """Row i: codes of S * 2**-E (exact) and the row scale 2**E from its parts' amaxes."""
        amax = s_amax[pp]
        for k in cutlass.range_constexpr(1, self.N // 64):
            amax = cutlass.max(amax, s_amax[k * self.P + pp])
        e = bits.pow2_exponent_above(amax, FP8_MANT_LIMIT, FP8_E_OFF)
        inv = bits.exp2_int(-e)
        if nq == 0:
            if q == 0:
                copy.scales[slot * copy.scale_stride + hh * self.P + pp] = bits.exp2_int(e)
        r_rc = cute.make_rmem_tensor(cute.make_layout(nt // 2), Uint32)
        # cvt.rn.satfinite.e4m3x2.f32 (lo in bits [7:0]) on every target: Hopper has it too.
        for m in cutlass.range_constexpr(nt // 2):  # columns 4 m .. 4 m + 3 = n-tiles 2 m, 2 m + 1
            lo = bits.e4m3x2_rn_hw(acc[2 * m][2 * i] * inv, acc[2 * m][2 * i + 1] * inv)
            hi = bits.e4m3x2_rn_hw(acc[2 * m + 1][2 * i] * inv, acc[2 * m + 1][2 * i + 1] * inv)
            r_rc[m] = lo | (hi << 16)
        rc_w = cute.recast_ptr(copy.codes, dtype=Uint32)
        rc_head = slot * copy.codes_stride16 * 4 + hh * (self.P * self.N // 4)
        bits.vec_aligned(rc_w, rc_head + pp * (self.N // 4) + Int64(col0 // 4), nt // 2).store(r_rc.load())


class Fp16(Fp8):
    """state_dtype="fp16": no read copy (format.md section 4b); the steps read the checkpoint
    on FP8's MMAs, its words the A pairs as they are. No row scale: a value (< 2**16) times
    C' (< 2**15) is exact in FP32, a row's sum stays below 2**38 and the smallest product
    (2**-48) is normal, so R[p] = up (dot) as the reference's FP32 checkpoint.float() . C.
    The flush and the fold only rewrite the checkpoint (each lane the elements it loaded); a
    step reads only rows that do not flush, or runs after the fold (PDL wait). 3 CTAs an SM
    spill nowhere; at 4 the sm_90a non-flush and sm_100a pending steps spill 8 bytes."""

    name = "fp16"
    Args = A.Fp16Copy
    row_amax = False
    step_ctas_per_sm = 3
    flush_round_up_batch = 0  # FP8's rule not measured here
    step_ctas_n256 = 2  # 3 spills (24 bytes on sm_90a)

    def __init__(self, arch: str, P: int = 64, N: int = 128) -> None:
        super().__init__(arch, P, N)
        # sm_90a: the warp-voted rounding (FP8's fp16x2_sr_fma spills 24 bytes in this flush).
        self.sr_voted = not self.hw

    def tensors(self, cache, L) -> dict:
        return {"state": cache[L.CHECKPOINT]}

    def c_word(self, c: int, q, h=0):
        """Word offset of vector h of chunk c of lane q's n-set, n = 64 c + 32 h + 8 q .. + 7:
        a row's four lanes read one 64-byte span (whole sectors) with each 16-byte load."""
        return 32 * c + 16 * h + 4 * q

    @cute.jit
    def code_rows(self, copy, slot, hh, gq, q, hint: cutlass.Constexpr):
        """rc[i][c]: row 8 gq + i, eight f16-pair words at C's words of chunk c (`c_word`)."""
        ck_w = cute.recast_ptr(copy.state, dtype=Uint32)
        head = slot * copy.stride16 * 4 + hh * (self.P * self.N // 2)
        base = (ck_w + (head + Int64(gq * (8 * self.N // 2)))).toint()
        tail = (ck_w + (head + Int64((64 + 2 * gq) * (self.N // 2)))).toint() if self.TAIL else None
        rc = []
        for i in cutlass.range_constexpr(self.ROWS):  # rows 8 gq + i, then 64 + 2 gq + i - 8
            row = []
            for c in cutlass.range_constexpr(self.CHUNKS):
                at = [(base + 2 * self.N * i if i < 8 else tail + 2 * self.N * (i - 8)) + 4 * self.c_word(c, q, h) for h in range(2)]
                row.append(bits.ld_global_v4_u32(at[0], hint) + bits.ld_global_v4_u32(at[1], hint))
            rc.append(row)
        return rc

    def row_pairs(self, words, v: int):
        """Words 2 v, 2 v + 1 of the chunk, the n of C's words 2 v, 2 v + 1."""
        return [words[2 * v], words[2 * v + 1]]

    @cute.jit
    def load_rows(self, copy, slot, hh, g, gq, q, hint: cutlass.Constexpr):
        return self.code_rows(copy, slot, hh, gq, q, hint)

    pending_loads = load_rows

    @cute.jit
    def row_dots(self, loaded, cw, down, up, gq, q):
        """`Fp8.row_dots` with every row factor 1."""
        return [[acc[0], acc[2]] for acc in self.code_dots(loaded, cw, down)], up, [Float32(1.0)] * self.OUT_ROWS

    @cute.jit
    def pending_dots(self, loaded, cw, down, gq, q):
        """`Fp8.pending_dots` with every row factor 1."""
        return self.code_dots(loaded, cw, down), [Float32(1.0)] * self.ROWS

    store_row = Fp8._nothing


class Nvfp4(_Format):
    """e2m1 codes, an e4m3 scale per block of 16 and a power-of-two second-level scale
    per (slot, group) from the delayed amax in meta (format.md sections 3-4)."""

    name = "nvfp4"
    Args = A.Nvfp4Copy
    ctas_per_sm = 4.0
    step_ctas_n256 = 3  # 4 spills (32 bytes on sm_90a)
    fold_ctas_per_sm = 6  # 80 registers (sm_90a spills 16 bytes); docs/design.md section 10
    stage_one_source = True
    row_amax = False

    def __init__(self, arch: str, P: int = 64, N: int = 128) -> None:
        super().__init__(arch, P, N)
        # sm_90a rounds the checkpoint through a warp-voted branch to the normal-range path
        # (bits.fp16x2_sr_voted; fp16x2_sr_fast is its general path); sm_100a in hardware.
        self.sr_voted = not self.hw
        self.fp16x2_sr = bits.fp16x2_sr_hw if self.hw else bits.fp16x2_sr_fast
        # The decoded f16 values are e2m1 value / decode_factor, in decode_order.
        self.decode_order = bits_nvfp4.HW_DECODE_ORDER if self.hw else bits_nvfp4.SOFT_DECODE_ORDER
        self.decode_factor = 1.0 if self.hw else bits_nvfp4.SOFT_DECODE_FACTOR
        self.e2m1x8_f16x2 = bits_nvfp4.e2m1x8_f16x2_hw if self.hw else bits_nvfp4.e2m1x8_f16x2_sw
        self.e2m1x8_rn = bits_nvfp4.e2m1x8_rn_hw if self.hw else bits_nvfp4.e2m1x8_rn_soft

    def tensors(self, cache, L) -> dict:
        return {"codes": cache[L.READ_COPY], "scales": cache[L.SCALES], "meta": cache[L.META], "parity": cache[L.PARITY]}

    # -- non-flush ------------------------------------------------------------------------
    def c_word(self, c: int, q, h=0):
        """Word offset of vector h (values 8 h .. + 7) of chunk c of lane q's n-set:
        n = 128 (c // 2) + 32 q + 16 (c % 2) .. + 15, block 8 (c // 2) + 2 q + c % 2."""
        return 64 * (c // 2) + 16 * q + 8 * (c % 2) + 4 * h

    @cute.jit
    def c_decoded(self, cw, downs, kh: int = 0):
        """The lane's C[128 kh + 32 q + m] times downs[m // 16] as f16 pairs in the decoded
        order: chm[wd][j] holds elements order[2 j], order[2 j + 1] of code word wd
        (elements n = 128 kh + 32 q + 8 wd + e), as the decode of that word returns them."""
        cf = []
        for c in cutlass.range_constexpr(2):
            for v in cutlass.range_constexpr(8):
                pair = bf16x2_to_f32x2(cw[2 * kh + c][v])
                cf += [pair[0] * downs[c], pair[1] * downs[c]]
        order = self.decode_order
        return [[f32x2_to_f16x2(cf[8 * wd + order[2 * j]], cf[8 * wd + order[2 * j + 1]]) for j in range(4)] for wd in range(4)]

    @cute.jit
    def load_rows(self, copy, slot, hh, g, gq, q, hint: cutlass.Constexpr):
        """rc[kh][i]: codes of row 8 gq + i, elements 128 kh + 32 q .. + 31; bs4[kh][mt] the
        scales of blocks 8 kh + 2 q, + 1 of m-tile mt's rows; the live scale g = 2**E of the
        slot and group (`& 1` keeps a corrupt parity word inside the slot's meta)."""
        read_w = cute.recast_ptr(copy.codes, dtype=Uint32)
        head = slot * copy.codes_stride16 * 4 + hh * (self.P * self.N // 8)
        rc_base = (read_w + (head + Int64(gq * (8 * self.N // 8) + 4 * q))).toint()
        rt_base = (read_w + (head + Int64((64 + 2 * gq) * (self.N // 8) + 4 * q))).toint() if self.TAIL else None
        halves = self.N // 128
        rc = []  # rows 8 gq + i, then (head dim 80) 64 + 2 gq + i - 8
        for kh in cutlass.range_constexpr(halves):
            rc.append([bits.ld_global_v4_u32(rc_base + (self.N // 2) * i + 64 * kh, hint) for i in range(8)]
                      + [bits.ld_global_v4_u32(rt_base + (self.N // 2) * i + 64 * kh, hint) for i in range(self.ROWS - 8)])
        s_base = slot * copy.scale_stride + hh * (self.P * self.BLOCKS) + Int64(gq * (8 * self.BLOCKS) + 2 * q)
        t_base = slot * copy.scale_stride + hh * (self.P * self.BLOCKS) + Int64((64 + 2 * gq) * self.BLOCKS + 2 * q) if self.TAIL else None
        bs4 = []  # m-tile mt's rows (bits [15:0], [31:16]), blocks 8 kh + 2 q, + 1
        for kh in cutlass.range_constexpr(halves):
            row = []
            for mt in cutlass.range_constexpr(self.P // 16):
                base, m = (s_base, mt) if mt < 4 else (t_base, 0)
                sb = [Uint32(copy.scales[base + self.BLOCKS * (2 * m + i // 2) + 8 * kh + i % 2]) for i in range(4)]
                row.append(sb[0] | (sb[1] << 8) | (sb[2] << 16) | (sb[3] << 24))
            bs4.append(row)
        par = Int64(copy.parity[slot * copy.parity_stride] & Int32(1))
        a_live = copy.meta[slot * copy.meta_stride + g * 2 + par].bitcast(Int32) & Int32(0x7FFFFFFF)
        g_scale = bits.exp2_int(bits.pow2_exponent_above(a_live, bits_nvfp4.NVFP4_MANT_LIMIT, bits_nvfp4.NVFP4_E_OFF))
        return rc, bs4, g_scale

    @cute.jit
    def row_dots(self, loaded, cw, down, up, gq, q):
        """Row dots by block: B column j holds C' on block j's k-values and zeros elsewhere
        (lane (gq, q), chunk c = block 2 q + c: C' where gq = 2 q + c, else C times 0; an
        infinite C gives NaN there, the dot is not finite then anyway), so accumulator
        column j is an A row's dot over block j with no A value scaled. Each lane scales its
        blocks 2 q, 2 q + 1 in FP32 and a quad butterfly sums the 8; R[p] = g (dot' 2**e)."""
        rc, bs4, g_scale = loaded
        halves = self.N // 128
        # C[128 kh + 32 q + m] * down or * 0 (chunk c of the half's n-set: block 2 q + c of it).
        chms = [self.c_decoded(cw, [sel(gq == 2 * q + c, down, Float32(0.0)) for c in range(2)], kh) for kh in range(halves)]
        # Code word wd's k-steps take its decoded words j0, j0 + 1 (j0 = 0, 2); acc = (rows
        # 8 gq + 2 mt, + 1) x (blocks 2 q, 2 q + 1 of the half), halves added in order.
        b0 = (q % 2) == 1

        def block_sums(mt):  # the lane's blocks' scaled dots of m-tile mt's two rows, halves added
            sums = None
            for kh in cutlass.range_constexpr(halves):
                chm = chms[kh]
                acc = [Float32(0.0)] * 4
                for wd in cutlass.range_constexpr(4):
                    lo = self.e2m1x8_f16x2(rc[kh][2 * mt][wd])
                    hi = self.e2m1x8_f16x2(rc[kh][2 * mt + 1][wd])
                    for j0 in cutlass.range_constexpr(0, 4, 2):
                        a = [lo[j0], hi[j0], lo[j0 + 1], hi[j0 + 1]]
                        acc = mma_f16_16x8x16(a, [chm[wd][j0], chm[wd][j0 + 1]], acc)
                s0 = bits.f16x2_to_f32x2(DSL_OPS.e4m3x2_f16x2(bs4[kh][mt], 0))
                s1 = bits.f16x2_to_f32x2(DSL_OPS.e4m3x2_f16x2(bs4[kh][mt], 1))
                pk = [acc[0] * s0[0] + acc[1] * s0[1], acc[2] * s1[0] + acc[3] * s1[1]]
                sums = pk if sums is None else [sums[0] + pk[0], sums[1] + pk[1]]
            return sums

        def exchange(pair, b, m):  # keep pair[b] (both rows), add lane ^ m's pair[1 - b]
            bfly = cute.arch.shuffle_sync_bfly
            return [sel(b, pair[1][i], pair[0][i]) + bfly(sel(b, pair[0][i], pair[1][i]), m) for i in range(2)]

        # Quad sum, butterfly: lane q ends with m-tile q's two rows (finish's selects);
        # first m-tiles 2 h, 2 h + 1 over lane pairs -> m-tile 2 h + q % 2.
        half = [exchange([block_sums(mt) for mt in range(2 * h, 2 * h + 2)], b0, 1) for h in range(2)]
        rd = [exchange(half, (q // 2) == 1, 2)] * 4
        if cutlass.const_expr(self.TAIL):  # m-tile 4: its quad sum in every lane
            tail = block_sums(4)
            for m in (1, 2):
                tail = [v + cute.arch.shuffle_sync_bfly(v, m) for v in tail]
            rd.append(tail)
        return rd, up * Float32(self.decode_factor), [g_scale] * self.OUT_ROWS

    # -- pending (cute/pending.py) ---------------------------------------------------------
    pending_loads = load_rows

    @cute.jit
    def pending_dots(self, loaded, cw, down, gq, q):
        """(acc, rf) as `Fp8.pending_dots`: each decoded f16 pair times its block scale
        (exact in f16: at most 6 significant bits, within range), so no per-block sums;
        rf = g * decode_factor for every row."""
        rc, bs4, g_scale = loaded
        halves = self.N // 128
        chms = [self.c_decoded(cw, [down, down], kh) for kh in range(halves)]
        acc_all = []
        for mt in cutlass.range_constexpr(self.P // 16):
            acc = [Float32(0.0)] * 4
            for kh in cutlass.range_constexpr(halves):
                chm = chms[kh]
                # Scale pairs of rows 2 mt (bytes 0, 1 of bs4: blocks 2 q, 2 q + 1) and 2 mt + 1.
                s_lo = e4m3x4_to_f16x2x2(bits.prmt(bs4[kh][mt], Uint32(0), 0x1100))
                s_hi = e4m3x4_to_f16x2x2(bits.prmt(bs4[kh][mt], Uint32(0), 0x3322))
                for wd in cutlass.range_constexpr(4):
                    lo = [bits.mul_f16x2(w, s_lo[wd // 2]) for w in self.e2m1x8_f16x2(rc[kh][2 * mt][wd])]
                    hi = [bits.mul_f16x2(w, s_hi[wd // 2]) for w in self.e2m1x8_f16x2(rc[kh][2 * mt + 1][wd])]
                    for j0 in cutlass.range_constexpr(0, 4, 2):
                        acc = mma_f16_16x8x16([lo[j0], hi[j0], lo[j0 + 1], hi[j0 + 1]], [chm[wd][j0], chm[wd][j0 + 1]], acc)
            acc_all.append(acc)
        rf = g_scale * Float32(self.decode_factor)
        return acc_all, [rf] * self.ROWS

    # -- flush ----------------------------------------------------------------------------
    # The flush writes `formats.nvfp4_encode(S, A_live)`, A_live = meta[slot, group, 1 - old
    # parity], and max-accumulates S's group amax into meta[slot, group, old parity] by an
    # atomic max on the FP32 bits as int32 (non-negative floats order like their bits; the
    # max is order-independent: every run writes the same bits). Race-free: the prepare
    # launch (same stream) flipped the parity and zeroed the old half, a (slot, group)'s CTAs
    # read only the live half and write only the old one, and the non-flush launch touches
    # other slots. A lane holds a whole block of each row.
    def shared(self, smem, warps: int):
        """Per-warp group amaxes, and meta as int32 bits for the atomic max."""
        return smem.allocate_tensor(Int32, cute.make_layout(warps), byte_alignment=16)

    @cute.jit
    def begin_row(self, copy, plan, slot, bb, g):
        """(old parity, meta row, g = 2**E, 1 / g) from the live amax: the half the prepare
        kernel did not reset (`& 1`: stay inside the slot's meta)."""
        return self.begin_fold(copy, Int64(Int32(plan.old_parity[bb]) & Int32(1)), slot, g)

    @cute.jit
    def begin_fold(self, copy, old, slot, g):
        """`begin_row` given the old parity (Int64, 0 or 1)."""
        meta_row = slot * copy.meta_stride + g * 2
        a_live = copy.meta[meta_row + 1 - old].bitcast(Int32) & Int32(0x7FFFFFFF)
        e = bits.pow2_exponent_above(a_live, bits_nvfp4.NVFP4_MANT_LIMIT, bits_nvfp4.NVFP4_E_OFF)
        return old, meta_row, bits.exp2_int(e), bits.exp2_int(-e)

    @cute.jit
    def lane_stats(self, acc, rows: cutlass.Constexpr, nt: cutlass.Constexpr):
        """Block amax (FP32 bits) of each of the lane's rows: its 16 values, a whole block."""
        bamax = []
        for i in cutlass.range_constexpr(rows):
            amax = Int32(0)
            for c in cutlass.range_constexpr(2 * nt):
                amax = cutlass.max(amax, acc[c // 2][2 * i + c % 2].bitcast(Int32) & Int32(0x7FFFFFFF))
            bamax.append(amax)
        return bamax

    def block_scales(self, bamax, ctx):
        """Both rows' block scales, one e4m3x2 conversion: s = e4m3((bamax * 2**-E) * fp32(1/6))."""
        t = [bits_nvfp4.block_scale_input(b.bitcast(Float32), ctx[3], DSL_OPS) for b in bamax]
        s_pair = bits.e4m3x2_rn_hw(t[0], t[1])
        return [s_pair & Uint32(0xFF), (s_pair >> 8) & Uint32(0xFF)]

    @cute.jit
    def store_row(self, copy, slot, hh, pp, col0, q, nq, acc, i, s_amax, ctx, scodes, nt: cutlass.Constexpr):
        """Row i: this lane's block, e2m1(x / (e4m3(s) * 2**E)) as two words, and its scale byte."""
        g_scale = ctx[2]
        r = bits_nvfp4.block_recip(scodes[i], g_scale, DSL_OPS)
        scaled = [acc[c // 2][2 * i + c % 2] * r for c in range(2 * nt)]
        r_codes = cute.make_rmem_tensor(cute.make_layout(2), Uint32)
        for k in cutlass.range_constexpr(2):
            r_codes[k] = self.e2m1x8_rn(scaled[8 * k:8 * k + 8])
        rc_w = cute.recast_ptr(copy.codes, dtype=Uint32)
        rc_head = slot * copy.codes_stride16 * 4 + hh * (self.P * self.WORDS_PER_ROW)
        bits.vec_aligned(rc_w, rc_head + pp * self.WORDS_PER_ROW + Int64(col0 // 8), 2).store(r_codes.load())
        copy.scales[slot * copy.scale_stride + hh * (self.P * self.BLOCKS) + pp * self.BLOCKS + Int64(col0 // 16)] = Uint8(scodes[i])

    @cute.jit
    def before_barrier(self, t, bamax, s_gmax):
        """Group amax: this lane's two blocks, then the warp, into shared memory."""
        tmax = bits.xor_reduce(cutlass.max(bamax[0], bamax[1]), 32, cutlass.max)
        if t % 32 == 0:
            s_gmax[t // 32] = tmax

    @cute.jit
    def after_barrier(self, t, ctx, s_gmax, copy, warps: cutlass.Constexpr):
        """One atomic max per CTA into the accumulator half (old parity)."""
        old, meta_row = ctx[0], ctx[1]
        if t == 0:
            cta_max = s_gmax[0]
            for w in cutlass.range_constexpr(1, warps):
                cta_max = cutlass.max(cta_max, s_gmax[w])
            meta_bits = cute.recast_ptr(copy.meta, dtype=Int32)
            cute.arch.atomic_max(meta_bits + (meta_row + old), cta_max, sem="relaxed", scope="gpu")


@functools.lru_cache(maxsize=None)
def read_copy_format(state_dtype: str, arch: str, P: int = 64, N: int = 128) -> _Format:
    """The strategy object of `state_dtype` ("fp8", "nvfp4", "fp16") on `arch`, geometry (P, N)."""
    return {"fp8": Fp8, "nvfp4": Nvfp4, "fp16": Fp16}[state_dtype](arch, P, N)


__all__ = ["Fp8", "Nvfp4", "Fp16", "read_copy_format"]
