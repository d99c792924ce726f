"""Pending-mode kernels (speculative decoding, docs/format.md section 5b): a call of up to
T = max_seqlen tokens a row in three launches, no host sync, no allocation once a plan
buffer of the batch size exists, so a CUDA graph captures it.

1. `_plan_kernel`, grid (cdiv(batch, BLOCK),): per row, the commit and the fold decision
   of `pending.pending_decode` steps 1-2 from the device-resident positions (c, q):
   a = clamp(num_accepted, 0, q) (q when None), c' = c + a, f_old = f(c), f_new = f(c');
   positions become (c', T_b); NVFP4 rows that fold flip parity and zero the half of meta
   that becomes the amax accumulator (as separate mode's prepare does for its flush).
   Writes the plan row (`_plan_row`) and appends the rows that fold to a work list.
2. `_fold_kernel`, persistent (FOLD_CTAS_PER_SM programs an SM): the list's rows, work
   items of FOLD_ROWS state rows of one head: the checkpoint and the read copy.
3. `_step_kernel`, grid (batch, H / HB): every live row's outputs and ring writes from
   the read copy at f_new (the fold kernel ran before), HB heads of one group a program
   (the group's B window, C and B_j . C_t once), and the padding rows' zero outputs.

The fold reads window entries j < nf = f_new - f_old of the 16 token indices f_old ..
f_old + 15 (committed ring entries (f_old + j) mod 16); the step reads the window from
f_new, which holds every entry it reads or writes (format.md proves it): window entry j
is ring entry (f_new + j) mod 16 for j < u = c' - f_new (committed) and token j - u of
the call for u <= j < u + T_b. With pre_j = dt_0 + .. + dt_j over a window:

  fold rows (nf > 0): S = exp(A pre_{nf-1}) ckpt + sum_{j < nf} dt_j exp(A (pre_{nf-1} - pre_j)) x_j (x) B_j
    in FP32; the checkpoint becomes fp16_sr(S) (hash tag (seed, slot, f_new)) and the read
    copy is re-derived from S (NVFP4: with the live amax meta[slot, g, parity], and the
    head's amax max-accumulated into the other half);
  every live row, R = the dequantized read copy, token t (last = u + t):
    y_t = exp(A pre_last) R C_t + sum_{j <= last} dt_j exp(A (pre_last - pre_j)) (B_j . C_t) x_j + D x_t

then tokens 0 .. T_b - 1 go to ring entries (c' + t) mod 16 (B by the group's first
head). Dead entries (rejected drafts, NaN allowed) are never loaded; masked terms are
selected, never multiplied, and an entry with a non-finite x reaches only the tokens that
read it (`_replay`).

Products on the tensor cores: R C_t and B_j . C_t in bf16 (a
dequantized FP8 value has 4 significant bits, an NVFP4 value 2 x 4, C and B are bf16: the
products are exact in the FP32 accumulator; FP8's power-of-two row scale multiplies after
the dot); FP32 operands (the fold, the replay) split three ways (`PRECISION`,
tf32x3). The interpreter computes bf16 dots wrongly, so it takes FP32 operands there
(`F32_DOTS`), and its e4m3 encode is the integer twin (`HW_CVT`). softplus is
log1p(exp(v)) with log1p by Goldberg's identity (log(1 + y) * y / ((1 + y) - 1)), linear
above 20: a few FP32 ulps from PyTorch's.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ... import layout as L
from ...formats import Format
from ...pending import grid as pending_grid
from ...quant.rng import seed_key
from .bits import (
    ONE_SIXTH_BITS,
    decode_e4m3_pos,
    encode_e2m1_rn,
    encode_e4m3_rn,
    encode_fp16_sr,
    f32_exp2,
    pow2_exponent_above,
    random_word,
    stream_key,
)
from .launch import current_stream, int32_pattern, interpreting, keep

# Int32 words of a plan row (the kernels' row stride; `_plan_row` names them).
PLAN_COLS = 8
STEP_WARPS, STEP_HEADS = 4, 2  # the step kernel: warps, heads a program
FOLD_WARPS, FOLD_ROWS, FOLD_CTAS_PER_SM = 4, 32, 2  # the fold kernel: warps, state rows an item, programs an SM
# FP32 products: three-way split on the tensor cores (~2**-21 relative a product).
PRECISION = "tf32x3"


@triton.jit(do_not_specialize=["batch", "stride_ids", "stride_pos", "stride_parity", "stride_meta", "num_slots", "grid", "seed_key"])
def _plan_kernel(
    p_ids,
    p_pos,
    p_acc,
    p_cu,
    p_parity,
    p_meta,
    p_plan,
    p_list,
    batch,
    stride_ids,
    stride_pos,
    stride_parity,
    stride_meta,
    num_slots,
    grid,
    seed_key,
    T: tl.constexpr,
    G: tl.constexpr,
    HAS_ACC: tl.constexpr,
    VARLEN: tl.constexpr,
    NVFP4: tl.constexpr,
    BLOCK: tl.constexpr,
):
    o_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = o_b < batch
    raw = tl.load(p_ids + o_b.to(tl.int64) * stride_ids, mask=row, other=0)
    valid = row & (raw > 0) & (raw < num_slots)
    slot = tl.where(valid, raw, 0).to(tl.int64)
    c = tl.load(p_pos + slot * stride_pos, mask=valid, other=0)
    q = tl.load(p_pos + slot * stride_pos + 1, mask=valid, other=0)
    if HAS_ACC:
        acc = tl.load(p_acc + o_b, mask=valid, other=0).to(tl.int64)
        a = tl.minimum(tl.maximum(acc, 0), q.to(tl.int64)).to(tl.int32)
    else:
        a = q
    cn = c + a
    f_old = (c // grid) * grid
    f_new = (cn // grid) * grid
    nf = tl.where(valid, f_new - f_old, 0)
    if VARLEN:
        start = tl.load(p_cu + o_b, mask=row, other=0)
        tb = tl.load(p_cu + o_b + 1, mask=row, other=0) - start
    else:
        start = tl.zeros([BLOCK], tl.int32)
        tb = tl.full([BLOCK], T, tl.int32)
    tl.store(p_pos + slot * stride_pos, cn, mask=valid)
    tl.store(p_pos + slot * stride_pos + 1, tb, mask=valid)
    live = tl.zeros([BLOCK], tl.int32)
    if NVFP4:
        fold = nf > 0
        old = tl.load(p_parity + slot * stride_parity, mask=valid, other=0) & 1
        live = tl.where(fold, 1 - old, old)
        tl.store(p_parity + slot * stride_parity, live, mask=fold)
        for g in tl.static_range(G):
            tl.store(p_meta + slot * stride_meta + g * 2 + old, tl.zeros([BLOCK], tl.float32), mask=fold)
    key = stream_key(seed_key, slot, f_new).to(tl.int32, bitcast=True)
    p_row = p_plan + o_b.to(tl.int64) * 8
    tl.store(p_row + 0, tl.where(valid, slot.to(tl.int32), -1), mask=row)
    tl.store(p_row + 1, cn, mask=row)
    tl.store(p_row + 2, f_old, mask=row)
    tl.store(p_row + 3, nf, mask=row)
    tl.store(p_row + 4, live, mask=row)
    tl.store(p_row + 5, key, mask=row)
    tl.store(p_row + 6, start, mask=row)
    tl.store(p_row + 7, tb, mask=row)
    # Rows that fold join the fold kernel's work list: p_list[0] counts them (reset to 0 by
    # the step kernel, which runs after the fold kernel), p_list[1 + i] are their rows.
    fold_row = nf > 0
    at = tl.atomic_add(p_list + tl.zeros([BLOCK], tl.int32), fold_row.to(tl.int32), mask=fold_row, sem="relaxed")
    tl.store(p_list + 1 + at, o_b, mask=fold_row)


@triton.jit
def _plan_row(p_plan, row):
    """Plan row `row` (written by `_plan_kernel`): (slot, or -1 for padding; c'; f_old;
    nf = f_new - f_old; the NVFP4 live parity after the call; the stream key of the fold;
    the row's first token; T_b)."""
    p = p_plan + row * 8
    key = tl.load(p + 5).to(tl.uint32, bitcast=True)
    return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3), tl.load(p + 4), key, tl.load(p + 6), tl.load(p + 7)


@triton.jit
def _window_index(cn, f_old, start, tb, o_j):
    """Window entries o_j from the checkpoint f_old: (u = committed entries since it,
    from the ring (j < u), the call's tokens (u <= j < u + T_b), their ring entries, the
    input token of each (clamped; loads are masked by is_new))."""
    u = cn - f_old
    is_ring = o_j < u
    is_new = (o_j >= u) & (o_j < u + tb)
    phys = (f_old + o_j) & 15
    tj = (start + tl.maximum(o_j - u, 0)).to(tl.int64)
    return u, is_ring, is_new, phys, tj


@triton.jit
def _softplus(v):
    y = tl.exp(v)
    u = 1.0 + y
    lp = tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))
    return tl.where(v > 20.0, v, lp)


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """a @ b with FP32 accumulation: bf16 operands on the tensor cores (exact products),
    FP32 operands in the interpreter."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _decode_e2m1(code):
    """FP32 value of an e2m1 code (int32, 4 bits, sign at bit 3), exact: its bits placed
    in an FP16 (exponent bits 11..10, mantissa bit 9, sign 15) are the value times 2**-14,
    subnormal 0.5 included."""
    h = ((code & 7) << 9) | ((code & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e4m3_rn(x, HW: tl.constexpr):
    """FP32 -> e4m3fn codes (uint8), nearest-even, saturating, NaN -> 0x7F: the hardware
    conversion (cvt.rn.satfinite.e4m3x2.f32) on the GPU, the integer twin in the interpreter."""
    if HW:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return encode_e4m3_rn(x).to(tl.uint8)


@triton.jit
def _window(p_xr, p_x, p_dtr, p_dt, p_bias, slot64, s_xr, s_dtr, row, sx_row, sx_tok, sx_h, sdt_row, sdt_tok, sdt_h,
            sbias, h, o_c, phys, tj, is_ring, is_new):
    """Head h's window at columns o_c: x from the ring (entries j < u) and the call (u <= j
    < u + T_b) as loaded, dt (processed) and the call's processed dt."""
    all_c = o_c[None, :] >= 0
    x_r = tl.load(p_xr + slot64 * s_xr + (h * 16 + phys)[:, None] * 64 + o_c[None, :], mask=is_ring[:, None] & all_c, other=0.0)
    x_n = tl.load(p_x + row * sx_row + tj[:, None] * sx_tok + h * sx_h + o_c[None, :], mask=is_new[:, None] & all_c, other=0.0)
    dt_r = tl.load(p_dtr + slot64 * s_dtr + h * 16 + phys, mask=is_ring, other=0.0)
    dt_i = tl.load(p_dt + row * sdt_row + tj * sdt_tok + h * sdt_h, mask=is_new, other=0.0)
    dt_sp = _softplus(dt_i.to(tl.float32) + tl.load(p_bias + h * sbias))
    dt_w = tl.where(is_new, dt_sp, tl.where(is_ring, dt_r, 0.0))
    return x_r, x_n, dt_w, dt_sp


@triton.jit
def _replay(coef, inside, x_w, y, PRECISION: tl.constexpr):
    """y + coef @ x_w, NaN-safe: coef[t, j] is zero outside `inside`, and an entry holding
    a non-finite x (a later draft may be NaN) enters through a zero row, its tokens'
    outputs set to NaN instead (what the product gives where the entry counts)."""
    bad_j = tl.max(((x_w != x_w) | (tl.abs(x_w) == float("inf"))).to(tl.int32), axis=1)  # [16 entries]
    bad_t = tl.max(tl.where(inside, bad_j[None, :], 0), axis=1) > 0  # [16 tokens]
    x_c = tl.where(bad_j[:, None] > 0, 0.0, x_w)
    y = y + tl.dot(coef, x_c, input_precision=PRECISION)
    return tl.where(bad_t[:, None], float("nan"), y)


@triton.jit(do_not_specialize=["num_slots"])
def _step_kernel(
    p_plan, p_list, p_x, p_dt, p_A, p_B, p_C, p_D, p_bias, p_out, p_xr, p_dtr, p_br, p_read, p_scales, p_meta,
    sx_row, sx_tok, sx_h, sdt_row, sdt_tok, sdt_h, sb_row, sb_tok, sb_g, sc_row, sc_tok, sc_g, so_row, so_tok, so_h,
    sD_h, sD_p, sA, sbias, s_xr, s_dtr, s_br, s_read, s_scales, s_meta,
    num_slots,
    HPG: tl.constexpr,
    HB: tl.constexpr,
    NVFP4: tl.constexpr,
    F32_DOTS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Every live row's outputs, and the padding rows' zeros: program (b, i) takes
    heads HB i .. HB i + HB - 1 (one group) of row b; the group's B window, C and
    B_j . C_t once, then per head the read-copy term, the replay and the ring writes."""
    i_b = tl.program_id(0)
    h0 = tl.program_id(1) * HB
    g = h0 // HPG
    row = i_b.to(tl.int64)
    # The fold kernel (launched before) has consumed the work list: reset its count.
    # (Vector masks throughout: a scalar condition as a mask is int32 to Triton 3.9's interpreter.)
    o_1 = tl.arange(0, 1)
    tl.store(p_list + o_1, tl.zeros([1], tl.int32), mask=o_1 < tl.where((i_b == 0) & (h0 == 0), 1, 0))
    slot, cn, f_old, nf, live, _, start, tb = _plan_row(p_plan, row)
    o_p = tl.arange(0, 64)
    o_n = tl.arange(0, 128)
    o_t = tl.arange(0, 16)  # the call's tokens (T <= 8, padded for the dots)
    o_j = tl.arange(0, 16)  # window entries
    all_p = o_p[None, :] < 64
    all_n = o_n[None, :] < 128
    tok_ok = o_t < tb
    tok = (start + o_t).to(tl.int64)
    if slot < 0:  # padding row: zero outputs, nothing else
        for hh in tl.static_range(HB):
            p_o = p_out + row * so_row + tok[:, None] * so_tok + (h0 + hh) * so_h + o_p[None, :]
            tl.store(p_o, tl.zeros([16, 64], tl.float32).to(p_out.dtype.element_ty), mask=tok_ok[:, None] & all_p)
        return
    slot64 = slot.to(tl.int64)
    # The window from the checkpoint after the call's fold (the fold kernel ran before).
    u, is_ring, is_new, phys, tj = _window_index(cn, f_old + nf, start, tb, o_j)

    p_bw = p_br + slot64 * s_br + (g * 16 + phys)[:, None] * 128 + o_n[None, :]
    b_new = tl.load(p_B + row * sb_row + tj[:, None] * sb_tok + g * sb_g + o_n[None, :], mask=is_new[:, None] & all_n, other=0.0)
    b_w = tl.where(is_new[:, None], b_new, tl.load(p_bw, mask=is_ring[:, None] & all_n, other=0.0))
    c = tl.load(p_C + row * sc_row + tok[:, None] * sc_tok + g * sc_g + o_n[None, :], mask=tok_ok[:, None] & all_n, other=0.0)
    bc = _dot(c, tl.trans(b_w), F32_DOTS)  # [16 tokens, 16 entries]
    last = u + o_t
    inside = (o_j[None, :] <= last[:, None]) & tok_ok[:, None]
    # The group's first head appends B (no entry read above is among these: window bound).
    tl.store(p_bw, b_new, mask=is_new[:, None] & (o_n[None, :] < tl.where(h0 % HPG == 0, 128, 0)))
    if NVFP4:
        gbits = tl.load(p_meta + slot64 * s_meta + g * 2 + live).to(tl.int32, bitcast=True)
        gs = f32_exp2(pow2_exponent_above(gbits, 0x280000, 7))
    read_s = p_read + slot64 * s_read
    scales_s = p_scales + slot64 * s_scales
    for hh in tl.static_range(HB):
        h = h0 + hh
        x_r, x_n, dt_w, dt_sp = _window(
            p_xr, p_x, p_dtr, p_dt, p_bias, slot64, s_xr, s_dtr, row, sx_row, sx_tok, sx_h, sdt_row, sdt_tok, sdt_h,
            sbias, h, o_p, phys, tj, is_ring, is_new,
        )
        a_h = tl.load(p_A + h * sA)
        pre = tl.cumsum(dt_w, axis=0)
        pre_last = tl.sum(tl.where(o_j[None, :] == last[:, None], pre[None, :], 0.0), axis=1)  # [16 tokens]
        coef = tl.where(inside, dt_w[None, :] * tl.exp(a_h * (pre_last[:, None] - pre[None, :])) * bc, 0.0)
        rows = h * 64 + o_p  # slot-relative offsets stay int32 (a slot's tensors are < 2**31 bytes)
        if NVFP4:
            packed = tl.load(read_s + rows[:, None] * 64 + tl.arange(0, 64)[None, :])
            sc = tl.load(scales_s + rows[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.int32)  # [64, 8]
            d = tl.reshape(tl.broadcast_to((decode_e4m3_pos(sc) * gs)[:, :, None], (64, 8, 16)), (64, 128))
            vals = tl.interleave(_decode_e2m1((packed & 0xF).to(tl.int32)), _decode_e2m1((packed >> 4).to(tl.int32)))
            r = vals * d  # exact in bf16 (2 x 4 significant bits)
            rc = _dot(c, tl.trans(r), F32_DOTS)
        else:
            q = tl.load(read_s + rows[:, None] * 128 + o_n[None, :])
            if F32_DOTS:
                qi = q.to(tl.int32)
                r = tl.where(qi >= 128, -decode_e4m3_pos(qi & 0x7F), decode_e4m3_pos(qi))
            else:
                r = q.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            scale = tl.load(scales_s + rows)
            rc = _dot(c, tl.trans(r), F32_DOTS) * scale[None, :]
        y = _replay(coef, inside, tl.where(is_new[:, None], x_n, x_r).to(tl.float32), tl.exp(a_h * pre_last)[:, None] * rc, PRECISION)
        x_t = tl.load(
            p_x + row * sx_row + tok[:, None] * sx_tok + h * sx_h + o_p[None, :], mask=tok_ok[:, None] & all_p, other=0.0
        ).to(tl.float32)
        y += tl.load(p_D + h * sD_h + o_p * sD_p)[None, :] * x_t
        p_o = p_out + row * so_row + tok[:, None] * so_tok + h * so_h + o_p[None, :]
        tl.store(p_o, y.to(p_out.dtype.element_ty), mask=tok_ok[:, None] & all_p)
        tl.store(p_xr + slot64 * s_xr + (h * 16 + phys)[:, None] * 64 + o_p[None, :], x_n, mask=is_new[:, None] & all_p)
        tl.store(p_dtr + slot64 * s_dtr + h * 16 + phys, dt_sp, mask=is_new)


@triton.jit(do_not_specialize=["head_offset"])
def _fold_kernel(
    p_plan, p_list, p_A, p_ckpt, p_xr, p_dtr, p_br, p_read, p_scales, p_meta, p_meta_bits, p_dbg,
    sA, s_ckpt, s_xr, s_dtr, s_br, s_read, s_scales, s_meta,
    head_offset,
    H: tl.constexpr,
    HPG: tl.constexpr,
    FP: tl.constexpr,
    NVFP4: tl.constexpr,
    DEBUG: tl.constexpr,
    HW_CVT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Rows that fold, from the plan kernel's work list: persistent programs take work
    items (row, head h, state rows FP i .. FP i + FP - 1) in turn (every FP8 row scale
    and NVFP4 block depends on its own state row; the NVFP4 group amax is an order-free
    atomic max). The fold only: the step kernel, launched after, reads the new read copy."""
    NQ: tl.constexpr = 64 // FP
    items = tl.load(p_list) * (H * NQ)
    w = tl.program_id(0)
    while w < items:
        i_b = tl.load(p_list + 1 + w // (H * NQ))
        h = (w // NQ) % H
        i_q = w % NQ
        _fold_item(
            p_plan, p_A, p_ckpt, p_xr, p_dtr, p_br, p_read, p_scales, p_meta, p_meta_bits, p_dbg,
            sA, s_ckpt, s_xr, s_dtr, s_br, s_read, s_scales, s_meta,
            head_offset, i_b, h, i_q, H, HPG, FP, NVFP4, DEBUG, HW_CVT, PRECISION,
        )
        w += tl.num_programs(0)


@triton.jit
def _fold_item(
    p_plan, p_A, p_ckpt, p_xr, p_dtr, p_br, p_read, p_scales, p_meta, p_meta_bits, p_dbg,
    sA, s_ckpt, s_xr, s_dtr, s_br, s_read, s_scales, s_meta,
    head_offset, i_b, h, i_q,
    H: tl.constexpr,
    HPG: tl.constexpr,
    FP: tl.constexpr,
    NVFP4: tl.constexpr,
    DEBUG: tl.constexpr,
    HW_CVT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One fold work item (a row of the list, so live and folding): state rows o_r of
    head h as a full [FP, 128] tile. The window entries j < nf are committed ring entries
    (nf <= u), the fold a K = 16 product on the tensor cores with FP32 operands split
    three ways (tf32x3: ~2**-21 relative a product, FP32 sums)."""
    g = h // HPG
    row = i_b.to(tl.int64)
    slot, cn, f_old, nf, live, key, start, tb = _plan_row(p_plan, row)
    slot64 = slot.to(tl.int64)
    o_r = i_q * FP + tl.arange(0, FP)  # this item's head rows p
    o_n = tl.arange(0, 128)
    o_j = tl.arange(0, 16)
    fold_j = o_j < nf
    phys = (f_old + o_j) & 15
    x_r = tl.load(p_xr + slot64 * s_xr + (h * 16 + phys)[:, None] * 64 + o_r[None, :], mask=fold_j[:, None] & (o_r[None, :] >= 0), other=0.0)
    dt_w = tl.load(p_dtr + slot64 * s_dtr + h * 16 + phys, mask=fold_j, other=0.0)
    b_ring = tl.load(p_br + slot64 * s_br + (g * 16 + phys)[:, None] * 128 + o_n[None, :], mask=fold_j[:, None] & (o_n[None, :] < 128), other=0.0)

    # S = exp(A pre_f) ckpt + sum_{j < nf} dt_j exp(A (pre_f - pre_j)) x_j (x) B_j, FP32.
    a_h = tl.load(p_A + h * sA)
    pre = tl.cumsum(dt_w, axis=0)
    pre_f = tl.sum(tl.where(o_j == nf - 1, pre, 0.0), axis=0)
    w_f = tl.where(fold_j, dt_w * tl.exp(a_h * (pre_f - pre)), 0.0)
    wx = tl.where(fold_j[:, None], w_f[:, None] * x_r.to(tl.float32), 0.0)  # [16, FP]
    p_ck = p_ckpt + slot64 * s_ckpt + (h * 64 + o_r)[:, None] * 128 + o_n[None, :]
    s_f = tl.exp(a_h * pre_f) * tl.load(p_ck).to(tl.float16, bitcast=True).to(tl.float32)
    s_f = tl.dot(tl.trans(wx), b_ring.to(tl.float32), s_f, input_precision=PRECISION)  # [FP, 128]
    if DEBUG:
        tl.store(p_dbg + (row * H + h) * 8192 + o_r[:, None] * 128 + o_n[None, :], s_f)
    # FP16 checkpoint, stochastic rounding: word ((h + head_offset) 64 + p) 64 + n // 2
    # gives bits [12:0] to the even column n and [28:16] to the odd one (quant/rng.py).
    rw = random_word(key, ((h + head_offset) * 64 + o_r)[:, None] * 64 + tl.arange(0, 64)[None, :])
    rbits = tl.reshape(tl.join(rw & 0x1FFF, (rw >> 16) & 0x1FFF), (FP, 128))
    tl.store(p_ck, encode_fp16_sr(s_f, rbits).to(tl.int16))
    a_f = s_f.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    rows = h * 64 + o_r
    if NVFP4:
        gbits = tl.load(p_meta + slot64 * s_meta + g * 2 + live).to(tl.int32, bitcast=True)
        e_g = pow2_exponent_above(gbits, 0x280000, 7)
        gs = f32_exp2(e_g)
        igs = f32_exp2(-e_g)
        bmax = tl.max(tl.reshape(a_f, (FP, 8, 16)), axis=2)  # [FP, 8] block amax bits
        one_sixth = tl.full([], ONE_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
        s_code = encode_e4m3_rn((bmax.to(tl.float32, bitcast=True) * igs) * one_sixth)
        d_blk = decode_e4m3_pos(s_code) * gs
        rcp = tl.math.div_rn(tl.full(d_blk.shape, 1.0, tl.float32), tl.where(d_blk == 0, 1.0, d_blk))
        rcp = tl.where(d_blk == 0, 0.0, rcp)
        rcp = tl.reshape(tl.broadcast_to(rcp[:, :, None], (FP, 8, 16)), (FP, 128))
        q_lo, q_hi = tl.split(tl.reshape(encode_e2m1_rn(s_f * rcp) & 0xF, (FP, 64, 2)))
        p_rd = p_read + slot64 * s_read + rows[:, None] * 64 + tl.arange(0, 64)[None, :]
        tl.store(p_rd, (q_lo | (q_hi << 4)).to(tl.uint8))
        tl.store(p_scales + slot64 * s_scales + rows[:, None] * 8 + tl.arange(0, 8)[None, :], s_code.to(tl.uint8))
        tl.atomic_max(p_meta_bits + slot64 * s_meta + g * 2 + (1 - live), tl.max(tl.max(a_f, axis=1), axis=0), sem="relaxed")
    else:
        e_r = pow2_exponent_above(tl.max(a_f, axis=1), 0x600000, 8)
        tl.store(p_read + slot64 * s_read + rows[:, None] * 128 + o_n[None, :], _e4m3_rn(s_f * f32_exp2(-e_r)[:, None], HW_CVT))
        tl.store(p_scales + slot64 * s_scales + rows, f32_exp2(e_r))


def _fold_programs(device: torch.device) -> int:
    """Persistent fold programs: FOLD_CTAS_PER_SM an SM (one in the interpreter)."""
    if interpreting() or device.type != "cuda":
        return 1
    return FOLD_CTAS_PER_SM * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class PendingPlan:
    """Plan buffers for up to `rows` batch rows: `buf` (int32 [rows, PLAN_COLS], the
    words `_plan_row` names; `view(batch)` is its first rows, so a call allocates nothing) and the fold
    work list (int32 [rows + 1]: a count, zero between calls, then rows)."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows = rows
        self.buf = torch.zeros(rows, PLAN_COLS, dtype=torch.int32, device=device)
        self.fold_list = torch.zeros(rows + 1, dtype=torch.int32, device=device)

    def view(self, batch: int) -> torch.Tensor:
        return self.buf[:batch]


def _tok_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int]:
    """(row stride, token stride) of a dense [b, T, ...] or varlen [total, ...] tensor."""
    return (0, t.stride(0)) if varlen else (t.stride(0), t.stride(1))


def _plan_arguments(cache, plan: PendingPlan, ids, accepted, cu_seqlens, fmt: Format, seed: int, max_seqlen: int):
    """The plan kernel's arguments (tensors, then its scalars) and constexprs for a call
    of `ids` (1-D) with verdicts `accepted` and `cu_seqlens` (None: not given; the ids
    fill their slots, unread)."""
    pos = cache[L.POSITIONS]
    meta, parity = (cache[L.META], cache[L.PARITY]) if fmt.two_level else (pos, pos)  # unused for FP8
    batch = ids.shape[0]
    acc = accepted if accepted is not None else ids
    cu = cu_seqlens if cu_seqlens is not None else ids
    args = (
        ids, pos, acc, cu, parity, meta, plan.view(batch), plan.fold_list,
        batch, ids.stride(0), pos.stride(0), parity.stride(0), meta.stride(0), cache[L.CHECKPOINT].shape[0],
        pending_grid(max_seqlen), int32_pattern(seed_key(seed)),
    )  # fmt: skip
    constexprs = dict(T=max_seqlen, G=cache[L.B_RING].shape[1], HAS_ACC=accepted is not None,
                      VARLEN=cu_seqlens is not None, NVFP4=fmt.two_level, BLOCK=64 if interpreting() else 128)  # fmt: skip
    return args, constexprs


class PlanLaunch:
    """The plan launch of one cache, plan buffer, format, seed and max_seqlen, with every
    argument but the ids, the verdicts and cu_seqlens made once (addresses, not tensors:
    its keeper gives it the cache and plan it was made for). Every runtime integer of the
    plan kernel is unspecialized, so the compiled kernel depends on the dtypes and 16-byte
    alignment of the three per-call tensors and on whether verdicts and cu_seqlens are
    given; the first launch of each goes through Triton's launcher with tensors, later
    ones launch it with addresses (`launch.Compiled`)."""

    def __init__(self, cache, plan: PendingPlan, fmt: Format, seed: int, max_seqlen: int) -> None:
        self.args = (fmt, seed, max_seqlen)
        ids = plan.fold_list[:1]  # stands in for the per-call tensors
        args, constexprs = _plan_arguments(cache, plan, ids, None, None, fmt, seed, max_seqlen)
        self.middle = tuple(t.data_ptr() for t in args[4:8])  # parity, meta, plan rows, fold list
        self.pos = args[1].data_ptr()
        self.scalars = args[10:]
        self.constexprs = constexprs
        self.compiled: dict[tuple, object] = {}

    def __call__(self, cache, plan: PendingPlan, ids, accepted, cu_seqlens, stream: int) -> None:
        """Launch for `ids` (1-D), `accepted` and `cu_seqlens` (None: not given) on stream
        handle `stream`."""
        batch = ids.shape[0]
        acc = accepted if accepted is not None else ids
        cu = cu_seqlens if cu_seqlens is not None else ids
        ptrs = (ids.data_ptr(), acc.data_ptr(), cu.data_ptr())
        key = (ids.dtype, acc.dtype, cu.dtype, accepted is None, cu_seqlens is None, *(p % 16 == 0 for p in ptrs))
        kernel = self.compiled.get(key)
        blocks = triton.cdiv(batch, self.constexprs["BLOCK"])
        if kernel is None:
            args, constexprs = _plan_arguments(cache, plan, ids, accepted, cu_seqlens, *self.args)
            keep(self.compiled, key, _plan_kernel[(blocks,)](*args, **constexprs, num_warps=4), stream)
            return
        c = self.constexprs
        kernel(
            (blocks, 1, 1), stream,
            (ptrs[0], self.pos, ptrs[1], ptrs[2], *self.middle, batch, ids.stride(0), *self.scalars,
             c["T"], c["G"], accepted is not None, cu_seqlens is not None, c["NVFP4"], c["BLOCK"]),
        )  # fmt: skip


def pending_decode(
    cache,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    *,
    fmt: Format,
    seed: int,
    max_seqlen: int,
    num_accepted_tokens: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    head_offset: int = 0,
    plan: PendingPlan | None = None,
    debug_state: torch.Tensor | None = None,
    step_heads: int = STEP_HEADS,
    step=None,
    fold=None,
    plan_launches: dict | None = None,
) -> torch.Tensor:
    """One pending-mode call on the kernels (`pending.pending_decode`'s semantics).

    Inputs as `api.normalize_pending_inputs` returns them: dense x [b, T, H, 64], dt
    [b, T, H] (any float dtype), B, C [b, T, G, 128], out [b, T, H, 64] with T ==
    max_seqlen, or varlen (`cu_seqlens` int32 [b + 1]) x [total, H, 64], dt [total, H],
    B, C [total, G, 128], out [total, H, 64]; any strides with a contiguous last dim
    (others are copied). A, dt_bias [H] and D [H, 64] FP32, any strides.
    `num_accepted_tokens`: int [b] or None. `plan`: a `PendingPlan` with room for b rows
    (made when None). `debug_state`: FP32 [b, H, 64, 128] receiving the folded state S of
    the rows that fold (tests). `fold`: launches the fold in place of `_fold_kernel` (the
    CuTe kernel: fold(plan rows, fold list, debug_state)). `step`: launches the fold and
    the step in place of `_step_kernel` (the CuTe kernels: step(x, dt, B, C, out, plan
    rows, fold list, varlen, launch_fold) -> whether it launched; it calls launch_fold()
    for the fold, and its step resets the fold list's count; False: it launched nothing).
    `plan_launches`: a dict owned with the cache (the kernel backend's context) keeping
    its `PlanLaunch`es, so repeated calls launch the plan kernel past Triton's dispatch.
    Three launches (the CuTe pair may split its step in two); returns `out`."""
    ids = ids.reshape(-1)
    batch = ids.shape[0]
    if batch == 0:
        return out
    varlen = cu_seqlens is not None
    ckpt = cache[L.CHECKPOINT]
    num_slots, heads = ckpt.shape[:2]
    x_ring, dt_ring, b_ring, read, scales, pos = (
        cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING], cache[L.READ_COPY], cache[L.SCALES], cache[L.POSITIONS],
    )
    groups = b_ring.shape[1]
    lead = 1 if varlen else 2
    x = x.reshape(*x.shape[:lead], heads, L.HEAD_DIM)
    out_v = out.view(*out.shape[:lead], heads, L.HEAD_DIM)
    B = B.reshape(*B.shape[:lead], groups, L.STATE_DIM)
    C = C.reshape(*C.shape[:lead], groups, L.STATE_DIM)
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    if plan is None:
        plan = PendingPlan(batch, ids.device)
    pv = plan.view(batch)
    if fmt.two_level:
        meta = cache[L.META]
        scales_arg = scales.view(torch.uint8)
    else:
        meta = pos  # unused (the NVFP4 branches are compiled out)
        scales_arg = scales
    stream = current_stream(ids.device) if plan_launches is not None else None
    if stream is None:
        args, constexprs = _plan_arguments(cache, plan, ids, num_accepted_tokens, cu_seqlens, fmt, seed, max_seqlen)
        _plan_kernel[(triton.cdiv(batch, constexprs["BLOCK"]),)](*args, **constexprs, num_warps=4)
    else:
        key = (fmt, seed, max_seqlen, plan.buf.data_ptr(), plan.fold_list.data_ptr())
        launch = plan_launches.get(key)
        if launch is None:
            launch = plan_launches[key] = PlanLaunch(cache, plan, fmt, seed, max_seqlen)
        launch(cache, plan, ids, num_accepted_tokens, cu_seqlens, stream)
    hpg = heads // groups

    def launch_fold() -> None:  # the rows that fold (checkpoint and read copy)
        if fold is not None:
            fold(pv, plan.fold_list, debug_state)
            return
        dbg = debug_state if debug_state is not None else pv
        _fold_kernel[(min(batch * heads * (L.HEAD_DIM // FOLD_ROWS), _fold_programs(ids.device)),)](
            pv, plan.fold_list, A, ckpt.view(torch.int16), x_ring, dt_ring, b_ring, read.view(torch.uint8), scales_arg,
            meta, meta.view(torch.int32), dbg,
            A.stride(0), ckpt.stride(0), x_ring.stride(0), dt_ring.stride(0), b_ring.stride(0), read.stride(0),
            scales.stride(0), meta.stride(0), head_offset,
            H=heads, HPG=hpg, FP=FOLD_ROWS, NVFP4=fmt.two_level, DEBUG=debug_state is not None, HW_CVT=not interpreting(),
            PRECISION=PRECISION, num_warps=FOLD_WARPS,
        )

    # The fold, then every row's outputs and ring writes (a `step` launches both).
    if step is not None and step(x, dt, B, C, out_v, pv, plan.fold_list, varlen, launch_fold):
        return out
    launch_fold()
    inputs = (pv, plan.fold_list, x, dt, A, B, C, D, dt_bias, out_v)
    strides = (
        *_tok_strides(x, varlen), x.stride(-2),
        *_tok_strides(dt, varlen), dt.stride(-1),
        *_tok_strides(B, varlen), B.stride(-2),
        *_tok_strides(C, varlen), C.stride(-2),
        *_tok_strides(out_v, varlen), out_v.stride(-2),
        D.stride(0), D.stride(1), A.stride(0), dt_bias.stride(0),
    )
    hb = min(step_heads, hpg)
    _step_kernel[(batch, heads // hb)](
        *inputs, x_ring, dt_ring, b_ring, read.view(torch.uint8), scales_arg, meta, *strides,
        x_ring.stride(0), dt_ring.stride(0), b_ring.stride(0), read.stride(0), scales.stride(0), meta.stride(0),
        num_slots,
        HPG=hpg, HB=hb, NVFP4=fmt.two_level, F32_DOTS=interpreting(), PRECISION=PRECISION, num_warps=STEP_WARPS,
    )
    return out


__all__ = ["PendingPlan", "pending_decode", "PLAN_COLS"]
