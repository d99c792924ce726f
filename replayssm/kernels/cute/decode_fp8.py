"""Non-flush decode kernel for the FP8 read copy (CuTe DSL, SIMT).

For every batch row whose plan says valid and not flush (docs/format.md section 5):

    y[p] = exp(A pre_r) scale[p] sum_n e4m3(code[p, n]) C[n]
           + sum_{j <= r} dt_j exp(A (pre_r - pre_j)) (B_j . C) x_j[p] + D[p] x[p]

with ring entries j < r and the current token as entry r, and the token's (x, processed
dt, B) stored at ring entry r. It reads the read copy, never the checkpoint, and writes
no state. Padding and flush rows return at once (the prepare kernel zeroed the outputs of
padding rows; the flush kernel owns flush rows), so both kernels launch every step and a
captured CUDA graph replays any mix of rows.

Grid (heads, batch), 128 threads. Thread t owns
- read copy: 16-byte chunks t, t + 128, t + 256, t + 384 of the head's 8 KiB, i.e. rows
  p_i = 16 i + t // 8 (i = 0..3) at n = 16 (t % 8) .. + 15: every warp load instruction
  reads 512 contiguous bytes, and the thread needs only 16 values of C;
- ring entry j = t // 8 (0..15) at the same 16 n (B_j . C partial) and x_j[8 (t % 8) ..
  + 7] (staged in shared memory): the 8 lanes of entry j finish B_j . C with three xor
  shuffles, as they do each read-copy row dot.
Entries beyond r are staged as zeros (never multiplied by poisoned memory).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float8E4M3FN, Float32, Int32, Int64
from cuda.bindings import driver as cuda_driver
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from .bits import sel, softplus, vec as _vec, xor_sum as _xor_sum

THREADS = 128
P, N, RING = 64, 128, 16
# Row stride (floats) of the staged x entries: 68 keeps 16-byte rows and puts entries
# 2k and 2k + 1 (read by the two threads of an output row) in different banks.
X_ROW = 68


class DecodeFp8:
    """Non-flush decode for one geometry (heads, groups); the same code for every arch."""

    name = "decode_fp8"
    # Programmatic dependent launch (launch.py sets it, batch 1): the kernel may start
    # while the grid before it on the stream (the prepare kernel) finishes, and waits for
    # that grid (griddepcontrol.wait) before its first memory access.
    pdl = False

    def __init__(self, heads: int, groups: int) -> None:
        self.heads, self.groups = heads, groups
        self.hpg = heads // groups

    @cute.jit
    def __call__(
        self,
        read: Pointer,  # fp8 [S, H, 64, 128] as uint32 words, 16-byte aligned
        scales: Pointer,  # f32 [S, H, 64]
        x_ring: Pointer,  # bf16 [S, H, 16, 64], 16-byte aligned
        dt_ring: Pointer,  # f32 [S, H, 16]
        b_ring: Pointer,  # bf16 [S, G, 16, 128], 16-byte aligned
        x: Pointer,  # bf16 [batch, H, 64] contiguous, 16-byte aligned
        dt: Pointer,  # f32 [batch, H] (raw dt), strided
        A: Pointer,  # f32 [H], strided
        B: Pointer,  # bf16 [batch, G, 128] contiguous, 16-byte aligned
        C: Pointer,  # bf16 [batch, G, 128] contiguous, 16-byte aligned
        D: Pointer,  # f32 [H, 64], strided
        dt_bias: Pointer,  # f32 [H], strided
        out: Pointer,  # bf16 [batch, H, 64] contiguous
        plan_valid: Pointer,  # int8 [batch]
        plan_slot: Pointer,  # int64 [batch]
        plan_ring: Pointer,  # int64 [batch]
        plan_flush: Pointer,  # int8 [batch]
        read_stride16: Int64,  # slot strides: of the 16-byte-aligned tensors in 16-byte units
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
            read, scales, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
            plan_valid, plan_slot, plan_ring, plan_flush,
            read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
            dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
        ).launch(grid=self.grid(batch), block=[self.threads, 1, 1], stream=stream, **self.launch_options())

    # Launch shape (the tensor-core variants, decode_fp8_mma.py and decode_warp.py,
    # override these and `kernel`, and share this signature).
    threads = THREADS

    def grid(self, batch):
        return [self.heads, batch, 1]

    def launch_options(self) -> dict:
        return {"use_pdl": True} if self.pdl else {}

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
    ):
        H, G, HPG = self.heads, self.groups, self.hpg
        t, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        smem = SmemAllocator()
        s_x = smem.allocate_tensor(Float32, cute.make_layout(RING * X_ROW), byte_alignment=16)
        s_dot = smem.allocate_tensor(Float32, cute.make_layout(P), byte_alignment=16)
        s_dt = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)
        s_bc = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)
        s_coef = smem.allocate_tensor(Float32, cute.make_layout(RING + 1), byte_alignment=16)

        bb = Int64(b)
        # The whole plan row at once (one memory latency, not two): 1 exactly for valid
        # rows that do not flush (flush implies valid).
        live = Int32(plan_valid[bb]) - Int32(plan_flush[bb])
        slot = plan_slot[bb]
        r = Int32(plan_ring[bb])
        if live == Int32(1):
            hh = Int64(h)
            g = hh // HPG
            lane8 = t % 8
            j = t // 8  # ring entry of this thread; also its read-copy row offset
            n0 = lane8 * 16
            p_out = t // 2  # output row of this thread (two threads a row)

            # Loads first: the read copy (the bulk of the bytes), C, then ring entry j.
            # The launcher passes the read copy as words (the tensor-core kernel's view).
            r_head = cute.recast_ptr(read, dtype=Float8E4M3FN) + (slot * read_stride16 * 16 + hh * (P * N))
            r_codes = []
            for i in cutlass.range_constexpr(4):
                r_codes.append(_vec(r_head, t * 16 + i * (THREADS * 16), 16).load())
            c_row = C + (bb * G + g) * N
            r_c = _vec(c_row, n0, 16).load().to(Float32)
            r_scale = scales[slot * scale_stride + hh * P + Int64(p_out)]
            r_d = D[hh * d_stride_h + Int64(p_out) * d_stride_p]

            # Ring entry j: zeros beyond r, the current token at r (stored into the ring).
            r_b = cute.make_rmem_tensor(cute.make_layout(16), BFloat16)
            r_b.fill(0.0)
            r_x = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            r_x.fill(0.0)
            dt_j = Float32(0.0)
            br_row = b_ring + (slot * b_ring_stride16 * 8 + (g * RING + Int64(j)) * N)
            xr_row = x_ring + (slot * x_ring_stride16 * 8 + (hh * RING + Int64(j)) * P)
            dtr = slot * dt_ring_stride + hh * RING + Int64(j)
            if j < r:
                r_b.store(_vec(br_row, n0, 16).load())
                r_x.store(_vec(xr_row, lane8 * 8, 8).load())
                dt_j = dt_ring[dtr]
            if j == r:
                cur_b = _vec(B + (bb * G + g) * N, n0, 16).load()
                r_b.store(cur_b)
                cur_x = _vec(x + (bb * H + hh) * P, lane8 * 8, 8).load()
                r_x.store(cur_x)
                dt_j = softplus(dt[bb * dt_stride_b + hh * dt_stride_h] + dt_bias[hh * dt_bias_stride])
                _vec(xr_row, lane8 * 8, 8).store(cur_x)
                if lane8 == 0:
                    dt_ring[dtr] = dt_j
                if hh % HPG == 0:
                    # B is shared by the group: one head writes it.
                    _vec(br_row, n0, 16).store(cur_b)
            _vec(s_x.iterator, j * X_ROW + lane8 * 8, 8).store(r_x.load().to(Float32))
            bc = _xor_sum((r_b.load().to(Float32) * r_c).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), 8)
            if lane8 == 0:
                s_dt[j] = dt_j
                s_bc[j] = bc

            # Read-copy row dots (unscaled): rows 16 i + j, reduced over the 8 lanes.
            for i in cutlass.range_constexpr(4):
                part = (r_codes[i].to(Float32) * r_c).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                part = _xor_sum(part, 8)
                if lane8 == i:
                    s_dot[i * 16 + j] = part
            cute.arch.sync_threads()

            # Warp 0, lanes 0..15 = entries: pre_k = dt_0 + .. + dt_k (shuffle scan),
            # w_k = dt_k exp(A (pre_r - pre_k)); coef_k = w_k (B_k . C); s_coef[16] = decay.
            if t < 32:
                k = t % 16
                dt_k = s_dt[k]
                pre = dt_k
                off = 1
                while off < RING:
                    up = cute.arch.shuffle_sync_up(pre, off)
                    pre = sel(k >= off, pre + up, pre)
                    off *= 2
                pre_r = cute.arch.shuffle_sync(pre, r)
                a_h = A[hh * a_stride]
                if t < RING:
                    s_coef[t] = dt_k * cute.math.exp(a_h * (pre_r - pre)) * s_bc[k]
                if t == RING:
                    s_coef[RING] = cute.math.exp(a_h * pre_r)
            cute.arch.sync_threads()

            # Output row p_out: two threads share the ring sum (even / odd entries).
            half = t % 2
            acc = Float32(0.0)
            for kk in cutlass.range_constexpr(RING // 2):
                e = 2 * kk + half
                acc = acc + s_coef[e] * s_x[e * X_ROW + p_out]
            acc = acc + cute.arch.shuffle_sync_bfly(acc, 1)
            if half == 0:
                y = s_coef[RING] * (r_scale * s_dot[p_out]) + acc + r_d * s_x[r * X_ROW + p_out]
                out[(bb * H + hh) * P + Int64(p_out)] = BFloat16(y)


__all__ = ["DecodeFp8"]
