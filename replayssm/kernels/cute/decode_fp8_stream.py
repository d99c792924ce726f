"""Non-flush decode for the FP8 read copy, persistent and software-pipelined (CuTe DSL).

The arithmetic and thread map of decode_fp8.py (`DecodeFp8`, whose docstring states the
formula), in CTAs that stay resident and walk their head's batch rows
b = blockIdx.y, + gridDim.y, ... so that a row's memory traffic overlaps the previous
row's arithmetic:

    plan(b + gy) loads            (issued before the row dots of b; used after them)
    row dots of b                 (registers -> shared memory; the data registers are free)
    read copy, C, scale and ring entry loads of b + gy into the same registers
    barrier, scan, barrier, outputs of b   (shared memory only, double-buffered by row
                                            parity, so two barriers a row suffice)

The loads of row b + gy stay in flight through the scan and outputs of row b and the
barriers, instead of each CTA streaming memory only at the start of its life. A thread
loads ring entry j from the ring (j < r), from the step's inputs (j = r) or not at all
(j > r: zeros), through one predicated load with a selected address.

Grid (heads, min(batch, rows_per_pass)), 128 threads: rows_per_pass = ceil(SMs x
CTAS_PER_SM / heads), so that the grid fits the GPU in one pass with room left for the
flush kernel's CTAs on its side stream.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits
from .bits import bf16x2_to_f32x2, sel, softplus
from .decode_fp8 import RING, THREADS, X_ROW, DecodeFp8, N, P, _xor_sum
from .flush_fp8 import _vec_a

# Resident CTAs of this kernel per SM (128 threads and ~64 registers each, 8 would fill
# the register file); the rest of the SM is left to the flush kernel.
CTAS_PER_SM = 6
# Streaming multiprocessors per target (H100 / H200 SXM; B200 / B300).
SMS = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}


class DecodeFp8Stream(DecodeFp8):
    """Persistent, software-pipelined variant of DecodeFp8 (same signature and results
    up to the order of the FP32 sums, which is the same: per thread, then xor shuffles)."""

    def __init__(self, heads: int, groups: int, arch: str = "sm_90a", ctas_per_sm: int = CTAS_PER_SM) -> None:
        super().__init__(heads, groups)
        self.rows_per_pass = max(1, -(-SMS.get(arch, 132) * ctas_per_sm // heads))

    def grid(self, batch):
        return [self.heads, cutlass.min(batch, Int32(self.rows_per_pass)), 1]

    @cute.kernel
    def kernel(
        self,
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
        plan_valid: Pointer,
        plan_slot: Pointer,
        plan_ring: Pointer,
        plan_flush: Pointer,
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
        _, gy, _ = cute.arch.grid_dim()
        smem = SmemAllocator()
        # Two buffers (row parity) of: staged x_j, row dots, dt_j, B_j . C, coefficients.
        s_x = smem.allocate_tensor(Float32, cute.make_layout(2 * RING * X_ROW), byte_alignment=16)
        s_dot = smem.allocate_tensor(Float32, cute.make_layout(2 * P), byte_alignment=16)
        s_dt = smem.allocate_tensor(Float32, cute.make_layout(2 * RING), byte_alignment=16)
        s_bc = smem.allocate_tensor(Float32, cute.make_layout(2 * RING), byte_alignment=16)
        s_coef = smem.allocate_tensor(Float32, cute.make_layout(2 * (RING + 1)), byte_alignment=16)

        hh = Int64(h)
        g = hh // HPG
        lane8 = t % 8
        j = t // 8  # ring entry of this thread; also its read-copy row offset
        n0 = lane8 * 16
        p_out = t // 2  # output row of this thread (two threads a row)
        r_d = D[hh * d_stride_h + Int64(p_out) * d_stride_p]
        a_h = A[hh * a_stride]
        bias = dt_bias[hh * dt_bias_stride]

        read_w = cute.recast_ptr(read, dtype=Uint32)
        c_w = cute.recast_ptr(C, dtype=Uint32)
        b_cur_w = cute.recast_ptr(B, dtype=Uint32)
        b_ring_w = cute.recast_ptr(b_ring, dtype=Uint32)
        x_cur_w = cute.recast_ptr(x, dtype=Uint32)
        x_ring_w = cute.recast_ptr(x_ring, dtype=Uint32)

        # Plan and data registers of the row in hand (rmem tensors: written in one
        # iteration, read in the next). plan: live, ring index r; slot apart (Int64).
        r_plan = cute.make_rmem_tensor(cute.make_layout(2), Int32)
        r_slot = cute.make_rmem_tensor(cute.make_layout(1), Int64)
        r_codes = cute.make_rmem_tensor(cute.make_layout(16), Uint32)  # 4 x 16 bytes
        r_cw = cute.make_rmem_tensor(cute.make_layout(8), Uint32)  # C[n0 .. n0 + 15]
        r_bw = cute.make_rmem_tensor(cute.make_layout(8), Uint32)  # B_j[n0 .. n0 + 15]
        r_xw = cute.make_rmem_tensor(cute.make_layout(4), Uint32)  # x_j[8 lane8 .. + 7]
        r_sc = cute.make_rmem_tensor(cute.make_layout(2), Float32)  # scale, raw dt_j

        live0, r0, slot0 = self.load_plan(by, batch, plan_valid, plan_flush, plan_ring, plan_slot)
        r_plan[0] = live0
        r_plan[1] = r0
        r_slot[0] = slot0
        self.load_row(
            t, hh, by, live0, r0, slot0, read_w, c_w, b_cur_w, b_ring_w, x_cur_w, x_ring_w, scales, dt, dt_ring,
            read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16, dt_stride_b, dt_stride_h,
            r_codes, r_cw, r_bw, r_xw, r_sc,
        )

        n_rows = (batch - by + gy - 1) // gy
        for k in range(n_rows):
            b = by + k * gy
            bb = Int64(b)
            buf = k % 2
            live = r_plan[0]
            r = r_plan[1]
            slot = r_slot[0]
            # The next row's plan: in flight during this row's dots.
            live_n, r_n, slot_n = self.load_plan(b + gy, batch, plan_valid, plan_flush, plan_ring, plan_slot)

            xb = buf * (RING * X_ROW)
            if live == Int32(1):
                # Ring entry j: the current token (j = r) is written to the ring.
                dt_j = r_sc[1]
                if j == r:
                    dt_j = softplus(dt_j + bias)
                    xr = x_ring_w + (slot * x_ring_stride16 * 4 + (hh * RING + Int64(j)) * (P // 2) + Int64(lane8 * 4))
                    _vec_a(xr, 0, 4).store(r_xw.load())
                    if lane8 == 0:
                        dt_ring[slot * dt_ring_stride + hh * RING + Int64(j)] = dt_j
                    if hh % HPG == 0:
                        # B is shared by the group: one head writes it.
                        br = b_ring_w + (slot * b_ring_stride16 * 4 + (g * RING + Int64(j)) * (N // 2) + Int64(n0 // 2))
                        _vec_a(br, 0, 4).store(_vec_a(r_bw.iterator, 0, 4).load())
                        _vec_a(br, 4, 4).store(_vec_a(r_bw.iterator, 4, 4).load())
                r_xf = cute.make_rmem_tensor(cute.make_layout(8), Float32)
                for k2 in cutlass.range_constexpr(4):
                    pair = bf16x2_to_f32x2(r_xw[k2])
                    r_xf[2 * k2] = pair[0]
                    r_xf[2 * k2 + 1] = pair[1]
                for k2 in cutlass.range_constexpr(2):
                    _vec_a(s_x.iterator, xb + j * X_ROW + lane8 * 8 + 4 * k2, 4).store(_vec_a(r_xf.iterator, 4 * k2, 4).load())
                r_cf = cute.make_rmem_tensor(cute.make_layout(16), Float32)
                bc = Float32(0.0)
                for k2 in cutlass.range_constexpr(8):
                    cp = bf16x2_to_f32x2(r_cw[k2])
                    bp = bf16x2_to_f32x2(r_bw[k2])
                    r_cf[2 * k2] = cp[0]
                    r_cf[2 * k2 + 1] = cp[1]
                    bc = bc + bp[0] * cp[0]
                    bc = bc + bp[1] * cp[1]
                bc = _xor_sum(bc, 8)
                if lane8 == 0:
                    s_dt[buf * RING + j] = dt_j
                    s_bc[buf * RING + j] = bc
                # Read-copy row dots (unscaled): rows 16 i + j, reduced over the 8 lanes.
                for i in cutlass.range_constexpr(4):
                    part = Float32(0.0)
                    for k2 in cutlass.range_constexpr(4):
                        w = r_codes[4 * i + k2]
                        lo = bits.e4m3x2_to_f32x2(w & Uint32(0xFFFF))
                        hi = bits.e4m3x2_to_f32x2(w >> 16)
                        part = part + lo[0] * r_cf[4 * k2] + lo[1] * r_cf[4 * k2 + 1]
                        part = part + hi[0] * r_cf[4 * k2 + 2] + hi[1] * r_cf[4 * k2 + 3]
                    part = _xor_sum(part, 8)
                    if lane8 == i:
                        s_dot[buf * P + i * 16 + j] = part
            scale = r_sc[0]

            # The next row's loads, in flight through this row's scan and outputs.
            r_plan[0] = live_n
            r_plan[1] = r_n
            r_slot[0] = slot_n
            self.load_row(
                t, hh, b + gy, live_n, r_n, slot_n, read_w, c_w, b_cur_w, b_ring_w, x_cur_w, x_ring_w, scales, dt, dt_ring,
                read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16, dt_stride_b, dt_stride_h,
                r_codes, r_cw, r_bw, r_xw, r_sc,
            )
            cute.arch.sync_threads()

            if live == Int32(1):
                # Warp 0, lanes 0..15 = entries: pre_k = dt_0 + .. + dt_k (shuffle scan),
                # w_k = dt_k exp(A (pre_r - pre_k)); coef_k = w_k (B_k . C); coef_16 = decay.
                if t < 32:
                    kk = t % 16
                    dt_k = s_dt[buf * RING + kk]
                    pre = dt_k
                    off = 1
                    while off < RING:
                        up = cute.arch.shuffle_sync_up(pre, off)
                        pre = sel(kk >= off, pre + up, pre)
                        off *= 2
                    pre_r = cute.arch.shuffle_sync(pre, r)
                    if t < RING:
                        s_coef[buf * (RING + 1) + t] = dt_k * cute.math.exp(a_h * (pre_r - pre)) * s_bc[buf * RING + kk]
                    if t == RING:
                        s_coef[buf * (RING + 1) + RING] = cute.math.exp(a_h * pre_r)
            cute.arch.sync_threads()

            if live == Int32(1):
                # Output row p_out: two threads share the ring sum (even / odd entries).
                half = t % 2
                acc = Float32(0.0)
                for k2 in cutlass.range_constexpr(RING // 2):
                    e = 2 * k2 + half
                    acc = acc + s_coef[buf * (RING + 1) + e] * s_x[xb + e * X_ROW + p_out]
                acc = acc + cute.arch.shuffle_sync_bfly(acc, 1)
                if half == 0:
                    y = s_coef[buf * (RING + 1) + RING] * (scale * s_dot[buf * P + p_out]) + acc + r_d * s_x[xb + r * X_ROW + p_out]
                    out[(bb * H + hh) * P + Int64(p_out)] = BFloat16(y)



    @cute.jit
    def load_plan(self, b, batch, plan_valid, plan_flush, plan_ring, plan_slot):
        """(live, r, slot) of batch row b; live = 0 past the batch (the loads then
        read the last row instead, no branch)."""
        bb = Int64(cutlass.min(b, batch - 1))
        live = Int32(plan_valid[bb]) - Int32(plan_flush[bb])
        live = sel(b < batch, live, Int32(0))
        return live, Int32(plan_ring[bb]), plan_slot[bb]



    @cute.jit
    def load_row(
        self, t, hh, b, live, r, slot, read_w, c_w, b_cur_w, b_ring_w, x_cur_w, x_ring_w, scales, dt, dt_ring,
        read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16, dt_stride_b, dt_stride_h,
        r_codes, r_cw, r_bw, r_xw, r_sc,
    ):
        """Issue the loads of row b into the data registers (zeros where not live)."""
        H, G = self.heads, self.groups
        g = hh // self.hpg
        lane8 = t % 8
        j = t // 8
        n0 = lane8 * 16
        p_out = t // 2
        bb = Int64(b)
        on = sel(live == Int32(1), Int32(1), Int32(0))
        rw = slot * read_stride16 * 4 + hh * (P * N // 4) + Int64(t * 4)
        for i in cutlass.range_constexpr(4):
            v = bits.ld_global_v4_u32_if((read_w + (rw + i * (THREADS * 4))).toint(), on)
            for k in cutlass.range_constexpr(4):
                r_codes[4 * i + k] = v[k]
        cw = (bb * G + g) * (N // 2) + Int64(n0 // 2)
        for i in cutlass.range_constexpr(2):
            v = bits.ld_global_v4_u32_if((c_w + (cw + 4 * i)).toint(), on)
            for k in cutlass.range_constexpr(4):
                r_cw[4 * i + k] = v[k]
        r_sc[0] = bits.ld_global_u32_if((scales + (slot * scale_stride + hh * P + Int64(p_out))).toint(), on).bitcast(Float32)
        # Ring entry j: from the ring (j < r), the step's inputs (j = r), else zeros.
        on_j = sel(j <= r, on, Int32(0))
        ring = j < r
        jj = Int64(j)
        b_addr = sel(
            ring,
            (b_ring_w + (slot * b_ring_stride16 * 4 + (g * RING + jj) * (N // 2) + Int64(n0 // 2))).toint(),
            (b_cur_w + ((bb * G + g) * (N // 2) + Int64(n0 // 2))).toint(),
        )
        for i in cutlass.range_constexpr(2):
            v = bits.ld_global_v4_u32_if(b_addr + 16 * i, on_j)
            for k in cutlass.range_constexpr(4):
                r_bw[4 * i + k] = v[k]
        x_addr = sel(
            ring,
            (x_ring_w + (slot * x_ring_stride16 * 4 + (hh * RING + jj) * (P // 2) + Int64(lane8 * 4))).toint(),
            (x_cur_w + ((bb * H + hh) * (P // 2) + Int64(lane8 * 4))).toint(),
        )
        v = bits.ld_global_v4_u32_if(x_addr, on_j)
        for k in cutlass.range_constexpr(4):
            r_xw[k] = v[k]
        dt_addr = sel(
            ring,
            (dt_ring + (slot * dt_ring_stride + hh * RING + jj)).toint(),
            (dt + (bb * dt_stride_b + hh * dt_stride_h)).toint(),
        )
        r_sc[1] = bits.ld_global_u32_if(dt_addr, sel(lane8 == 0, on_j, Int32(0))).bitcast(Float32)


__all__ = ["DecodeFp8Stream", "CTAS_PER_SM", "SMS"]
