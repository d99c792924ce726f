"""Initialize kernel: FP16 checkpoint and read copy of each valid row's slot from FP32
prefill states [batch, H, 64, 128], bit-exact with `reference.initialize`.

Grid (batch, H * 64 // BLOCK_R): program (i_b, i_r) encodes state rows r = h * 64 + p in
[i_r * BLOCK_R, (i_r + 1) * BLOCK_R) of batch row i_b. Each row of 128 is held as two
[BLOCK_R, 8, 8] tiles, the even and the odd elements (element n = 16 b + 2 j (+1)), because
that pairing is shared by all three encodings:
- FP16 checkpoint: elements 2m and 2m+1 take bits [12:0] and [28:16] of one random word
  (quant/rng.py `checkpoint_rbits`), so one hash serves both tiles;
- NVFP4: b is the 16-element block, and byte m of the packed row is
  code(2m) | code(2m+1) << 4, i.e. even | odd << 4 at byte index 8 b + j;
- FP8: one power-of-two scale per row (max over both tiles);
- fp16 (`READ_COPY` off): no read copy, the checkpoint alone.
NVFP4 needs the amax over a whole group (up to 128 heads, many programs): `head_amax.py`
reduces it per head in an earlier launch, and every program takes the max over its group's
heads from there, so all programs of a group agree on the second-level scale without
atomics. The group's first row writes meta[slot, g, 0] = meta[slot, g, 1] = group amax,
and the program holding row 0 writes parity[slot] = 0. Each program also zeroes its share
(CLEAR_BLOCK elements of each ring; program 0 the positions) of the slot's rings, the
clear kernel's body (`clear.zero_slot`), so an initialize is one launch (two for NVFP4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import layout as L
from ...formats import Format
from ...quant.rng import seed_key_i32
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
from .clear import ring_arguments, zero_slot
from .head_amax import head_amax
from .launch import interpreting



@triton.jit(do_not_specialize=["num_slots", "seed_key"])
def _initialize_kernel(
    p_states,
    p_ids,
    p_hmax,
    p_ckpt,
    p_read,
    p_scales,
    p_meta,
    p_parity,
    p_xr,
    p_dtr,
    p_br,
    p_pos,
    stride_ids,
    stride_sb,
    stride_sh,
    stride_sp,
    stride_sn,
    stride_ckpt,
    stride_read,
    stride_scales,
    stride_meta,
    stride_parity,
    stride_xr,
    stride_dtr,
    stride_br,
    stride_pos,
    num_slots,
    seed_key,
    head_offset,
    H: tl.constexpr,
    HPG: tl.constexpr,
    BLOCK_HPG: tl.constexpr,
    NVFP4: tl.constexpr,
    READ_COPY: tl.constexpr,
    BLOCK_R: tl.constexpr,
    N_X: tl.constexpr,
    N_DT: tl.constexpr,
    N_B: tl.constexpr,
    POS_WIDTH: tl.constexpr,
    CLEAR_BLOCK: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_r = tl.program_id(1)
    slot = tl.load(p_ids + i_b.to(tl.int64) * stride_ids)
    if (slot <= 0) | (slot >= num_slots):  # padding row: writes nothing
        return
    slot = slot.to(tl.int64)
    # Rings and positions cleared: this program's share of the slot's ring elements.
    zero_slot(slot, i_r, p_xr, p_dtr, p_br, p_pos, stride_xr, stride_dtr, stride_br, stride_pos, N_X, N_DT, N_B, POS_WIDTH, CLEAR_BLOCK)

    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # state rows h * 64 + p of the slot
    o_bk = tl.arange(0, 8)  # 16-element blocks of a row
    o_j = tl.arange(0, 8)  # element pairs within a block
    o_row = o_r[:, None, None]
    o_pair = o_bk[None, :, None] * 8 + o_j[None, None, :]  # pair index m: elements 2m, 2m+1
    o_n = (2 * o_pair).to(tl.int64)

    p_x = (
        p_states
        + i_b.to(tl.int64) * stride_sb
        + (o_row >> 6).to(tl.int64) * stride_sh
        + (o_row & 63).to(tl.int64) * stride_sp
        + o_n * stride_sn
    )
    b_xe = tl.load(p_x)
    b_xo = tl.load(p_x + stride_sn)

    # FP16 checkpoint, stochastic rounding; stream tag at position INIT_POSITION (2**32 - 1).
    key = stream_key(seed_key, slot, tl.full([], -1, tl.int32))
    b_w = random_word(key, (o_row + head_offset * 64) * 64 + o_pair)  # the model's head (TP shards)
    b_ce = encode_fp16_sr(b_xe, b_w & 0x1FFF)
    b_co = encode_fp16_sr(b_xo, (b_w >> 16) & 0x1FFF)
    p_c = p_ckpt + slot * stride_ckpt + o_row.to(tl.int64) * 128 + o_n
    tl.store(p_c, b_ce.to(tl.int16))
    tl.store(p_c + 1, b_co.to(tl.int16))

    b_ae = b_xe.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    b_ao = b_xo.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    b_bmax = tl.maximum(tl.max(b_ae, axis=2), tl.max(b_ao, axis=2))  # [BLOCK_R, 8] bits
    if NVFP4:
        o_g = (o_r >> 6) // HPG  # group of each row
        o_k = tl.arange(0, BLOCK_HPG)[None, :]  # the group's heads (HPG of a power-of-two block)
        b_gbits = tl.max(tl.load(p_hmax + i_b.to(tl.int64) * H + o_g[:, None] * HPG + o_k, mask=o_k < HPG, other=0), axis=1)
        e_g = pow2_exponent_above(b_gbits, 0x280000, 7)  # [BLOCK_R]
        gs = f32_exp2(e_g)[:, None]
        igs = f32_exp2(-e_g)[:, None]
        one_sixth = tl.full([], ONE_SIXTH_BITS, tl.int32).to(tl.float32, bitcast=True)
        b_t = (b_bmax.to(tl.float32, bitcast=True) * igs) * one_sixth
        b_s = encode_e4m3_rn(b_t)  # block scale codes, non-negative
        b_d = decode_e4m3_pos(b_s) * gs
        b_r = tl.math.div_rn(tl.full(b_d.shape, 1.0, tl.float32), tl.where(b_d == 0, 1.0, b_d))
        b_r = tl.where(b_d == 0, 0.0, b_r)[:, :, None]
        b_qe = encode_e2m1_rn(b_xe * b_r) & 0xF
        b_qo = encode_e2m1_rn(b_xo * b_r) & 0xF
        p_q = p_read + slot * stride_read + o_row.to(tl.int64) * 64 + o_pair
        tl.store(p_q, (b_qe | (b_qo << 4)).to(tl.uint8))
        p_s = p_scales + slot * stride_scales + o_r[:, None].to(tl.int64) * 8 + o_bk[None, :]
        tl.store(p_s, b_s.to(tl.uint8))
        # The group's first row (head g * HPG, p = 0) writes both halves of meta[slot, g].
        o_half = tl.arange(0, 2)[None, :]
        first = (o_r % (HPG * 64) == 0)[:, None]
        b_gamax = tl.broadcast_to(b_gbits.to(tl.float32, bitcast=True)[:, None], (BLOCK_R, 2))
        tl.store(p_meta + slot * stride_meta + o_g[:, None] * 2 + o_half, b_gamax, mask=first)
        tl.store(p_parity + slot * stride_parity, tl.zeros([], tl.int32), mask=i_r == 0)
    elif READ_COPY:
        e_r = pow2_exponent_above(tl.max(b_bmax, axis=1), 0x600000, 8)  # [BLOCK_R]
        inv = f32_exp2(-e_r)[:, None, None]
        b_qe = encode_e4m3_rn(b_xe * inv)
        b_qo = encode_e4m3_rn(b_xo * inv)
        p_q = p_read + slot * stride_read + o_row.to(tl.int64) * 128 + o_n
        tl.store(p_q, b_qe.to(tl.uint8))
        tl.store(p_q + 1, b_qo.to(tl.uint8))
        tl.store(p_scales + slot * stride_scales + o_r, f32_exp2(e_r))


def _arguments(cache, heads: int, fmt: Format, seed: int, head_offset: int):
    """The initialize kernel's cache arguments (views), the scalars after the states'
    strides, and the constexprs; the hmax, meta and parity slots hold the checkpoint in
    FP8 (unused: the NVFP4 branch is compiled out), the read copy and scales slots too
    in fp16 (no read copy: both branches compiled out)."""
    ckpt = cache[L.CHECKPOINT]
    read, scales = (cache[L.READ_COPY], cache[L.SCALES]) if fmt.has_read_copy else (ckpt, ckpt)
    if fmt.two_level:
        groups = cache[L.META].shape[1]
        meta, parity = cache[L.META], cache[L.PARITY]
        scales_arg = scales.view(torch.uint8)
    else:
        groups = cache[L.B_RING].shape[1]
        meta = parity = ckpt
        scales_arg = scales
    rows = heads * L.HEAD_DIM
    # The interpreter pays per program: one program per batch row (up to 1024 state rows)
    # there; 16 rows (2048 elements) per program on the GPU.
    block_r = min(1024, rows & -rows) if interpreting() else 16
    rings, ring_scalars, ring_consts = ring_arguments(cache, programs=rows // block_r)
    tensors = (ckpt.view(torch.int16), read.view(torch.uint8), scales_arg, meta, parity, *rings)
    scalars = (ckpt.stride(0), read.stride(0), scales.stride(0), meta.stride(0), parity.stride(0), *ring_scalars[:4],
               ckpt.shape[0], seed_key_i32(seed), head_offset)  # fmt: skip
    clear_block = ring_consts.pop("BLOCK")
    return tensors, scalars, dict(H=heads, HPG=heads // groups, BLOCK_HPG=triton.next_power_of_2(heads // groups), NVFP4=fmt.two_level, READ_COPY=fmt.has_read_copy, BLOCK_R=block_r,
                                  **ring_consts, CLEAR_BLOCK=clear_block)  # fmt: skip


def initialize(cache, states: torch.Tensor, ids: torch.Tensor, *, fmt: Format, seed: int, head_offset: int = 0) -> None:
    """Checkpoint, read copy and scales (NVFP4: meta and parity too) of the valid slots in
    `ids` from FP32 `states` [batch, H, 64, 128] (any strides, stride 0 on the batch dim
    included), and their rings and positions cleared. Launches: head amax (NVFP4 only),
    then encode-and-clear."""
    ids = ids.reshape(-1)
    batch, heads = states.shape[:2]
    if batch == 0:
        return
    num_slots = cache[L.CHECKPOINT].shape[0]
    tensors, scalars, constexprs = _arguments(cache, heads, fmt, seed, head_offset)
    hmax = head_amax(states, ids, num_slots) if fmt.two_level else tensors[0]
    _initialize_kernel[(batch, heads * L.HEAD_DIM // constexprs["BLOCK_R"])](
        states, ids, hmax, *tensors, ids.stride(0), *states.stride(), *scalars, **constexprs, num_warps=4, enable_fp_fusion=False
    )
