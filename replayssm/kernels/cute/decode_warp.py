"""Non-flush decode kernels, one warp per (row, head): registers only, tensor-core dots
(CuTe DSL). Both formats: `DecodeFp8Warp` (FP8 read copy) and `DecodeNvfp4Warp` (NVFP4),
sharing everything but the read-copy part.

The formula of decode_fp8.py / decode_nvfp4.py:

    y[p] = exp(A pre_r) R[p] + sum_{j <= r} dt_j exp(A (pre_r - pre_j)) (B_j . C) x_j[p] + D[p] x[p]

with R[p] the read-copy row dot (FP8: scale[p] sum_n e4m3(code[p, n]) C[n]; NVFP4:
g sum_n e4m3(s[p, n // 16]) e2m1(code[p, n]) C[n]).

Why this shape: the SIMT kernels (a CTA of 4 warps per (row, head)) issue ~2,100 (FP8)
and ~3,300 (NVFP4) warp-instructions per (row, head), and a step is bound by issue and
latency together (docs/perf-notes-cute.md, session 4). Here one warp does a whole head
with ~900 (FP8) or ~1,500 (NVFP4; its software e2m1 decode is most of the
difference): no shared memory, no barrier, every load lands in the registers an MMA
consumes. A CTA holds `heads_per_cta` warps of one row and one group (their C, B ring
and plan loads meet in L1).

Per warp, lane (g, q) = (lane // 4, lane % 4) (fragment layouts in mma.py):

1. Read-copy row dots, `mma.m16n8k16` f16 x f16 -> f32: four m-tiles of 16 state rows,
   eight k-steps. Lane (g, q) holds rows p = 8 g + i (i = 0..7); m-tile mt takes rows
   i = 2 mt (MMA row g) and 2 mt + 1 (MMA row g + 8). Its k values are a permutation of
   n that A and B share, within the n-set of lane q (the 32 values of n that its loads
   hold; the four lanes q cover all 128): FP8 [16 q, 16 q + 16) and [64 + 16 q, + 16),
   NVFP4 [32 q, 32 q + 32) (two whole blocks). C enters as C' = C 2**-e in f16, 2**e
   putting max |C| in [2**14, 2**15) (bf16's 8 significant bits fit f16's 11 for
   |C'| >= 2**-17, i.e. within 2**-31 of max |C|; below that, the f16 rounding error is
   < 2**-25 of a C' unit).
   - FP8: the e4m3 codes become f16 pairs exactly (`cvt.rn.f16x2.e4m3x2`). Every column
     of B is C', so every output column is the dot.
   - NVFP4: a code pair becomes an f16 pair exactly (sm_90a: the codes moved to e4m3
     codes of value * 2**-6 by shifts and masks, then `cvt.rn.f16x2.e4m3x2`; sm_100a:
     `cvt.rn.f16x2.e2m1x2`, the value). B's column j is C' on the k values of block j
     and zero elsewhere (lane (g, q) holds blocks 2 q, 2 q + 1; it supplies column g for
     its k values, C' where g = 2 q + c for its chunk c, else zeros), so output column j
     is the dot over block j. Lane (g, q) multiplies its blocks 2 q, 2 q + 1 by their
     block scales in FP32, and a butterfly over the quad's lanes sums the 8 blocks.
2. B_j . C for the 16 ring entries (entries beyond r zero, never read; the step's B at
   r), `mma.m16n8k16` bf16 x bf16 (exact products) over the same n-sets: A rows g and
   g + 8 are entries g and g + 8, B is C.
3. The scan over the entries (lane k % 16 = entry k): coef_k = dt_k exp(A (pre_r - pre_k))
   (B_k . C), decay = exp(A pre_r), as in the SIMT kernels.
4. Ring replay sum_j coef_j x_j[p], `mma.m16n8k16` bf16: A rows as in 1, k = entries
   (lane (g, q) loads entries 2 q, 2 q + 1, 2 q + 8, 2 q + 9 at p = 8 g .. + 7 and pairs
   them by byte permutes); B's even columns coef in bf16, its odd columns the bf16
   remainder coef - bf16(coef) (16 significant bits): c0 + c1 is row g, c2 + c3 row g + 8.
5. Lane (g, q) writes rows p0 = 8 g + 2 q and p0 + 1 (m-tile q): the warp's 64 outputs.

The tensor cores add the FP32 products in their own order and precision (not the SIMT
kernels'); the GPU tests bound the outputs against the reference.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits, bits_nvfp4
from .bits import bf16x2_to_f32x2, e4m3x4_to_f16x2x2, f32x2_to_bf16x2, f32x2_to_f16x2, inline_ptx, prmt, sel, softplus
from .decode_fp8 import RING, DecodeFp8, N, P
from .decode_nvfp4 import BLOCKS, DecodeNvfp4
from .mma import mma_bf16_16x8x16, mma_f16_16x8x16

# 2**-e brings max |C| to [2**14, 2**15).
C_TARGET_EXP = 14
HEADS_PER_CTA = 4
# CTAs an SM should hold (caps the registers at 65536 / (32 x heads_per_cta x this)).
# H200, 16 heads / 2 groups, batch 256 / 1024 (us per step, non-flush kernel in
# parentheses; docs/perf-notes-cute.md, session 5): 3 -> FP8 27.18 (16.11) / 87.92
# (54.48), NVFP4 28.10 (15.61) / 97.16 (52.20); 4 -> 26.32 (16.16) / 84.94 (53.60),
# 26.57 (14.00) / 90.27 (45.96); 5 -> 29.91 (19.08) / 94.30 (62.61), 28.69 (16.12) /
# 94.57 (50.03). With 4 the FP8 kernel spills 40 bytes a lane (measured that way).
# Session 9, beside the persistent flush (step_timeline, us per step at 256 / 1024): the
# sm_90a NVFP4 kernel with its e2m1 decode through e4m3 (1,301 instructions, 124
# registers) was faster at 5 (23.05 / 72.35 at 4, 22.62 / 70.38 at 5); with the row dots
# by block as well (1,229 instructions) 5 spills 8 bytes and 4 is faster (22.52 / 70.69
# for the previous kernel at 5, 22.71 / 71.47 for this one at 5, 22.25 / 70.36 at 4). FP8
# stays at 4 (22.44 / 65.46 at 4, 23.07 / 65.90 at 5).
CTAS_PER_SM = 4
K_STEPS = N // 16  # k-steps of 16 over the state dimension


def heads_per_cta(hpg: int, limit: int = HEADS_PER_CTA) -> int:
    """Heads per CTA: the largest of 8, 4, 2, 1 up to `limit` that divides the heads per
    group (a CTA's heads share one group)."""
    return max(d for d in (1, 2, 4, 8) if d <= limit and hpg % d == 0)


# benchmarks/cta_trace.py: int64 words a CTA's trace record holds.
TRACE_WORDS = 8


class _WarpHead:
    """What the two formats' warp kernels share: launch shape, the plan, the per-head
    loads, B_j . C, the scan, the ring replay, the outputs and the ring writes."""

    # benchmarks/cta_trace.py: the global address of a zeroed int64 [CTAs, TRACE_WORDS]
    # buffer compiles a traced variant, whose thread 0 writes per CTA (grid order) its
    # %globaltimer at entry and exit, %clock64 at entry, when the row's slot is back,
    # after the row dots, after `finish`, at exit, and smid + (live << 32). 0: no trace.
    trace_addr = 0
    # PTX qualifiers of the read copy's loads (bits.ld_global_v4_u32): "" (plain); the
    # launchers choose (FP8: launch.FP8_READ_HINT when launch.fp8_read_hint says so;
    # NVFP4: launch_nvfp4.NVFP4_READ_HINT but at batch 1).
    rc_hint = ""

    @cute.jit
    def trace_record(self, t, bx, b, words):
        """Thread 0 writes `words` (Int64) to this CTA's trace record."""
        if t == 0:
            nbx, _, _ = cute.arch.grid_dim()
            rec = Int64(self.trace_addr) + (Int64(b) * Int64(nbx) + Int64(bx)) * (8 * TRACE_WORDS)
            for i in cutlass.range_constexpr(len(words)):
                bits.st_global_u64(rec + 8 * i, words[i])

    def _init_warp(self, heads_per_cta_limit: int, ctas_per_sm: int) -> None:
        self.hpc = heads_per_cta(self.hpg, heads_per_cta_limit)
        self.ctas_per_sm = ctas_per_sm

    @property
    def threads(self) -> int:
        return 32 * self.hpc

    def grid(self, batch):
        return [self.heads // self.hpc, batch, 1]

    def launch_options(self) -> dict:
        # PDL (`pdl`, batch 1, launch.PDL_KERNEL_ENV "warp"): the kernel waits for the
        # prepare kernel (griddepcontrol.wait) before its first memory access.
        # preferred_smem_carveout -1: the driver's choice (no device query at compile time).
        opts = {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": -1}
        return {**opts, "use_pdl": True} if self.pdl else opts

    def c_word(self, c: int, q):
        """Word (bf16 pair) offset of chunk c (8 words) of lane q's n-set in a row of 128."""
        raise NotImplementedError

    @cute.jit
    def warp_coords(self, t, bx):
        """(lane, gq, q, head, group) of thread t in CTA bx."""
        lane = t % 32
        hh = Int64(bx * self.hpc + t // 32)
        return lane, lane // 4, lane % 4, hh, hh // self.hpg

    @cute.jit
    def plan_row(self, plan_valid, plan_slot, plan_ring, plan_flush, bb):
        """(live, slot, r) of batch row bb: live is 1 exactly for valid rows that do not
        flush.

        The source issues all four loads before the branch on live, but ptxas sinks the
        slot and ring-index loads below it, where they are used (sm_90a SASS): the flags
        and then the slot each take a round trip before the data loads. Making the branch
        wait for the slot load too (checked in the SASS: both before the exit) made steps
        slower on the H200, measured with session 11's plan record (FP8 about 0.6 / 1.5 us at
        batch 256 / 1024; docs/perf-notes-cute.md, session 11), so it stays this way."""
        live = Int32(plan_valid[bb]) - Int32(plan_flush[bb])
        slot_w = bits.ld_global_v2_u32_if((plan_slot + bb).toint(), Int32(1))
        r = Int32(bits.ld_global_u32_if((plan_ring + bb).toint(), Int32(1)))
        return live, Int64(slot_w[0]) | (Int64(slot_w[1]) << 32), r

    @cute.jit
    def group_loads(self, C, B, b_ring, bb, g, gq, q, r, slot, b_ring_stride16, w):
        """C (cw[c][v], chunk c of lane q's n-set) and, of ring entries gq, gq + 8 at the
        same n, this warp's share (bq[e][i]: vector half vh = w * VH + i, VH = 4 //
        heads_per_cta, i.e. words 4 (vh % 2) .. + 3 of chunk vh // 2; the step's B at r,
        zeros beyond r): the CTA's warps split B_j . C over k (`finish`)."""
        G = self.groups
        c_w = cute.recast_ptr(C, dtype=Uint32)
        c_row = (bb * G + g) * (N // 2)
        cw = []
        for c in cutlass.range_constexpr(2):
            base = (c_w + (c_row + Int64(self.c_word(c, q)))).toint()
            cw.append(bits.ld_global_v4_u32(base) + bits.ld_global_v4_u32(base + 16))
        br_w = cute.recast_ptr(b_ring, dtype=Uint32)
        b_w = cute.recast_ptr(B, dtype=Uint32)
        br_row0 = slot * b_ring_stride16 * 4 + g * (RING * N // 2)
        b_row = (bb * G + g) * (N // 2)
        bq = []
        for e in cutlass.range_constexpr(2):
            j = gq + 8 * e
            on = sel(j <= r, Int32(1), Int32(0))
            row = []
            for i in cutlass.range_constexpr(self.vh_per_warp):
                wo = Int64(self.vh_word(w * self.vh_per_warp + i, q))
                src = sel(j < r, (br_w + (br_row0 + Int64(j * (N // 2)) + wo)).toint(), (b_w + (b_row + wo)).toint())
                row.append(bits.ld_global_v4_u32_if(src, on))
            bq.append(row)
        return cw, bq

    @property
    def vh_per_warp(self) -> int:
        """Vector halves (4 words, 2 k-steps of B_j . C) of the ring entries per warp."""
        if 4 % self.hpc:
            raise ValueError(f"heads per CTA must divide 4 (the ring entries' 4 vector halves); got {self.hpc}")
        return 4 // self.hpc

    def vh_word(self, vh, q):
        """Word offset of vector half vh (runtime) of lane q's n-set in a row of 128."""
        return self.c_word(vh // 2, q) + 4 * (vh % 2)

    @cute.jit
    def head_loads(
        self, x, x_ring, dt_ring, dt, A, D, dt_bias, bb, hh, gq, q, lane, r, slot,
        x_ring_stride16, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
    ):
        """Ring x (xw[u]: entry 2 q + u % 2 + 8 (u // 2) at p = 8 gq .. + 7, the step's x
        at r, zeros beyond) and the scalars: dt of entry lane % 16 (zero beyond r), the
        step's raw dt, dt_bias, A, D and x at the lane's output rows p0, p0 + 1."""
        H = self.heads
        one = Int32(1)
        xr_w = cute.recast_ptr(x_ring, dtype=Uint32)
        x_w = cute.recast_ptr(x, dtype=Uint32)
        x_row = (bb * H + hh) * (P // 2)
        x_cur = (x_w + (x_row + Int64(4 * gq))).toint()
        xr_row = slot * x_ring_stride16 * 4 + hh * (RING * P // 2) + Int64(4 * gq)
        xw = []
        for u in cutlass.range_constexpr(4):
            j = 2 * q + (u % 2) + 8 * (u // 2)
            src = sel(j < r, (xr_w + (xr_row + Int64(j * (P // 2)))).toint(), x_cur)
            xw.append(bits.ld_global_v4_u32_if(src, sel(j <= r, one, Int32(0))))
        k = lane % 16
        dtr = slot * dt_ring_stride + hh * RING
        dt_k = bits.ld_global_u32_if((dt_ring + (dtr + Int64(k))).toint(), sel(k < r, one, Int32(0))).bitcast(Float32)
        dt_raw = dt[bb * dt_stride_b + hh * dt_stride_h]
        bias = dt_bias[hh * dt_bias_stride]
        a_h = A[hh * a_stride]
        p0 = 8 * gq + 2 * q
        d0 = D[hh * d_stride_h + Int64(p0) * d_stride_p]
        d1 = D[hh * d_stride_h + Int64(p0 + 1) * d_stride_p]
        xo = bf16x2_to_f32x2(x_w[x_row + Int64(p0 // 2)])
        return xw, dt_k, dt_raw, bias, a_h, d0, d1, xo

    @cute.jit
    def c_prime(self, cw):
        """(down, up): C' = C down in f16 has max |C'| in [2**14, 2**15) and up = 1 / down
        (0 when max |C| < 2**-112); max |C| over the lane's four lanes q, which hold all 128."""
        m = Uint32(0)
        for c in cutlass.range_constexpr(2):
            for v in cutlass.range_constexpr(8):
                m = bits.max_u16x2(m, cw[c][v] & Uint32(0x7FFF7FFF))
        amax = Int32(cutlass.max(m >> 16, m & Uint32(0xFFFF)) << 16)  # FP32 bits of max |C|
        amax = bits.xor_reduce(amax, 4, cutlass.max)
        ef = amax >> 23  # biased exponent (255: Inf / NaN)
        down = (cutlass.min(Int32(127 + 127 + C_TARGET_EXP) - ef, Int32(254)) << 23).bitcast(Float32)
        up_field = ef - Int32(C_TARGET_EXP)
        up = sel(up_field >= Int32(1), up_field << 23, Int32(0)).bitcast(Float32)
        return down, up

    @cute.jit
    def finish(
        self, cw, bq, w, s_bc, xw, dt_k, dt_raw, bias, a_h, d0, d1, xo, rd, inner, outer, bb, hh, gq, q, lane, r, slot,
        out, x_ring, dt_ring, b_ring, x_ring_stride16, dt_ring_stride, b_ring_stride16,
    ):
        """B_j . C, the scan, the ring replay, the outputs and the ring writes. rd[mt]: the
        MMA row dots of m-tile mt (rows 8 gq + 2 mt, + 1); the read-copy term of output
        row p0 + i is outer[i] * (inner * dot), in that order (no intermediate overflow
        where the term itself is finite)."""
        H, HPG = self.heads, self.hpg
        g = hh // HPG
        # B_j . C (bf16 MMA), split over k between the CTA's warps: this warp's k-steps
        # (two per vector half of bq), entries gq (acc[0]) and gq + 8 (acc[2]); the
        # partial sums meet in shared memory.
        acc_bc = [Float32(0.0)] * 4
        for i in cutlass.range_constexpr(self.vh_per_warp):
            vh = w * self.vh_per_warp + i
            for hs in cutlass.range_constexpr(2):
                a = [bq[0][i][2 * hs], bq[1][i][2 * hs], bq[0][i][2 * hs + 1], bq[1][i][2 * hs + 1]]
                # C words 4 (vh % 2) + 2 hs, + 1 of chunk vh // 2 (vh is per warp: a select).
                b0, b1 = cw[0][2 * hs], cw[0][2 * hs + 1]
                for cand in cutlass.range_constexpr(1, 4):
                    v = 4 * (cand % 2) + 2 * hs
                    b0 = sel(vh == cand, cw[cand // 2][v], b0)
                    b1 = sel(vh == cand, cw[cand // 2][v + 1], b1)
                acc_bc = mma_bf16_16x8x16(a, [b0, b1], acc_bc)
        if q == 0:
            s_bc[w * RING + gq] = acc_bc[0]
            s_bc[w * RING + gq + 8] = acc_bc[2]
        cute.arch.sync_threads()

        # Scan: lane k % 16 = entry k.
        k = lane % 16
        bc_k = s_bc[k]
        for ww in cutlass.range_constexpr(1, self.hpc):
            bc_k = bc_k + s_bc[ww * RING + k]
        dt_k = sel(k == r, softplus(dt_raw + bias), dt_k)
        pre = dt_k
        off = 1
        while off < RING:
            prev = cute.arch.shuffle_sync_up(pre, off)
            pre = sel(k >= off, pre + prev, pre)
            off *= 2
        pre_r = cute.arch.shuffle_sync(pre, r)
        coef = dt_k * cute.math.exp(a_h * (pre_r - pre)) * bc_k
        decay = cute.math.exp(a_h * pre_r)

        # Ring replay (bf16 MMA): B column n = coef (n even) or its remainder (n odd).
        odd = (gq % 2) == 1
        bfr = []
        for hlf in cutlass.range_constexpr(2):
            c_lo = cute.arch.shuffle_sync(coef, 2 * q + 8 * hlf)
            c_hi = cute.arch.shuffle_sync(coef, 2 * q + 8 * hlf + 1)
            w_hi = f32x2_to_bf16x2(c_lo, c_hi)
            back = bf16x2_to_f32x2(w_hi)
            w_lo = f32x2_to_bf16x2(c_lo - back[0], c_hi - back[1])
            bfr.append(sel(odd, w_lo, w_hi))
        acc_x = []
        for mt in cutlass.range_constexpr(4):
            a = [
                prmt(xw[0][mt], xw[1][mt], 0x5410),
                prmt(xw[0][mt], xw[1][mt], 0x7632),
                prmt(xw[2][mt], xw[3][mt], 0x5410),
                prmt(xw[2][mt], xw[3][mt], 0x7632),
            ]
            acc_x.append(mma_bf16_16x8x16(a, bfr, [Float32(0.0)] * 4))

        # Outputs p0 = 8 gq + 2 q, p0 + 1: m-tile q.
        rd0, rd1 = rd[0]
        rs0, rs1 = acc_x[0][0] + acc_x[0][1], acc_x[0][2] + acc_x[0][3]
        for mt in cutlass.range_constexpr(1, 4):
            rd0 = sel(q == mt, rd[mt][0], rd0)
            rd1 = sel(q == mt, rd[mt][1], rd1)
            rs0 = sel(q == mt, acc_x[mt][0] + acc_x[mt][1], rs0)
            rs1 = sel(q == mt, acc_x[mt][2] + acc_x[mt][3], rs1)
        p0 = 8 * gq + 2 * q
        y0 = decay * (outer[0] * (inner * rd0)) + rs0 + d0 * xo[0]
        y1 = decay * (outer[1] * (inner * rd1)) + rs1 + d1 * xo[1]
        o = (bb * H + hh) * P + Int64(p0)
        out[o] = BFloat16(y0)
        out[o + 1] = BFloat16(y1)

        # The step's token into the ring: x (lanes with q = (r % 8) // 2), its processed
        # dt (lane r), B (the group's first head, lanes with gq = r % 8).
        if q == (r % 8) // 2:
            u = r % 2 + 2 * (r // 8)
            xs = xw[0]
            for uu in cutlass.range_constexpr(1, 4):
                xs = [sel(u == uu, xw[uu][i], xs[i]) for i in range(4)]
            xr_w = cute.recast_ptr(x_ring, dtype=Uint32)
            xr_row = slot * x_ring_stride16 * 4 + hh * (RING * P // 2) + Int64(4 * gq)
            bits.st_global_v4_u32((xr_w + (xr_row + Int64(r * (P // 2)))).toint(), xs)
        if lane == r:
            dt_ring[slot * dt_ring_stride + hh * RING + Int64(r)] = dt_k
        if (hh - Int64(w)) % HPG == 0:  # the CTA that holds the group's first head: each warp its share
            if gq == r % 8:
                br_w = cute.recast_ptr(b_ring, dtype=Uint32)
                dst_row = slot * b_ring_stride16 * 4 + g * (RING * N // 2) + Int64(r * (N // 2))
                for i in cutlass.range_constexpr(self.vh_per_warp):
                    dst = (br_w + (dst_row + Int64(self.vh_word(w * self.vh_per_warp + i, q)))).toint()
                    bits.st_global_v4_u32(dst, [sel(r >= 8, bq[1][i][u], bq[0][i][u]) for u in range(4)])


class DecodeFp8Warp(_WarpHead, DecodeFp8):
    """FP8 non-flush decode, one warp per (row, head); DecodeFp8's launcher and arguments."""

    name = "decode_fp8_warp"

    def __init__(self, heads: int, groups: int, *, heads_per_cta_limit: int = HEADS_PER_CTA, ctas_per_sm: int = CTAS_PER_SM) -> None:
        DecodeFp8.__init__(self, heads, groups)
        self._init_warp(heads_per_cta_limit, ctas_per_sm)

    def c_word(self, c: int, q):
        return 32 * c + 8 * q  # n = 64 c + 16 q .. + 15

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
        t, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        bb = Int64(b)
        if cutlass.const_expr(self.trace_addr):
            gt0 = bits.globaltimer_after(Int32(b))
            c0 = bits.clock_after(Int32(b))
        live, slot, r = self.plan_row(plan_valid, plan_slot, plan_ring, plan_flush, bb)
        if cutlass.const_expr(self.trace_addr):
            if live != Int32(1):
                self.trace_record(t, bx, b, [gt0, bits.globaltimer_after(live), c0, Int64(0), Int64(0), Int64(0), bits.clock_after(live), Int64(bits.sm_id())])
        if live == Int32(1):  # the same for the whole CTA (one row)
            if cutlass.const_expr(self.trace_addr):
                c1 = bits.clock_after(Int32(slot))
            lane, gq, q, hh, g = self.warp_coords(t, bx)
            w = Int32(t // 32)
            s_bc = SmemAllocator().allocate_tensor(Float32, cute.make_layout(RING * self.hpc), byte_alignment=16)
            cw, bq = self.group_loads(C, B, b_ring, bb, g, gq, q, r, slot, b_ring_stride16, w)
            # Read copy: rc[i][c] = row 8 gq + i, bytes 64 c + 16 q .. + 15 (four words).
            read_w = cute.recast_ptr(read, dtype=Uint32)
            rc_base = (read_w + (slot * read_stride16 * 4 + hh * (P * N // 4) + Int64(gq * (8 * N // 4) + 4 * q))).toint()
            rc = []
            for i in cutlass.range_constexpr(8):
                rc.append([bits.ld_global_v4_u32(rc_base + N * i + 64 * c, self.rc_hint) for c in range(2)])
            xw, dt_k, dt_raw, bias, a_h, d0, d1, xo = self.head_loads(
                x, x_ring, dt_ring, dt, A, D, dt_bias, bb, hh, gq, q, lane, r, slot,
                x_ring_stride16, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
            )
            sc_off = slot * scale_stride + hh * P + Int64(8 * gq + 2 * q)
            sc0 = scales[sc_off]
            sc1 = scales[sc_off + 1]

            # Row dots (f16 MMA) with C' in natural pairs: k-step s takes word s % 4 of
            # chunk s // 4 of rows 2 mt, 2 mt + 1; its codes 0, 1 are k = 2 q, 2 q + 1.
            down, up = self.c_prime(cw)
            ch = []
            for c in cutlass.range_constexpr(2):
                row = []
                for v in cutlass.range_constexpr(8):
                    pair = bf16x2_to_f32x2(cw[c][v])
                    row.append(f32x2_to_f16x2(pair[0] * down, pair[1] * down))
                ch.append(row)
            rd = []
            for mt in cutlass.range_constexpr(4):
                acc = [Float32(0.0)] * 4
                for s in cutlass.range_constexpr(K_STEPS):
                    c, v = s // 4, s % 4
                    lo = e4m3x4_to_f16x2x2(rc[2 * mt][c][v])
                    hi = e4m3x4_to_f16x2x2(rc[2 * mt + 1][c][v])
                    acc = mma_f16_16x8x16([lo[0], hi[0], lo[1], hi[1]], [ch[c][2 * v], ch[c][2 * v + 1]], acc)
                rd.append([acc[0], acc[2]])
            if cutlass.const_expr(self.trace_addr):
                c2 = bits.clock_after(rd[3][1].bitcast(Int32))
            # R[p] = scale[p] (dot 2**e).
            self.finish(
                cw, bq, w, s_bc, xw, dt_k, dt_raw, bias, a_h, d0, d1, xo, rd, up, [sc0, sc1], bb, hh, gq, q, lane, r, slot,
                out, x_ring, dt_ring, b_ring, x_ring_stride16, dt_ring_stride, b_ring_stride16,
            )
            if cutlass.const_expr(self.trace_addr):
                c3 = bits.clock_after(t)
                self.trace_record(
                    t, bx, b,
                    [gt0, bits.globaltimer_after(t), c0, c1, c2, c3, bits.clock_after(t), Int64(bits.sm_id()) | (Int64(1) << 32)],
                )


class DecodeNvfp4Warp(_WarpHead, DecodeNvfp4):
    """NVFP4 non-flush decode, one warp per (row, head); DecodeNvfp4's launcher and
    arguments. `hw`: the e2m1 pairs by `cvt.rn.f16x2.e2m1x2` (sm_100a / sm_103a), else
    from the code bits (sm_90a)."""

    name = "decode_nvfp4_warp"

    def __init__(self, heads: int, groups: int, *, hw: bool, heads_per_cta_limit: int = HEADS_PER_CTA, ctas_per_sm: int = CTAS_PER_SM) -> None:
        DecodeNvfp4.__init__(self, heads, groups)
        self._init_warp(heads_per_cta_limit, ctas_per_sm)
        self.hw = hw
        self.decode_order = bits_nvfp4.HW_DECODE_ORDER if hw else bits_nvfp4.SOFT_DECODE_ORDER
        # The decoded f16 values are v / decode_factor.
        self.decode_factor = 1.0 if hw else bits_nvfp4.SOFT_DECODE_FACTOR

    def c_word(self, c: int, q):
        return 16 * q + 8 * c  # n = 32 q + 16 c .. + 15

    def e2m1x8_f16x2(self, w):
        return bits_nvfp4.e2m1x8_f16x2_hw(w) if self.hw else bits_nvfp4.e2m1x8_f16x2_sw(w)

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
        t, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        bb = Int64(b)
        if cutlass.const_expr(self.trace_addr):
            gt0 = bits.globaltimer_after(Int32(b))
            c0 = bits.clock_after(Int32(b))
        live, slot, r = self.plan_row(plan_valid, plan_slot, plan_ring, plan_flush, bb)
        if cutlass.const_expr(self.trace_addr):
            if live != Int32(1):
                self.trace_record(t, bx, b, [gt0, bits.globaltimer_after(live), c0, Int64(0), Int64(0), Int64(0), bits.clock_after(live), Int64(bits.sm_id())])
        if live == Int32(1):  # the same for the whole CTA (one row)
            if cutlass.const_expr(self.trace_addr):
                c1 = bits.clock_after(Int32(slot))
            lane, gq, q, hh, g = self.warp_coords(t, bx)
            w = Int32(t // 32)
            s_bc = SmemAllocator().allocate_tensor(Float32, cute.make_layout(RING * self.hpc), byte_alignment=16)
            cw, bq = self.group_loads(C, B, b_ring, bb, g, gq, q, r, slot, b_ring_stride16, w)
            # Codes: rc[i] = row 8 gq + i, elements 32 q .. + 31 (bytes 16 q .. + 15);
            # block scales of blocks 2 q, 2 q + 1 of the same rows (two bytes).
            read_w = cute.recast_ptr(read, dtype=Uint32)
            rc_base = (read_w + (slot * read_stride16 * 4 + hh * (P * N // 8) + Int64(gq * (8 * N // 8) + 4 * q))).toint()
            rc = []
            for i in cutlass.range_constexpr(8):
                rc.append(bits.ld_global_v4_u32(rc_base + (N // 2) * i, self.rc_hint))
            s_base = slot * scale_stride + hh * (P * BLOCKS) + Int64(gq * (8 * BLOCKS) + 2 * q)
            bs4 = []  # rows 8 gq + 2 mt (bits [15:0]) and + 1 ([31:16]), blocks 2 q, 2 q + 1
            for mt in cutlass.range_constexpr(4):
                sb = [Uint32(scales[s_base + BLOCKS * (2 * mt + i // 2) + i % 2]) for i in range(4)]
                bs4.append(sb[0] | (sb[1] << 8) | (sb[2] << 16) | (sb[3] << 24))
            # The live second-level scale g = 2**E of this slot and group (format.md 4);
            # `& 1` keeps a corrupt parity word inside the slot's meta.
            par = Int64(parity[slot * parity_stride] & Int32(1))
            a_live = meta[slot * meta_stride + g * 2 + par].bitcast(Int32) & Int32(0x7FFFFFFF)
            g_scale = bits.exp2_int(bits.pow2_exponent_above(a_live, bits_nvfp4.NVFP4_MANT_LIMIT, bits_nvfp4.NVFP4_E_OFF))
            xw, dt_k, dt_raw, bias, a_h, d0, d1, xo = self.head_loads(
                x, x_ring, dt_ring, dt, A, D, dt_bias, bb, hh, gq, q, lane, r, slot,
                x_ring_stride16, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
            )

            # Row dots by block: B column j holds C' on block j's k-values and zeros
            # elsewhere, so accumulator column j is the dot of an A row with C' over block
            # j, and no A value is scaled. Lane (gq, q) supplies column gq for its k-values
            # of chunk c (code words 2 c, 2 c + 1: block 2 q + c): C' where gq = 2 q + c,
            # else C times a zero factor (an infinite C gives NaN there; the dot is not
            # finite then anyway).
            # C' pairs in the decoded order: code word wd (elements n = 32 q + 8 wd + e)
            # decodes to f16 words j = (element order[2 j], order[2 j + 1]).
            down, up = self.c_prime(cw)
            cf = []  # C[32 q + m] * down or * 0, m = 0..31 (FP32)
            for c in cutlass.range_constexpr(2):
                down_c = sel(gq == 2 * q + c, down, Float32(0.0))
                for v in cutlass.range_constexpr(8):
                    pair = bf16x2_to_f32x2(cw[c][v])
                    cf += [pair[0] * down_c, pair[1] * down_c]
            order = self.decode_order
            chm = []  # chm[wd][j]
            for wd in cutlass.range_constexpr(4):
                chm.append([f32x2_to_f16x2(cf[8 * wd + order[2 * j]], cf[8 * wd + order[2 * j + 1]]) for j in range(4)])
            # The k-steps of code word wd take its decoded words j0 (k = 2 q, 2 q + 1) and
            # j0 + 1 (k = 2 q + 8, + 9), j0 = 0, 2. acc = (rows 8 gq + 2 mt, + 1) x
            # (blocks 2 q, 2 q + 1): times this lane's own block scales (bs4[mt]), then
            # summed over the quad's four lanes.
            b0 = (q % 2) == 1
            half = []  # m-tiles 2 h, 2 h + 1 summed over lane pairs -> m-tile 2 h + q % 2
            for h in cutlass.range_constexpr(2):
                part = []
                for mt in cutlass.range_constexpr(2 * h, 2 * h + 2):
                    acc = [Float32(0.0)] * 4
                    for wd in cutlass.range_constexpr(4):
                        lo = self.e2m1x8_f16x2(rc[2 * mt][wd])
                        hi = self.e2m1x8_f16x2(rc[2 * mt + 1][wd])
                        for j0 in cutlass.range_constexpr(0, 4, 2):
                            a = [lo[j0], hi[j0], lo[j0 + 1], hi[j0 + 1]]
                            acc = mma_f16_16x8x16(a, [chm[wd][j0], chm[wd][j0 + 1]], acc)
                    s0 = bits.f16x2_to_f32x2(bits_nvfp4.DSL_OPS.e4m3x2_f16x2(bs4[mt], 0))
                    s1 = bits.f16x2_to_f32x2(bits_nvfp4.DSL_OPS.e4m3x2_f16x2(bs4[mt], 1))
                    part.append([acc[0] * s0[0] + acc[1] * s0[1], acc[2] * s1[0] + acc[3] * s1[1]])
                # Quad sum, butterfly: lane q ends with m-tile q's two rows (finish's selects).
                row = []
                for i in cutlass.range_constexpr(2):
                    mine = sel(b0, part[1][i], part[0][i])
                    other = sel(b0, part[0][i], part[1][i])
                    row.append(mine + cute.arch.shuffle_sync_bfly(other, 1))
                half.append(row)
            b1 = (q // 2) == 1
            dots = []
            for i in cutlass.range_constexpr(2):
                mine = sel(b1, half[1][i], half[0][i])
                other = sel(b1, half[0][i], half[1][i])
                dots.append(mine + cute.arch.shuffle_sync_bfly(other, 2))
            rd = [dots] * 4
            if cutlass.const_expr(self.trace_addr):
                c2 = bits.clock_after(dots[1].bitcast(Int32))
            # R[p] = g (dot' 2**7 2**e), dot' = sum v s 2**-7 C'; the dots here are
            # sum v s C' / DECODE_FACTOR (decoded values v / factor, soft or hardware).
            self.finish(
                cw, bq, w, s_bc, xw, dt_k, dt_raw, bias, a_h, d0, d1, xo, rd, up * Float32(self.decode_factor), [g_scale, g_scale],
                bb, hh, gq, q, lane, r, slot,
                out, x_ring, dt_ring, b_ring, x_ring_stride16, dt_ring_stride, b_ring_stride16,
            )
            if cutlass.const_expr(self.trace_addr):
                c3 = bits.clock_after(t)
                self.trace_record(
                    t, bx, b,
                    [gt0, bits.globaltimer_after(t), c0, c1, c2, c3, bits.clock_after(t), Int64(bits.sm_id()) | (Int64(1) << 32)],
                )


__all__ = ["DecodeFp8Warp", "DecodeNvfp4Warp", "heads_per_cta"]
