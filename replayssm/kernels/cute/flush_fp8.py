"""Flush kernel for the FP8 read copy (CuTe DSL, SIMT).

For every batch row whose plan says flush (ring index 15, docs/format.md section 5):

    S = exp(A pre_15) float(checkpoint) + sum_{j=0..15} dt_j exp(A (pre_15 - pre_j)) x_j (x) B_j

in FP32 (entries 0..14 from the rings, 15 the current token), y = S . C + D x from the
unrounded S, then the checkpoint is rewritten as FP16 with stochastic rounding (the hash
bits of format.md section 6) and the read copy and its per-row power-of-two scales are
re-derived from S (format.md section 3, nearest-even e4m3, satfinite). Rows that do not
flush return at once. The ring is not written: the next step starts a period at entry 0.

Grid (heads, ceil(batch / ROWS_PER_CTA)), THREADS = 512 threads: a CTA reads the flush
flags of its ROWS_PER_CTA = 8 batch rows with one ballot and folds each flushing row in
turn. Thread t owns n = 8 (t % 16) .. + 7 of state rows t // 16 + 32 i (i = 0, 1): 16
values of S in registers across the 16 entries. The 16 lanes of a row finish its dot with
C and its amax with four xor shuffles; each thread then writes 16 bytes of checkpoint and
8 bytes of read copy per row.

Only the two conversions differ between targets: `FlushFp8Sm90` (software stochastic
rounding, integer steps of quant/minifloat.py; e4m3 by the `cvt.rn.satfinite.e4m3x2.f32`
Hopper also has, or in software with REPLAYSSM_SM90_E4M3=soft) and `FlushFp8Sm100`
(`cvt.rs.satfinite.f16x2.f32` fed the same hash words, `cvt.rn.satfinite.e4m3x2.f32`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cuda.bindings import driver as cuda_driver
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits
from .bits import sel, softplus

THREADS = 512
P, N, RING = 64, 128, 16
ROWS = 2  # state rows per thread: row0 + 32 i
ROW_STEP = THREADS // 16
# Batch rows per CTA: the grid is (heads, ceil(batch / ROWS_PER_CTA)); a CTA reads its
# rows' flush flags at once (one ballot) and flushes the marked rows one after another.
# With ~1/16 of the rows flushing per step most CTAs get about one row, instead of
# batch x heads CTAs of which 15/16 would exit at once.
ROWS_PER_CTA = 8
# Two CTAs per SM (at most 64 registers a thread): a desynchronized batch has about one
# flushing row per CTA, so per-SM concurrency comes from resident CTAs.
MIN_CTAS_PER_SM = 2
# amax <= 448 * scale: E = ceil(log2(amax / 448)), 448 = 1.75 * 2**8 (formats.fp8_row_scale).
FP8_MANT_LIMIT, FP8_E_OFF = 0x600000, 8


def _vec(ptr, offset, n: int):
    return cute.make_tensor(ptr + offset, cute.make_layout(n))


def _xor_reduce(v, width: int, op):
    off = 1
    while off < width:
        v = op(v, cute.arch.shuffle_sync_bfly(v, off))
        off *= 2
    return v


class FlushFp8:
    """Flush for one geometry (heads, groups); subclasses supply the two conversions.

    `debug=True` compiles a variant that also writes the FP32 state S of every flushed
    row to an extra [batch, H, 64, 128] buffer (tests compare the quantized outputs with
    the reference quantizers applied to it)."""

    name = "flush_fp8"
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

    @cute.jit
    def __call__(
        self,
        ckpt: Pointer,  # f16 [S, H, 64, 128], 16-byte aligned
        read: Pointer,  # fp8 [S, H, 64, 128] as uint32 words, 16-byte aligned
        scales: Pointer,  # f32 [S, H, 64]
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
        state_out: Pointer,  # f32 [batch, H, 64, 128] (debug variant only), 16-byte aligned
        ckpt_stride16: Int64,
        read_stride16: Int64,
        scale_stride: Int64,
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
            ckpt, read, scales, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
            plan_slot, plan_flush, plan_key, state_out,
            ckpt_stride16, read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
            dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
            batch,
        ).launch(
            grid=[self.heads, (batch + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1],
            block=[THREADS, 1, 1],
            min_blocks_per_mp=MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1,  # the driver's default (and no device query at compile time)
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        ckpt: Pointer,
        read: Pointer,
        scales: Pointer,
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
        state_out: Pointer,
        ckpt_stride16: Int64,
        read_stride16: Int64,
        scale_stride: Int64,
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
        s_mask = smem.allocate_tensor(Int32, cute.make_layout(1), byte_alignment=4)

        # Which of this CTA's batch rows flush: one load per lane of warp 0, one ballot.
        if t < 32:
            b_t = by * ROWS_PER_CTA + t
            f = Int32(0)
            if t < ROWS_PER_CTA:
                if b_t < batch:
                    f = Int32(plan_flush[Int64(b_t)])
            m = cute.arch.vote_ballot_sync(f != Int32(0))
            if t == 0:
                s_mask[0] = Int32(m)
        cute.arch.sync_threads()
        mask = s_mask[0]

        hh = Int64(h)
        g = hh // HPG
        q = t % 16
        n0 = q * 8
        row0 = t // 16  # this thread's rows: row0 + 32 i
        ck_words = cute.recast_ptr(ckpt, dtype=Uint32)  # FP16 pairs, the unit of the stores
        for rr in range(ROWS_PER_CTA):
            if ((mask >> rr) & Int32(1)) != Int32(0):
                bb = Int64(by * ROWS_PER_CTA + rr)
                self.flush_row(
                    t, q, n0, row0, hh, g, bb, H, G, s_x, s_b, s_dt, s_w, ck_words,
                    read, scales, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
                    plan_slot, plan_key, state_out,
                    ckpt_stride16, read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
                    dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
                )

    @cute.jit
    def flush_row(
        self, t, q, n0, row0, hh, g, bb, H: cutlass.Constexpr, G: cutlass.Constexpr, s_x, s_b, s_dt, s_w, ck_words,
        read, scales, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
        plan_slot, plan_key, state_out,
        ckpt_stride16, read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
        dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
    ):
        """One flushing batch row of head hh (the whole CTA)."""
        slot = plan_slot[bb]
        key = Uint32(plan_key[bb])

        # Checkpoint first (the largest read), in flight during the staging below.
        ck_head_w = slot * ckpt_stride16 * 4 + hh * (P * N // 2)
        ck_thread_w = ck_head_w + Int64(row0 * (N // 2) + q * 4)
        r_ck = []
        for i in cutlass.range_constexpr(ROWS):
            r_ck.append(_vec(ck_words, ck_thread_w + i * ROW_STEP * (N // 2), 4).load())

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

        r_state = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        r_ck_out = cute.make_rmem_tensor(cute.make_layout(4), Uint32)
        r_rc_out = cute.make_rmem_tensor(cute.make_layout(2), Uint32)
        rc_head = slot * read_stride16 * 4 + hh * (P * N // 4)  # read-copy words of this head
        for i in cutlass.range_constexpr(ROWS):
            p = i * ROW_STEP + row0
            pp = Int64(p)
            # y = S . C + D x, from the unrounded S; the row's amax from the bits.
            dot = Float32(0.0)
            amax = Int32(0)
            for k in cutlass.range_constexpr(8):
                dot = dot + s[i][k] * r_c[k]
                amax = cutlass.max(amax, s[i][k].bitcast(Int32) & Int32(0x7FFFFFFF))
            dot = _xor_reduce(dot, 16, lambda a, c: a + c)
            amax = _xor_reduce(amax, 16, cutlass.max)
            if q == i:
                y = dot + D[hh * d_stride_h + pp * d_stride_p] * s_x[(RING - 1) * P + p]
                out[(bb * H + hh) * P + pp] = BFloat16(y)
            if cutlass.const_expr(self.debug):
                for k in cutlass.range_constexpr(8):
                    r_state[k] = s[i][k]
                _vec(state_out, ((bb * H + hh) * P + pp) * N + n0, 8).store(r_state.load())

            # Read copy: codes of S * 2**-E, scale 2**E (exact power-of-two products).
            e = bits.pow2_exponent_above(amax, FP8_MANT_LIMIT, FP8_E_OFF)
            inv = bits.exp2_int(-e)
            if q == 0:
                scales[slot * scale_stride + hh * P + pp] = bits.exp2_int(e)
            for m in cutlass.range_constexpr(2):
                lo = self.e4m3x2_rn(s[i][4 * m] * inv, s[i][4 * m + 1] * inv)
                hi = self.e4m3x2_rn(s[i][4 * m + 2] * inv, s[i][4 * m + 3] * inv)
                r_rc_out[m] = lo | (hi << 16)
            _vec(read, rc_head + pp * (N // 4) + q * 2, 2).store(r_rc_out.load())

            # Checkpoint: FP16 pairs with stochastic rounding; one hash word per pair,
            # word index ((h * 64 + p) * 128 + n) / 2.
            w0 = Uint32((hh * P + pp) * (N // 2)) + Uint32(q * 4)
            for m in cutlass.range_constexpr(4):
                word = bits.random_word(key, w0 + Uint32(m))
                r_ck_out[m] = self.fp16x2_sr(s[i][2 * m], s[i][2 * m + 1], word)
            _vec(ck_words, ck_head_w + pp * (N // 2) + q * 4, 4).store(r_ck_out.load())
        # The next flushing row of this CTA restages the shared buffers.
        cute.arch.sync_threads()


class FlushFp8Sm90(FlushFp8):
    """sm_90a: software stochastic rounding (Hopper has no cvt.rs). The read copy's e4m3
    encode is software too, or with `hw_e4m3=True` the `cvt.rn.satfinite.e4m3x2.f32`
    the sm_100a kernels use (Hopper has it: sm_89+), which lets an H200 check that
    instruction against the reference bit for bit."""

    arch = "sm_90a"

    def __init__(self, heads: int, groups: int, *, debug: bool = False, hw_e4m3: bool = False) -> None:
        super().__init__(heads, groups, debug=debug)
        self.hw_e4m3 = hw_e4m3

    def fp16x2_sr(self, lo, hi, word):
        return bits.fp16x2_sr_soft(lo, hi, word)

    def e4m3x2_rn(self, lo, hi):
        if self.hw_e4m3:
            return bits.e4m3x2_rn_hw(lo, hi)
        return bits.e4m3x2_rn_soft(lo, hi)


class FlushFp8Sm100(FlushFp8):
    """sm_100a / sm_103a: `cvt.rs.satfinite.f16x2.f32` with the same hash words and
    `cvt.rn.satfinite.e4m3x2.f32`; bit-identical to FlushFp8Sm90 by construction."""

    arch = "sm_100a"

    def fp16x2_sr(self, lo, hi, word):
        return bits.fp16x2_sr_hw(lo, hi, word)

    def e4m3x2_rn(self, lo, hi):
        return bits.e4m3x2_rn_hw(lo, hi)


__all__ = ["FlushFp8", "FlushFp8Sm90", "FlushFp8Sm100"]
