"""Pipelined FP8 non-flush decode: decode_warp.py's one warp per (row, head), with every
per-row array a head reads brought into shared memory by bulk copies one unit of work
ahead (CuTe DSL). Opt-in: $REPLAYSSM_FP8_DECODE=pipe.

Why: decode_warp.py's kernel issues few instructions (~900 a head) yet its warps spend
most of their time waiting for memory: each warp lives for one head and waits for its
plan row, then for its loads (the read copy, and the ring, C and the scales, which ptxas
partly places after the first wait), and the 64 registers that hold its read copy in
flight cap an SM at 16 warps (docs/perf-notes-cute.md, sessions 5 to 7). A first version
of this kernel that prefetched only the read copy (commit 9c62c97) was still waiting on
the ring and C loads half of its time (ncu, session 7).

Here a CTA of 4 warps (4 heads of one group) walks `chunk` units of work, unit = (row,
the CTA's 4 heads); unit k of CTA bx is u = chunk bx + k, row u // (H / 4). Two
shared-memory stages; while the CTA computes unit k from one, the bulk copies of unit
k + 1 fill the other. A stage holds the group's C, B and live B ring entries (once for
the 4 heads) and per head its read copy, scales, live x ring entries, x and dt ring.
Each warp's lane 0 issues its head's copies (warp 0 also the group's) with one
`mbarrier.arrive.expect_tx` on the stage's "full" barrier (4 arrivals); after computing,
each warp arrives on the stage's "empty" barrier (4 arrivals), which the issuing lanes
wait for before refilling it. The plan is loaded two units ahead and the per-head
scalars (dt, dt_bias, A, D) one unit ahead, both carried in registers, so no wait on
them sits between the stage's arrival and the compute.

The arithmetic is decode_warp.py's (`_WarpHead.c_prime`, `finish`), unchanged: the same
fragments, MMAs, output and ring-write order, with the same operands loaded from shared
memory instead of global memory.

Layout needs (checked by the launcher, `stage_layout_ok`): 16-byte-aligned bases and
slot strides for the read copy, scales, x ring, dt ring and B ring (the default cache
layout has them).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda_driver
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits, bulk
from .bits import bf16x2_to_f32x2, e4m3x4_to_f16x2x2, f32x2_to_f16x2, sel
from .decode_fp8 import RING, N, P
from .decode_warp import K_STEPS, DecodeFp8Warp
from .mma import mma_f16_16x8x16

STAGES = 2
# Stage layout (bytes). Group part: C, the step's B, the B ring (16 entries).
OFF_C = 0
OFF_B = 2 * N
OFF_BRING = 4 * N
GROUP_BYTES = OFF_BRING + RING * 2 * N
# Head part (one per warp): the read copy.
HEAD_BYTES = P * N
WARPS = 4
STAGE_BYTES = GROUP_BYTES + WARPS * HEAD_BYTES
# Two CTAs of 4 warps per SM: 2 x 2 x 47,360 bytes of stages.
PIPE_CTAS_PER_SM = 2


class DecodeFp8Pipe(DecodeFp8Warp):
    """Pipelined FP8 non-flush decode (module docstring). Launched with one more
    argument than `DecodeFp8`: `ctas`, the grid size (`ctas(batch)`)."""

    name = "decode_fp8_pipe"
    persistent = True

    def __init__(self, heads: int, groups: int, *, chunk: int = 0, ctas_per_sm: int = PIPE_CTAS_PER_SM) -> None:
        DecodeFp8Warp.__init__(self, heads, groups, heads_per_cta_limit=WARPS, ctas_per_sm=ctas_per_sm)
        if self.hpc != WARPS:
            raise ValueError(f"the pipelined FP8 decode needs heads per group divisible by {WARPS}; got {self.hpg}")
        self.chunk = chunk or heads // self.hpc
        import os  # TEMP experiment knob: "full" | "nocompute" | "nocopy"
        self.exp = os.environ.get("REPLAYSSM_PIPE_EXP", "full")

    def units(self, batch: int) -> int:
        """Units of work of a `batch`-row step: (row, the 4 heads of one CTA)."""
        return batch * (self.heads // self.hpc)

    def ctas(self, batch: int) -> int:
        return -(-self.units(batch) // self.chunk)

    def launch_options(self) -> dict:
        opts = super().launch_options()
        opts["smem"] = self.smem_bytes()
        return opts

    def smem_bytes(self) -> int:
        # Stages (128-byte aligned), then the full and empty mbarriers of each stage.
        return 128 + STAGES * STAGE_BYTES + 2 * STAGES * 8

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
    def unit_plan(self, k, bx, w, plan_valid, plan_slot, plan_ring, plan_flush):
        """(row, head, live, slot, r) of warp w's unit k of CTA bx."""
        upr = self.heads // self.hpc
        u = bx * self.chunk + k
        bb = Int64(u // upr)
        hh = Int64((u % upr) * self.hpc + w)
        live, slot, r = self.plan_row(plan_valid, plan_slot, plan_ring, plan_flush, bb)
        return bb, hh, live, slot, r

    @cute.jit
    def issue(
        self, k, bb, hh, live, slot, r, w, lane, st0, bar_full, bar_empty,
        read, scales, x_ring, dt_ring, b_ring, x, B, C,
        read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
    ):
        """Lane 0 of each warp: once every warp is done with the stage's previous unit
        (k - 2), start unit k's copies into it: the head's read copy, scales, live x
        ring entries, x and dt ring; warp 0 also the group's C, B and live B ring
        entries. A unit with nothing to read gets a plain arrival."""
        s = k % STAGES
        if lane == 0:
            if k >= STAGES:
                bulk.mbar_wait(bar_empty + 8 * s, (k // STAGES + 1) % 2)
            bulk.fence_proxy_async()
            full = bar_full + 8 * s
            if live == Int32(1) and cutlass.const_expr(self.exp != "nocopy"):
                H, G = self.heads, self.groups
                g = hh // self.hpg
                stage = st0 + s * STAGE_BYTES
                head = stage + GROUP_BYTES + w * HEAD_BYTES
                nbytes = Int32(P * N)
                if w == 0:
                    nbytes = nbytes + Int32(4 * N) + r * (2 * N)
                bulk.mbar_arrive_expect_tx(full, nbytes)
                rd_src = cute.recast_ptr(read, dtype=Uint32) + (slot * read_stride16 * 4 + hh * (P * N // 4))
                bulk.bulk_copy(head, rd_src.toint(), Int32(P * N), full)
                if w == 0:  # the CTA's heads share one group
                    bulk.bulk_copy(stage + OFF_C, (C + (bb * G + g) * N).toint(), Int32(2 * N), full)
                    bulk.bulk_copy(stage + OFF_B, (B + (bb * G + g) * N).toint(), Int32(2 * N), full)
                    if r > 0:
                        br = b_ring + (slot * b_ring_stride16 * 8 + g * (RING * N))
                        bulk.bulk_copy(stage + OFF_BRING, br.toint(), r * (2 * N), full)
            else:
                bulk.mbar_arrive(full)

    @cute.jit
    def group_stage_loads(self, stage, gq, q, r):
        """decode_warp.py's group_loads (its register layout) from the stage: cw, bw."""
        one = Int32(1)
        cw = []
        for c in cutlass.range_constexpr(2):
            a = stage + OFF_C + 4 * self.c_word(c, q)
            cw.append(bulk.ld_shared_v4_u32(a) + bulk.ld_shared_v4_u32(a + 16))
        bw = []
        for e in cutlass.range_constexpr(2):
            j = gq + 8 * e
            on = sel(j <= r, one, Int32(0))
            row = []
            for c in cutlass.range_constexpr(2):
                wo = 4 * self.c_word(c, q)
                a = sel(j < r, stage + OFF_BRING + j * (2 * N) + wo, stage + OFF_B + wo)
                row.append(bulk.ld_shared_v4_u32_if(a, on) + bulk.ld_shared_v4_u32_if(a + 16, on))
            bw.append(row)
        return cw, bw

    @cute.jit
    def head_values(
        self, x, x_ring, dt_ring, dt, A, D, dt_bias, scales, bb, hh, gq, q, lane, r, slot,
        x_ring_stride16, dt_ring_stride, scale_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
    ):
        """decode_warp.py's head_loads and the scales at p0, p0 + 1, as one flat list of
        26 scalars (carried one unit ahead): xw (16 words), dt_k, dt_raw, bias, a_h, d0,
        d1, xo (2), sc0, sc1. Every address is in bounds for any plan row (padding rows
        have slot 0)."""
        xw, dt_k, dt_raw, bias, a_h, d0, d1, xo = self.head_loads(
            x, x_ring, dt_ring, dt, A, D, dt_bias, bb, hh, gq, q, lane, r, slot,
            x_ring_stride16, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
        )
        sc_off = slot * scale_stride + hh * P + Int64(8 * gq + 2 * q)
        sc0 = bits.ld_global_u32_if((scales + sc_off).toint(), Int32(1)).bitcast(Float32)
        sc1 = bits.ld_global_u32_if((scales + (sc_off + 1)).toint(), Int32(1)).bitcast(Float32)
        return [*xw[0], *xw[1], *xw[2], *xw[3], dt_k, dt_raw, bias, a_h, d0, d1, xo[0], xo[1], sc0, sc1]

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
        t, _, _ = cute.arch.thread_idx()
        bx, _, _ = cute.arch.block_idx()
        lane, w = t % 32, t // 32
        gq, q = lane // 4, lane % 4
        smem = SmemAllocator()
        s_st = smem.allocate_tensor(Uint32, cute.make_layout(STAGES * STAGE_BYTES // 4), byte_alignment=128)
        s_bar = smem.allocate_tensor(Int64, cute.make_layout(2 * STAGES), byte_alignment=8)
        st0 = s_st.iterator.toint()
        bar_full = s_bar.iterator.toint()
        bar_empty = bar_full + 8 * STAGES
        if t == 0:
            for s in cutlass.range_constexpr(2 * STAGES):
                bulk.mbar_init(bar_full + 8 * s, WARPS)
            bulk.mbar_init_fence()
        cute.arch.sync_threads()

        n_units = batch * (self.heads // self.hpc)
        mine = cutlass.min(Int32(self.chunk), n_units - bx * self.chunk)  # units of this CTA (>= 1)
        plans = (plan_valid, plan_slot, plan_ring, plan_flush)
        copy_args = (
            w, lane, st0, bar_full, bar_empty, read, scales, x_ring, dt_ring, b_ring, x, B, C,
            read_stride16, scale_stride, x_ring_stride16, dt_ring_stride, b_ring_stride16,
        )
        hv_args = (x_ring_stride16, dt_ring_stride, scale_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p)
        # Unit 0 issued; the plans of units 0 and 1 and unit 0's scalars carried into the
        # loop, which loads plans two units ahead and scalars one unit ahead.
        bb, hh, live, slot, r = self.unit_plan(0, bx, w, *plans)
        bb_n, hh_n, live_n, slot_n, r_n = self.unit_plan(cutlass.min(Int32(1), mine - 1), bx, w, *plans)
        hv = self.head_values(x, x_ring, dt_ring, dt, A, D, dt_bias, scales, bb, hh, gq, q, lane, r, slot, *hv_args)
        self.issue(0, bb, hh, live, slot, r, *copy_args)
        for k in cutlass.range(mine):
            bb_nn, hh_nn, live_nn, slot_nn, r_nn = self.unit_plan(cutlass.min(k + 2, mine - 1), bx, w, *plans)
            hv_n = self.head_values(x, x_ring, dt_ring, dt, A, D, dt_bias, scales, bb_n, hh_n, gq, q, lane, r_n, slot_n, *hv_args)
            if k + 1 < mine:
                self.issue(k + 1, bb_n, hh_n, live_n, slot_n, r_n, *copy_args)
            s = k % STAGES
            bulk.mbar_wait(bar_full + 8 * s, (k // STAGES) % 2)
            if live == Int32(1) and cutlass.const_expr(self.exp != "nocompute"):  # the same for the whole CTA (one row)
                stage = st0 + s * STAGE_BYTES
                head = stage + GROUP_BYTES + w * HEAD_BYTES
                cw, bw = self.group_stage_loads(stage, gq, q, r)
                xw = [hv[4 * u: 4 * u + 4] for u in range(4)]
                dt_k, dt_raw, bias, a_h, d0, d1, xo0, xo1, sc0, sc1 = hv[16:]
                down, up = self.c_prime(cw)
                ch = []
                for c in cutlass.range_constexpr(2):
                    row = []
                    for v in cutlass.range_constexpr(8):
                        pair = bf16x2_to_f32x2(cw[c][v])
                        row.append(f32x2_to_f16x2(pair[0] * down, pair[1] * down))
                    ch.append(row)
                # Row dots (decode_warp.py): rc[i][c] = row 8 gq + i, bytes 64 c + 16 q .. + 15.
                rc_base = head + gq * (8 * N) + 16 * q
                rd = []
                for mt in cutlass.range_constexpr(4):
                    rc = [[bulk.ld_shared_v4_u32(rc_base + N * i + 64 * c) for c in range(2)] for i in (2 * mt, 2 * mt + 1)]
                    acc = [Float32(0.0)] * 4
                    for st in cutlass.range_constexpr(K_STEPS):
                        c, v = st // 4, st % 4
                        lo = e4m3x4_to_f16x2x2(rc[0][c][v])
                        hi = e4m3x4_to_f16x2x2(rc[1][c][v])
                        acc = mma_f16_16x8x16([lo[0], hi[0], lo[1], hi[1]], [ch[c][2 * v], ch[c][2 * v + 1]], acc)
                    rd.append([acc[0], acc[2]])
                self.finish(
                    cw, bw, xw, dt_k, dt_raw, bias, a_h, d0, d1, [xo0, xo1], rd, up, [sc0, sc1], bb, hh, gq, q, lane, r, slot,
                    out, x_ring, dt_ring, b_ring, x_ring_stride16, dt_ring_stride, b_ring_stride16,
                )
            cute.arch.sync_warp()
            if lane == 0:
                bulk.mbar_arrive(bar_empty + 8 * s)
            bb, hh, live, slot, r = bb_n, hh_n, live_n, slot_n, r_n
            bb_n, hh_n, live_n, slot_n, r_n = bb_nn, hh_nn, live_nn, slot_nn, r_nn
            hv = hv_n


__all__ = ["DecodeFp8Pipe", "PIPE_CTAS_PER_SM", "STAGE_BYTES"]
