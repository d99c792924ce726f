"""Flush kernel for the NVFP4 read copy (CuTe DSL, SIMT).

The FP8 flush (flush_fp8.py) with the NVFP4 read copy: for every batch row the plan
marks flush, fold the 16 tokens into the FP32 state S, y = S . C + D x from the unrounded
S, the FP16 checkpoint with stochastic rounding (bit for bit the FP8 kernel's), then

- the NVFP4 copy of S, exactly `formats.nvfp4_encode(S, A_live)` (format.md section 3),
  with A_live = meta[slot, group, 1 - old_parity] (the prepare kernel has already set
  parity[slot] = 1 - old_parity and zeroed meta[slot, group, old_parity]);
- the group amax of S, max-accumulated into meta[slot, group, old_parity] with an atomic
  max on the FP32 bits as int32 (non-negative values order like their bits; max is
  order-independent, so every run writes the same bits).

Why this is race-free (format.md section 4): the CTAs of one (slot, group) (one per head)
read only the half 1 - old and write only the half old; the reset of `old` and the parity
flip happened in the prepare launch before this one on the same stream, and the non-flush
launch of the step touches only non-flushing slots.

Grid (heads, ceil(batch / ROWS_PER_CTA)), 512 threads (the first FP8 flush's thread map): thread t owns
n = 8 (t % 16) .. + 7 of state rows t // 16 + 32 i (i = 0, 1). An NVFP4 block (16
elements) is two adjacent lanes: one xor shuffle gives its amax; both lanes derive the
same scale and each encodes its 8 elements into one 32-bit word of codes. The two rows'
block scales go through one e4m3x2 conversion.

Targets differ in three conversions: the two of the FP8 flush (bits.py: FP16 stochastic
rounding and the e4m3 encode, here of the block scales) and the e2m1 encode (software integer steps on sm_90a,
`cvt.rn.satfinite.e2m1x2.f32` on sm_100a / sm_103a): identical codes for identical inputs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint8, Uint32
from cuda.bindings import driver as cuda_driver
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits, bits_nvfp4
from .bits import sel, softplus
from .bits_nvfp4 import DSL_OPS
from .flush_fp8 import ROWS_PER_CTA, N, P, RING, _vec, _xor_reduce, flush_mask

# Launch shape and thread map (those of the first FP8 flush, before it moved to the tensor
# cores): the code below depends on them (two rows per thread: one e4m3x2 conversion for
# their scales).
THREADS = 512
ROWS = 2  # state rows per thread: row0 + 32 i
ROW_STEP = THREADS // 16
MIN_CTAS_PER_SM = 2
WARPS = THREADS // 32
WORDS_PER_ROW = N // 8  # packed e2m1 codes of one state row, in 32-bit words
BLOCKS = N // 16  # block scales per state row


class FlushNvfp4:
    """NVFP4 flush for one geometry (heads, groups); subclasses supply the conversions.

    `debug=True` also writes the FP32 state S of every flushed row to an extra
    [batch, H, 64, 128] buffer, as the FP8 debug variant does."""

    name = "flush_nvfp4"
    arch = ""

    def __init__(self, heads: int, groups: int, *, debug: bool = False) -> None:
        self.heads, self.groups = heads, groups
        self.hpg = heads // groups
        self.debug = debug

    # -- the per-target conversions -------------------------------------------------------
    def fp16x2_sr(self, lo: Float32, hi: Float32, word: Uint32) -> Uint32:
        raise NotImplementedError

    def e4m3x2_rn(self, lo: Float32, hi: Float32) -> Uint32:
        raise NotImplementedError

    def e2m1x8_rn(self, vals) -> Uint32:
        raise NotImplementedError

    @cute.jit
    def __call__(
        self,
        ckpt: Pointer,  # f16 [S, H, 64, 128], 16-byte aligned
        read: Pointer,  # uint8 [S, H, 64, 64] as uint32 words, 16-byte aligned
        scales: Pointer,  # e4m3 bytes [S, H, 64, 8]
        meta: Pointer,  # f32 [S, G, 2]
        x_ring: Pointer,  # bf16 [S, H, 16, 64], 16-byte aligned
        dt_ring: Pointer,  # f32 [S, H, 16]
        b_ring: Pointer,  # bf16 [S, G, 16, 128], 16-byte aligned
        x: Pointer,  # bf16 [batch, H, 64] contiguous, 16-byte aligned
        dt: Pointer,  # f32 [batch, H] raw, strided
        A: Pointer,
        B: Pointer,  # bf16 [batch, G, 128] contiguous, 16-byte aligned
        C: Pointer,
        D: Pointer,
        dt_bias: Pointer,
        out: Pointer,  # bf16 [batch, H, 64] contiguous
        plan_slot: Pointer,  # int64 [batch]
        plan_flush: Pointer,  # int8 [batch]
        plan_key: Pointer,  # int64 [batch] (uint32 stream tags)
        plan_old: Pointer,  # int64 [batch]: parity before the step
        state_out: Pointer,  # f32 [batch, H, 64, 128] (debug variant only), 16-byte aligned
        ckpt_stride16: Int64,
        read_stride16: Int64,
        scale_stride: Int64,
        meta_stride: Int64,
        x_ring_stride16: Int64,
        dt_ring_stride: Int64,
        b_ring_stride16: Int64,
        dt_stride_b: Int64,
        dt_stride_h: Int64,
        a_stride: Int64,
        dt_bias_stride: Int64,
        d_stride_h: Int64,
        d_stride_p: Int64,
        batch: Int32,
        stream: cuda_driver.CUstream,
    ):
        self.kernel(
            ckpt, read, scales, meta, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
            plan_slot, plan_flush, plan_key, plan_old, state_out,
            ckpt_stride16, read_stride16, scale_stride, meta_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
            dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
            batch,
        ).launch(
            grid=[self.heads, (batch + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1],
            block=[THREADS, 1, 1],
            min_blocks_per_mp=MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        ckpt: Pointer,
        read: Pointer,
        scales: Pointer,
        meta: Pointer,
        x_ring: Pointer,
        dt_ring: Pointer,
        b_ring: Pointer,
        x: Pointer,
        dt: Pointer,
        A: Pointer,
        B: Pointer,
        C: Pointer,
        D: Pointer,
        dt_bias: Pointer,
        out: Pointer,
        plan_slot: Pointer,
        plan_flush: Pointer,
        plan_key: Pointer,
        plan_old: Pointer,
        state_out: Pointer,
        ckpt_stride16: Int64,
        read_stride16: Int64,
        scale_stride: Int64,
        meta_stride: Int64,
        x_ring_stride16: Int64,
        dt_ring_stride: Int64,
        b_ring_stride16: Int64,
        dt_stride_b: Int64,
        dt_stride_h: Int64,
        a_stride: Int64,
        dt_bias_stride: Int64,
        d_stride_h: Int64,
        d_stride_p: Int64,
        batch: Int32,
    ):
        H, G, HPG = self.heads, self.groups, self.hpg
        t, _, _ = cute.arch.thread_idx()
        h, by, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        s_x = smem.allocate_tensor(Float32, cute.make_layout(RING * P), byte_alignment=16)
        s_b = smem.allocate_tensor(Float32, cute.make_layout(RING * N), byte_alignment=16)
        s_dt = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)
        s_w = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)
        s_amax = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
        s_mask = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)

        # Which of this CTA's batch rows flush (one ballot, as the FP8 flush).
        mask = flush_mask(t, by, plan_flush, batch, s_mask)

        hh = Int64(h)
        g = hh // HPG
        q = t % 16
        n0 = q * 8
        row0 = t // 16  # this thread's rows: row0 + 32 i
        ck_words = cute.recast_ptr(ckpt, dtype=Uint32)  # FP16 pairs, the unit of the stores
        meta_bits = cute.recast_ptr(meta, dtype=Int32)  # the atomic max works on the bits
        for rr in range(ROWS_PER_CTA):
            if ((mask >> rr) & Int32(1)) != Int32(0):
                bb = Int64(by * ROWS_PER_CTA + rr)
                self.flush_row(
                    t, q, n0, row0, hh, g, bb, H, G, s_x, s_b, s_dt, s_w, s_amax, ck_words, meta_bits,
                    read, scales, meta, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
                    plan_slot, plan_key, plan_old, state_out,
                    ckpt_stride16, read_stride16, scale_stride, meta_stride,
                    x_ring_stride16, dt_ring_stride, b_ring_stride16,
                    dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
                )

    @cute.jit
    def flush_row(
        self, t, q, n0, row0, hh, g, bb, H: cutlass.Constexpr, G: cutlass.Constexpr,
        s_x, s_b, s_dt, s_w, s_amax, ck_words, meta_bits,
        read, scales, meta, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
        plan_slot, plan_key, plan_old, state_out,
        ckpt_stride16, read_stride16, scale_stride, meta_stride,
        x_ring_stride16, dt_ring_stride, b_ring_stride16,
        dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
    ):
        """One flushing batch row of head hh (the whole CTA)."""
        slot = plan_slot[bb]
        key = Uint32(plan_key[bb])
        old = Int64(Int32(plan_old[bb]) & Int32(1))  # `& 1`: stay inside the slot's meta

        # Checkpoint first (the largest read), in flight during the staging below.
        ck_head_w = slot * ckpt_stride16 * 4 + hh * (P * N // 2)
        ck_thread_w = ck_head_w + Int64(row0 * (N // 2) + q * 4)
        r_ck = []
        for i in cutlass.range_constexpr(ROWS):
            r_ck.append(_vec(ck_words, ck_thread_w + i * ROW_STEP * (N // 2), 4).load())
        # The live amax (the half the prepare kernel did not reset) -> g = 2**E.
        meta_row = slot * meta_stride + g * 2
        a_live = meta[meta_row + 1 - old].bitcast(Int32) & Int32(0x7FFFFFFF)
        e = bits.pow2_exponent_above(a_live, bits_nvfp4.NVFP4_MANT_LIMIT, bits_nvfp4.NVFP4_E_OFF)
        g_scale = bits.exp2_int(e)
        ig_scale = bits.exp2_int(-e)

        # Stage x_j (FP32) and B_j (BF16) of entries 0..15: 15 from the rings, the
        # current token as entry 15.
        if t < RING * P // 8:
            jx = t // 8
            xs = (t % 8) * 8
            r_x = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            if jx < RING - 1:
                r_x.store(_vec(x_ring, slot * x_ring_stride16 * 8 + (hh * RING + Int64(jx)) * P + xs, 8).load())
            else:
                r_x.store(_vec(x, (bb * H + hh) * P + xs, 8).load())
            _vec(s_x.iterator, jx * P + xs, 8).store(r_x.load().to(Float32))
        if t < RING * N // 8:
            jb = t // 16
            bs = (t % 16) * 8
            r_bv = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            if jb < RING - 1:
                r_bv.store(_vec(b_ring, slot * b_ring_stride16 * 8 + (g * RING + Int64(jb)) * N + bs, 8).load())
            else:
                r_bv.store(_vec(B, (bb * G + g) * N + bs, 8).load())
            _vec(s_b.iterator, jb * N + bs, 8).store(r_bv.load().to(Float32))
        if t < RING:
            dt_t = Float32(0.0)
            if t < RING - 1:
                dt_t = dt_ring[slot * dt_ring_stride + hh * RING + Int64(t)]
            else:
                dt_t = softplus(dt[bb * dt_stride_b + hh * dt_stride_h] + dt_bias[hh * dt_bias_stride])
            s_dt[t] = dt_t
        r_c = _vec(C, (bb * G + g) * N + n0, 8).load().to(Float32)
        cute.arch.sync_threads()

        # pre_k = dt_0 + .. + dt_k in order; w_j = dt_j exp(A (pre_15 - pre_j)).
        a_h = A[hh * a_stride]
        acc = Float32(0.0)
        pre_t = Float32(0.0)
        for k in cutlass.range_constexpr(RING):
            acc = acc + s_dt[k]
            pre_t = sel(t == k, acc, pre_t)
        if t < RING:
            s_w[t] = s_dt[t] * cute.math.exp(a_h * (acc - pre_t))
        decay = cute.math.exp(a_h * acc)
        cute.arch.sync_threads()

        # S in registers: s[i][k] for row row0 + 32 i, n = n0 + k.
        s = []
        for i in cutlass.range_constexpr(ROWS):
            ck = r_ck[i].bitcast(Float16).to(Float32)
            row = []
            for k in cutlass.range_constexpr(8):
                row.append(decay * ck[k])
            s.append(row)
        for j in cutlass.range_constexpr(RING):
            b_j = _vec(s_b.iterator, j * N + n0, 8).load()
            w_j = s_w[j]
            for i in cutlass.range_constexpr(ROWS):
                wx = w_j * s_x[j * P + i * ROW_STEP + row0]
                for k in cutlass.range_constexpr(8):
                    s[i][k] = s[i][k] + wx * b_j[k]

        # Per row: y = S . C + D x from the unrounded S, and the amax of the row's block
        # (this thread's 8 values and its neighbour lane's 8), from the bits.
        r_state = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        bamax = []
        for i in cutlass.range_constexpr(ROWS):
            p = i * ROW_STEP + row0
            pp = Int64(p)
            dot = Float32(0.0)
            amax = Int32(0)
            for k in cutlass.range_constexpr(8):
                dot = dot + s[i][k] * r_c[k]
                amax = cutlass.max(amax, s[i][k].bitcast(Int32) & Int32(0x7FFFFFFF))
            dot = _xor_reduce(dot, 16, lambda a, c: a + c)
            bamax.append(cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 1)))
            if q == i:
                y = dot + D[hh * d_stride_h + pp * d_stride_p] * s_x[(RING - 1) * P + p]
                out[(bb * H + hh) * P + pp] = BFloat16(y)
            if cutlass.const_expr(self.debug):
                for k in cutlass.range_constexpr(8):
                    r_state[k] = s[i][k]
                _vec(state_out, ((bb * H + hh) * P + pp) * N + n0, 8).store(r_state.load())

        # Block scales of both rows in one e4m3x2 conversion (nearest, satfinite):
        # s = e4m3((bamax * 2**-E) * fp32(1/6)), then r = 1 / (e4m3(s) * 2**E).
        t0 = bits_nvfp4.block_scale_input(bamax[0].bitcast(Float32), ig_scale, DSL_OPS)
        t1 = bits_nvfp4.block_scale_input(bamax[1].bitcast(Float32), ig_scale, DSL_OPS)
        s_pair = self.e4m3x2_rn(t0, t1)
        s_codes = [s_pair & Uint32(0xFF), (s_pair >> 8) & Uint32(0xFF)]

        r_ck_out = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        rc_head = slot * read_stride16 * 4 + hh * (P * WORDS_PER_ROW)  # packed-code words of this head
        sc_head = slot * scale_stride + hh * (P * BLOCKS)
        for i in cutlass.range_constexpr(ROWS):
            p = i * ROW_STEP + row0
            pp = Int64(p)
            # Read copy: e2m1(x * r), 8 codes = one word per thread and row; the even
            # lane of the block stores its scale byte.
            r = bits_nvfp4.block_recip(s_codes[i], g_scale, DSL_OPS)
            scaled = []
            for k in cutlass.range_constexpr(8):
                scaled.append(s[i][k] * r)
            read[rc_head + pp * WORDS_PER_ROW + q] = self.e2m1x8_rn(scaled)
            if q % 2 == 0:
                scales[sc_head + pp * BLOCKS + q // 2] = Uint8(s_codes[i])

            # Checkpoint: FP16 pairs with stochastic rounding; one hash word per pair,
            # word index ((h * 64 + p) * 128 + n) / 2 (as the FP8 flush).
            w0 = Uint32((hh * P + pp) * (N // 2)) + Uint32(q * 4)
            for m in cutlass.range_constexpr(4):
                word = bits.random_word(key, w0 + Uint32(m))
                r_ck_out[m] = self.fp16x2_sr(s[i][2 * m], s[i][2 * m + 1], word)
            _vec(ck_words, ck_head_w + pp * (N // 2) + q * 4, 4).store(r_ck_out.load())

        # Group amax: this thread's two blocks, the warp, then the CTA's warps in shared
        # memory; one atomic max per CTA into the accumulator half (old parity).
        tmax = _xor_reduce(cutlass.max(bamax[0], bamax[1]), 32, cutlass.max)
        if t % 32 == 0:
            s_amax[t // 32] = tmax
        # Also: the next flushing row of this CTA restages the shared buffers.
        cute.arch.sync_threads()
        if t == 0:
            cta_max = s_amax[0]
            for w in cutlass.range_constexpr(1, WARPS):
                cta_max = cutlass.max(cta_max, s_amax[w])
            cute.arch.atomic_max(meta_bits + (meta_row + old), cta_max, sem="relaxed", scope="gpu")


class FlushNvfp4Sm90(FlushNvfp4):
    """sm_90a: software stochastic rounding, e4m3 and e2m1 encodes (integer steps of
    quant/minifloat.py; the first two are the FP8 flush's, from bits.py)."""

    arch = "sm_90a"

    def fp16x2_sr(self, lo, hi, word):
        return bits.fp16x2_sr_soft(lo, hi, word)

    def e4m3x2_rn(self, lo, hi):
        return bits.e4m3x2_rn_soft(lo, hi)

    def e2m1x8_rn(self, vals):
        return bits_nvfp4.e2m1x8_rn_soft(vals)


class FlushNvfp4Sm100(FlushNvfp4):
    """sm_100a / sm_103a: `cvt.rs.satfinite.f16x2.f32`, `cvt.rn.satfinite.e4m3x2.f32` and
    `cvt.rn.satfinite.e2m1x2.f32`; bit-identical to FlushNvfp4Sm90 by construction."""

    arch = "sm_100a"

    def fp16x2_sr(self, lo, hi, word):
        return bits.fp16x2_sr_hw(lo, hi, word)

    def e4m3x2_rn(self, lo, hi):
        return bits.e4m3x2_rn_hw(lo, hi)

    def e2m1x8_rn(self, vals):
        return bits_nvfp4.e2m1x8_rn_hw(vals)


__all__ = ["FlushNvfp4", "FlushNvfp4Sm90", "FlushNvfp4Sm100"]
