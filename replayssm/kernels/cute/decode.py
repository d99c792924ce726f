"""Non-flush decode kernel (CuTe DSL): one warp per (row, head), registers only, tensor-core
dots (docs/design.md section 3). The read-copy format (`read_copy.Fp8` / `Nvfp4` / `Fp16`)
supplies the read-copy loads and row dots; the rest is shared. For every batch row whose
plan says valid and not flush (docs/format.md section 5):

    y[p] = exp(A pre_r) R[p] + sum_{j <= r} dt_j exp(A (pre_r - pre_j)) (B_j . C) x_j[p] + D[p] x[p]

with ring entries j < r, the current token as entry r (its x, processed dt and B are
stored there) and R[p] the read-copy row dot. Padding and flush rows return at once, so a
captured CUDA graph of both kernels replays any mix of rows.

Per warp, lane (g, q) = (lane // 4, lane % 4) (fragment layouts in mma.py):

1. Row dots, `mma.m16n8k16` f16 x f16 -> f32, four m-tiles by eight k-steps: lane (g, q)
   holds rows p = 8 g + i (i = 0..7), m-tile mt rows i = 2 mt (MMA row g) and 2 mt + 1
   (MMA row g + 8); k runs over a permutation, shared by A and B, of lane q's n-set (the
   32 values of n its loads hold, `c_word`). C enters as C' = C 2**-e in f16, max |C'| in
   [2**14, 2**15) (bf16's 8 significant bits fit f16's 11 for |C'| >= 2**-17, i.e.
   within 2**-31 of max |C|; below that, the f16 rounding error is < 2**-25 of a C' unit).
2. B_j . C for the 16 ring entries (zero beyond r), bf16 MMA (exact products) over the
   same n-sets: A rows g and g + 8 are entries g and g + 8, B is C.
3. The scan, lane k % 16 = entry k: coef_k = dt_k exp(A (pre_r - pre_k)) (B_k . C).
4. Ring replay sum_j coef_j x_j[p], bf16 MMA: A rows as in 1, k = entries (lane (g, q)
   loads entries 2 q, 2 q + 1, 2 q + 8, 2 q + 9 at p = 8 g .. + 7 and pairs them by byte
   permutes); B's even columns coef in bf16, its odd columns the bf16 remainder coef -
   bf16(coef): c0 + c1 is row g, c2 + c3 row g + 8.
5. Lane (g, q) writes rows 8 g + 2 q and 8 g + 2 q + 1 (m-tile q).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda_driver
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ...layout import RING
from . import args as A
from . import bits
from .bits import bf16x2_to_f32x2, f32x2_to_bf16x2, prmt, sel, softplus
from .mma import mma_bf16_16x8x16

# 2**-e brings max |C| to [2**14, 2**15).
C_TARGET_EXP = 14
HEADS_PER_CTA = 4
# CTAs of HEADS_PER_CTA warps an SM should hold (registers capped at 65536 / (32 x
# HEADS_PER_CTA x this)); 4 measured best (docs/design.md). Formats may override it
# (`step_ctas_per_sm`, read_copy.py); `Decode.ctas_per_sm` scales it to the CTA.
CTAS_PER_SM = 4


def heads_per_cta(hpg: int, limit: int = HEADS_PER_CTA) -> int:
    """The largest of 8, 4, 2, 1 up to `limit` that divides the heads per group (a CTA's
    heads share one group)."""
    return max(d for d in (1, 2, 4, 8) if d <= limit and hpg % d == 0)


class Decode:
    """The non-flush step for one (format, heads, groups) and launch variant: `pdl` (wait
    for the prepare kernel by griddepcontrol before the first global access), `read_hint`
    (the PTX cache qualifier of the read-copy loads) and `dense_rows` (x, B, C rows at
    their constant contiguous stride, else at `Inputs`' runtime row strides)."""

    def __init__(self, fmt, heads: int, groups: int, *, pdl: bool = False, read_hint: str = "",
                 dense_rows: bool = True) -> None:
        self.fmt = fmt
        self.P, self.N = fmt.P, fmt.N  # head dim, state dim
        self.dense_rows = dense_rows
        self.heads, self.groups = heads, groups
        self.hpg = heads // groups
        self.hpc = heads_per_cta(self.hpg)
        self.pdl = pdl
        self.read_hint = read_hint

    @property
    def ctas_per_sm(self) -> int:
        """The format's CTAs an SM for CTAs of HEADS_PER_CTA warps, scaled to this CTA's
        warps, so that a CTA of 2 heads gets the registers a thread of 4 does
        (docs/design.md section 3)."""
        return self.fmt.step_ctas_per_sm * HEADS_PER_CTA // self.hpc

    @cute.jit
    def __call__(self, ring, copy, inputs, plan, batch: Int32, stream: cuda_driver.CUstream):
        # preferred_smem_carveout -1: the driver's choice (no device query at compile time).
        self.kernel(ring, copy, inputs, plan).launch(
            grid=[self.heads // self.hpc, batch, 1],
            block=[32 * self.hpc, 1, 1],
            stream=stream,
            min_blocks_per_mp=self.ctas_per_sm,
            preferred_smem_carveout=-1,
            **({"use_pdl": True} if self.pdl else {}),
        )

    @cute.kernel
    def kernel(self, ring, copy, inputs, plan):
        t, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        bb = Int64(b)
        live, slot, r = self.plan_row(plan, bb)
        if live == Int32(1):  # the same for the whole CTA (one row)
            self.live_row(ring, copy, inputs, bb, slot, r, t, bx)

    @cute.jit
    def plan_row(self, plan, bb):
        """(live, slot, r) of batch row bb: live is 1 exactly for valid rows that do not
        flush. ptxas sinks the slot and ring-index loads below the branch on live (sm_90a
        SASS); making the branch wait for them too made FP8 steps slower on the H200
        (about 0.6 / 1.5 us at batch 256 / 1024), so it stays this way."""
        live = Int32(plan.valid[bb]) - Int32(plan.flush[bb])
        slot_w = bits.ld_global_v2_u32_if((plan.slot + bb).toint(), Int32(1))
        r = Int32(bits.ld_global_u32_if((plan.ring_index + bb).toint(), Int32(1)))
        return live, Int64(slot_w[0]) | (Int64(slot_w[1]) << 32), r

    @cute.jit
    def live_row(self, ring, copy, inputs, bb, slot, r, t, bx):
        """Steps 1-5 for a live row: every load issued first, then B_j . C, the scan, the
        ring replay, the outputs and the ring writes."""
        lane = t % 32
        hh = Int64(bx * self.hpc + t // 32)
        gq, q, g = lane // 4, lane % 4, hh // self.hpg
        w = Int32(t // 32)
        s_bc = SmemAllocator().allocate_tensor(Float32, cute.make_layout(RING * self.hpc), byte_alignment=16)
        cw, bq = self.group_loads(inputs, ring.b, bb, g, gq, q, r, slot, ring.b_stride16, w)
        loaded = self.fmt.load_rows(copy, slot, hh, g, gq, q, self.read_hint)
        xw, dt_k, dt_raw, bias, a_h, d0, d1, xo, tail = self.head_loads(
            ring, inputs, bb, hh, gq, q, lane, r, slot)
        down, up = self.c_prime(cw)
        # rd[mt]: the row dots of m-tile mt (rows 8 gq + 2 mt, + 1); the read-copy term of
        # row p0 + i is outer[i] * (inner * dot), in that order (no intermediate overflow
        # where the term itself is finite).
        rd, inner, outer = self.fmt.row_dots(loaded, cw, down, up, gq, q)
        out = inputs.out

        # B_j . C: this warp's k share, entries gq (acc[0]) and gq + 8 (acc[2]); the
        # partial sums meet in shared memory.
        acc_bc = self.bc_partial(bq, cw, w)
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
        pre = self.prefix_sum(dt_k, k)
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
        acc_x = [mma_bf16_16x8x16(self.x_fragment(xw, mt), bfr, [Float32(0.0)] * 4) for mt in range(4)]

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
        o = (bb * self.heads + hh) * self.P + Int64(p0)
        out[o] = BFloat16(y0)
        out[o + 1] = BFloat16(y1)
        if cutlass.const_expr(self.fmt.TAIL):  # rows 64 + 2 gq, 65 + 2 gq: m-tile 4, lanes q = 0
            xt, dtl, xot = tail
            acc_t = mma_bf16_16x8x16(self.x_fragment([[w_] for w_ in xt], 0), bfr, [Float32(0.0)] * 4)
            if q == 0:
                ot = (bb * self.heads + hh) * self.P + Int64(64 + 2 * gq)
                for i in cutlass.range_constexpr(2):
                    yt = decay * (outer[2 + i] * (inner * rd[4][i])) + (acc_t[2 * i] + acc_t[2 * i + 1])
                    out[ot + i] = BFloat16(yt + dtl[i] * xot[i])

        # The step's token into the ring: x (lanes with q = (r % 8) // 2), its processed
        # dt (lane r), B (the group's first head, lanes with gq = r % 8).
        if q == (r % 8) // 2:
            u = r % 2 + 2 * (r // 8)
            xs = xw[0]
            for uu in cutlass.range_constexpr(1, 4):
                xs = [sel(u == uu, xw[uu][i], xs[i]) for i in range(4)]
            xr_w = cute.recast_ptr(ring.x, dtype=Uint32)
            xr_row = slot * ring.x_stride16 * 4 + hh * (RING * self.P // 2) + Int64(4 * gq)
            bits.st_global_v4_u32((xr_w + (xr_row + Int64(r * (self.P // 2)))).toint(), xs)
            if cutlass.const_expr(self.fmt.TAIL):
                xst = tail[0][0]
                for uu in cutlass.range_constexpr(1, 4):
                    xst = sel(u == uu, tail[0][uu], xst)
                xr_w[slot * ring.x_stride16 * 4 + hh * (RING * self.P // 2)
                     + Int64(r * (self.P // 2) + 32 + gq)] = xst
        if lane == r:
            ring.dt[slot * ring.dt_stride + hh * RING + Int64(r)] = dt_k
        if (hh - Int64(w)) % self.hpg == 0:  # the CTA that holds the group's first head: each warp its share
            if gq == r % 8:
                br_w = cute.recast_ptr(ring.b, dtype=Uint32)
                dst_row = slot * ring.b_stride16 * 4 + g * (RING * self.N // 2) + Int64(r * (self.N // 2))
                for i in cutlass.range_constexpr(self.vh_per_warp):
                    dst = (br_w + (dst_row + Int64(self.vh_word(w * self.vh_per_warp + i, q)))).toint()
                    bits.st_global_v4_u32(dst, [sel(r >= 8, bq[1][i][u], bq[0][i][u]) for u in range(4)])

    @cute.jit
    def group_loads(self, inputs, b_ring, bb, g, gq, q, r, slot, b_ring_stride16, w):
        """C (cw[c][v], chunk c of lane q's n-set) and this warp's share of ring entries gq,
        gq + 8 of B at the same n (bq[e][i]: vector half w * vh_per_warp + i, `vh_word`; the
        step's B at r, zeros beyond r): the CTA's warps split B_j . C over k."""
        row_w = self.groups * self.N // 2  # words of a row of B or C
        c_w = cute.recast_ptr(inputs.C, dtype=Uint32)
        c_row = A.row_words(self.dense_rows, bb, inputs.c_stride16, row_w) + g * (self.N // 2)
        cw = []
        for c in cutlass.range_constexpr(self.fmt.CHUNKS):
            at = [(c_w + (c_row + Int64(self.fmt.c_word(c, q, h)))).toint() for h in range(2)]
            cw.append(bits.ld_global_v4_u32(at[0]) + bits.ld_global_v4_u32(at[1]))
        br_w = cute.recast_ptr(b_ring, dtype=Uint32)
        b_w = cute.recast_ptr(inputs.B, dtype=Uint32)
        br_row0 = slot * b_ring_stride16 * 4 + g * (RING * self.N // 2)
        b_row = A.row_words(self.dense_rows, bb, inputs.b_stride16, row_w) + g * (self.N // 2)
        bq = []
        for e in cutlass.range_constexpr(2):
            j = gq + 8 * e
            on = sel(j <= r, Int32(1), Int32(0))
            row = []
            for i in cutlass.range_constexpr(self.vh_per_warp):
                wo = Int64(self.vh_word(w * self.vh_per_warp + i, q))
                src = sel(j < r, (br_w + (br_row0 + Int64(j * (self.N // 2)) + wo)).toint(),
                          (b_w + (b_row + wo)).toint())
                row.append(bits.ld_global_v4_u32_if(src, on))
            bq.append(row)
        return cw, bq

    @property
    def vh_per_warp(self) -> int:
        """Vector halves (4 words, 2 k-steps of B_j . C) of the ring entries per warp."""
        vh = 2 * self.fmt.CHUNKS
        if vh % self.hpc:
            raise ValueError(
                f"heads per CTA must divide {vh} (the ring entries' vector halves); got {self.hpc}"
            )
        return vh // self.hpc

    def vh_word(self, vh, q):
        """Word offset of vector half vh (runtime) of lane q's n-set in a row of N."""
        return self.fmt.c_word(vh // 2, q, vh % 2)

    @cute.jit
    def head_loads(self, ring, inputs, bb, hh, gq, q, lane, r, slot):
        """Ring x (xw[u]: entry 2 q + u % 2 + 8 (u // 2) at p = 8 gq .. + 7, the step's x
        at r, zeros beyond), the scalars (dt of entry lane % 16, zero beyond r; the step's
        raw dt, dt_bias, A; D and x at the lane's output rows p0, p0 + 1) and at head dim
        80 `tail`: x words of the same entries (xt[u]), D and x at rows 64 + 2 gq, + 1."""
        one = Int32(1)
        xr_w = cute.recast_ptr(ring.x, dtype=Uint32)
        x_w = cute.recast_ptr(inputs.x, dtype=Uint32)
        x_row = A.row_words(self.dense_rows, bb, inputs.x_stride16, self.heads * self.P // 2)
        x_row = x_row + hh * (self.P // 2)
        x_cur = (x_w + (x_row + Int64(4 * gq))).toint()
        xr_row = slot * ring.x_stride16 * 4 + hh * (RING * self.P // 2) + Int64(4 * gq)
        xw = []
        for u in cutlass.range_constexpr(4):
            j = 2 * q + (u % 2) + 8 * (u // 2)
            src = sel(j < r, (xr_w + (xr_row + Int64(j * (self.P // 2)))).toint(), x_cur)
            xw.append(bits.ld_global_v4_u32_if(src, sel(j <= r, one, Int32(0))))
        k = lane % 16
        dtr = slot * ring.dt_stride + hh * RING
        dt_at = (ring.dt + (dtr + Int64(k))).toint()
        dt_k = bits.ld_global_u32_if(dt_at, sel(k < r, one, Int32(0))).bitcast(Float32)
        dt_raw = inputs.dt[bb * inputs.dt_stride_b + hh * inputs.dt_stride_h].to(Float32)  # exact
        bias = inputs.dt_bias[hh * inputs.dt_bias_stride]
        a_h = inputs.A[hh * inputs.a_stride]
        p0 = 8 * gq + 2 * q
        d0 = inputs.D[hh * inputs.d_stride_h + Int64(p0) * inputs.d_stride_p]
        d1 = inputs.D[hh * inputs.d_stride_h + Int64(p0 + 1) * inputs.d_stride_p]
        xo = bf16x2_to_f32x2(x_w[x_row + Int64(p0 // 2)])
        tail = None
        if cutlass.const_expr(self.fmt.TAIL):  # rows 64 + 2 gq, + 1: the fifth m-tile
            x_row = A.row_words(self.dense_rows, bb, inputs.x_stride16, self.heads * self.P // 2)
            x_row = x_row + hh * (self.P // 2) + Int64(32 + gq)
            xr_row = slot * ring.x_stride16 * 4 + hh * (RING * self.P // 2) + Int64(32 + gq)
            xt = []
            for u in cutlass.range_constexpr(4):
                j = 2 * q + (u % 2) + 8 * (u // 2)
                src = sel(j < r, (xr_w + (xr_row + Int64(j * (self.P // 2)))).toint(), (x_w + x_row).toint())
                xt.append(bits.ld_global_u32_if(src, sel(j <= r, Int32(1), Int32(0))))
            d = [inputs.D[hh * inputs.d_stride_h + Int64(64 + 2 * gq + i) * inputs.d_stride_p]
                 for i in range(2)]
            tail = (xt, d, bf16x2_to_f32x2(x_w[x_row]))
        return xw, dt_k, dt_raw, bias, a_h, d0, d1, xo, tail

    @cute.jit
    def c_prime(self, cw):
        """(down, up): C' = C down in f16 has max |C'| in [2**14, 2**15) and up = 1 / down
        (0 when max |C| < 2**-112); max |C| over the lane's four lanes q, which hold all N."""
        m = Uint32(0)
        for c in cutlass.range_constexpr(self.fmt.CHUNKS):
            for v in cutlass.range_constexpr(8):
                m = bits.max_u16x2(m, cw[c][v] & Uint32(0x7FFF7FFF))
        amax = Int32(cutlass.max(m >> 16, m & Uint32(0xFFFF)) << 16)  # FP32 bits of max |C|
        amax = bits.xor_reduce(amax, 4, cutlass.max)
        ef = amax >> 23  # biased exponent (255: Inf / NaN)
        down = (cutlass.min(Int32(127 + 127 + C_TARGET_EXP) - ef, Int32(254)) << 23).bitcast(Float32)
        up_field = ef - Int32(C_TARGET_EXP)
        up = sel(up_field >= Int32(1), up_field << 23, Int32(0)).bitcast(Float32)
        return down, up

    @staticmethod
    def prefix_sum(v, k):
        """Inclusive prefix sums of v over the 16 entries, lane k % 16 = entry k (both half
        warps alike), by shuffles."""
        off = 1
        while off < RING:
            prev = cute.arch.shuffle_sync_up(v, off)
            v = sel(k >= off, v + prev, v)
            off *= 2
        return v

    @staticmethod
    def x_fragment(xw, mt):
        """The replay MMA's A fragment of m-tile mt from the x words xw (`head_loads`):
        rows 8 gq + 2 mt (+ 1 for the high halves) by entries 2 q, 2 q + 1 (+ 8, + 9)."""
        return [prmt(xw[2 * i][mt], xw[2 * i + 1][mt], s) for i in range(2) for s in (0x5410, 0x7632)]

    @cute.jit
    def bc_partial(self, bq, cw, w):
        """This warp's k share of B_j . C (bf16 MMA): its vector halves of the entries' B
        (bq, `group_loads`) against the same words of the lane's C (cw; lane gq's own C
        column in the pending step). Accumulators: entries gq, gq + 8 by the MMA's columns
        2 q, 2 q + 1."""
        acc_bc = [Float32(0.0)] * 4
        for i in cutlass.range_constexpr(self.vh_per_warp):
            vh = w * self.vh_per_warp + i
            for hs in cutlass.range_constexpr(2):
                a = [bq[0][i][2 * hs], bq[1][i][2 * hs], bq[0][i][2 * hs + 1], bq[1][i][2 * hs + 1]]
                # C words 4 (vh % 2) + 2 hs, + 1 of chunk vh // 2 (vh is per warp: a select).
                b0, b1 = cw[0][2 * hs], cw[0][2 * hs + 1]
                for cand in cutlass.range_constexpr(1, 2 * self.fmt.CHUNKS):
                    v = 4 * (cand % 2) + 2 * hs
                    b0 = sel(vh == cand, cw[cand // 2][v], b0)
                    b1 = sel(vh == cand, cw[cand // 2][v + 1], b1)
                acc_bc = mma_bf16_16x8x16(a, [b0, b1], acc_bc)
        return acc_bc


__all__ = ["Decode", "heads_per_cta", "CTAS_PER_SM"]
