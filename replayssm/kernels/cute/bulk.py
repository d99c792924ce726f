"""Asynchronous bulk copies global -> shared memory and the mbarriers that count their
bytes (sm_90a and later; inline PTX). Device-side only.

A warp-owned stage of shared memory is filled by one `cp.async.bulk` that lane 0 issues
after `mbarrier.arrive.expect_tx` (the barrier's phase completes when the arrival and
the bytes are in); every lane then waits on the phase's parity before reading the stage.
A stage with nothing to copy gets a plain arrival, so the phase still completes and the
parity of each use stays (use // stages) % 2.
"""

from __future__ import annotations

from cutlass import Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from .bits import inline_ptx


@dsl_user_op
def mbar_init(bar, count: int, *, loc=None, ip=None) -> None:
    """Initialise the mbarrier at shared address `bar` (Int32) for `count` arrivals."""
    inline_ptx("mbarrier.init.shared::cta.b64 [$0], $1;", "r,r", [Int32(bar), Int32(count)], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbar_init_fence(*, loc=None, ip=None) -> None:
    """Make initialised mbarriers visible to the asynchronous proxy."""
    inline_ptx("fence.mbarrier_init.release.cluster;", "", [], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def fence_proxy_async(*, loc=None, ip=None) -> None:
    """Order this thread's earlier shared-memory accesses before later asynchronous-proxy
    ones (a bulk copy that overwrites a stage the warp has read)."""
    inline_ptx("fence.proxy.async.shared::cta;", "", [], side_effects=True, loc=loc, ip=ip)


@dsl_user_op
def mbar_arrive(bar, *, loc=None, ip=None) -> None:
    """One arrival on the mbarrier at `bar` (no bytes expected)."""
    inline_ptx(
        "{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [$0];\n\t}", "r", [Int32(bar)], side_effects=True, loc=loc, ip=ip
    )


@dsl_user_op
def bulk_g2s(dst, src, nbytes, bar, *, loc=None, ip=None) -> None:
    """One arrival on `bar` expecting `nbytes`, then the bulk copy of `nbytes` (a multiple
    of 16) from global `src` (Int64, 16-byte aligned) to shared `dst` (Int32, 16-byte
    aligned) that completes them."""
    inline_ptx(
        "{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [$3], $2;\n\t"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];\n\t}",
        "r,l,r,r", [Int32(dst), Int64(src), Int32(nbytes), Int32(bar)], side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def mbar_arrive_expect_tx(bar, nbytes, *, loc=None, ip=None) -> None:
    """One arrival on `bar` that also expects `nbytes` more bytes (the bulk copies that
    follow complete them)."""
    inline_ptx(
        "{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1;\n\t}",
        "r,r", [Int32(bar), Int32(nbytes)], side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def bulk_copy(dst, src, nbytes, bar, *, loc=None, ip=None) -> None:
    """Bulk copy of `nbytes` (a multiple of 16) from global `src` (Int64, 16-byte aligned)
    to shared `dst` (Int32, 16-byte aligned), completing that many bytes on `bar`."""
    inline_ptx(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        "r,l,r,r", [Int32(dst), Int64(src), Int32(nbytes), Int32(bar)], side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def bulk_prefetch_l2(src, nbytes, *, loc=None, ip=None) -> None:
    """Prefetch `nbytes` (a multiple of 16, > 0) from global `src` (16-byte aligned) into L2."""
    inline_ptx(
        "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", [Int64(src), Int32(nbytes)], side_effects=True, loc=loc, ip=ip
    )


@dsl_user_op
def mbar_wait(bar, parity, *, loc=None, ip=None) -> None:
    """Wait until the phase of parity `parity` (Int32, 0 or 1) of the mbarrier at `bar`
    has completed."""
    inline_ptx(
        "{\n\t.reg .pred done;\n\tWAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [$0], $1;\n\t"
        "@!done bra WAIT;\n\t}",
        "r,r", [Int32(bar), Int32(parity)], side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ld_shared_v4_u32(addr, *, loc=None, ip=None) -> list:
    """The 16 bytes at shared address `addr` (Int32, 16-byte aligned) as four words, kept
    after the waits before it (side effects)."""
    return inline_ptx(
        "ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,r", [Int32(addr)], [Uint32] * 4, side_effects=True, loc=loc, ip=ip
    )


@dsl_user_op
def ld_shared_v4_u32_if(addr, pred, *, loc=None, ip=None) -> list:
    """ld_shared_v4_u32 if `pred` (Int32) is nonzero, else four zeros."""
    return inline_ptx(
        "{\n\t.reg .pred p;\n\tsetp.ne.s32 p, $5, 0;\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;\n\t"
        "mov.b32 $2, 0;\n\tmov.b32 $3, 0;\n\t@p ld.shared.v4.b32 {$0, $1, $2, $3}, [$4];\n\t}",
        "=r,=r,=r,=r,r,r", [Int32(addr), Int32(pred)], [Uint32] * 4, side_effects=True, loc=loc, ip=ip,
    )


@dsl_user_op
def ld_shared_u32(addr, *, loc=None, ip=None) -> Uint32:
    """The word at shared address `addr` (Int32), kept after the waits before it."""
    return inline_ptx("ld.shared.b32 $0, [$1];", "=r,r", [Int32(addr)], [Uint32], side_effects=True, loc=loc, ip=ip)


__all__ = [
    "mbar_init", "mbar_init_fence", "fence_proxy_async", "mbar_arrive", "bulk_g2s", "mbar_arrive_expect_tx", "bulk_copy",
    "bulk_prefetch_l2", "mbar_wait", "ld_shared_v4_u32", "ld_shared_v4_u32_if", "ld_shared_u32",
]
