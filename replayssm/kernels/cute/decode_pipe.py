"""Persistent FP8 non-flush decode: decode_warp.py's one warp per (row, head), with the
read copy brought into shared memory by bulk copies one unit of work ahead (CuTe DSL).

Why: decode_warp.py's kernel issues few instructions (~900 a head) yet reaches about
half of the copy bandwidth. Each warp lives for one head and waits for three memory
round trips in a row (its plan row, its loads, a second round of loads ptxas placed
after the first wait), and the 64 registers that hold its read copy in flight cap an SM
at 16 warps (docs/perf-notes-cute.md, sessions 5 and 6). Here a CTA of `hpc` warps stays
resident and walks units of work (row, the CTA's heads) u = blockIdx.x, + gridDim.x, ...;
each warp owns `stages` shared-memory stages of one head's read copy (8 KiB) and, while
it computes unit k, the bulk copy of unit k + stages - 1 is in flight (lane 0 issues it,
an mbarrier counts its bytes). The read copy then costs no registers until it is read,
and the round trip that matters for the bytes is off the warp's critical path.
Optionally lane 0 also prefetches the next unit's ring entries, x, B and C into L2
(`cp.async.bulk.prefetch.L2`), so the per-unit register loads hit L2.

The arithmetic is decode_warp.py's (`_WarpHead`), unchanged: the same fragments, the
same MMAs, the same output and ring-write order, so results are bit-identical to
`DecodeFp8Warp` (GPU-tested).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda_driver
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits, bulk
from .bits import bf16x2_to_f32x2, e4m3x4_to_f16x2x2, f32x2_to_f16x2
from .decode_fp8 import RING, N, P
from .decode_warp import K_STEPS, DecodeFp8Warp
from .mma import mma_f16_16x8x16

STAGE_BYTES = P * N  # one head's FP8 read copy
STAGES = 2
PIPE_CTAS_PER_SM = 3


class DecodeFp8Pipe(DecodeFp8Warp):
    """Persistent FP8 non-flush decode (module docstring). Launched with one more
    argument than `DecodeFp8`: `ctas`, the grid size (the launcher passes min(units,
    SMs x ctas_per_sm))."""

    name = "decode_fp8_pipe"
    persistent = True

    def __init__(self, heads: int, groups: int, *, chunk: int = 0, ctas_per_sm: int = PIPE_CTAS_PER_SM, prefetch: bool = False) -> None:
        DecodeFp8Warp.__init__(self, heads, groups, ctas_per_sm=ctas_per_sm)
        self.stages = STAGES
        self.chunk = chunk or heads // self.hpc
        self.prefetch = prefetch

    def units(self, batch: int) -> int:
        """Units of work of a `batch`-row step: (row, the hpc heads of one CTA)."""
        return batch * (self.heads // self.hpc)

    def ctas(self, batch: int) -> int:
        return -(-self.units(batch) // self.chunk)

    @cute.jit
    def __call__(
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
        ctas: Int32,
        stream: cuda_driver.CUstream,
    ):
        self.kernel(
            read, scales, x_ring, dt_ring, b_ring, x, dt, A, B, C, D, dt_bias, out,
            plan_valid, plan_slot, plan_ring, plan_flush,
            read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
            dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p, batch, ctas,
        ).launch(grid=[ctas, 1, 1], block=[self.threads, 1, 1], stream=stream, **self.launch_options())

    @cute.jit
    def unit_coords(self, k, bx, w):
        """(row, head) of warp w's unit k of CTA bx (CTA bx takes units chunk bx ..
        chunk bx + chunk - 1: with chunk = heads / hpc, one whole row)."""
        upr = self.heads // self.hpc
        u = bx * self.chunk + k
        return Int64(u // upr), Int64((u % upr) * self.hpc + w)

    @cute.jit
    def issue(
        self, k, bb, hh, live, slot, r, w, lane, stage0, bar0, read_w, x_ring, dt_ring, b_ring, x, B, C,
        read_stride16, x_ring_stride16, dt_ring_stride, b_ring_stride16,
    ):
        """Lane 0: start unit k's read copy into its stage (a plain arrival for a unit
        with nothing to read), and with `prefetch` its ring, x, B and C into L2."""
        s = k % self.stages
        bar = bar0 + 8 * s
        if lane == 0:
            bulk.fence_proxy_async()
            if live == Int32(1):
                src = (read_w + (slot * read_stride16 * 4 + hh * (P * N // 4))).toint()
                bulk.bulk_g2s(stage0 + s * STAGE_BYTES, src, Int32(STAGE_BYTES), bar)
                if cutlass.const_expr(self.prefetch):
                    H, G = self.heads, self.groups
                    g = hh // self.hpg
                    bulk.bulk_prefetch_l2((x + (bb * H + hh) * P).toint(), Int32(2 * P))
                    bulk.bulk_prefetch_l2((dt_ring + (slot * dt_ring_stride + hh * RING)).toint(), Int32(4 * RING))
                    if r > 0:
                        xr = x_ring + (slot * x_ring_stride16 * 8 + hh * (RING * P))
                        bulk.bulk_prefetch_l2(xr.toint(), r * (2 * P))
                    if w == 0:  # the CTA's heads share one group
                        bulk.bulk_prefetch_l2((C + (bb * G + g) * N).toint(), Int32(2 * N))
                        bulk.bulk_prefetch_l2((B + (bb * G + g) * N).toint(), Int32(2 * N))
                        if r > 0:
                            br = b_ring + (slot * b_ring_stride16 * 8 + g * (RING * N))
                            bulk.bulk_prefetch_l2(br.toint(), r * (2 * N))
            else:
                bulk.mbar_arrive(bar)

    def launch_options(self) -> dict:
        opts = super().launch_options()
        opts["smem"] = self.smem_bytes()
        return opts

    def smem_bytes(self) -> int:
        # Stages (128-byte aligned) then one 8-byte mbarrier per stage, per warp.
        return 128 + self.hpc * self.stages * (STAGE_BYTES + 8)

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
        ctas: Int32,
    ):
        S = self.stages
        t, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane, w = t % 32, t // 32
        gq, q = lane // 4, lane % 4
        smem = SmemAllocator()
        s_rc = smem.allocate_tensor(Uint32, cute.make_layout(self.hpc * S * (STAGE_BYTES // 4)), byte_alignment=128)
        s_bar = smem.allocate_tensor(Int64, cute.make_layout(self.hpc * S), byte_alignment=8)
        stage0 = (s_rc.iterator + w * (S * (STAGE_BYTES // 4))).toint()
        bar0 = (s_bar.iterator + w * S).toint()
        if lane == 0:
            for s in cutlass.range_constexpr(S):
                bulk.mbar_init(bar0 + 8 * s, 1)
            bulk.mbar_init_fence()
        cute.arch.sync_warp()

        n_units = batch * (self.heads // self.hpc)
        mine = cutlass.min(Int32(self.chunk), n_units - bx * self.chunk)  # units of this CTA
        read_w = cute.recast_ptr(read, dtype=Uint32)
        issue_args = (
            w, lane, stage0, bar0, read_w, x_ring, dt_ring, b_ring, x, B, C,
            read_stride16, x_ring_stride16, dt_ring_stride, b_ring_stride16,
        )
        # Prologue: units 0 .. S - 2 into their stages; unit S - 2's plan carried into
        # the loop (the plan of a unit is loaded once, S - 1 iterations before its
        # compute, so the loop waits for no plan; with S = 2, one iteration).
        bb_n, hh_n = self.unit_coords(0, bx, w)
        live_n, slot_n, r_n = self.plan_row(plan_valid, plan_slot, plan_ring, plan_flush, bb_n)
        self.issue(0, bb_n, hh_n, live_n, slot_n, r_n, *issue_args)
        for k in cutlass.range(mine):
            bb, hh, live, slot, r = bb_n, hh_n, live_n, slot_n, r_n
            kn = cutlass.min(k + 1, mine - 1)
            bb_n, hh_n = self.unit_coords(kn, bx, w)
            live_n, slot_n, r_n = self.plan_row(plan_valid, plan_slot, plan_ring, plan_flush, bb_n)
            if live == Int32(1):  # the same for the whole CTA (one row)
                g = hh // self.hpg
                cw, bw = self.group_loads(C, B, b_ring, bb, g, gq, q, r, slot, b_ring_stride16)
                xw, dt_k, dt_raw, bias, a_h, d0, d1, xo = self.head_loads(
                    x, x_ring, dt_ring, dt, A, D, dt_bias, bb, hh, gq, q, lane, r, slot,
                    x_ring_stride16, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
                )
                sc_off = slot * scale_stride + hh * P + Int64(8 * gq + 2 * q)
                sc0 = bits.ld_global_u32_if((scales + sc_off).toint(), Int32(1)).bitcast(Float32)
                sc1 = bits.ld_global_u32_if((scales + (sc_off + 1)).toint(), Int32(1)).bitcast(Float32)
                # Unit k's loads are in flight: start unit k + 1's read copy (waits for
                # its plan, loaded above).
                if k + 1 < mine:
                    self.issue(k + 1, bb_n, hh_n, live_n, slot_n, r_n, *issue_args)
                down, up = self.c_prime(cw)
                ch = []
                for c in cutlass.range_constexpr(2):
                    row = []
                    for v in cutlass.range_constexpr(8):
                        pair = bf16x2_to_f32x2(cw[c][v])
                        row.append(f32x2_to_f16x2(pair[0] * down, pair[1] * down))
                    ch.append(row)
                # The read copy from this unit's stage: rc[i][c] = row 8 gq + i, bytes
                # 64 c + 16 q .. + 15 (decode_warp.py's register layout).
                s = k % S
                bulk.mbar_wait(bar0 + 8 * s, (k // S) % 2)
                rc_base = stage0 + s * STAGE_BYTES + gq * (8 * N) + 16 * q
                rc = []
                for i in cutlass.range_constexpr(8):
                    rc.append([bulk.ld_shared_v4_u32(rc_base + N * i + 64 * c) for c in range(2)])
                rd = []
                for mt in cutlass.range_constexpr(4):
                    acc = [Float32(0.0)] * 4
                    for st in cutlass.range_constexpr(K_STEPS):
                        c, v = st // 4, st % 4
                        lo = e4m3x4_to_f16x2x2(rc[2 * mt][c][v])
                        hi = e4m3x4_to_f16x2x2(rc[2 * mt + 1][c][v])
                        acc = mma_f16_16x8x16([lo[0], hi[0], lo[1], hi[1]], [ch[c][2 * v], ch[c][2 * v + 1]], acc)
                    rd.append([acc[0], acc[2]])
                self.finish(
                    cw, bw, xw, dt_k, dt_raw, bias, a_h, d0, d1, xo, rd, up, [sc0, sc1], bb, hh, gq, q, lane, r, slot,
                    out, x_ring, dt_ring, b_ring, x_ring_stride16, dt_ring_stride, b_ring_stride16,
                )
            else:
                if k + 1 < mine:
                    self.issue(k + 1, bb_n, hh_n, live_n, slot_n, r_n, *issue_args)
            cute.arch.sync_warp()


__all__ = ["DecodeFp8Pipe", "STAGES", "PIPE_CTAS_PER_SM"]
