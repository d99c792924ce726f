"""The pending-mode kernels against the reference (`replayssm.pending`), one call at a time
from identical caches, on the GPU: the plan kernel (cute/plan.py) with the CuTe fold and
step (cute/pending.py), at 16 heads / 2 groups, with a CUDA-graph replay of a cache's
calls; the plan kernel's positions, parity, meta and fold list against the reference's.

Per call: rows that fold give the kernel's own FP32 state S (debug dump) within
FOLD_REL_TOL of the reference fold; the reference then runs the call with that S as its
fold, and every cache tensor compares bit for bit (positions, parity, meta, checkpoint,
read copy, scales, x and B rings) except the dt ring, within DT_RING_REL_TOL (the
kernels' softplus is FP32 log1p(exp(v)), the reference's FP64 rounded once); outputs
within KERNEL_OUTPUT_BF16_ULPS of the call's max."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from replayssm import layout as L, reference as ref
from replayssm.formats import FORMATS, FP8
from replayssm.layout import allocate_cache
from replayssm.pending import checkpoint_index, fold_range, grid, pending_decode
from replayssm.synthetic import layer_params, prefill_states

from . import tolerances as tol
from .helpers import same_bits

NAN = float("nan")


def _world(fmt, heads, groups, device, slots, seed=5, P=L.HEAD_DIM, N=L.STATE_DIM):
    gen = torch.Generator().manual_seed(heads + len(fmt))
    p = layer_params(heads, generator=gen)
    cache = allocate_cache(slots, heads, groups, fmt, pending=True, device=device, head_dim=P, state_dim=N)
    live = list(range(1, slots - 1))
    st = prefill_states(p, len(live), groups, 16, generator=gen, head_dim=P, state_dim=N).to(device)
    ref.initialize(cache, st, torch.tensor(live, device=device), fmt=FORMATS[fmt], seed=seed)
    params = (p.A.float().to(device), p.D.float().reshape(heads, -1).expand(heads, P).to(device),
              p.dt_bias.float().to(device))  # fmt: skip
    return cache, params, gen


def _tokens(gen, lead, heads, groups, device, N=L.STATE_DIM, P=L.HEAD_DIM):
    x = torch.randn(*lead, heads, P, generator=gen).to(torch.bfloat16)
    dt = (0.5 * torch.randn(*lead, heads, generator=gen)).to(torch.bfloat16)
    B = torch.randn(*lead, groups, N, generator=gen).to(torch.bfloat16)
    C = torch.randn(*lead, groups, N, generator=gen).to(torch.bfloat16)
    return [t.to(device) for t in (x, dt, B, C)]


def _engine_shaped(x, dt, B, C):
    """The same values as a Mamba-2 mixer hands them over: x, B, C column slices of one
    projection row (row stride = the projection's width), dt bf16 tied over 64 (stride 0)."""
    lead = x.shape[:-2]
    hp, gn = x.shape[-2] * x.shape[-1], B.shape[-2] * B.shape[-1]
    proj = torch.zeros(*lead, hp + 2 * gn + 8, dtype=x.dtype, device=x.device)
    proj[..., :hp] = x.reshape(*lead, hp)
    proj[..., hp : hp + gn] = B.reshape(*lead, gn)
    proj[..., hp + gn : hp + 2 * gn] = C.reshape(*lead, gn)
    xs = proj[..., :hp].view(*lead, x.shape[-2], x.shape[-1])
    Bs = proj[..., hp : hp + gn].view(*B.shape)
    Cs = proj[..., hp + gn : hp + 2 * gn].view(*C.shape)
    return xs, dt.to(torch.bfloat16).unsqueeze(-1).expand(*dt.shape, x.shape[-1])[..., 0], Bs, Cs


def _check_call(cache, kc, params, toks, ids, acc, M, fmt, seed, plan, cu=None, engine=False, kernel=None,
                out_dtype=torch.float32):  # fmt: skip
    """One call on the kernels (`kc`, a copy of `cache`; engine-shaped inputs when
    `engine`; `kernel` the decode function, `_cute_decode` by default; `plan` the plan
    buffer every call of a run shares, as a cache's) and on the
    reference (`cache`), whose fold is given the kernel's own FP32 state S (checked
    against the reference fold first), so every state tensor compares bit for bit and
    the outputs within KERNEL_OUTPUT_BF16_ULPS; then `kc` takes the reference's cache
    (the next call starts from identical caches)."""
    from unittest import mock

    from replayssm import pending as pend

    if kernel is None:
        kernel = _cute_decode
    A, D, bias = params
    x, dt, B, C = toks
    heads = cache[L.CHECKPOINT].shape[1]
    dev = x.device
    before = [t.clone() for t in cache]
    P = x.shape[-1]
    out_shape = (*x.shape[:-1], P) if x.dim() == 3 else (*x.shape[:2], heads, P)
    want = torch.full(out_shape, NAN, device=dev, dtype=out_dtype)
    got = torch.full(out_shape, NAN, device=dev, dtype=out_dtype)
    dbg = torch.full((ids.numel(), heads, *L.dims(cache)), NAN, device=dev)
    kx, kdt, kB, kC = _engine_shaped(x, dt, B, C) if engine else (x, dt, B, C)
    kernel(kc, kx, kdt, A, kB, kC, D, bias, ids, got, fmt=FORMATS[fmt], seed=seed, max_seqlen=M,
           num_accepted_tokens=acc, cu_seqlens=cu, debug_state=dbg, plan=plan)  # fmt: skip

    num_slots = cache[L.CHECKPOINT].shape[0]
    pos0 = before[L.POSITIONS]
    row_of, folds = {}, 0
    for r, s in enumerate(ids.tolist()):
        if not 0 < s < num_slots:
            continue
        c, q = pos0[s].tolist()
        a = q if acc is None else min(max(int(acc[r]), 0), q)
        f_old = int(checkpoint_index(torch.tensor(c), M))
        f_new = int(checkpoint_index(torch.tensor(c + a), M))
        if f_new == f_old:
            continue
        folds += 1
        row_of[s] = r
        S_ref = fold_range(before, torch.tensor([s], device=dev), torch.tensor([f_old], device=dev),
                           torch.tensor([f_new - f_old], device=dev), A)  # fmt: skip
        assert float((dbg[r : r + 1] - S_ref).abs().max()) <= tol.FOLD_REL_TOL * float(S_ref.abs().max())

    def kernel_fold(cache_, slots, start, count, A_):
        return torch.stack([dbg[row_of[s]] for s in slots.tolist()])

    with mock.patch.object(pend, "fold_range", kernel_fold):
        pending_decode(cache, x, dt.float(), A, B, C, D, bias, ids, want, fmt=FORMATS[fmt], seed=seed, max_seqlen=M,
                       num_accepted_tokens=acc, cu_seqlens=cu)  # fmt: skip
    assert not torch.isnan(got).any()
    scale = want.float().abs().amax().clamp_min(1e-30)
    assert float((got.float() - want.float()).abs().max()) <= tol.KERNEL_OUTPUT_BF16_ULPS * 2.0**-8 * float(scale)
    for i in range(len(cache)):
        if i != L.DT_RING:
            assert same_bits(kc[i], cache[i]), i
    dr, dk = cache[L.DT_RING], kc[L.DT_RING]
    fin = torch.isfinite(dr)
    assert torch.equal(fin, torch.isfinite(dk))
    rel = torch.where(fin, (dk - dr).abs() / dr.abs().clamp_min(1e-30), torch.zeros((), device=dev))
    assert float(rel.max()) <= tol.DT_RING_REL_TOL
    for dst, src in zip(kc, cache):
        dst.copy_(src)
    return folds


def _run(fmt, M, heads, groups, device, calls, varlen_every=3, seed=5, kernel=None, out_dtype=torch.float32, P=L.HEAD_DIM,
         N=L.STATE_DIM):  # fmt: skip
    cache, params, gen = _world(fmt, heads, groups, device, slots=6, seed=seed, P=P, N=N)
    # Desynchronized rows: slot 3 starts just below a fold grid point (its committed entries
    # since the checkpoint are zero tokens), the others at 0.
    cache[L.POSITIONS][3, 0] = max(grid(M) - 2, 0)
    kc = [t.clone() for t in cache]
    rng = random.Random(M)
    ids = torch.tensor([1, 0, 3, 4, 9, 2], device=device)  # padding rows 0 and 9
    b = ids.numel()
    folds = 0
    from replayssm.kernels.buffers import PendingPlan

    plan = PendingPlan(b, device)
    for call in range(calls):
        acc = None if call == 0 else torch.tensor([rng.randint(-1, M) for _ in range(b)], dtype=torch.int32, device=device)
        pos = cache[L.POSITIONS]
        for r, s in enumerate(ids.tolist()):  # rejected drafts hold NaN in the ring
            if 0 < s < pos.shape[0] and acc is not None:
                c, q = pos[s].tolist()
                for i in range(min(max(int(acc[r]), 0), q), q):
                    for t in (cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING]):
                        t[s, :, (c + i) % L.RING] = NAN
        for dst, src in zip(kc, cache):
            dst.copy_(src)
        if call % varlen_every == varlen_every - 1:
            lens = [rng.randint(0, M) for _ in range(b)]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
            toks = _tokens(gen, (int(cu[-1]),), heads, groups, device, N, P)
        else:
            cu = None
            toks = _tokens(gen, (b, M), heads, groups, device, N, P)
        folds += _check_call(cache, kc, params, toks, ids, acc, M, fmt, seed, plan, cu, engine=call % 2 == 1,
                             kernel=kernel, out_dtype=out_dtype)  # fmt: skip
    return folds


def _plan_launch(cache, plan, ids, acc, cu, fmt, seed, M, plan_launches=None):
    """The plan kernel through a `PendingPlanLaunch` (kept in `plan_launches` when given,
    as a cache context keeps it; else a new one)."""
    from replayssm.kernels.cute.arch import arch_for
    from replayssm.kernels.cute.plan import PendingPlanLaunch

    key = (fmt, seed, M, plan.words)
    launch = plan_launches.get(key) if plan_launches is not None else None
    if launch is None:
        launch = PendingPlanLaunch(cache, plan, fmt, seed, M, arch_for(ids.device))
        if plan_launches is not None:
            plan_launches[key] = launch
    launch(ids, acc, cu, torch.cuda.current_stream().cuda_stream)


def _cute_decode(cache, x, dt, A, B, C, D, bias, ids, out, *, fmt, seed, max_seqlen, num_accepted_tokens=None,
                 cu_seqlens=None, debug_state=None, plan=None, split=None, plan_launches=None):  # fmt: skip
    """The plan kernel, then the CuTe fold and step (cute/pending.py
    `fold_and_step`; `split` as it takes it), x, B, C copied where the step cannot read
    them as they are (as the kernel backend does)."""
    from replayssm.kernels.cute.arch import arch_for
    from replayssm.kernels.cute.pending import fold_and_step, pending_fold, reads_as_is
    from replayssm.kernels.buffers import PendingPlan

    varlen = cu_seqlens is not None
    heads, groups = cache[L.CHECKPOINT].shape[1], cache[L.B_RING].shape[1]
    lead = x.shape[:1] if varlen else x.shape[:2]
    P, N = L.dims(cache)
    x, B, C = (t if reads_as_is(t, w, varlen) else t.reshape(*lead, n, w).contiguous()
               for t, n, w in ((x, heads, P), (B, groups, N), (C, groups, N)))  # fmt: skip
    out_v = out.view(*lead, heads, P)
    plan = plan or PendingPlan(ids.numel(), x.device)
    _plan_launch(cache, plan, ids, num_accepted_tokens, cu_seqlens, fmt, seed, max_seqlen, plan_launches)
    rows, arch, stream = plan.view(ids.numel()), arch_for(x.device), torch.cuda.current_stream().cuda_stream

    def fold():
        pending_fold(cache, A, rows, plan.fold_list, state_dtype=fmt.name, arch=arch, head_offset=0, stream=stream,
                     debug_state=debug_state)  # fmt: skip

    fold_and_step(cache, x, dt, A, B, C, D, bias, out_v, rows, plan.fold_list, fold, state_dtype=fmt.name, arch=arch,
                  varlen=varlen, stream=stream, split=split)  # fmt: skip
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("M", [2, 4, 8])
@pytest.mark.parametrize("split", [False, True])
def test_pending_cute_kernels_match_the_reference_gpu(fmt, M, split):
    """The CuTe fold and step after the plan kernel: 16 heads / 2 groups, 24 calls, bf16
    outputs (dense and varlen, plain and engine-shaped inputs, random verdicts with
    out-of-range ones, padding rows, NaN in every rejected draft); `split`: the step in
    two launches, the rows that do not fold beside the fold. One `PendingPlanLaunch`
    serves every call, as a cache context keeps it."""
    pytest.importorskip("cutlass")
    kernel = functools.partial(_cute_decode, split=split, plan_launches={})
    assert _run(fmt, M, 16, 2, "cuda", calls=24, kernel=kernel, out_dtype=torch.bfloat16) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("heads,groups", [(112, 8), (14, 1), (48, 1), (6, 1)])
def test_pending_cute_kernels_at_model_geometries_gpu(fmt, heads, groups):
    """The plan, fold and step against the reference at served models' heads-a-group
    ratios (test_geometries.py): 12 calls, M = 4, bf16 outputs."""
    pytest.importorskip("cutlass")
    kernel = functools.partial(_cute_decode, plan_launches={})
    assert _run(fmt, 4, heads, groups, "cuda", calls=12, kernel=kernel, out_dtype=torch.bfloat16) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
@pytest.mark.parametrize("heads,groups,P,N", [(16, 2, 64, 256), (32, 1, 64, 256), (16, 2, 80, 128), (16, 1, 80, 128), (8, 2, 80, 256)])
@pytest.mark.parametrize("split", [False, True])
def test_pending_cute_kernels_at_head_dim_80_and_state_dim_256_gpu(fmt, heads, groups, P, N, split):
    """The plan, fold and step against the reference at state dim 256 (Nemotron-H 47B /
    56B's TP-8 shard 32 / 1; the fold's 8-warp CTAs, the step's four n-chunks) and head
    dim 80 (Nemotron Nano 2's TP-8 shard 16 / 1; five row parts a head, the step's fifth
    m-tile): 12 calls, M = 4, bf16 outputs, one step launch and the split one."""
    pytest.importorskip("cutlass")
    kernel = functools.partial(_cute_decode, split=split, plan_launches={})
    assert _run(fmt, 4, heads, groups, "cuda", calls=12, kernel=kernel, out_dtype=torch.bfloat16, P=P, N=N) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_pending_cute_split_step_equals_one_step_bit_for_bit(fmt):
    """The step split in two launches (beside and after the fold) gives the one-launch
    step's outputs and cache bit for bit: 12 calls of 6 rows (padding rows, random
    verdicts, varlen every third call) on two copies of one cache, M = 4. The one-launch
    side keeps one `PendingPlanLaunch`, the split side makes one every call."""
    pytest.importorskip("cutlass")
    from replayssm.kernels.buffers import PendingPlan

    launches = {}

    M = 4
    cache, (A, D, bias), gen = _world(fmt, 16, 2, "cuda", slots=6, seed=7)
    cache[L.POSITIONS][3, 0] = grid(M) - 2
    twin = [t.clone() for t in cache]
    plans = PendingPlan(6, "cuda"), PendingPlan(6, "cuda")
    ids = torch.tensor([1, 0, 3, 4, 9, 2], device="cuda")
    rng = random.Random(3)
    for call in range(12):
        acc = None if call == 0 else torch.tensor([rng.randint(0, M) for _ in range(6)], dtype=torch.int32, device="cuda")
        cu = None
        if call % 3 == 2:
            lens = [rng.randint(0, M) for _ in range(6)]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        x, dt, B, C = _tokens(gen, (6, M) if cu is None else (int(cu[-1]),), 16, 2, "cuda")
        outs = []
        for c, plan, split, kept in ((cache, plans[0], False, launches), (twin, plans[1], True, None)):
            out = torch.full((*x.shape[:-1], L.HEAD_DIM), NAN, dtype=torch.bfloat16, device="cuda")
            _cute_decode(c, x, dt, A, B, C, D, bias, ids, out, fmt=FORMATS[fmt], split=split, seed=5,
                         max_seqlen=M, num_accepted_tokens=acc, cu_seqlens=cu, plan=plan, plan_launches=kept)  # fmt: skip
            outs.append(out)
        torch.cuda.synchronize()
        assert same_bits(outs[0], outs[1])
        for a, b in zip(cache, twin):
            assert same_bits(a, b)
    assert len(launches) == 1


@pytest.mark.gpu
def test_pending_split_step_variants_take_their_rows():
    """Each launch of a split step computes its rows only: from the same cache and inputs,
    the fold followed by the "rest" step alone writes the outputs of the live rows that do
    not fold (and zeros for padding rows) and leaves those of folding rows untouched; the
    "fold" step alone the reverse; each written output equals the one-launch step's, bit
    for bit. FP8, 16 heads / 2 groups, M = 4, the first call where some rows fold and
    others do not."""
    pytest.importorskip("cutlass")
    from replayssm.kernels.cute.arch import arch_for
    from replayssm.kernels.cute.pending import pending_fold, pending_step
    from replayssm.kernels.buffers import PendingPlan

    M, b = 4, 6
    cache, (A, D, bias), gen = _world("fp8", 16, 2, "cuda", slots=6, seed=11)
    cache[L.POSITIONS][3, 0] = grid(M) - 2
    ids = torch.tensor([1, 0, 3, 4, 9, 2], device="cuda")
    rng = random.Random(5)
    stream = torch.cuda.current_stream().cuda_stream

    def call(c, x, dt, B, C, acc, rows):
        plan = PendingPlan(b, "cuda")
        out = torch.full((b, M, 16, L.HEAD_DIM), NAN, dtype=torch.bfloat16, device="cuda")
        _plan_launch(c, plan, ids, acc, None, FP8, 5, M)
        pv, arch = plan.view(b), arch_for(x.device)
        pending_fold(c, A, pv, plan.fold_list, state_dtype="fp8", arch=arch, head_offset=0, stream=stream)
        pending_step(c, x, dt, A, B, C, D, bias, out, pv, plan.fold_list, state_dtype="fp8", arch=arch, varlen=False,
                     stream=stream, rows=rows)  # fmt: skip
        torch.cuda.synchronize()
        return out, plan.view(b).cpu()

    for n in range(16):
        acc = None if n == 0 else torch.tensor([rng.randint(0, M) for _ in range(b)], dtype=torch.int32, device="cuda")
        x, dt, B, C = _tokens(gen, (b, M), 16, 2, "cuda")
        before = [t.clone() for t in cache]
        whole, plan = call(cache, x, dt, B, C, acc, "all")
        live = plan[:, 0] >= 0
        folds = live & (plan[:, 3] > 0)
        if not (folds.any() and (live & ~folds).any()):
            continue
        rest, _ = call([t.clone() for t in before], x, dt, B, C, acc, "rest")
        fold, _ = call([t.clone() for t in before], x, dt, B, C, acc, "fold")
        for r in range(b):
            took_rest, took_fold = not bool(folds[r]), bool(folds[r]) and bool(live[r])
            for got, took in ((rest, took_rest), (fold, took_fold)):
                if took:
                    assert same_bits(got[r], whole[r]), r
                else:
                    assert torch.isnan(got[r].float()).all(), r
        return
    pytest.fail("no call had both folding and non-folding rows")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4", "fp16"])
def test_pending_decode_replays_in_a_cuda_graph(fmt):
    """`ReplaySSMCache.decode` in pending mode captured in a CUDA graph: replays give the
    eager calls' outputs and cache bit for bit (same inputs, same verdicts)."""
    from replayssm import ReplaySSMCache

    heads, groups, M, b = 16, 2, 4, 5
    gen = torch.Generator().manual_seed(1)
    p = layer_params(heads, generator=gen)
    A, D, bias = (t.cuda() for t in (p.A, p.D, p.dt_bias))
    caches = []
    for _ in range(2):
        c = ReplaySSMCache(8, heads, groups, fmt, "cuda", seed=2, spec_tokens=M - 1, backend="kernels")
        slots = c.allocate(b)
        g2 = torch.Generator().manual_seed(3)
        c.prefill_init(prefill_states(p, b, groups, 16, generator=g2).cuda(), slots)
        caches.append(c)
    eager, graphed = caches
    ids = torch.tensor([1, 2, 0, 3, 4, 5][:b], device="cuda", dtype=torch.int32)
    x, dt, B, C = _tokens(gen, (b, M), heads, groups, "cuda")
    acc = torch.tensor([1, 3, 2, 4, 0][:b], device="cuda", dtype=torch.int32)
    out_e = torch.empty(b, M, heads, L.HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out_g = torch.empty_like(out_e)
    for c, o in ((eager, out_e), (graphed, out_g)):  # first call (and compile) eagerly
        c.decode(x, dt, A, B, C, D, bias, ids, o)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.decode(x, dt, A, B, C, D, bias, ids, out_g, num_accepted_tokens=acc)
    for _ in range(7):
        eager.decode(x, dt, A, B, C, D, bias, ids, out_e, num_accepted_tokens=acc)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_e, out_g)
        for te, tg in zip(eager.tensors, graphed.tensors):
            assert same_bits(te, tg)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,M", [("fp8", 1), ("fp8", 4), ("nvfp4", 3), ("nvfp4", 8), ("fp16", 4)])
def test_plan_kernel_commits_as_the_reference_does(fmt, M):
    """The plan kernel (cute/plan.py) on the GPU, over calls
    with random verdicts (out-of-range ones included), padding rows, dense and varlen:
    positions after it equal the reference call's, and its fold list
    holds exactly the rows whose checkpoint advances (f(c') > f(c)); NVFP4: parity and the
    live half of meta equal the reference's."""
    from replayssm.kernels.buffers import PendingPlan

    pytest.importorskip("cutlass")
    dev = "cuda"
    cache, (A, D, bias), gen = _world(fmt, 8, 1, dev, slots=6, seed=3)
    cache[L.POSITIONS][3, 0] = max(grid(M) - 2, 0)
    ids = torch.tensor([1, 0, 3, 4, 9, 2], device=dev)
    b, rng = ids.numel(), random.Random(M)
    plan = PendingPlan(b, dev)
    for call in range(8):
        acc = None if call == 0 else torch.tensor([rng.randint(-1, M + 1) for _ in range(b)], dtype=torch.int32, device=dev)
        cu = None
        if call % 3 == 2:
            lens = [rng.randint(0, M) for _ in range(b)]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        x, dt, B, C = _tokens(gen, (b, M) if cu is None else (int(cu[-1]),), 8, 1, dev)
        kc = [t.clone() for t in cache]
        c_old = cache[L.POSITIONS][:, 0].tolist()
        _plan_launch(kc, plan, ids, acc, cu, FORMATS[fmt], 5, M)
        out = torch.empty(*x.shape[:-1], L.HEAD_DIM, dtype=torch.bfloat16, device=dev)
        pending_decode(cache, x, dt, A, B, C, D, bias, ids, out, fmt=FORMATS[fmt], seed=5, max_seqlen=M,
                       num_accepted_tokens=acc, cu_seqlens=cu)  # fmt: skip
        for i in [L.POSITIONS] + ([L.PARITY] if fmt == "nvfp4" else []):
            assert same_bits(kc[i], cache[i]), (call, i)
        if fmt == "nvfp4":  # the live half; the other, the fold's amax accumulator, the plan zeroes
            live = cache[L.PARITY].long().view(-1, 1, 1).expand(-1, cache[L.META].shape[1], 1)
            assert same_bits(kc[L.META].gather(2, live), cache[L.META].gather(2, live)), call
        c_new = cache[L.POSITIONS][:, 0].tolist()
        want = sorted(r for r, s in enumerate(ids.tolist()) if 0 < s < 6
                      and int(checkpoint_index(torch.tensor(c_new[s]), M)) > int(checkpoint_index(torch.tensor(c_old[s]), M)))  # fmt: skip
        n = int(plan.fold_list[0])
        assert sorted(plan.fold_list[1 : 1 + n].tolist()) == want, call
        plan.fold_list[0] = 0  # the step resets it
