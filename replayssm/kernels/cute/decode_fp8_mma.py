"""Non-flush decode kernel for the FP8 read copy (CuTe DSL, tensor cores).

For every batch row whose plan says valid and not flush (docs/format.md section 5):

    y[p] = exp(A pre_r) scale[p] sum_n e4m3(code[p, n]) C[n]
           + sum_{j <= r} dt_j exp(A (pre_r - pre_j)) (B_j . C) x_j[p] + D[p] x[p]

with ring entries j < r and the current token as entry r, and the token's (x, processed
dt, B) stored at ring entry r. It reads the read copy, never the checkpoint, and writes
no state. Padding and flush rows return at once (the prepare kernel zeroed the outputs of
padding rows; the flush kernel owns flush rows), so both kernels launch every step and a
captured CUDA graph replays any mix of rows.

Opt-in ($REPLAYSSM_FP8_DECODE=mma): on an H200 this kernel alone takes 17-26 % longer
than the SIMT one (decode_fp8.py) at batch 256 and 1024 (whole steps: 8-20 % slower, batch
1 ~25 %), whatever its shape; it is the compute core of a pipelined
design (docs/perf-notes-cute.md, session 2).

Grid (groups * HPG / heads_per_cta, batch): a CTA takes heads_per_cta heads of one group
for one row, one warp per head (two with warps_per_head=2, each taking half the m-tiles).
Each lane first starts asynchronous copies (cp.async) of its head's codes and ring x into
its warp's shared memory and loads its scalars; the CTA meanwhile computes what the heads
of a group share: B_j . C for the 16 ring entries, and C split into three e4m3 terms,

    C 2**-e = c1 + c2 + c3,  c1 = e4m3(C 2**-e), c2 = e4m3(C 2**-e - c1), ...

(2**-e the power of two that brings max |C| to at most 448; three terms hold bf16's 8
significant bits except below e4m3's subnormal step, 2**-9 of the scaled C, i.e. an
absolute error under 2**-17 max |C|). Each warp then computes the read-copy row dots of
its head on the tensor cores: 16 `mma.m16n8k32` e4m3 x e4m3 -> f32 with the codes as A
(64 x 128) and the three terms as columns 0..2 of B (128 x 8); the sum of the three
output columns is the row dot times 2**-e. The kernel writes no decode of its own: on
sm_90a ptxas lowers the FP8 mma.sync to f16 HMMAs with one F2FP per two codes (Hopper's
mma.sync has no FP8 path; wgmma has).

Lane 4 g + q of a warp feeds, for m-tile mt (0..3), state rows 8 g + 2 mt (MMA row g)
and 8 g + 2 mt + 1 (MMA row g + 8): bytes 16 q .. 16 q + 15 and 64 + 16 q .. + 15 of each
(k-step s takes bytes 8 (s & 1) .. + 7 of chunk s >> 1, i.e. the MMA's k index is a
permutation of n that A and B share). After the MMAs the four lanes of group g hold the
dots of rows 8 g .. 8 g + 7; lane q keeps rows 8 g + 2 q and 8 g + 2 q + 1 and computes
their outputs, ring replay included.

Accuracy: the products of e4m3 codes are exact; the tensor core adds them with a
reduced-precision aligned sum (relative error ~2**-13 of the largest partial sum per
MMA), two orders of magnitude below the e4m3 read copy's own error (2**-4 relative per
element) and below the bf16 rounding of the output.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from . import bits
from .bits import bf16x2_to_f32x2 as _bf16x2, sel, softplus, vec as _vec, xor_sum as _xor_sum
from .decode_fp8 import DecodeFp8
from .mma import mma_e4m3_16x8x32

P, N, RING = 64, 128, 16
MAX_WARPS = 16
# Heads per CTA (a divisor of the heads per group): 2, 4 and 8 gave 34.37 / 34.09 / 33.68
# us per step at batch 256 and 107.30 / 104.95 / 107.93 at 1024 on an H200 (within 3 %;
# docs/perf-notes-cute.md). With 4, the 64-register cap that min_blocks_per_mp implies
# spills 16 bytes a thread (measured that way).
HEADS_PER_CTA = 4
# Terms of C (columns of the MMA's B operand).
TERMS = 3
CODE_WORDS = P * N // 4  # one head's read copy, in words
# amax <= 448 * 2**e (as the FP8 row scale, formats.fp8_row_scale).
FP8_MANT_LIMIT, FP8_E_OFF = 0x600000, 8


def warps_for(hpg: int, limit: int = MAX_WARPS) -> int:
    """Heads per CTA: the largest divisor of the heads per group up to `limit`."""
    return max(d for d in range(1, min(hpg, limit) + 1) if hpg % d == 0)


class DecodeFp8Mma(DecodeFp8):
    """Non-flush decode for one geometry (heads, groups) on the tensor cores; the same
    code for every arch. Takes DecodeFp8's launcher (its pointer and stride arguments)
    with its own kernel and launch shape."""

    name = "decode_fp8_mma"

    def __init__(self, heads: int, groups: int, *, heads_per_cta: int = HEADS_PER_CTA, warps_per_head: int = 1) -> None:
        self.heads, self.groups = heads, groups
        self.hpg = heads // groups
        # Warps per head (1 or 2): two halve each warp's serial work and double the warps
        # an SM holds; measured no faster (docs/perf-notes-cute.md), 1 by default.
        if warps_per_head not in (1, 2):
            raise ValueError(f"warps_per_head must be 1 or 2; got {warps_per_head}")
        self.wph = warps_per_head
        self.warps = warps_for(self.hpg, heads_per_cta)  # heads per CTA
        self.splits = self.hpg // self.warps  # CTAs per (row, group)
        self.mt = 4 // self.wph  # m-tiles per warp
        self.rpl = self.mt // 2  # output rows per lane

    @property
    def threads(self) -> int:
        return 32 * self.warps * self.wph

    def grid(self, batch):
        return [self.groups * self.splits, batch, 1]

    def launch_options(self) -> dict:
        return {
            "min_blocks_per_mp": max(1, 32 // (self.warps * self.wph)),
            "preferred_smem_carveout": -1,  # the driver's choice (and no device query at compile time)
        }

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
        G, HPG, WARPS, WPH = self.groups, self.hpg, self.warps, self.wph
        THREADS = 32 * WARPS * WPH
        t, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        smem = SmemAllocator()
        s_ct = smem.allocate_tensor(Uint32, cute.make_layout(TERMS * N // 4), byte_alignment=16)
        s_bc = smem.allocate_tensor(Float32, cute.make_layout(RING), byte_alignment=16)
        s_pow = smem.allocate_tensor(Float32, cute.make_layout(1), byte_alignment=4)
        # Per warp: its m-tiles' codes (8 KiB / WPH) and ring x (2 KiB), each lane's own words.
        s_codes = smem.allocate_tensor(Uint32, cute.make_layout(WARPS * CODE_WORDS), byte_alignment=16)
        s_xr = smem.allocate_tensor(Uint32, cute.make_layout(WARPS * WPH * RING * 32), byte_alignment=16)

        bb = Int64(b)
        # The whole plan row at once (one memory latency): 1 exactly for valid rows that
        # do not flush (flush implies valid).
        live = Int32(plan_valid[bb]) - Int32(plan_flush[bb])
        slot = plan_slot[bb]
        r = Int32(plan_ring[bb])
        if live == Int32(1):
            g = Int64(bx // self.splits)
            split = bx % self.splits  # which WARPS heads of the group this CTA takes
            lane = t % 32
            w = t // 32
            sub = w % WPH  # which m-tiles of its head this warp takes
            h0 = g * HPG + Int64(split * WARPS + w // WPH)
            gq = lane // 4
            q = lane % 4
            read_w = cute.recast_ptr(read, dtype=Uint32)
            xr_w = cute.recast_ptr(x_ring, dtype=Uint32)
            x_w = cute.recast_ptr(x, dtype=Uint32)
            slot_rw = slot * read_stride16 * 4

            # This warp's first head: codes and ring x copied to shared memory
            # asynchronously, in flight during the shared part.
            my_codes = s_codes.iterator + w * (CODE_WORDS // WPH)
            my_xr = s_xr.iterator + w * (RING * 32)
            self.copy_head(read_w, xr_w, my_codes, my_xr, slot_rw, slot, r, h0, sub, lane, gq, q, x_ring_stride16)
            scalars = self.head_loads(
                h0, bb, slot, r, sub, lane, gq, q, x_w, scales, dt_ring, dt, A, D, dt_bias,
                scale_stride, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
            )

            # Shared by the group: B_j . C (entries > r are zero) and the e4m3 terms of C
            # (warp 0). Predicated loads, no branch before the barrier.
            c_w = cute.recast_ptr(C, dtype=Uint32)
            b_w = cute.recast_ptr(B, dtype=Uint32)
            br_w = cute.recast_ptr(b_ring, dtype=Uint32)
            for it in cutlass.range_constexpr((RING * 16 + THREADS - 1) // THREADS):
                tt = t + it * THREADS
                if tt < RING * 16:
                    j = tt // 16
                    ch = tt % 16
                    cw = _vec(c_w, (bb * G + g) * (N // 2) + ch * 4, 4).load()
                    curw = _vec(b_w, (bb * G + g) * (N // 2) + ch * 4, 4).load()
                    br_off = slot * b_ring_stride16 * 4 + (g * RING + Int64(j)) * (N // 2) + ch * 4
                    ringw = bits.ld_global_v4_u32_if((br_w + br_off).toint(), sel(j < r, Int32(1), Int32(0)))
                    c_v = []
                    part = Float32(0.0)
                    for i in cutlass.range_constexpr(4):
                        cf = _bf16x2(cw[i])
                        bf = _bf16x2(sel(j == r, curw[i], ringw[i]))
                        c_v += cf
                        part = part + bf[0] * cf[0] + bf[1] * cf[1]
                    if j == r:
                        if split == 0:  # B is shared by the group: one CTA writes it
                            _vec(br_w, br_off, 4).store(curw)
                    bc = _xor_sum(part, 16)
                    if ch == 0:
                        s_bc[j] = bc
                    if tt < 32:
                        # Warp 0: lanes 16..31 hold the same chunks of C as lanes 0..15.
                        e = self.c_exponent(c_v)
                        if j == 0:
                            self.c_terms(c_v, e, ch, s_ct, s_pow)
            bits.cp_async_wait_all()
            cute.arch.sync_threads()

            # B operand: lane (g, q) holds column g = term g (zero for g >= TERMS) at the
            # 32 k positions of thread q, as 8 words (two per k-step).
            row = sel(gq < TERMS, gq, Int32(0))
            bw0 = _vec(s_ct.iterator, row * (N // 4) + q * 4, 4).load()
            bw1 = _vec(s_ct.iterator, row * (N // 4) + 16 + q * 4, 4).load()
            bfrag = []
            for i in cutlass.range_constexpr(8):
                v = bw0[i] if i < 4 else bw1[i - 4]
                bfrag.append(sel(gq < TERMS, v, Uint32(0)))
            e_pow = s_pow[0]

            codes = self.read_codes(my_codes, lane)
            xr_words = [my_xr[j * 32 + lane] for j in range(RING)]
            self.head(
                h0, bb, slot, r, sub, lane, gq, q, codes, xr_words, scalars, bfrag, e_pow, s_bc, xr_w,
                dt_ring, out, x_ring_stride16, dt_ring_stride,
            )

    def lane_rows(self, sub, gq, q) -> list:
        """This lane's output rows: of the 2 MT rows 8 gq + 2 MT sub .. its quad holds
        after the MMAs (MMA rows g, g + 8 of m-tile mt are state rows 8 g + 2 mt and
        8 g + 2 mt + 1), lane q takes RPL consecutive ones."""
        base = 8 * gq + 2 * self.mt * sub + self.rpl * q
        return [base + k for k in range(self.rpl)]

    def x_word(self, sub, gq, q):
        """Index of the bf16 pair holding this lane's first row (within a 64-row vector)."""
        return self.lane_rows(sub, gq, q)[0] // 2

    @cute.jit
    def copy_head(self, read_w, xr_w, my_codes, my_xr, slot_rw, slot, r, hh, sub, lane, gq, q, x_ring_stride16):
        """Start this lane's asynchronous copies of head hh into its warp's buffers: the
        16-byte code chunks it feeds to the MMAs of its m-tiles (chunk i to word
        4 (32 i + lane): every shared access of the warp is 512 contiguous bytes) and the
        bf16 pair of x_j holding its rows, for ring entries j < r (zeros beyond, never read)."""
        for ml in cutlass.range_constexpr(self.mt):
            mt = sub * self.mt + ml
            for half in cutlass.range_constexpr(2):
                rw = slot_rw + (Int64(hh) * P + Int64(8 * gq + 2 * mt + half)) * (N // 4) + Int64(q * 4)
                for c in cutlass.range_constexpr(2):
                    i = (ml * 2 + half) * 2 + c
                    bits.cp_async_16((my_codes + (i * 32 + lane) * 4).toint(), (read_w + rw + 16 * c).toint())
        xr_head = slot * x_ring_stride16 * 4 + Int64(hh) * (RING * P // 2) + Int64(self.x_word(sub, gq, q))
        for j in cutlass.range_constexpr(RING):
            bits.cp_async_4_if(
                (my_xr + j * 32 + lane).toint(), (xr_w + (xr_head + j * (P // 2))).toint(), sel(Int32(j) < r, Int32(1), Int32(0))
            )

    @cute.jit
    def read_codes(self, my_codes, lane):
        """codes[ml][half][c]: the words copy_head fetched for this lane."""
        codes = []
        for ml in cutlass.range_constexpr(self.mt):
            pair = []
            for half in cutlass.range_constexpr(2):
                pair.append([_vec(my_codes, ((ml * 2 + half) * 2 + c) * 128 + lane * 4, 4).load() for c in range(2)])
            codes.append(pair)
        return codes

    @cute.jit
    def c_exponent(self, c_v):
        """e with max |C| <= 448 * 2**e, from the 16 lanes that hold one copy of C."""
        amax = Int32(0)
        for i in cutlass.range_constexpr(8):
            amax = cutlass.max(amax, c_v[i].bitcast(Int32) & Int32(0x7FFFFFFF))
        off = 1
        while off < 16:
            amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, off))
            off *= 2
        return bits.pow2_exponent_above(amax, FP8_MANT_LIMIT, FP8_E_OFF)

    @cute.jit
    def c_terms(self, c_v, e, ch, s_ct, s_pow):
        """Threads ch = 0..15 of ring entry 0 (n = 8 ch .. + 7): the power of two 2**e
        and the three e4m3 terms of C 2**-e into shared memory (no shuffles: these
        lanes are half a warp)."""
        inv = bits.exp2_int(-e)
        if ch == 0:
            s_pow[0] = bits.exp2_int(e)
        rest = [c_v[i] * inv for i in range(8)]
        for term in cutlass.range_constexpr(TERMS):
            words = []
            for m in cutlass.range_constexpr(2):
                halves = []
                for pr in cutlass.range_constexpr(2):
                    i = 4 * m + 2 * pr
                    code = bits.e4m3x2_rn_hw(rest[i], rest[i + 1])
                    dec = bits.e4m3x2_to_f32x2(code)
                    rest[i] = rest[i] - dec[0]
                    rest[i + 1] = rest[i + 1] - dec[1]
                    halves.append(code)
                words.append(halves[0] | (halves[1] << 16))
            s_ct[term * (N // 4) + ch * 2] = words[0]
            s_ct[term * (N // 4) + ch * 2 + 1] = words[1]

    @cute.jit
    def head_loads(
        self, hh, bb, slot, r, sub, lane, gq, q, x_w, scales, dt_ring, dt, A, D, dt_bias,
        scale_stride, dt_ring_stride, dt_stride_b, dt_stride_h, a_stride, dt_bias_stride, d_stride_h, d_stride_p,
    ):
        """The scalars `head` needs, loaded where this call stands (before the barrier):
        [x pair word, raw dt, dt_bias, dt_j (lane j % 16, 0 for j >= r), A, then scale[p]
        and D[p] of each of this lane's rows]."""
        H = self.heads
        hh = Int64(hh)
        one = Int32(1)
        jl = lane % 16

        def f32(ptr, off, pred=one):
            return bits.ld_global_u32_if((ptr + off).toint(), pred).bitcast(Float32)

        vals = [
            bits.ld_global_u32_if((x_w + ((bb * H + hh) * (P // 2) + Int64(self.x_word(sub, gq, q)))).toint(), one),
            f32(dt, bb * dt_stride_b + hh * dt_stride_h),
            f32(dt_bias, hh * dt_bias_stride),
            f32(dt_ring, slot * dt_ring_stride + hh * RING + Int64(jl), sel(jl < r, one, Int32(0))),
            f32(A, hh * a_stride),
        ]
        for p in self.lane_rows(sub, gq, q):
            vals.append(f32(scales, slot * scale_stride + hh * P + Int64(p)))
            vals.append(f32(D, hh * d_stride_h + Int64(p) * d_stride_p))
        return vals

    @cute.jit
    def head(
        self, hh, bb, slot, r, sub, lane, gq, q, codes, xr_words, scalars, bfrag, e_pow, s_bc, xr_w,
        dt_ring, out, x_ring_stride16, dt_ring_stride,
    ):
        """This warp's share of one head: row dots of its m-tiles on the tensor cores,
        ring replay and outputs of its lanes' rows (`scalars`: what head_loads fetched)."""
        H, MT, RPL = self.heads, self.mt, self.rpl
        xw, dt_raw, dt_b, dt_j, a_h = scalars[:5]
        rows = self.lane_rows(sub, gq, q)
        # Ring coefficients: lane j (and j + 16) holds entry j: pre_j = dt_0 + .. + dt_j
        # (shuffle scan), coef_j = dt_j exp(A (pre_r - pre_j)) (B_j . C); 0 beyond r.
        jl = lane % 16
        dtr = slot * dt_ring_stride + hh * RING
        dt_cur = softplus(dt_raw + dt_b)
        dt_j = sel(jl == r, dt_cur, dt_j)
        if sub == 0:
            if lane == r:
                dt_ring[dtr + Int64(r)] = dt_cur
        pre = dt_j
        off = 1
        while off < RING:
            up = cute.arch.shuffle_sync_up(pre, off)
            pre = sel(jl >= off, pre + up, pre)
            off *= 2
        pre_r = cute.arch.shuffle_sync(pre, r)
        coef = dt_j * cute.math.exp(a_h * (pre_r - pre)) * s_bc[jl]
        decay = cute.math.exp(a_h * pre_r)

        # Row dots: MT m-tiles x 4 k-steps of m16n8k32; dots[2 ml + half] is the dot of
        # state row 8 gq + 2 (MT sub + ml) + half, in all four lanes of the quad.
        dots = []
        for ml in cutlass.range_constexpr(MT):
            acc = [Float32(0.0)] * 4
            for s in cutlass.range_constexpr(4):
                c0 = codes[ml][0][s // 2]
                c1 = codes[ml][1][s // 2]
                i = 2 * (s % 2)
                acc = mma_e4m3_16x8x32(
                    [c0[i], c1[i], c0[i + 1], c1[i + 1]], [bfrag[2 * s], bfrag[2 * s + 1]], acc
                )
            dots += [_xor_sum(acc[0] + acc[1], 4), _xor_sum(acc[2] + acc[3], 4)]
        # Lane q's rows are local rows RPL q + k of the quad's 2 MT.
        mine = []
        for k in cutlass.range_constexpr(RPL):
            d = dots[0]
            for c in cutlass.range_constexpr(1, 2 * MT):
                d = sel(q * RPL + k == c, dots[c], d)
            mine.append(d)

        # Ring replay over entries j < r (zero words beyond), then the current token.
        accs = [Float32(0.0)] * RPL
        for j in cutlass.range_constexpr(RING):
            c_j = cute.arch.shuffle_sync(coef, j)
            xv = self.lane_x(xr_words[j], q)
            for k in cutlass.range_constexpr(RPL):
                accs[k] = accs[k] + c_j * xv[k]
        xr_head = slot * x_ring_stride16 * 4 + hh * (RING * P // 2) + Int64(self.x_word(sub, gq, q))
        if cutlass.const_expr(RPL == 2):
            xr_w[xr_head + Int64(r) * (P // 2)] = xw
        else:
            if q % 2 == 0:  # lanes q, q + 1 share the pair: one writes it
                xr_w[xr_head + Int64(r) * (P // 2)] = xw
        xc = self.lane_x(xw, q)
        c_r = cute.arch.shuffle_sync(coef, r)
        f = decay * e_pow
        for k in cutlass.range_constexpr(RPL):
            sc_k, d_k = scalars[5 + 2 * k], scalars[6 + 2 * k]
            y = f * sc_k * mine[k] + (accs[k] + c_r * xc[k]) + d_k * xc[k]
            out[(bb * H + hh) * P + Int64(rows[k])] = BFloat16(y)

    def lane_x(self, word, q) -> list:
        """This lane's x values from the bf16 pair holding its rows."""
        v = _bf16x2(word)
        if self.rpl == 2:
            return v
        return [sel(q % 2 == 0, v[0], v[1])]


__all__ = ["DecodeFp8Mma", "warps_for"]
