"""Shared GPU test harness of the CuTe decode kernels (tests/test_cute_decode_gpu.py): a
poisoned cache with live slots at mixed ring
positions and padding rows, and the checks both formats run the same way (CUDA-graph
replay against eager steps, warmup). Importing it needs no GPU; running it does."""

from __future__ import annotations

import math

import torch

from replayssm import layout as L
from replayssm import reference as ref
from replayssm.api import initialize_replayssm_state, normalize_decode_inputs, selective_state_update_replayssm
from replayssm.synthetic import layer_params, prefill_states, token

from .helpers import same_bits

DEVICE = "cuda"
NAN = float("nan")
# 30 live slots of 40 (with 15 padding rows a batch of 45): the flush kernels' CTAs take
# 16 batch rows each, so this batch spans three CTA rows, the last one partial.
MANY_LIVE = tuple((7 * i + 3) % 39 + 1 for i in range(30))
MANY_SLOTS = 40


def ulp_bf16(m: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at magnitude m (8 significant bits)."""
    e = torch.floor(torch.log2(m.clamp_min(2.0**-120)))
    return torch.exp2(e - 7)


class World:
    """A NaN-poisoned, slot-padded `fmt` cache with live slots at mixed ring positions
    (valid ring entries below the position, NaN at and above it) and a batch that mixes
    them with padding rows (slot 0, negative, >= S).

    `sync`: every live row at ring index 13 (all flush on the same steps). `wide`: the
    first live slot's state spans 10**-12 .. 1 within every row and its tokens have
    x = 0, so its flushes meet FP16-subnormal and e4m3-subnormal results. NVFP4: garbage
    codes (0xFF) in every uninitialized slot, and the live amax the first flush encodes
    with is off by 1/64, 64 and 0 for the first three live slots (saturating, subnormal
    and zero block scales)."""

    def __init__(
        self, fmt, heads=16, groups=2, seed=0, live=(3, 5, 1, 7, 2, 9, 4, 8, 10), num_slots=12, sync=False, wide=False,
        head_dim=64, state_dim=128,
    ):  # fmt: skip
        self.fmt, self.heads, self.groups, self.seed = fmt, heads, groups, seed
        self.P, self.N = P, N = head_dim, state_dim
        dims = {"head_dim": P, "state_dim": N}
        self.gen = torch.Generator().manual_seed(seed)
        self.params = layer_params(heads, generator=self.gen, device=DEVICE)
        self.cache = cache = L.allocate_cache(num_slots, heads, groups, fmt, DEVICE, slot_padding=64, fill=NAN, **dims)
        if fmt == "nvfp4":
            cache[L.READ_COPY].fill_(0xFF)
        live_t = torch.tensor(live, dtype=torch.int32, device=DEVICE)
        states = prefill_states(self.params, len(live), groups, 24, generator=self.gen, device=DEVICE, **dims)
        self.wide_slot = live[0] if wide else None
        if wide:
            mag = torch.pow(10.0, -12.0 * torch.rand(heads, P, N, generator=self.gen)).to(DEVICE)
            states[0] = torch.randn(heads, P, N, generator=self.gen).to(DEVICE) * mag
        initialize_replayssm_state(cache, states, live_t, state_dtype=fmt, seed=seed)
        if fmt == "nvfp4":
            # The half the first flush encodes with (parity is 0 after init).
            for s, f in zip(live[:3], (1 / 64, 64.0, 0.0)):
                cache[L.META][s, :, 1] *= f
        xr, dtr, br, pos = cache[L.X_RING], cache[L.DT_RING], cache[L.B_RING], cache[L.POSITIONS]
        for t in (xr, dtr, br):
            t.fill_(NAN)
        for i, s in enumerate(live):
            q = 16 * (i % 3) + (13 if sync else (5 * i) % 16)
            r = q % 16
            pos[s] = q
            tok = token(r, heads, groups, generator=self.gen, device=DEVICE, **dims)
            if s == self.wide_slot:
                tok.x.zero_()
            dts = ref.softplus_dt(tok.dt, self.params.dt_bias.view(1, -1))
            xr[s, :, :r] = tok.x.transpose(0, 1)
            dtr[s, :, :r] = dts.transpose(0, 1)
            br[s, :, :r] = tok.B.transpose(0, 1)
        S = num_slots
        pad = [0, -1, S, 0, S + 7]
        ids = []
        for i, s in enumerate(live):
            ids.append(s)
            if i % 2 == 1:
                ids.append(pad[(i // 2) % len(pad)])
        self.ids = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
        self.batch = len(ids)
        # The byte page all slot tensors are carved from (allocate_cache, slot_padding).
        storage = cache[L.CHECKPOINT].untyped_storage()
        self.page = torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(storage).view(num_slots, -1)
        assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in cache[1:])
        # Bytes between the tensors of a slot: never written by anyone.
        gap = torch.ones(self.page.shape[1], dtype=torch.bool, device=DEVICE)
        for t in cache[1:]:
            off = t.data_ptr() - self.page.data_ptr()
            gap[off : off + math.prod(t.shape[1:]) * t.element_size()] = False
        self.gap = gap

    def token(self):
        tok = token(self.batch, self.heads, self.groups, generator=self.gen, device=DEVICE, head_dim=self.P, state_dim=self.N)
        if self.wide_slot is not None:
            tok.x[self.ids == self.wide_slot] = 0
        return tok

    def inputs(self, tok):
        p = self.params
        return normalize_decode_inputs(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, self.batch, self.heads, self.groups, self.P, self.N)

    def gaps_untouched(self) -> bool:
        return bool((self.page[:, self.gap] == 0xFF).all())


def check_graph_replays_whole_periods(fmt: str, **world) -> None:
    """32 steps (two periods) captured in one CUDA graph and replayed twice give the bits
    of the same steps run eagerly on a twin cache (outputs and every cache tensor).
    `world`: World keywords (live=(5,) is a batch of one row, the PDL launch)."""
    from replayssm.kernels import kernel_backend

    w = World(fmt, 16, 2, seed=1, **world)
    twin = World(fmt, 16, 2, seed=1, **world)  # the same construction: identical bits
    for a, b in zip(w.cache, twin.cache):
        assert same_bits(a, b)
    steps = 32
    toks = [w.token() for _ in range(steps)]
    p = w.params

    def run(cache, outs):
        for t, o in zip(toks, outs):
            selective_state_update_replayssm(
                cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, w.ids, o, state_dtype=fmt, seed=w.seed
            )

    assert kernel_backend().cute_for(w.cache) is not None, "the CuTe kernels must run this cache"
    eager = [torch.empty(w.batch, 16, 64, dtype=torch.bfloat16, device=DEVICE) for _ in range(steps)]
    graph_out = [torch.empty_like(o) for o in eager]
    run(twin.cache, eager)  # compiles, loads the modules and creates the plan scratch
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
        run(w.cache, graph_out)
    torch.cuda.current_stream().wait_stream(stream)
    for rep in range(2):
        if rep:
            run(twin.cache, eager)
        g.replay()
        torch.cuda.synchronize()
        for s, (a, b) in enumerate(zip(graph_out, eager)):
            assert same_bits(a, b), f"replay {rep}, step {s}: graph output differs from eager"
        for i, (a, b) in enumerate(zip(w.cache, twin.cache)):
            assert same_bits(a, b), f"replay {rep}: cache[{i}] differs from eager"
    assert w.gaps_untouched()


def check_warmup(fmt: str) -> list[str]:
    """ReplaySSMCache.warmup() compiles and launches both CuTe kernels of `fmt` and leaves
    the cache's bits as they were; returns the names warmup gave."""
    from replayssm import ReplaySSMCache

    cache = ReplaySSMCache(num_slots=6, num_heads=16, num_groups=2, state_dtype=fmt, device=DEVICE, slot_padding=64)
    before = [t.clone() for t in cache.tensors]
    names = cache.warmup()
    torch.cuda.synchronize()
    # Every variant a step may launch: the non-flush kernel plain and as the batch-1 PDL
    # kernel, the flush plain (batch 1) and as the PDL kernel above it.
    for kind, tag in (("decode", "-pdl"), ("flush", "-pdl")):
        mine = [n for n in names if n.startswith(f"cute.{kind}-{fmt}-h16g2")]
        assert any(tag in n for n in mine) and any(tag not in n for n in mine), names
    for i, (a, b) in enumerate(zip(before, cache.tensors)):
        assert same_bits(a, b), f"warmup changed cache[{i}]"
    return names
