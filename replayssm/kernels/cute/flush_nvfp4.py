"""Flush kernel for the NVFP4 read copy (CuTe DSL, tensor-core fold).

The FP8 flush (flush_fp8.py) with the NVFP4 read copy: for every batch row the plan
marks flush, fold the 16 tokens into the FP32 state S on the tensor cores, y = S . C + D x
from the unrounded S, the FP16 checkpoint with stochastic rounding (bit for bit the FP8
kernel's: the same methods, inherited), then

- the NVFP4 copy of S, exactly `formats.nvfp4_encode(S, A_live)` (format.md section 3),
  with A_live = meta[slot, group, 1 - old_parity] (the prepare kernel has already set
  parity[slot] = 1 - old_parity and zeroed meta[slot, group, old_parity]);
- the group amax of S, max-accumulated into meta[slot, group, old_parity] with an atomic
  max on the FP32 bits as int32 (non-negative values order like their bits; max is
  order-independent, so every run writes the same bits).

Why this is race-free (format.md section 4): the CTAs of one (slot, group) (two per head)
read only the half 1 - old and write only the half old; the reset of `old` and the parity
flip happened in the prepare launch before this one on the same stream, and the non-flush
launch of the step touches only non-flushing slots.

Thread map: the FP8 flush's (two CTAs of 4 warps per (row, head); lane q of a row quad
holds 16 consecutive columns 64 (w // 2) + 16 q .. + 15 of two rows), so a lane holds
one whole NVFP4 block of each row: its amax needs no shuffle, its 16 codes are two words
(one 8-byte store) and the lane writes the block's scale byte. (Sessions 3-13's 8-warp
map gave a lane 8 columns, half a block: one xor shuffle for its amax, the even lane
wrote the scale.) The two rows' block scales go through one e4m3x2 conversion.

Targets differ in three conversions: the two of the FP8 flush (FP16 stochastic rounding;
the e4m3 encode, here of the block scales, the e4m3x2 `cvt` on every target unless
$REPLAYSSM_SM90_E4M3=soft asks sm_90a for integer steps) and the e2m1 encode
(software integer steps on sm_90a, `cvt.rn.satfinite.e2m1x2.f32` on sm_100a / sm_103a):
identical codes for identical inputs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cuda.bindings import driver as cuda_driver
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits, bits_nvfp4
from .bits_nvfp4 import DSL_OPS
from .flush_fp8 import MIN_CTAS_PER_SM, M_SPLIT, NT, THREADS, WARPS, FlushFp8, FlushFp8Sm90, N, P, _vec_a, _xor_reduce

ROWS = 2  # state rows per thread
WORDS_PER_ROW = N // 8  # packed e2m1 codes of one state row, in 32-bit words
BLOCKS = N // 16  # block scales per state row


class FlushNvfp4(FlushFp8):
    """NVFP4 flush for one geometry (heads, groups); subclasses supply the conversions.

    `debug=True` also writes the FP32 state S of every flushed row to an extra
    [batch, H, 64, 128] buffer, as the FP8 debug variant does."""

    name = "flush_nvfp4"
    # flush_columns: 10 CTA columns on the H200 at 16 heads (FlushFp8.ctas_per_sm), 3 at
    # 64 heads. Session 9, with the non-flush kernel at 5 CTAs an SM, us per step at batch
    # 256 / 1024, two runs each: 8 columns 23.13 / 70.68, 23.11 / 70.57; 10: 22.62 / 70.60,
    # 22.62 / 70.41; 12: 22.39 / 70.37, 22.38 / 70.42. Session 12, project benchmark, 16
    # heads / 2 groups, alternated twice: 10 columns (2.5) 20.66 / 67.69, 20.65 / 67.69;
    # 12 (3.0) 21.00 / 68.08, 20.97 / 68.22; 14 (3.5) 20.51 / 68.16, 20.56 / 68.36
    # (docs/perf-notes-cute.md). At 64 heads 2.5 and 3.0 give the same 3 columns.
    # Session 14, the 4-warp CTAs, project benchmark, alternated twice,
    # 16 heads / 2 groups at 256 / 1024, then 64 heads / 8 groups at 256 / 1024: 2.0 (8 /
    # 2 columns) 20.90 / 65.33, 63.75 / 233.5; 2.5 (10 / 3) 20.68 / 66.65, 64.8 / 236.1;
    # 3.0 (12 / 3) 20.15 / 66.46, 64.85 / 236.1; 3.5 (14 / 4) 20.21 / 65.86, 63.04 / 229.7.
    # Session 15, the flush launched with PDL behind prepare (launch.flush_pdl_for),
    # alternated twice, 16 heads / 2 groups: 3.5 19.66 / 64.92, 19.67 / 64.85; 4.0 (16
    # columns) 19.14 / 63.66, 19.10 / 63.65; 5.0 (one run) 19.08 / 72.91; at 64 heads 3.5
    # and 4.0 give the same 4 columns. At 4.0 the flush takes every CTA slot while it
    # runs, so the non-flush kernel mostly follows it (cta_trace.py).
    ctas_per_sm = 4.0
    stage_one_source = True  # FlushFp8.stage_one_source
    arch = ""

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
        columns: Int64,  # CTA columns of the grid (flush_columns)
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
            grid=[self.heads * M_SPLIT * cutlass.min((batch + self.rows - 1) // self.rows, Int32(columns)), 1, 1],
            block=[THREADS, 1, 1],
            min_blocks_per_mp=MIN_CTAS_PER_SM,
            preferred_smem_carveout=-1,  # the driver's choice (and no device query at compile time)
            stream=stream,
            **({"use_pdl": True} if self.pdl else {}),
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
        t, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # before the first global access
        smem = SmemAllocator()
        s_x, s_b, s_dt, s_dot, s_amax = self.shared_buffers(smem)
        s_gmax = smem.allocate_tensor(Int32, cute.make_layout(WARPS), byte_alignment=16)
        s_mask = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=4)
        s_slot = self.slot_buffer(smem)
        meta_bits = cute.recast_ptr(meta, dtype=Int32)  # the atomic max works on the bits

        def row(hh, mh, bb, slot, unit=None):
            self.flush_row_nvfp4(
                t, hh, mh, bb, slot, unit, s_x, s_b, s_dt, s_dot, s_amax, s_gmax, meta_bits,
                ckpt, read, scales, meta, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
                plan_key, plan_old, state_out,
                ckpt_stride16, read_stride16, scale_stride, meta_stride,
                x_ring_stride16, dt_ring_stride, b_ring_stride16,
                dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
            )

        self.for_each_flush_row(t, plan_flush, plan_slot, batch, s_mask, s_slot, row)  # FlushFp8's walk

    @cute.jit
    def flush_row_nvfp4(
        self, t, hh, mh, bb, slot, unit, s_x, s_b, s_dt, s_dot, s_amax, s_gmax, meta_bits,
        ckpt, read, scales, meta, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
        plan_key, plan_old, state_out,
        ckpt_stride16, read_stride16, scale_stride, meta_stride,
        x_ring_stride16, dt_ring_stride, b_ring_stride16,
        dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
    ):
        """State rows 32 mh .. + 31 of one flushing batch row of head hh (the whole CTA)."""
        _, _, rows, col0 = self.lane_geometry(t, mh)
        g = hh // self.hpg
        if cutlass.const_expr(self.trace_addr):
            stamps = self.trace_begin(bb)
        key = Uint32(plan_key[bb])
        old = Int64(Int32(plan_old[bb]) & Int32(1))  # `& 1`: stay inside the slot's meta
        # The live amax (the half the prepare kernel did not reset) -> g = 2**E.
        meta_row = slot * meta_stride + g * 2
        a_live = meta[meta_row + 1 - old].bitcast(Int32) & Int32(0x7FFFFFFF)
        e = bits.pow2_exponent_above(a_live, bits_nvfp4.NVFP4_MANT_LIMIT, bits_nvfp4.NVFP4_E_OFF)
        g_scale = bits.exp2_int(e)
        ig_scale = bits.exp2_int(-e)

        acc, r_c, ck_w, ck_head = self.fold(
            t, hh, mh, bb, slot, s_x, s_b, s_dt, ckpt, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias,
            ckpt_stride16, x_ring_stride16, dt_ring_stride, b_ring_stride16, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride,
            d_stride_h, d_stride_p,
        )
        if cutlass.const_expr(self.trace_addr):
            stamps.append(bits.clock_after(acc[0][0].bitcast(Int32)))
        self.row_partials(t, mh, acc, r_c, s_dot, s_amax, row_amax=False)
        # Block amax of row i, from the bits: this lane's 16 values, a whole block.
        bamax = []
        for i in cutlass.range_constexpr(ROWS):
            amax = Int32(0)
            for c in cutlass.range_constexpr(2 * NT):
                amax = cutlass.max(amax, acc[c // 2][2 * i + c % 2].bitcast(Int32) & Int32(0x7FFFFFFF))
            bamax.append(amax)
        cute.arch.sync_threads()
        if cutlass.const_expr(self.trace_addr):
            stamps.append(bits.clock_after(t))

        # Block scales of both rows in one e4m3x2 conversion (nearest, satfinite):
        # s = e4m3((bamax * 2**-E) * fp32(1/6)), then r = 1 / (e4m3(s) * 2**E).
        t0 = bits_nvfp4.block_scale_input(bamax[0].bitcast(Float32), ig_scale, DSL_OPS)
        t1 = bits_nvfp4.block_scale_input(bamax[1].bitcast(Float32), ig_scale, DSL_OPS)
        s_pair = self.e4m3x2_rn(t0, t1)
        s_codes = [s_pair & Uint32(0xFF), (s_pair >> 8) & Uint32(0xFF)]

        rc_w = cute.recast_ptr(read, dtype=Uint32)
        rc_head = slot * read_stride16 * 4 + hh * (P * WORDS_PER_ROW)  # packed-code words of this head
        sc_head = slot * scale_stride + hh * (P * BLOCKS)
        blk = col0 // 16
        for i in cutlass.range_constexpr(ROWS):
            p = rows[i]
            pp = Int64(p)
            self.row_output(t, mh, hh, bb, p, s_x, s_dot, s_dt, out)
            self.store_state(hh, bb, pp, col0, acc, i, state_out)
            # Read copy: e2m1(x * r), this lane's 16 codes = two words; the block's scale
            # byte.
            r = bits_nvfp4.block_recip(s_codes[i], g_scale, DSL_OPS)
            scaled = [acc[c // 2][2 * i + c % 2] * r for c in range(2 * NT)]
            r_codes = cute.make_rmem_tensor(cute.make_layout(2), Uint32)
            for k in cutlass.range_constexpr(2):
                r_codes[k] = self.e2m1x8_rn(scaled[8 * k:8 * k + 8])
            _vec_a(rc_w, rc_head + pp * WORDS_PER_ROW + Int64(col0 // 8), 2).store(r_codes.load())
            scales[sc_head + pp * BLOCKS + Int64(blk)] = Uint8(s_codes[i])
            self.store_checkpoint(hh, pp, col0, key, acc, i, ck_w, ck_head)

        # Group amax: this lane's two blocks, the warp, then the CTA's warps in shared
        # memory; one atomic max per CTA into the accumulator half (old parity).
        tmax = _xor_reduce(cutlass.max(bamax[0], bamax[1]), 32, cutlass.max)
        if t % 32 == 0:
            s_gmax[t // 32] = tmax
        # Also: the next flushing row of this CTA restages the shared buffers.
        cute.arch.sync_threads()
        if t == 0:
            cta_max = s_gmax[0]
            for w in cutlass.range_constexpr(1, WARPS):
                cta_max = cutlass.max(cta_max, s_gmax[w])
            cute.arch.atomic_max(meta_bits + (meta_row + old), cta_max, sem="relaxed", scope="gpu")
        if cutlass.const_expr(self.trace_addr):
            self.trace_end(t, stamps, unit)


class FlushNvfp4Sm90(FlushNvfp4):
    """sm_90a: the FP8 flush's fast stochastic rounding (bits.fp16x2_sr_fast), behind a
    warp-voted branch to its normal-range path (bits.fp16x2_sr_voted), and software e2m1
    encodes (integer steps of quant/minifloat.py; Hopper has no e2m1 conversion). The
    block scales' e4m3 encode is the `cvt.rn.satfinite.e4m3x2.f32` the sm_100a kernels
    use (Hopper has it: sm_89+), or software with `hw_e4m3=False` ($REPLAYSSM_SM90_E4M3,
    as for the FP8 flush). H200, project benchmark, same call, alternated twice, software
    -> cvt: 16 heads / 2 groups 20.74 -> 20.53 us at batch 256, 68.23 -> 67.26 at 1024;
    64 heads / 8 groups 67.12 -> 66.13 and 245.6 -> 241.7 (1,719 -> 1,675 static
    instructions; docs/perf-notes-cute.md, session 13)."""

    arch = "sm_90a"
    sr_voted = True

    def __init__(self, heads: int, groups: int, *, debug: bool = False, hw_e4m3: bool = True) -> None:
        super().__init__(heads, groups, debug=debug)
        self.hw_e4m3 = hw_e4m3

    def fp16x2_sr(self, lo, hi, word):
        return bits.fp16x2_sr_fast(lo, hi, word)

    e4m3x2_rn = FlushFp8Sm90.e4m3x2_rn  # the same `hw_e4m3` switch

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
