"""The bookkeeping kernel (CuTe DSL): initialize and clear, bit-exact with
`reference.initialize` / `reference.clear`; one launch each, no host sync, no allocation.

Grid (batch, groups * splits), 256 threads: CTA (b, g * splits + k) serves row b's slot
(padding rows: nothing) and heads g * hpg + k, + splits, .. of group g: x and dt rings
zeroed and, initialize, the FP32 state written as the flush writes a folded one (checkpoint
tagged (seed, slot, INIT_POSITION), read copy by the format's strategy). k = 0 also zeroes
the group's B ring and writes NVFP4's meta, g = k = 0 the positions (both words in pending
mode) and NVFP4's parity. Every NVFP4 CTA reduces the group amax itself (max of |x|'s bits:
exact, order-free), so none waits for another; `splits` trades those repeated reads (mostly
L2 hits) against parallelism. Other formats and clear take one head a CTA.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import torch
from cuda.bindings import driver as cuda_driver
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.runtime import make_fake_stream, make_ptr
from cutlass.cute.typing import Pointer
from cutlass.memory import SmemAllocator

from ... import layout as L
from ...formats import FP16
from ...layout import RING
from ...quant.rng import seed_key_i32
from . import args as A
from . import bits
from .bits_nvfp4 import NVFP4_E_OFF, NVFP4_MANT_LIMIT
from .flush import NT, Flush, shape
from .launch import compile_entry
from .plan import ID_DTYPES, row_slot, slots_words, stream_key
from .read_copy import read_copy_format

THREADS = 256  # flush CTAs' lane maps (`flush.Shape`) side by side: a head in one or more trips
# NVFP4: CTAs a launch aims at (about one an SM) before it stops splitting a (row, group)
# over more CTAs, each of which reduces the group amax again.
NVFP4_CTAS = 128


class Bookkeeping:
    """Initialize (`fmt`: a `read_copy` strategy) or clear (`fmt` None) for hpg heads a
    group, positions of `pos_width` words and head dim P, state dim N; `vec`: the states'
    rows are read by 16-byte loads (unit column stride, 16-byte-aligned base and strides)."""

    def __init__(self, fmt, hpg: int, pos_width: int, vec: bool = False, P: int = 64, N: int = 128) -> None:
        self.fmt, self.hpg, self.pos_width, self.vec = fmt, hpg, pos_width, vec
        if fmt is not None and (fmt.P, fmt.N) != (P, N):
            raise ValueError(f"the format's geometry {(fmt.P, fmt.N)} is not {(P, N)}")
        self.P, self.N = P, N
        self.two_level = fmt is not None and fmt.name == "nvfp4"
        self.flush = Flush(fmt, hpg, 1) if fmt is not None else None
        # The head's rows as the flush's CTAs (units) map them, THREADS // threads units a trip
        # (head dim 80: 5 units; the last trip's spare threads redo the last: same values, addresses).
        self.sh = shape(P, N)
        self.unit = self.sh.threads
        self.trips = -(-self.sh.m_split // (THREADS // self.unit))

    @cute.jit
    def __call__(self, ids: Pointer, ids_stride: Int64, states: Pointer, sb: Int64, sh: Int64, sp: Int64, sn: Int64, ckpt: A.Checkpoint,
                 ring: A.Ring, copy, slots: A.Slots, seed: Int32, batch: Int32, groups: Int32, splits: Int32, stream: cuda_driver.CUstream):  # fmt: skip
        self.kernel(ids, ids_stride, states, sb, sh, sp, sn, ckpt, ring, copy, slots, seed, splits).launch(
            grid=[batch, groups * splits, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, ids, ids_stride, states, sb, sh, sp, sn, ckpt, ring, copy, slots, seed, splits):
        t, _, _ = cute.arch.thread_idx()
        bx, by, _ = cute.arch.block_idx()
        g, k = Int32(by) // splits, Int32(by) % splits
        smem = SmemAllocator()
        s_amax = smem.allocate_tensor(Int32, cute.make_layout(self.sh.cp * self.P), byte_alignment=16)
        valid, slot = row_slot(ids, Int64(bx), ids_stride, slots.num_slots)
        if valid != Int32(0):  # the same for the whole CTA (one row)
            row = Int64(bx) * sb
            ctx = None
            gmax = Int32(0)
            if cutlass.const_expr(self.two_level):
                gmax = self.group_amax(t, states, row, sh, sp, sn, g, s_amax)
                e = bits.pow2_exponent_above(gmax, NVFP4_MANT_LIMIT, NVFP4_E_OFF)
                ctx = (None, None, bits.exp2_int(e), bits.exp2_int(-e))  # read_copy.Nvfp4.begin_fold's g, 1 / g
            key = stream_key(seed, slot, Int32(-1))  # INIT_POSITION
            for h in range(g * self.hpg + k, (g + Int32(1)) * self.hpg, splits):
                hh = Int64(h)
                self.zero(t, ring.x, ring.x_stride16, slot, hh, RING * self.P // 8)
                if t < RING:
                    ring.dt[slot * ring.dt_stride + hh * RING + Int64(t)] = Float32(0.0)
                if cutlass.const_expr(self.fmt is not None):
                    for trip in cutlass.range_constexpr(self.trips):
                        mh = self.part(t, trip)
                        self.encode(t, mh, self.load(t, mh, states, row + hh * sh, sp, sn), slot, hh, key, ckpt, copy, s_amax, ctx)
            if k == Int32(0):
                self.zero(t, ring.b, ring.b_stride16, slot, Int64(g), RING * self.N // 8)
                if t == 0:
                    if cutlass.const_expr(self.two_level):
                        for half in cutlass.range_constexpr(2):
                            copy.meta[slot * copy.meta_stride + Int64(g) * 2 + half] = gmax.bitcast(Float32)
                    if g == Int32(0):
                        for w in cutlass.range_constexpr(self.pos_width):
                            slots.positions[slot * slots.pos_stride + w] = Int32(0)
                        if cutlass.const_expr(self.two_level):
                            copy.parity[slot * copy.parity_stride] = Int32(0)

    @cute.jit
    def zero(self, t, ring, stride16, slot, i, vectors: cutlass.Constexpr):
        """Zero part i (`vectors` 16-byte vectors: an x ring head, a B ring group) of `slot`."""
        w = cute.recast_ptr(ring, dtype=Uint32)
        for k in cutlass.range_constexpr(-(-vectors // THREADS)):
            if t + k * THREADS < vectors:
                bits.st_global_v4_u32((w + (slot * stride16 + i * vectors + Int64(t + k * THREADS)) * 4).toint(), [Uint32(0)] * 4)

    def part(self, t, trip: int):
        """The row part (flush CTA) thread t maps in `trip` (the last one for spare threads)."""
        mh = t // self.unit + trip * (THREADS // self.unit)
        if self.trips * (THREADS // self.unit) > self.sh.m_split:
            mh = cutlass.min(mh, Int32(self.sh.m_split - 1))
        return mh

    @cute.jit
    def load(self, t, mh, states, head, sp, sn):
        """This thread's 32 values of the head at `head` in part mh as the flush's
        accumulators: acc[nt][2 i + e] = S[rows[i], col0 + 2 nt + e]."""
        _, _, rows, col0 = Flush.lane_geometry(t % self.unit, mh, self.sh.mt)
        vals = []
        for i in cutlass.range_constexpr(2):
            at = head + Int64(rows[i]) * sp
            if cutlass.const_expr(self.vec):
                v4 = [bits.vec_aligned(states, at + Int64(col0 + 4 * c), 4).load() for c in range(4)]
                vals.append([v4[c // 4][c % 4] for c in range(2 * NT)])
            else:
                vals.append([states[at + Int64(col0 + c) * sn] for c in range(2 * NT)])
        return [[vals[0][2 * nt], vals[0][2 * nt + 1], vals[1][2 * nt], vals[1][2 * nt + 1]] for nt in range(NT)]

    @cute.jit
    def group_amax(self, t, states, row, sh, sp, sn, g, s_red):
        """FP32 bits of max |x| over group g's heads of the row (the whole CTA; `s_red`: a
        shared word a warp, free again on return)."""
        amax = Int32(0)
        for h in range(g * self.hpg, (g + Int32(1)) * self.hpg):
            for trip in cutlass.range_constexpr(self.trips):
                acc = self.load(t, self.part(t, trip), states, row + Int64(h) * sh, sp, sn)
                for c in cutlass.range_constexpr(4 * NT):
                    amax = cutlass.max(amax, acc[c // 4][c % 4].bitcast(Int32) & Int32(0x7FFFFFFF))
        amax = bits.xor_reduce(amax, 32, cutlass.max)
        if t % 32 == 0:
            s_red[t // 32] = amax
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(THREADS // 32):
            amax = cutlass.max(amax, s_red[w])
        cute.arch.sync_threads()  # every warp has read s_red before it is rewritten
        return amax

    @cute.jit
    def encode(self, t, mh, acc, slot, hh, key, ckpt, copy, s_amax, ctx):
        """Checkpoint and read copy of head hh from `acc`, as `flush.Flush.fold_row`."""
        fmt = self.fmt
        q, nq, rows, col0 = Flush.lane_geometry(t % self.unit, mh, self.sh.mt)
        if cutlass.const_expr(fmt.row_amax):  # FP8: a row's amax over its column parts
            self.flush.row_partials(t % self.unit, mh, acc, None, None, s_amax, True, False)
            cute.arch.sync_threads()
        scodes = fmt.block_scales(fmt.lane_stats(acc, 2, NT), ctx)
        ck_w = cute.recast_ptr(ckpt.state, dtype=Uint32)
        ck_head = slot * ckpt.stride16 * 4 + hh * (self.P * self.N // 2)
        for i in cutlass.range_constexpr(2):
            pp = Int64(rows[i])
            fmt.store_row(copy, slot, hh, pp, col0, q, nq, acc, i, s_amax, ctx, scodes, NT)
            self.flush.store_checkpoint(hh + Int64(ckpt.head_offset), pp, col0, key, acc, i, ck_w, ck_head)
        if cutlass.const_expr(fmt.row_amax):
            cute.arch.sync_threads()  # s_amax is read before the next head rewrites it


def bookkeeping_kernel(state_dtype: str | None, arch: str, hpg: int, pos_width: int, ids_dtype: torch.dtype, vec: bool, P: int = 64, N: int = 128):
    """The kernel (initialize of `state_dtype`, clear for None) and its compile-time arguments."""
    fmt = read_copy_format(state_dtype, arch, P, N) if state_dtype else None
    copy = (fmt or read_copy_format("fp16", arch, P, N)).Args  # clear: the checkpoint's struct in the copy's place
    idt = ID_DTYPES[ids_dtype]
    fake = [
        make_ptr(idt, 0, assumed_align=ids_dtype.itemsize), Int64(0), make_ptr(Float32, 0, assumed_align=16 if vec else 4),
        *[Int64(0)] * 4, A.fake(A.Checkpoint), A.fake(A.Ring), A.fake(copy), A.fake(A.Slots), Int32(0), Int32(0), Int32(0),
        Int32(1), make_fake_stream(),
    ]  # fmt: skip
    return Bookkeeping(fmt, hpg, pos_width, vec, P, N), fake


@functools.lru_cache(maxsize=None)
def compiled_bookkeeping(state_dtype: str | None, arch: str, hpg: int, pos_width: int, ids_dtype: torch.dtype, vec: bool, P: int = 64, N: int = 128):
    return compile_entry(*bookkeeping_kernel(state_dtype, arch, hpg, pos_width, ids_dtype, vec, P, N), arch)


class BookkeepingLaunch:
    """The initialize (clear: `fmt` None) launches of one cache, format, seed and head
    offset, the structs made once as ints; it holds no tensor."""

    __slots__ = ("args", "key", "groups", "hpg", "two_level", "dims")

    def __init__(self, cache, fmt, seed: int, head_offset: int, arch: str) -> None:
        heads, self.groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
        self.hpg = heads // self.groups
        self.dims = L.dims(cache)  # (P, N), the compile key's last two fields
        copy = read_copy_format(fmt.name if fmt else "fp16", arch, *self.dims)
        self.args = (
            tuple(A.raw(A.Checkpoint, state=cache[L.CHECKPOINT], head_offset=head_offset)),
            tuple(A.raw(A.Ring, x=cache[L.X_RING], dt=cache[L.DT_RING], b=cache[L.B_RING])),
            tuple(A.raw(copy.Args, **copy.tensors(cache, L))),
            slots_words(cache, fmt or FP16),
            seed_key_i32(seed),
        )
        self.key = (fmt.name if fmt else None, arch, self.hpg, 2 if cache[L.POSITIONS].dim() == 2 else 1)
        self.two_level = bool(fmt and fmt.two_level)

    def __call__(self, ids: torch.Tensor, stream: int, states: torch.Tensor | None = None) -> None:
        """Initialize the valid slots of `ids` (1-D int32 / int64, batch >= 1) from FP32
        `states` [batch, H, P, N], or (clear) zero their rings and positions."""
        batch = ids.shape[0]
        # clear: the checkpoint's address stands in for the unread states
        at, st, vec, splits = self.args[0][0], (0, 0, 0, 0), False, self.hpg
        if states is not None:
            at, st = states.data_ptr(), states.stride()
            vec = st[3] == 1 and st[0] % 4 == 0 and st[1] % 4 == 0 and st[2] % 4 == 0 and at % 16 == 0
            splits = min(self.hpg, -(-NVFP4_CTAS // (batch * self.groups))) if self.two_level else self.hpg
        fn = compiled_bookkeeping(*self.key, ids.dtype, vec, *self.dims)
        fn(ids.data_ptr(), ids.stride(0), at, *st, *self.args, batch, self.groups, splits, stream)


__all__ = ["Bookkeeping", "BookkeepingLaunch", "bookkeeping_kernel", "compiled_bookkeeping", "NVFP4_CTAS", "THREADS"]
