"""Non-flush decode kernel for the NVFP4 read copy (CuTe DSL, SIMT).

The FP8 non-flush kernel (decode_fp8.py) with the NVFP4 read copy in place of the FP8 one
(docs/format.md sections 3 and 5): for every batch row the plan marks valid and not flush,

    y[p] = exp(A pre_r) g sum_b e4m3(s[p, b]) sum_{n in block b} e2m1(code[p, n]) C[n]
           + sum_{j <= r} dt_j exp(A (pre_r - pre_j)) (B_j . C) x_j[p] + D[p] x[p],

g = 2**E the live second-level scale of the (slot, group): E from meta[slot, group,
parity[slot]] (format.md section 4), and the token's (x, processed dt, B) stored at ring
entry r. Padding and flush rows return at once, as in the FP8 kernel.

Grid (heads, batch), 128 threads, the FP8 kernel's thread map: thread t owns n = 16 (t % 8)
.. + 15 of rows p_i = 16 i + t // 8 (i = 0..3) and ring entry t // 8. Those 16 elements of
a row are exactly one NVFP4 block: 8 bytes of codes (one 8-byte load; a warp load reads
256 contiguous bytes) and one block-scale byte per row.

Only the e2m1 decode differs between targets: `DecodeNvfp4Sm90` builds f16 halves from
the code bits (bits_nvfp4.e2m1x8_f16x2_soft: each code moved to an e4m3 code of value *
2**-6, then `cvt.rn.f16x2.e4m3x2`; the factor folded into the block scale),
`DecodeNvfp4Sm100` uses `cvt.rn.f16x2.e2m1x2`. Both decode exactly, so the two differ at
most in the FP32 summation order of a row's 16 products.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32, Int64, Uint32
from cuda.bindings import driver as cuda_driver
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits, bits_nvfp4
from .bits import sel, softplus
from .decode_fp8 import N, P, RING, _vec, _xor_sum

THREADS = 128  # the FP8 non-flush kernel's block and thread map (see above)

ROWS = 4  # read-copy rows per thread
WORDS_PER_HEAD = P * N // 8  # packed codes of one head, in 32-bit words
BLOCKS = N // 16  # block scales per state row


class DecodeNvfp4:
    """Non-flush decode with the NVFP4 read copy, for one geometry (heads, groups);
    subclasses supply the e2m1 decode of their target."""

    name = "decode_nvfp4"
    arch = ""
    pdl = False  # as DecodeFp8.pdl

    def __init__(self, heads: int, groups: int) -> None:
        self.heads, self.groups = heads, groups
        self.hpg = heads // groups
    # Element order of the 8 f16 halves `e2m1x8_f16x2` returns, and the factor that
    # turns them into e2m1 values.
    decode_order = bits_nvfp4.HW_DECODE_ORDER
    decode_factor = 1.0

    def e2m1x8_f16x2(self, w: Uint32) -> list:
        raise NotImplementedError

    # Launch shape (the warp-per-head variant, decode_warp.py, overrides these and
    # `kernel`, and shares this signature).
    threads = THREADS

    def grid(self, batch):
        return [self.heads, batch, 1]

    def launch_options(self) -> dict:
        return {"use_pdl": self.pdl}

    @cute.jit
    def __call__(
        self,
        read: Pointer,  # uint8 [S, H, 64, 64] as uint32 words, 16-byte aligned
        scales: Pointer,  # e4m3 bytes [S, H, 64, 8]
        meta: Pointer,  # f32 [S, G, 2]
        parity: Pointer,  # int32 [S]
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
        meta_stride: Int64,
        parity_stride: Int64,
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
            read, scales, meta, parity, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
            plan_valid, plan_slot, plan_ring, plan_flush,
            read_stride16, scale_stride, meta_stride, parity_stride,
            x_ring_stride16, dt_ring_stride, b_ring_stride16,
            dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
        ).launch(grid=self.grid(batch), block=[self.threads, 1, 1], stream=stream, **self.launch_options())

    @cute.kernel
    def kernel(
        self,
        read: Pointer,
        scales: Pointer,
        meta: Pointer,
        parity: Pointer,
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
        meta_stride: Int64,
        parity_stride: Int64,
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
            cute.arch.griddepcontrol_wait()  # as DecodeFp8.pdl
        smem = SmemAllocator()
        s_x = smem.allocate_tensor(BFloat16, cute.make_layout(RING * P), byte_alignment=16)
        s_dt = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)
        s_coef = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)

        bb = Int64(b)
        # The whole plan row at once (one memory latency, as the FP8 kernel): 1 exactly
        # for valid rows that do not flush (flush implies valid).
        live = Int32(plan_valid[bb]) - Int32(plan_flush[bb])
        slot = plan_slot[bb]
        r = Int32(plan_ring[bb])
        if live == Int32(1):
            hh = Int64(h)
            g = hh // HPG
            lane8 = t % 8
            j = t // 8  # ring entry of this thread; also the read-copy row offset
            n0 = lane8 * 16

            # Read copy first: row 16 i + j, block lane8 = 8 bytes at word 2 (128 i + t)
            # of the head, and that block's scale byte at 128 i + t.
            r_base = slot * read_stride16 * 4 + hh * WORDS_PER_HEAD
            s_base = slot * scale_stride + hh * (P * BLOCKS)
            r_codes = []
            r_bscale = []
            for i in cutlass.range_constexpr(ROWS):
                r_codes.append(_vec(read, r_base + (i * THREADS + t) * 2, 2).load())
                r_bscale.append(Uint32(scales[s_base + i * THREADS + t]))
            # The live second-level scale g = 2**E of this slot and group (format.md 4);
            # `& 1` keeps a corrupt parity word inside the slot's meta.
            par = Int64(parity[slot * parity_stride] & Int32(1))
            a_live = meta[slot * meta_stride + g * 2 + par].bitcast(Int32) & Int32(0x7FFFFFFF)
            g_scale = bits.exp2_int(
                bits.pow2_exponent_above(a_live, bits_nvfp4.NVFP4_MANT_LIMIT, bits_nvfp4.NVFP4_E_OFF)
            )
            r_c = _vec(C, (bb * G + g) * N + n0, 16).load().to(Float32)
            p_out = (lane8 % 4) * 16 + j  # output row of lanes 0..3 of each group of 8

            # Ring entry j: zeros beyond r, the current token at r (stored into the ring).
            r_b = cute.make_rmem_tensor(cute.make_layout(16), BFloat16)
            r_b.fill(0.0)
            r_x = cute.make_rmem_tensor(cute.make_layout(8), BFloat16)
            r_x.fill(0.0)
            dt_j = Float32(0.0)
            br_row = slot * b_ring_stride16 * 8 + (g * RING + Int64(j)) * N + n0
            xr_row = slot * x_ring_stride16 * 8 + (hh * RING + Int64(j)) * P + lane8 * 8
            dtr = slot * dt_ring_stride + hh * RING + Int64(j)
            if j < r:
                r_b.store(_vec(b_ring, br_row, 16).load())
                r_x.store(_vec(x_ring, xr_row, 8).load())
                dt_j = dt_ring[dtr]
            if j == r:
                cur_b = _vec(B, (bb * G + g) * N + n0, 16).load()
                r_b.store(cur_b)
                cur_x = _vec(x, (bb * H + hh) * P + lane8 * 8, 8).load()
                r_x.store(cur_x)
                dt_j = softplus(dt[bb * dt_stride_b + hh * dt_stride_h] + dt_bias[hh * dt_bias_stride])
                _vec(x_ring, xr_row, 8).store(cur_x)
                if lane8 == 0:
                    dt_ring[dtr] = dt_j
                if hh % HPG == 0:
                    # B is shared by the group: one head writes it.
                    _vec(b_ring, br_row, 16).store(cur_b)
            _vec(s_x.iterator, j * P + lane8 * 8, 8).store(r_x.load())
            if lane8 == 0:
                s_dt[j] = dt_j
            bc = _xor_sum((r_b.load().to(Float32) * r_c).reduce(cute.ReductionOp.ADD, Float32(0.0), 0), 8)

            # C in the element order of the decoded halves (two words of 8 elements).
            r_cp = cute.make_rmem_tensor(cute.make_layout(16), Float32)
            for k in cutlass.range_constexpr(16):
                r_cp[k] = r_c[(k // 8) * 8 + self.decode_order[k % 8]]
            c_perm = r_cp.load()
            # Read-copy row dots: one block per thread, times its scale, reduced over the
            # 8 lanes (blocks) of each row.
            dots = []
            r_h = cute.make_rmem_tensor(cute.make_layout(8), Uint32)
            for i in cutlass.range_constexpr(ROWS):
                for w in cutlass.range_constexpr(2):
                    halves = self.e2m1x8_f16x2(r_codes[i][w])
                    for m in cutlass.range_constexpr(4):
                        r_h[4 * w + m] = halves[m]
                vals = r_h.load().bitcast(Float16).to(Float32)
                part = (vals * c_perm).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                bscale = bits_nvfp4.e4m3_value(r_bscale[i], bits_nvfp4.DSL_OPS) * Float32(self.decode_factor)
                dots.append(_xor_sum(part * bscale, 8))
            cute.arch.sync_threads()

            # pre_k = dt_0 + .. + dt_k in order; w_j = dt_j exp(A (pre_r - pre_j)).
            a_h = A[hh * a_stride]
            acc = Float32(0.0)
            pre_j = Float32(0.0)
            pre_r = Float32(0.0)
            for k in cutlass.range_constexpr(RING):
                acc = acc + s_dt[k]
                pre_j = sel(j == k, acc, pre_j)
                pre_r = sel(r == k, acc, pre_r)
            w_j = dt_j * cute.math.exp(a_h * (pre_r - pre_j))
            if lane8 == 0:
                s_coef[j] = w_j * bc
            decay = cute.math.exp(a_h * pre_r)
            cute.arch.sync_threads()

            if lane8 < 4:
                dot = sel(lane8 == 1, dots[1], dots[0])
                dot = sel(lane8 == 2, dots[2], dot)
                dot = sel(lane8 == 3, dots[3], dot)
                y = decay * (g_scale * dot)
                for k in cutlass.range_constexpr(RING):
                    y = y + s_coef[k] * Float32(s_x[k * P + p_out])
                x_p = Float32(s_x[r * P + p_out])
                y = y + D[hh * d_stride_h + Int64(p_out) * d_stride_p] * x_p
                out[(bb * H + hh) * P + Int64(p_out)] = BFloat16(y)


class DecodeNvfp4Sm90(DecodeNvfp4):
    """sm_90a: e2m1 decoded from the code bits (no e2m1 conversion on Hopper)."""

    arch = "sm_90a"
    decode_order = bits_nvfp4.SOFT_DECODE_ORDER
    decode_factor = bits_nvfp4.SOFT_DECODE_FACTOR

    def e2m1x8_f16x2(self, w):
        return bits_nvfp4.e2m1x8_f16x2_sw(w)


class DecodeNvfp4Sm100(DecodeNvfp4):
    """sm_100a / sm_103a: `cvt.rn.f16x2.e2m1x2`."""

    arch = "sm_100a"

    def e2m1x8_f16x2(self, w):
        return bits_nvfp4.e2m1x8_f16x2_hw(w)


__all__ = ["DecodeNvfp4", "DecodeNvfp4Sm90", "DecodeNvfp4Sm100"]
