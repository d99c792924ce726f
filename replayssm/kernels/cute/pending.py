"""Pending-mode step kernel (CuTe DSL; docs/format.md section 5b, docs/design.md section
10): every live row's T_b <= 8 outputs and ring writes, one warp per (row, head),
`decode.Decode`'s lane map with the call's tokens in the MMA's n dimension (lane (g, q) =
(lane // 4, lane % 4) supplies token g's C'). It resets the fold's work list.

The plan row (slot or -1, c', f_old, nf, parity, key, first token, T_b) gives a window of
16 entries from f_new = f_old + nf: entry j is ring entry (f_new + j) mod 16 for j < u =
c' - f_new (committed), else token j - u. For token t (last = u + t), pre_j = dt_0 + .. + dt_j:

    y_t[p] = exp(A pre_last) R[p] . C_t + sum_{j <= last} dt_j exp(A (pre_last - pre_j)) (B_j . C_t) x_j[p] + D[p] x_t[p]

A later draft's non-finite x is zeroed in the MMA and only the tokens that read it output
NaN (an entry's B, C and dt are selected, never multiplied, into other tokens' terms).
Padding rows (slot -1) write zeros to their T_b outputs.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_stream
from cutlass.memory import SmemAllocator

from ... import layout as L
from ...layout import RING
from . import args as A
from . import bits
from .bits import bf16x2_to_f32x2, f32x2_to_bf16x2, sel, softplus
from .decode import Decode
from .flush import PendingFold, fold_ctas_per_sm, shape
from .launch import _sm_count, compile_entry, fork_streams, join_streams
from .mma import mma_bf16_16x8x16
from .read_copy import read_copy_format

TOKENS = 8  # the MMA's n: max_seqlen <= 8
ROWS = ("all", "rest", "fold")  # the rows a step launch takes: every row, those that do not fold, those that fold
# The step's read-copy loads stream (evict first): faster than no hint at 16h/2g batch 256
# and NVFP4 batch 1024, level at FP8 batch 1024.
STEP_READ_HINT = ".cs"


class PendingStep(Decode):
    """The pending step for one (format, heads, groups) with `decode.Decode`'s launch, CTA (a
    group's heads of one row, a warp each; 4 CTAs an SM, 5% faster than 3) and helpers.
    `rows` (ROWS): the rows it computes, with the same code for a row in every variant."""

    def __init__(self, fmt, heads: int, groups: int, *, pdl: bool = True, rows: str = "all") -> None:
        if rows not in ROWS:
            raise ValueError(f"rows must be one of {ROWS}; got {rows!r}")
        super().__init__(fmt, heads, groups, pdl=pdl, read_hint=STEP_READ_HINT)
        self.rows = rows

    @cute.kernel
    def kernel(self, ring, copy, inputs, plan):
        t, _, _ = cute.arch.thread_idx()
        bx, b, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()  # the fold (and plan) kernels, before the first global access
        bb = Int64(b)
        pw = cute.recast_ptr(plan.rows, dtype=Uint32)
        row0 = bits.ld_global_v4_u32((pw + bb * 8).toint())
        row1 = bits.ld_global_v4_u32((pw + bb * 8 + 4).toint())
        slot32, cn, f_old, nf = [Int32(v) for v in row0]
        start, tb = Int32(row1[2]), Int32(row1[3])
        lane = t % 32
        gq, q = lane // 4, lane % 4
        hh = Int64(bx * self.hpc + t // 32)
        w = Int32(t // 32)
        if cutlass.const_expr(self.rows != "rest"):
            if (bx == 0) & (b == 0) & (t == 0):  # the fold kernel (launched before) has consumed its list
                plan.fold_list[0] = Int32(0)
        take = Int32(1)  # whether this launch computes the row (padding rows have nf = 0)
        if cutlass.const_expr(self.rows == "rest"):
            take = sel(nf == Int32(0), Int32(1), Int32(0))
        if cutlass.const_expr(self.rows == "fold"):
            take = sel(nf > Int32(0), Int32(1), Int32(0))
        if (take != Int32(0)) & (slot32 < Int32(0)):
            # Padding row: zeros for its T_b tokens (tokens 2 q, 2 q + 1, rows 8 gq .. + 7).
            ow = cute.recast_ptr(inputs.out, dtype=Uint32)
            for s in cutlass.range_constexpr(2):
                tt = 2 * q + s
                if tt < tb:
                    o = bb * inputs.o_row + Int64(start + tt) * inputs.o_tok + hh * self.P + Int64(8 * gq)
                    bits.st_global_v4_u32((ow + o // 2).toint(), [Uint32(0)] * 4)
                    if cutlass.const_expr(self.fmt.TAIL):  # rows 64 + 2 gq, + 1
                        ow[(o + Int64(64 - 6 * gq)) // 2] = Uint32(0)
        elif (take != Int32(0)) & (tb > Int32(0)):
            s_bc = SmemAllocator().allocate_tensor(Float32, cute.make_layout(RING * TOKENS * self.hpc), byte_alignment=16)
            self.live_row(ring, copy, inputs, bb, Int64(slot32), cn, f_old + nf, start, tb, lane, gq, q, hh, w, s_bc)

    @cute.jit
    def live_row(self, ring, copy, inputs, bb, slot, cn, f_new, start, tb, lane, gq, q, hh, w, s_bc):
        g = hh // self.hpg
        u = cn - f_new  # committed entries in the window
        one, zero = Int32(1), Int32(0)

        # C of token gq on lane q's n-set (zeros past T_b).
        c_w = cute.recast_ptr(inputs.C, dtype=Uint32)
        c_on = sel(gq < tb, one, zero)
        c_row = (bb * inputs.c_row + Int64(start + gq) * inputs.c_tok + g * self.N) // 2
        cw = []
        for c in cutlass.range_constexpr(self.fmt.CHUNKS):
            at = [(c_w + (c_row + Int64(self.fmt.c_word(c, q, h)))).toint() for h in range(2)]
            cw.append(bits.ld_global_v4_u32_if(at[0], c_on) + bits.ld_global_v4_u32_if(at[1], c_on))

        # B of window entries gq, gq + 8: this warp's vector halves.
        br_w = cute.recast_ptr(ring.b, dtype=Uint32)
        b_w = cute.recast_ptr(inputs.B, dtype=Uint32)
        br_row0 = slot * ring.b_stride16 * 4 + g * (RING * self.N // 2)
        bq = []
        for e in cutlass.range_constexpr(2):
            j = gq + 8 * e
            on = sel(j < u + tb, one, zero)
            phys = Int64((f_new + j) % RING)
            b_tok = (bb * inputs.b_row + Int64(start + cutlass.max(j - u, zero)) * inputs.b_tok + g * self.N) // 2
            row = []
            for i in cutlass.range_constexpr(self.vh_per_warp):
                wo = Int64(self.vh_word(w * self.vh_per_warp + i, q))
                src = sel(j < u, (br_w + (br_row0 + phys * (self.N // 2) + wo)).toint(), (b_w + (b_tok + wo)).toint())
                row.append(bits.ld_global_v4_u32_if(src, on))
            bq.append(row)

        loaded = self.fmt.pending_loads(copy, slot, hh, g, gq, q, self.read_hint)

        # x of window entries 2 q + v % 2 + 8 (v // 2) at rows 8 gq .. + 7.
        xr_w = cute.recast_ptr(ring.x, dtype=Uint32)
        x_w = cute.recast_ptr(inputs.x, dtype=Uint32)
        xr_head = slot * ring.x_stride16 * 4 + hh * (RING * self.P // 2) + Int64(4 * gq)
        xw, xw_t = [], []  # xw_t: head dim 80, rows 64 + 2 gq, + 1 (one word an entry)
        for v in cutlass.range_constexpr(4):
            j = 2 * q + (v % 2) + 8 * (v // 2)
            phys = Int64((f_new + j) % RING)
            x_tok = (bb * inputs.x_row + Int64(start + cutlass.max(j - u, zero)) * inputs.x_tok + hh * self.P) // 2 + Int64(4 * gq)
            src = sel(j < u, (xr_w + (xr_head + phys * (self.P // 2))).toint(), (x_w + x_tok).toint())
            xw.append(bits.ld_global_v4_u32_if(src, sel(j < u + tb, one, zero)))
            if cutlass.const_expr(self.fmt.TAIL):
                src_t = sel(j < u, (xr_w + (xr_head + phys * (self.P // 2) + Int64(32 - 3 * gq))).toint(), (x_w + (x_tok + Int64(32 - 3 * gq))).toint())
                xw_t.append(bits.ld_global_u32_if(src_t, sel(j < u + tb, one, zero)))
        # x of this lane's output tokens 2 q, 2 q + 1 (the D term and the ring writes).
        xt, xt_t = [], []
        for s in cutlass.range_constexpr(2):
            tt = 2 * q + s
            x_tok = (bb * inputs.x_row + Int64(start + tt) * inputs.x_tok + hh * self.P) // 2 + Int64(4 * gq)
            xt.append(bits.ld_global_v4_u32_if((x_w + x_tok).toint(), sel(tt < tb, one, zero)))
            if cutlass.const_expr(self.fmt.TAIL):
                xt_t.append(bits.ld_global_u32_if((x_w + (x_tok + Int64(32 - 3 * gq))).toint(), sel(tt < tb, one, zero)))

        # dt of entry k = lane % 16 (processed; zero outside the window's live entries).
        k = lane % 16
        dt_ring = bits.ld_global_u32_if(
            (ring.dt + (slot * ring.dt_stride + hh * RING + Int64((f_new + k) % RING))).toint(), sel(k < u, one, zero)
        ).bitcast(Float32)
        is_new = (k >= u) & (k < u + tb)
        dt_off = bb * inputs.dt_row + Int64(start + cutlass.max(k - u, zero)) * inputs.dt_tok + hh * inputs.dt_h
        dt_raw = bits.ld_global_dt_if(inputs.dt, dt_off, sel(is_new, one, zero))
        bias = inputs.dt_bias[hh * inputs.bias_stride]
        a_h = inputs.A[hh * inputs.a_stride]
        dd = [inputs.D[hh * inputs.d_h + Int64(8 * gq + i) * inputs.d_p] for i in range(8)]
        dd += [inputs.D[hh * inputs.d_h + Int64(64 + 2 * gq + i) * inputs.d_p] for i in range(self.fmt.ROWS - 8)]

        down, up = self.c_prime(cw)  # per token: lane (gq, q) holds token gq's C
        rd, rf = self.fmt.pending_dots(loaded, cw, down, gq, q)

        # B_j . C_t, this warp's k share; partial tiles [entry, token] meet in shared memory.
        acc_bc = self.bc_partial(bq, cw, w)
        tile = w * (RING * TOKENS)
        for e in cutlass.range_constexpr(4):  # entries gq, gq + 8 by tokens 2 q, 2 q + 1
            s_bc[tile + (gq + 8 * (e // 2)) * TOKENS + 2 * q + e % 2] = acc_bc[e]
        cute.arch.sync_threads()

        # Scan over the entries (lane k % 16 = entry k).
        dt_k = sel(is_new, softplus(dt_raw + bias), sel(k < u, dt_ring, Float32(0.0)))
        pre = self.prefix_sum(dt_k, k)
        # Token gq's coefficients at entries 2 q, 2 q + 1, 2 q + 8, 2 q + 9 (zero past last_g):
        # the replay MMA's B fragment, as bf16 plus its bf16 remainder (two MMAs).
        last_g = u + gq
        pre_last = cute.arch.shuffle_sync(pre, last_g % RING)
        coef = []
        for v in cutlass.range_constexpr(4):
            j = 2 * q + (v % 2) + 8 * (v // 2)
            pre_j = cute.arch.shuffle_sync(pre, j)
            dt_j = cute.arch.shuffle_sync(dt_k, j)
            bc = s_bc[j * TOKENS + gq]
            for ww in cutlass.range_constexpr(1, self.hpc):
                bc = bc + s_bc[ww * (RING * TOKENS) + j * TOKENS + gq]
            inside = (j <= last_g) & (gq < tb)
            coef.append(sel(inside, dt_j * cute.math.exp(a_h * (pre_last - pre_j)) * bc, Float32(0.0)))
        b_hi, b_lo = [], []
        for h2 in cutlass.range_constexpr(2):
            w_hi = f32x2_to_bf16x2(coef[2 * h2], coef[2 * h2 + 1])
            back = bf16x2_to_f32x2(w_hi)
            b_hi.append(w_hi)
            b_lo.append(f32x2_to_bf16x2(coef[2 * h2] - back[0], coef[2 * h2 + 1] - back[1]))

        # Non-finite x of an entry: zeroed in the MMA; tokens reading it output NaN.
        bad = Int32(0)
        for v in cutlass.range_constexpr(4):
            j = 2 * q + (v % 2) + 8 * (v // 2)
            nf_v = Int32(0)
            for wv in xw[v] + xw_t[v:v + 1]:
                nf_v = nf_v | sel(((wv & Uint32(0x7F80)) == Uint32(0x7F80)) | ((wv & Uint32(0x7F800000)) == Uint32(0x7F800000)), one, zero)
            xw[v] = [sel(nf_v != zero, Uint32(0), xw[v][i]) for i in range(4)]
            if cutlass.const_expr(self.fmt.TAIL):
                xw_t[v] = sel(nf_v != zero, Uint32(0), xw_t[v])
            bad = bad | (nf_v << j)
        bad = bits.xor_reduce(bad, 32, lambda a_, b_: a_ | b_)

        rs = []
        for mt in cutlass.range_constexpr(self.P // 16):
            a = self.x_fragment(xw, mt) if mt < 4 else self.x_fragment([[w_] for w_ in xw_t], 0)
            acc = mma_bf16_16x8x16(a, b_hi, [Float32(0.0)] * 4)
            rs.append(mma_bf16_16x8x16(a, b_lo, acc))

        # Outputs: tokens 2 q + s, rows 8 gq + i (accumulator 2 (i % 2) + s of m-tile i // 2).
        ow = cute.recast_ptr(inputs.out, dtype=Uint32)
        for s in cutlass.range_constexpr(2):
            tt = 2 * q + s
            pre_t = cute.arch.shuffle_sync(pre_last, 4 * tt)
            up_t = cute.arch.shuffle_sync(up, 4 * tt)
            decay = cute.math.exp(a_h * pre_t)
            nan_t = (bad & ((Int32(2) << cutlass.min(u + tt, Int32(RING - 1))) - one)) != zero
            xo = [v for wd in range(4) for v in bf16x2_to_f32x2(xt[s][wd])]
            if cutlass.const_expr(self.fmt.TAIL):  # rows 64 + 2 gq, + 1: m-tile 4
                xo += bf16x2_to_f32x2(xt_t[s])
            y = []
            for i in cutlass.range_constexpr(self.fmt.ROWS):
                mt, r = i // 2, i % 2
                yi = decay * (rf[i] * (up_t * rd[mt][2 * r + s])) + rs[mt][2 * r + s] + dd[i] * xo[i]
                y.append(sel(nan_t, Float32(float("nan")), yi))
            if tt < tb:
                o = bb * inputs.o_row + Int64(start + tt) * inputs.o_tok + hh * self.P + Int64(8 * gq)
                bits.st_global_v4_u32((ow + o // 2).toint(), [f32x2_to_bf16x2(y[2 * i], y[2 * i + 1]) for i in range(4)])
                dst = xr_head + Int64((cn + tt) % RING) * (self.P // 2)
                bits.st_global_v4_u32((xr_w + dst).toint(), xt[s])
                if cutlass.const_expr(self.fmt.TAIL):
                    ow[(o + Int64(64 - 6 * gq)) // 2] = f32x2_to_bf16x2(y[8], y[9])
                    xr_w[dst + Int64(32 - 3 * gq)] = xt_t[s]
        if lane < RING:
            if is_new:
                ring.dt[slot * ring.dt_stride + hh * RING + Int64((f_new + k) % RING)] = dt_k
        if (hh - Int64(w)) % self.hpg == 0:  # the CTA holding the group's first head: each warp its share
            for e in cutlass.range_constexpr(2):
                j = gq + 8 * e
                if (j >= u) & (j < u + tb):
                    dst_row = br_row0 + Int64((f_new + j) % RING) * (self.N // 2)
                    for i in cutlass.range_constexpr(self.vh_per_warp):
                        dst = (br_w + (dst_row + Int64(self.vh_word(w * self.vh_per_warp + i, q)))).toint()
                        bits.st_global_v4_u32(dst, bq[e][i])


def pending_kernel(state_dtype: str, arch: str, heads: int, groups: int, dt_dtype: torch.dtype = torch.float32, rows: str = "all", P: int = 64, N: int = 128):
    """The step (`rows`: as PendingStep takes it) and its compile-time arguments."""
    fmt = read_copy_format(state_dtype, arch, P, N)
    fake = [A.fake(A.Ring), A.fake(fmt.Args), A.fake(A.PendingInputs, dt=dt_dtype), A.fake(A.PendingPlan), Int32(0), make_fake_stream()]
    return PendingStep(fmt, heads, groups, pdl=True, rows=rows), fake


@functools.lru_cache(maxsize=None)
def compiled_pending(state_dtype: str, arch: str, heads: int, groups: int, dt_dtype: torch.dtype, rows: str = "all", P: int = 64, N: int = 128):
    return compile_entry(*pending_kernel(state_dtype, arch, heads, groups, dt_dtype, rows, P, N), arch)


def fold_kernel(state_dtype: str, arch: str, heads: int, groups: int, debug: bool = False, P: int = 64, N: int = 128):
    """The pending fold (flush.PendingFold) and its compile-time arguments."""
    fmt = read_copy_format(state_dtype, arch, P, N)
    plan = A.fake(A.PendingDebugPlan if debug else A.PendingPlan)
    fake = [A.fake(A.Checkpoint), A.fake(A.Ring), A.fake(fmt.Args), A.fake(A.FoldParams), plan, Int32(0), make_fake_stream()]
    return PendingFold(fmt, heads, groups, debug=debug), fake


@functools.lru_cache(maxsize=None)
def compiled_fold(state_dtype: str, arch: str, heads: int, groups: int, debug: bool = False, P: int = 64, N: int = 128):
    return compile_entry(*fold_kernel(state_dtype, arch, heads, groups, debug, P, N), arch)


class PendingLaunch:
    """The fold and step launches of pending-mode calls on one cache, plan buffer, format
    and head offset: the structs made once as tuples of ints, a call's by `step_words`."""

    __slots__ = ("state_dtype", "arch", "heads", "groups", "dims", "fold_ctas", "head_parts", "ckpt", "ring", "copy", "plan", "kernels")

    def __init__(self, cache, plan_rows, fold_list, state_dtype: str, arch: str, head_offset: int = 0) -> None:
        self.state_dtype, self.arch = state_dtype, arch
        self.heads, self.groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
        self.dims = L.dims(cache)  # (P, N), the compile keys' last two fields
        fmt = read_copy_format(state_dtype, arch, *self.dims)
        self.ckpt = tuple(A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=head_offset))
        self.ring = tuple(A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING]))
        self.copy = tuple(A.raw(fmt.Args, **fmt.tensors(cache, L)))
        self.plan = tuple(A.raw(A.PendingPlan, rows=plan_rows, fold_list=fold_list))
        self.fold_ctas = fold_ctas_per_sm(fmt) * _sm_count(cache[L.CHECKPOINT].get_device())
        self.head_parts = self.heads * shape(*self.dims).m_split  # fold work items a row
        self.kernels: dict[tuple, object] = {}

    def compiled(self, key: tuple):
        """The compiled kernel of `key`: ("fold", debug) or (dt dtype, rows)."""
        fn = self.kernels.get(key)
        if fn is None:
            if key[0] == "fold":
                fn = compiled_fold(self.state_dtype, self.arch, self.heads, self.groups, key[1], *self.dims)
            else:
                fn = compiled_pending(self.state_dtype, self.arch, self.heads, self.groups, *key, *self.dims)
            self.kernels[key] = fn
        return fn

    def fold(self, cache, A_, plan_rows, fold_list, stream: int, debug_state=None) -> None:
        """Launch the fold of the listed rows on a persistent grid (`fold_ctas_per_sm` CTAs an
        SM at most); `debug_state`: FP32 [b, H, P, N] receiving each folded row's S (tests)."""
        plan = self.plan
        if debug_state is not None:
            plan = tuple(A.raw(A.PendingDebugPlan, rows=plan_rows, fold_list=fold_list, state=debug_state))
        ctas = min(plan_rows.shape[0] * self.head_parts, self.fold_ctas)
        fn = self.compiled(("fold", debug_state is not None))
        fn(self.ckpt, self.ring, self.copy, (A_.data_ptr(), A_.stride(0)), plan, ctas, stream)

    def step(self, cache, x, dt, A_, B, C, D, dt_bias, out, plan_rows, fold_list, varlen: bool, stream: int, rows: str = "all") -> None:
        """Launch the step (`rows`: PendingStep's) behind the plan and, unless "rest", the fold:
        x [b, T, H, 64] (varlen [total, H, 64]), B, C [.., G, 128], out like x, dt [b, T, H]
        ([total, H]), A, dt_bias [H], D [H, 64]; the caller checked `reads_as_is`."""
        batch = plan_rows.shape[0]
        if dt.dtype not in A.DSL_DTYPES:
            dt = dt.float()
        fn = self.compiled((dt.dtype, rows))
        fn(self.ring, self.copy, step_words(x, dt, A_, B, C, D, dt_bias, out, varlen), self.plan, batch, stream)


def step_inputs(x, dt, A_, B, C, D, dt_bias, out, varlen: bool) -> dict:
    """The `A.PendingInputs` fields of a call, by name (tensors and strides)."""
    words = step_words(x, dt, A_, B, C, D, dt_bias, out, varlen)
    return dict(zip(A.PendingInputs._fields, (x, dt, A_, B, C, D, dt_bias, out, *words[8:])))


def step_words(x, dt, A_, B, C, D, dt_bias, out, varlen: bool) -> tuple:
    """`A.raw(A.PendingInputs, **step_inputs(...))` written out for the eager hot path."""
    xs, ds, bs, cs, os_ = x.stride(), dt.stride(), B.stride(), C.stride(), out.stride()
    if varlen:  # row strides 0, token strides the leading ones
        tok = (0, xs[0], 0, ds[0], ds[-1], 0, bs[0], 0, cs[0], 0, os_[0])
    else:
        tok = (xs[0], xs[1], ds[0], ds[1], ds[-1], bs[0], bs[1], cs[0], cs[1], os_[0], os_[1])
    return (
        x.data_ptr(), dt.data_ptr(), A_.data_ptr(), B.data_ptr(), C.data_ptr(), D.data_ptr(), dt_bias.data_ptr(), out.data_ptr(),
        *tok, A_.stride(0), dt_bias.stride(0), D.stride(0), D.stride(1),
    )  # fmt: skip


def pending_fold(cache, A_, plan_rows, fold_list, *, state_dtype: str, arch: str, head_offset: int, stream: int, debug_state=None) -> None:
    """`PendingLaunch.fold` with a launcher made for this call."""
    PendingLaunch(cache, plan_rows, fold_list, state_dtype, arch, head_offset).fold(cache, A_, plan_rows, fold_list, stream, debug_state)


def reads_as_is(t, width: int, varlen: bool = False) -> bool:
    """Whether the step reads x, B, C or out as it is: bf16, dense [b, T, n, width] or [b, T,
    n * width] (varlen [total, ...]) with (n, width) or n * width contiguous, a 16-byte-aligned
    base, the leading (row and token) strides multiples of 8."""
    split, s = len(t.shape) == (3 if varlen else 4), t.stride()
    if t.dtype != torch.bfloat16 or s[-1] != 1 or (split and s[-2] != width) or t.data_ptr() % 16:
        return False
    return not any(v % 8 for v in s[: -2 if split else -1])


def pending_step(cache, x, dt, A_, B, C, D, dt_bias, out, plan_rows, fold_list, *, state_dtype: str, arch: str, varlen: bool, stream: int, rows: str = "all") -> None:
    """`PendingLaunch.step` with a launcher made for this call."""
    launcher = PendingLaunch(cache, plan_rows, fold_list, state_dtype, arch)
    launcher.step(cache, x, dt, A_, B, C, D, dt_bias, out, plan_rows, fold_list, varlen, stream, rows)


SPLIT_MIN_BATCH = 64  # from this batch on a captured call's step is two launches


def fold_and_step(cache, x, dt, A_, B, C, D, dt_bias, out, plan_rows, fold_list, launch_fold, *, state_dtype: str,
                  arch: str, varlen: bool, stream: int, split: bool | None = None, launcher: PendingLaunch | None = None) -> None:  # fmt: skip
    """Launch a call's fold (`launch_fold()`, on `stream` behind the plan) and step
    (`launcher`: the cache's, else one made for this call). `split` (None: from
    SPLIT_MIN_BATCH rows on while a CUDA graph is captured): the rows that do not fold step
    on a side stream beside the fold, the others after it (docs/design.md section 10).
    Eager calls of SPLIT_MIN_BATCH rows compile the split variants, so a capture does not."""
    if launcher is None:
        launcher = PendingLaunch(cache, plan_rows, fold_list, state_dtype, arch)
    if dt.dtype not in A.DSL_DTYPES:
        dt = dt.float()  # before the fork: the side stream's step reads it
    big = plan_rows.shape[0] >= SPLIT_MIN_BATCH
    if split is None:
        split = big and torch.cuda.is_current_stream_capturing()
    if big and not split:  # compiled by the eager calls, not inside a capture
        for rows in ("rest", "fold"):
            launcher.compiled((dt.dtype, rows))
    args = (cache, x, dt, A_, B, C, D, dt_bias, out, plan_rows, fold_list, varlen)
    # The side stream forks before the fold: it waits for the plan only.
    side = fork_streams(out.get_device(), True, stream)[1] if split else None
    launch_fold()
    if split:
        launcher.step(*args, side, "rest")
        launcher.step(*args, stream, "fold")
        join_streams(out.get_device(), stream)
    else:
        launcher.step(*args, stream)


__all__ = [
    "PendingLaunch", "PendingStep", "step_inputs", "step_words", "ROWS", "SPLIT_MIN_BATCH", "STEP_READ_HINT", "TOKENS", "fold_and_step", "pending_kernel", "compiled_pending", "reads_as_is", "pending_step",
    "fold_kernel", "compiled_fold", "pending_fold",
]
