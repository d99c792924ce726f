"""Flush kernel (CuTe DSL) of every format, and the pending mode's fold (`PendingFold`); the
format (`read_copy`) supplies the checkpoint's rounding and the read copy's re-derivation.
For every batch row whose plan says flush (ring index 15, docs/format.md section 5):

    S = exp(A pre_15) float(checkpoint) + sum_{j=0..15} dt_j exp(A (pre_15 - pre_j)) x_j (x) B_j

in FP32 (entries 0..14 from the rings, 15 the current token), y = S . C + D x from the
unrounded S; the checkpoint is rewritten as FP16 with stochastic rounding (format.md section
6) and the read copy re-derived from S (section 3); the ring is not written (the next step
starts a period at entry 0). The CTAs of a (row, head) need no communication: every y[p],
FP8 row scale and NVFP4 block depends on state row p alone (the NVFP4 group amax is an
order-independent atomic max).

The fold, S = decay ckpt + X' B (K = 16, X'[p, j] = w_j x_j[p], B[j, n] = B_j[n]), runs on
`mma.m16n8k8` tf32 with X' split into hi (low 13 bits cleared) + lo (exact) and B exact in
tf32 (bf16): the FP32 fold to ~2**-21 relative per term. The MMA's n index is permuted
(`_b_slot`) so that a lane holds 16 consecutive columns of its two rows (`lane_geometry`):
16-byte checkpoint and read-copy accesses, adjacent pairs for the FP16x2 hash words.
docs/design.md gives the measurements behind the map.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda_driver
from cutlass import BFloat16, Float32, Int32, Int64, Uint32
from cutlass.memory import SmemAllocator

from ...layout import RING
from . import args as A
from . import bits
from .bits import bf16x2_to_f32x2 as _bf16x2, sel, softplus
from .bits import vec as _vec, vec_aligned as _vec_a, xor_reduce as _xor_reduce
from .mma import mma_tf32_16x8x8

NT = 8  # n-tiles of 8 per warp; a lane holds 2 rows x 16 columns
COLUMNS = 64  # state columns of a column part (4 lanes x 16)


class Shape(NamedTuple):
    """The flush CTA of a cache geometry: `mt` m-tiles of 16 state rows by `cp` parts of 64
    columns, a warp each, and `m_split` CTAs a (row, head). A lane's work is 2 rows x 16
    columns in every shape, so CTAs an SM scale with 1 / warps (16 warps: 128 registers)."""

    mt: int
    cp: int
    m_split: int

    @property
    def warps(self) -> int:
        return self.mt * self.cp

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def ctas(self, at_4_warps: float) -> float:  # CTAs an SM with the threads of that many 4-warp CTAs
        return at_4_warps * 4 / self.warps

    @property
    def min_ctas(self) -> int:  # the register bound: 16 warps an SM
        return 16 // self.warps


def shape(P: int, N: int) -> Shape:
    """64 / 128: 2 m-tiles x 2 parts (4 warps), 2 CTAs a head; 64 / 256: 2 x 4, 2 CTAs;
    80 (5 m-tiles): 1 m-tile x N / 64 parts, 5 CTAs a head."""
    mt = 2 if P % 32 == 0 else 1
    return Shape(mt, N // COLUMNS, P // (16 * mt))


def fold_ctas_per_sm(fmt) -> int:
    """The pending fold's CTAs an SM (grid, register bound): the format's, scaled by `Shape`."""
    return round(shape(fmt.P, fmt.N).ctas(fmt.fold_ctas_per_sm))


def flush_columns(heads: int, ctas_per_sm: float, sm_count: int, sh: Shape, round_up: bool = False) -> int:
    """CTA columns of the persistent flush grid: about `ctas_per_sm` CTAs of 4 warps an SM,
    the nearest whole number, or with `round_up` the next. Persistent because the flush runs
    beside the non-flush kernel, which one CTA per (head part, row group) held back until the
    last was handed out; a few CTAs an SM leave it the rest of every SM (docs/design.md)."""
    exact = sh.ctas(ctas_per_sm) * sm_count / (heads * sh.m_split)
    return max(1, math.ceil(exact) if round_up else round(exact))


def _b_slot(n: int, N: int) -> int:
    """Position of state column n in a staged B row: within column part n // 64, lane
    column c = 2 (n % 64 // 16) + n % 2 of n-tile nt = n % 16 // 2 sits at
    64 part + 32 (nt // 4) + 4 c + nt % 4, so lane gq reads n-tiles 4 k .. 4 k + 3 with
    one 16-byte load at 64 part + 32 k + 4 gq (k = 0, 1)."""
    part, within = divmod(n, COLUMNS)
    c = 2 * (within // (2 * NT)) + within % 2
    nt = within % (2 * NT) // 2
    return COLUMNS * part + 32 * (nt // 4) + 4 * c + nt % 4


@cute.jit
def flush_mask(t, by, plan_flush, plan_slot, batch, s_mask, s_slot, buf, rows: cutlass.Constexpr):
    """Bit rr set when batch row by * rows + rr flushes (one ballot, rows <= 32); warp 0 also
    stages the rows' plan.slot in s_slot[32 buf + lane]. Groups alternate buf: a word is
    rewritten only after every thread passed the barrier after the other's write."""
    if t < 32:
        b_t = by * rows + t
        f = Int32(0)
        if t < rows:
            if b_t < batch:
                f = Int32(plan_flush[Int64(b_t)])
                s_slot[buf * 32 + t] = plan_slot[Int64(b_t)]
        m = cute.arch.vote_ballot_sync(f != Int32(0))
        if t == 0:
            s_mask[buf] = Int32(m)
    cute.arch.sync_threads()
    return s_mask[buf]


def _b_stage_base(ch):
    """Staged position of column 8 ch: columns 8 ch + i sit there + 4 (i % 2) + i // 2
    (= _b_slot(8 ch + i)), so a staging thread writes 8 consecutive floats."""
    return 64 * (ch // 8) + 32 * (ch % 2) + 8 * ((ch % 8) // 2)


class Flush:
    """The flush of one (format, heads, groups) and launch variant: `pdl` (wait for the
    prepare kernel before the first global access), `rows` (a row group's batch rows, <= 32),
    `debug` (a `DebugPlan`; also writes the FP32 S of every flushed row, so tests can quantize
    the kernel's own S) and `dense_rows` (as `decode.Decode`'s)."""

    def __init__(self, fmt, heads: int, groups: int, *, pdl: bool = False, rows: int = 16,
                 debug: bool = False, dense_rows: bool = True, pending: bool = False) -> None:
        self.fmt, self.heads, self.groups, self.hpg = fmt, heads, groups, heads // groups
        self.pdl, self.rows, self.debug, self.dense_rows, self.pending = pdl, rows, debug, dense_rows, pending
        self.sr_voted = fmt.sr_voted  # the checkpoint's rounding through the warp-voted normal-range path
        self.P, self.N = fmt.P, fmt.N  # the cache geometry
        self.sh = shape(self.P, self.N)
        self.ROWS_CTA = 16 * self.sh.mt  # state rows a CTA folds
        # Staged rows padded by 8 floats (8 banks): B_j's so that the eight lanes of a 16-byte
        # load phase hit distinct banks, x_j's so that the four entries of an A fragment do.
        self.B_ROW = self.N + 8
        self.X_ROW = self.P + 8

    def _launch(self, kernel, ctas, min_ctas: int, stream):
        # Shared-memory carveout -1: the driver's choice (and no device query at compile time).
        kernel.launch(grid=[ctas, 1, 1], block=[self.sh.threads, 1, 1], min_blocks_per_mp=min_ctas,
                      preferred_smem_carveout=-1, stream=stream, **({"use_pdl": True} if self.pdl else {}))

    @cute.jit
    def __call__(self, ckpt, ring, copy, inputs, plan, columns: Int64, batch: Int32, stream: cuda_driver.CUstream):
        kernel = self.kernel(ckpt, ring, copy, inputs, plan, batch)
        groups = cutlass.min((batch + self.rows - 1) // self.rows, Int32(columns))
        self._launch(kernel, self.heads * self.sh.m_split * groups, self.sh.min_ctas, stream)

    @cute.kernel
    def kernel(self, ckpt, ring, copy, inputs, plan, batch: Int32):
        t, _, _ = cute.arch.thread_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # before the first global access
        smem = SmemAllocator()
        bufs = self.shared_buffers(smem)
        s_fmt = self.fmt.shared(smem, self.sh.warps)
        s_mask = smem.allocate_tensor(Int32, cute.make_layout(2), byte_alignment=4)
        s_slot = smem.allocate_tensor(Int64, cute.make_layout(64), byte_alignment=8)
        # Persistent: CTA bid keeps head part bid % hm and takes row groups bid // hm, + n_ctas
        # // hm, ...; per group one ballot (flush_mask), then one trip per flushing row, not
        # one per row: the 16-trip scan cost ~9 instructions a trip in every warp.
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        hm = Int32(self.heads * self.sh.m_split)
        bx = Int32(bid) % hm
        mh = bx % self.sh.m_split
        for by in range(Int32(bid) // hm, (batch + Int32(self.rows - 1)) // Int32(self.rows), Int32(n_ctas) // hm):
            buf = (by // (Int32(n_ctas) // hm)) & Int32(1)
            mask = flush_mask(t, by, plan.flush, plan.slot, batch, s_mask, s_slot, buf, self.rows)
            rows = mask
            for _ in range(bits.popc(mask)):
                rr = bits.lowest_set_bit(rows)
                rows = rows & (rows - Int32(1))
                if rr < Int32(self.rows):  # always true; keeps the body conditional (no hoisting out of the loop)
                    self.fold_row(t, Int64(bx // self.sh.m_split), mh, Int64(by * self.rows + rr),
                                  s_slot[buf * 32 + rr], 0, RING - 1, None, None, bufs, s_fmt, ckpt, ring,
                                  copy, inputs, plan)

    def shared_buffers(self, smem):
        """Staged x_j, B_j, dt_j then D[p] (FP32); per (column part, state row) dots, amaxes."""
        s_x = smem.allocate_tensor(Float32, cute.make_layout(RING * self.X_ROW), byte_alignment=16)
        s_b = smem.allocate_tensor(Float32, cute.make_layout(RING * self.B_ROW), byte_alignment=16)
        s_dt = smem.allocate_tensor(Float32, cute.make_layout(RING + self.ROWS_CTA), byte_alignment=16)
        s_dot = smem.allocate_tensor(Float32, cute.make_layout(self.sh.cp * self.P), byte_alignment=16)
        s_amax = smem.allocate_tensor(Int32, cute.make_layout(self.sh.cp * self.P), byte_alignment=16)
        return s_x, s_b, s_dt, s_dot, s_amax

    @cute.jit
    def fold_row(self, t, hh, mh, bb, slot, base, count, live, key, bufs, s_fmt, ckpt, ring, copy, inputs,
                 plan):
        """State-row part mh of head hh of one flushing (pending: folding, its plan row's
        `live` word and `key`) batch row, the whole CTA; `base`, `count` as `fold`'s."""
        fmt = self.fmt
        s_x, s_b, s_dt, s_dot, s_amax = bufs
        q, nq, rows, col0 = self.lane_geometry(t, mh, self.sh.mt)
        if cutlass.const_expr(self.pending):
            ctx = fmt.begin_fold(copy, Int64(Int32(1) - (live & Int32(1))), slot, hh // self.hpg)
        else:
            key = Uint32(plan.key[bb])
            ctx = fmt.begin_row(copy, plan, slot, bb, hh // self.hpg)
        acc, r_c, ck_w, ck_head = self.fold(t, hh, mh, bb, slot, bufs, ckpt, ring, inputs, base, count)
        self.row_partials(t, mh, acc, r_c, s_dot, s_amax, fmt.row_amax, not self.pending)
        stats = fmt.lane_stats(acc, 2, NT)
        cute.arch.sync_threads()
        scodes = fmt.block_scales(stats, ctx)
        for i in cutlass.range_constexpr(2):
            pp = Int64(rows[i])
            if cutlass.const_expr(not self.pending):
                self.row_output(t, mh, hh, bb, rows[i], s_x, s_dot, s_dt, inputs.out)
            if cutlass.const_expr(self.debug):
                self.store_state(hh, bb, pp, col0, acc, i, plan)
            fmt.store_row(copy, slot, hh, pp, col0, q, nq, acc, i, s_amax, ctx, scodes, NT)
            self.store_checkpoint(hh + Int64(ckpt.head_offset), pp, col0, Uint32(key), acc, i, ck_w, ck_head)
        fmt.before_barrier(t, stats, s_fmt)
        cute.arch.sync_threads()  # also: the next row or item restages the shared buffers
        fmt.after_barrier(t, ctx, s_fmt, copy, self.sh.warps)

    @staticmethod
    def lane_geometry(t, mh, mt_cta: int = 2):
        """(q, column part, [row 0, row 1], first column) of thread t in CTA mh: warp w takes
        m-tile mt_cta mh + w % mt_cta and part w // mt_cta; lane 4 gq + q rows 16 mt + gq
        (+ 8) at columns 64 part + 16 q .. + 15."""
        lane, w = t % 32, t // 32
        gq, q = lane // 4, lane % 4
        mt = mh * mt_cta + w % mt_cta
        nq = w // mt_cta
        return q, nq, [mt * 16 + gq, mt * 16 + gq + 8], nq * COLUMNS + q * (2 * NT)

    @staticmethod
    def words(ptr, off, n: int) -> list:
        """n (a multiple of 4) 32-bit words at word offset `off` by 16-byte loads, as a list."""
        out = []
        for k in range(n // 4):
            v = _vec_a(ptr, off + 4 * k, 4).load()
            out += [v[u] for u in range(4)]
        return out

    @staticmethod
    def f32x8(word, pairs: bool = False):
        """bf16x2 words word(0..3) as 8 FP32 registers: in order (`pairs`), or the even
        elements then the odd (B_j's staged order, `_b_stage_base`)."""
        r = cute.make_rmem_tensor(cute.make_layout(8), Float32)
        for k in range(4):
            v = _bf16x2(word(k))
            r[2 * k if pairs else k] = v[0]
            r[2 * k + 1 if pairs else 4 + k] = v[1]
        return r

    @cute.jit
    def stage_x(self, s_x, jx, xs, words):
        """x_j of entry jx, state rows xs .. xs + 7 (4 bf16x2 words), to s_x as FP32."""
        r_xs = self.f32x8(lambda k: words[k], True)
        for k in cutlass.range_constexpr(2):
            _vec_a(s_x.iterator, jx * self.X_ROW + xs + 4 * k, 4).store(_vec(r_xs.iterator, 4 * k, 4).load())

    def entry(self, base, j):
        """Ring entry of staged entry j: j (flush), or (base + j) mod 16 (pending: committed)."""
        return (base + j) & Int32(RING - 1) if self.pending else j  # base, j >= 0

    @cute.jit
    def fold(self, t, hh, mh, bb, slot, bufs, ckpt, ring, inputs, base, count):
        """S of this lane's 32 elements from the checkpoint and entries 0..15 (15 the current
        token; pending: ring entries `entry(base, j)` for j < count, zeros beyond): (acc, the
        lane's C words, checkpoint words, the head's first checkpoint word), acc[nt][2 i + e]
        row i at lane column 2 nt + e. Leaves s_x and s_dt[RING:] (D[p]) for the outputs."""
        s_x, s_b, s_dt = bufs[:3]
        g = hh // self.hpg
        lane = t % 32
        gq = lane // 4
        q, nq, rows, col0 = self.lane_geometry(t, mh, self.sh.mt)

        # Checkpoint first (the largest read), in flight during the staging below.
        ck_w = cute.recast_ptr(ckpt.state, dtype=Uint32)
        ck_head = slot * ckpt.stride16 * 4 + hh * (self.P * self.N // 2)
        r_ck = [self.words(ck_w, ck_head + Int64(rows[i] * (self.N // 2) + col0 // 2), NT) for i in range(2)]
        # dt_j (threads 0..14: the ring; thread 15: the step's raw dt and dt_bias) and A,
        # predicated in straight-line code so that ptxas issues them with the others (inside
        # the `t < RING` branch below they waited for the x_j / B_j stores: a round trip).
        ring_dt = bits.ld_global_u32_if((ring.dt + (slot * ring.dt_stride + hh * RING + Int64(self.entry(base, t)))).toint(), sel(t < count, Int32(1), Int32(0)))
        a_h = bits.ld_global_u32_if((inputs.A + hh * inputs.a_stride).toint(), Int32(1)).bitcast(Float32)
        raw_dt, bias_dt, d_row, r_c = Float32(0.0), Uint32(0), Uint32(0), None
        if cutlass.const_expr(not self.pending):
            last = sel(t == RING - 1, Int32(1), Int32(0))
            raw_dt = bits.ld_global_dt_if(inputs.dt, bb * inputs.dt_stride_b + hh * inputs.dt_stride_h, last)
            bias_dt = bits.ld_global_u32_if((inputs.dt_bias + hh * inputs.dt_bias_stride).toint(), last)
            # D[p] of the CTA's state rows, staged for the outputs (loaded in row_output, after
            # its barrier, D was a round trip in every flushed row's chain).
            d_row = bits.ld_global_u32_if((inputs.D + (hh * inputs.d_stride_h + Int64(mh * self.ROWS_CTA + t % self.ROWS_CTA) * inputs.d_stride_p)).toint(), sel(t < self.ROWS_CTA, Int32(1), Int32(0)))
            c_w = cute.recast_ptr(inputs.C, dtype=Uint32)
            r_c = self.words(c_w, A.row_words(self.dense_rows, bb, inputs.c_stride16, self.groups * self.N // 2) + g * (self.N // 2) + Int64(col0 // 2), NT)

        # Stage x_j of this CTA's state rows, B_j (fragment order) and dt_j, in FP32.
        xw = cute.recast_ptr(ring.x, dtype=Uint32)
        bw = cute.recast_ptr(ring.b, dtype=Uint32)
        xcur = bcur = None
        if cutlass.const_expr(not self.pending):
            xcur = cute.recast_ptr(inputs.x, dtype=Uint32)
            bcur = cute.recast_ptr(inputs.B, dtype=Uint32)
        ch = t % (self.N // 8)  # columns 8 ch .. 8 ch + 7
        # B_j staging: 16 entries x N / 8 chunks, `reps` a thread (the last holds entry 15).
        chunks = self.N // 8
        reps = RING * chunks // self.sh.threads
        tx = t % (RING * self.ROWS_CTA // 8)
        jx = tx // (self.ROWS_CTA // 8)
        xs = mh * self.ROWS_CTA + (tx % (self.ROWS_CTA // 8)) * 8
        r_bs = []
        if cutlass.const_expr(self.fmt.stage_one_source):
            # One predicated 16-byte load a thread and source (the other gives zeros), in
            # straight-line code, so that ptxas issues the x_j and B_j loads together.
            x_on = sel(t < RING * self.ROWS_CTA // 8, Int32(1), Int32(0))
            x_ring_on = sel(jx < count, x_on, Int32(0))
            x_ring_w = bits.ld_global_v4_u32_if((xw + (slot * ring.x_stride16 * 4 + (hh * RING + Int64(self.entry(base, jx))) * (self.P // 2) + Int64(xs // 2))).toint(), x_ring_on)
            x_cur_w = [Uint32(0)] * 4
            if cutlass.const_expr(not self.pending):
                x_cur_w = bits.ld_global_v4_u32_if((xcur + (A.row_words(self.dense_rows, bb, inputs.x_stride16, self.heads * self.P // 2) + hh * (self.P // 2) + Int64(xs // 2))).toint(), x_on - x_ring_on)
            b_words = []
            for rep in cutlass.range_constexpr(reps):
                jb = t // chunks + rep * (self.sh.threads // chunks)
                b_src = (bw + (slot * ring.b_stride16 * 4 + (g * RING + Int64(self.entry(base, jb))) * (self.N // 2) + Int64(ch * 4))).toint()
                if cutlass.const_expr(self.pending):
                    b_words.append(bits.ld_global_v4_u32_if(b_src, sel(jb < count, Int32(1), Int32(0))))
                elif cutlass.const_expr(rep == reps - 1):
                    b_ring_on = sel(jb < RING - 1, Int32(1), Int32(0))
                    b_ring_w = bits.ld_global_v4_u32_if(b_src, b_ring_on)
                    b_cur_w = bits.ld_global_v4_u32_if((bcur + (A.row_words(self.dense_rows, bb, inputs.b_stride16, self.groups * self.N // 2) + g * (self.N // 2) + Int64(ch * 4))).toint(), Int32(1) - b_ring_on)
                    b_words.append([b_ring_w[k] | b_cur_w[k] for k in range(4)])
                else:
                    b_words.append(bits.ld_global_v4_u32_if(b_src, Int32(1)))
            if t < RING * self.ROWS_CTA // 8:
                self.stage_x(s_x, jx, xs, [x_ring_w[k] | x_cur_w[k] for k in range(4)])
            for rep in cutlass.range_constexpr(reps):
                r_bs.append(self.f32x8(lambda k: b_words[rep][k]))
        else:
            # Both sources loaded, the entry picked by a select (pending: zeros for j >= count,
            # whose entries may be rejected drafts holding NaN).
            if t < RING * self.ROWS_CTA // 8:
                from_ring = _vec_a(xw, slot * ring.x_stride16 * 4 + (hh * RING + Int64(self.entry(base, jx))) * (self.P // 2) + Int64(xs // 2), 4).load()
                if cutlass.const_expr(self.pending):
                    self.stage_x(s_x, jx, xs, [sel(jx < count, from_ring[k], Uint32(0)) for k in range(4)])
                else:
                    cur = _vec_a(xcur, A.row_words(self.dense_rows, bb, inputs.x_stride16, self.heads * self.P // 2) + hh * (self.P // 2) + Int64(xs // 2), 4).load()
                    self.stage_x(s_x, jx, xs, [sel(jx == RING - 1, cur[k], from_ring[k]) for k in range(4)])
            for rep in cutlass.range_constexpr(reps):
                jb = t // chunks + rep * (self.sh.threads // chunks)
                from_ring = _vec_a(bw, slot * ring.b_stride16 * 4 + (g * RING + Int64(self.entry(base, jb))) * (self.N // 2) + Int64(ch * 4), 4).load()
                if cutlass.const_expr(self.pending):
                    r_bs.append(self.f32x8(lambda k: sel(jb < count, from_ring[k], Uint32(0))))
                elif cutlass.const_expr(rep == reps - 1):
                    cur = _vec_a(bcur, A.row_words(self.dense_rows, bb, inputs.b_stride16, self.groups * self.N // 2) + g * (self.N // 2) + Int64(ch * 4), 4).load()
                    r_bs.append(self.f32x8(lambda k: sel(jb == RING - 1, cur[k], from_ring[k])))
                else:
                    r_bs.append(self.f32x8(lambda k: from_ring[k]))
        for rep in cutlass.range_constexpr(reps):
            jb = t // chunks + rep * (self.sh.threads // chunks)
            b_base = jb * self.B_ROW + _b_stage_base(ch)
            for k in cutlass.range_constexpr(2):
                _vec_a(s_b.iterator, b_base + 4 * k, 4).store(_vec(r_bs[rep].iterator, 4 * k, 4).load())
        if t < RING:
            dt_t = ring_dt.bitcast(Float32)
            if cutlass.const_expr(not self.pending):
                if t == RING - 1:
                    dt_t = softplus(raw_dt + bias_dt.bitcast(Float32))
            s_dt[t] = dt_t
        if cutlass.const_expr(not self.pending):
            if t < self.ROWS_CTA:
                s_dt[RING + t] = d_row.bitcast(Float32)
        cute.arch.sync_threads()

        # pre_k = dt_0 + .. + dt_k (in order, the reference's sum), w_j = dt_j
        # exp(A (pre_15 - pre_j)), decay = exp(A pre_15); lane j % 16 holds entry j.
        jl = lane % 16
        dt_j = s_dt[jl]
        pre = Float32(0.0)
        for k in cutlass.range_constexpr(RING):
            pre = pre + sel(Int32(k) <= jl, s_dt[k], Float32(0.0))
        total = cute.arch.shuffle_sync(pre, RING - 1)
        w_j = dt_j * cute.math.exp(a_h * (total - pre))
        decay = cute.math.exp(a_h * total)

        # A fragments (X' = w_j x_j[p], tf32 hi + lo) of k-steps 0 and 1.
        a_hi, a_lo = [[], []], [[], []]
        for ks in cutlass.range_constexpr(2):
            for jj in cutlass.range_constexpr(2):  # a0/a1: entry 8 ks + q, a2/a3: + 4
                j = ks * 8 + jj * 4 + q
                w_s = cute.arch.shuffle_sync(w_j, j)
                for i in cutlass.range_constexpr(2):
                    xp = w_s * s_x[j * self.X_ROW + rows[i]]
                    hb = xp.bitcast(Uint32) & Uint32(0xFFFFE000)
                    a_hi[ks].append(hb)
                    a_lo[ks].append((xp - hb.bitcast(Float32)).bitcast(Uint32))
        # B fragments b0 = B_{8 ks + q}, b1 = B_{8 ks + q + 4}, column gq: 16-byte loads (_b_slot).
        b_frag = [[], []]
        for ks in cutlass.range_constexpr(2):
            for jj in cutlass.range_constexpr(2):
                off = (ks * 8 + jj * 4 + q) * self.B_ROW + nq * COLUMNS + gq * 4
                frag = []
                for k in cutlass.range_constexpr(NT // 4):
                    v = _vec_a(s_b.iterator, off + 32 * k, 4).load()
                    frag += [v[u].bitcast(Uint32) for u in range(4)]
                b_frag[ks].append(frag)

        # S: acc[nt] = (row 0 at lane columns 2 nt, 2 nt + 1, row 1 at the same).
        acc = []
        for nt in cutlass.range_constexpr(NT):
            a4 = []
            for i in cutlass.range_constexpr(2):
                pair = bits.f16x2_to_f32x2(r_ck[i][nt])
                a4 += [decay * pair[0], decay * pair[1]]
            for ks in cutlass.range_constexpr(2):
                bf = [b_frag[ks][0][nt], b_frag[ks][1][nt]]
                a4 = mma_tf32_16x8x8(a_hi[ks], bf, a4)
                a4 = mma_tf32_16x8x8(a_lo[ks], bf, a4)
            acc.append(a4)
        return acc, r_c, ck_w, ck_head

    @cute.jit
    def row_partials(self, t, mh, acc, r_c, s_dot, s_amax, row_amax: cutlass.Constexpr = True, dots: cutlass.Constexpr = True):
        """Row dots with C (`dots`) and amaxes (`row_amax`) of this column part, reduced over
        the 4 lanes of a row into s_dot / s_amax[part * P + row] (read after a barrier)."""
        q, nq, rows, col0 = self.lane_geometry(t, mh, self.sh.mt)
        for i in cutlass.range_constexpr(2):
            dot, amax = Float32(0.0), Int32(0)
            for nt in cutlass.range_constexpr(NT):
                for e in cutlass.range_constexpr(2):
                    v = acc[nt][2 * i + e]
                    if cutlass.const_expr(dots):
                        dot = dot + v * _bf16x2(r_c[nt])[e]
                    amax = cutlass.max(amax, v.bitcast(Int32) & Int32(0x7FFFFFFF))
            if cutlass.const_expr(dots):
                dot = _xor_reduce(dot, 4, lambda a, c: a + c)
            if cutlass.const_expr(row_amax):
                amax = _xor_reduce(amax, 4, cutlass.max)
            if q == 0:
                if cutlass.const_expr(dots):
                    s_dot[nq * self.P + rows[i]] = dot
                if cutlass.const_expr(row_amax):
                    s_amax[nq * self.P + rows[i]] = amax

    @cute.jit
    def row_output(self, t, mh, hh, bb, p, s_x, s_dot, s_dt, out):
        """y[p] = S[p] . C + D[p] x[p] from the parts' dots and the staged D[p]; one lane."""
        q, nq, rows, col0 = self.lane_geometry(t, mh, self.sh.mt)
        pp = Int64(p)
        if nq == 0:
            if q == 0:
                dot = s_dot[p]
                for k in cutlass.range_constexpr(1, self.sh.cp):  # the parts in order
                    dot = dot + s_dot[k * self.P + p]
                y = dot + s_dt[RING + p % self.ROWS_CTA] * s_x[(RING - 1) * self.X_ROW + p]
                out[(bb * self.heads + hh) * self.P + pp] = BFloat16(y)

    @cute.jit
    def store_state(self, hh, bb, pp, col0, acc, i, plan):
        """Test variant (a `DebugPlan`): this lane's 16 FP32 values of row i to plan.state."""
        r_state = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        for k4 in cutlass.range_constexpr(NT // 2):
            for k in cutlass.range_constexpr(4):
                c = 4 * k4 + k  # column col0 + c = 2 nt + e
                r_state[k] = acc[c // 2][2 * i + c % 2]
            at = ((bb * self.heads + hh) * self.P + pp) * self.N + Int64(col0 + 4 * k4)
            _vec_a(plan.state, at, 4).store(r_state.load())

    @cute.jit
    def store_checkpoint(self, h_model, pp, col0, key, acc, i, ck_w, ck_head):
        """Row i's 16 values as FP16 pairs with stochastic rounding, hash word ((h P + p) N + n) / 2
        a pair, h the model's head: tensor-parallel shards draw an unsharded cache's bits."""
        r_ck_out = cute.make_rmem_tensor(cute.make_layout(NT), Uint32)
        w0 = Uint32((h_model * self.P + pp) * (self.N // 2)) + Uint32(col0 // 2)
        if cutlass.const_expr(self.sr_voted):
            words = [bits.random_word(key, w0 + Uint32(nt)) for nt in range(NT)]
            codes = bits.fp16x2_sr_voted([(acc[nt][2 * i], acc[nt][2 * i + 1]) for nt in range(NT)], words)
            for nt in cutlass.range_constexpr(NT):
                r_ck_out[nt] = codes[nt]
        else:
            for nt in cutlass.range_constexpr(NT):
                word = bits.random_word(key, w0 + Uint32(nt))
                r_ck_out[nt] = self.fmt.fp16x2_sr(acc[nt][2 * i], acc[nt][2 * i + 1], word)
        for k in cutlass.range_constexpr(NT // 4):
            _vec_a(ck_w, ck_head + pp * (self.N // 2) + Int64(col0 // 2 + 4 * k), 4).store(_vec(r_ck_out.iterator, 4 * k, 4).load())


class PendingFold(Flush):
    """Pending mode's fold of the rows plan.py's plan kernel lists: S over the committed ring
    entries (f_old + j) mod 16, j < nf, then the checkpoint (the plan row's key) and the read
    copy as the flush writes them; no outputs. Work items (listed row, head part) over a
    persistent grid of `ctas` CTAs; `pdl` behind the plan kernel; `debug` as Flush's."""

    def __init__(self, fmt, heads: int, groups: int, *, pdl: bool = True, debug: bool = False) -> None:
        super().__init__(fmt, heads, groups, pdl=pdl, debug=debug, pending=True)
        # sm_90a: the warp-voted rounding (the fold bounds a pending call; the flush is a
        # sixteenth of a step's rows). CTAs an SM: the format's (its grid and register bound).
        self.sr_voted = not fmt.hw
        self.ctas_per_sm = fold_ctas_per_sm(fmt)

    @cute.jit
    def __call__(self, ckpt, ring, copy, params, plan, ctas: Int32, stream: cuda_driver.CUstream):
        self._launch(self.kernel(ckpt, ring, copy, params, plan), ctas, self.ctas_per_sm, stream)

    @cute.kernel
    def kernel(self, ckpt, ring, copy, params, plan):
        t, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        n_ctas, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the plan kernel's list, before the first global access
        smem = SmemAllocator()
        bufs = self.shared_buffers(smem)
        s_fmt = self.fmt.shared(smem, self.sh.warps)
        hm = Int32(self.heads * self.sh.m_split)
        pw = cute.recast_ptr(plan.rows, dtype=Uint32)
        for it in range(Int32(bid), Int32(plan.fold_list[0]) * hm, Int32(n_ctas)):
            bb = Int64(plan.fold_list[it // hm + 1])
            hx = it % hm
            row0 = bits.ld_global_v4_u32((pw + bb * 8).toint())
            row1 = bits.ld_global_v4_u32((pw + bb * 8 + 4).toint())
            self.fold_row(t, Int64(hx // self.sh.m_split), hx % self.sh.m_split, bb, Int64(Int32(row0[0])),
                          Int32(row0[2]), Int32(row0[3]), Int32(row1[0]), row1[1], bufs, s_fmt, ckpt, ring,
                          copy, params, plan)


__all__ = ["Flush", "PendingFold", "Shape", "flush_columns", "flush_mask", "fold_ctas_per_sm", "shape"]
