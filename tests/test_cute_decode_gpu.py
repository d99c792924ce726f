"""CuTe DSL FP8 decode kernels against the PyTorch reference, on the GPU.

Every step starts the reference from a copy of the kernels' cache, so both see the same
state and errors never compound; over 48 steps (three periods) every live row flushes
three times, at a different step per row, with padding rows (slot 0, negative, >= S) in
between. Per step:

- outputs: within 2 bf16 ulps (of the row's largest |y|) of the reference on the same
  GPU. Both compute in FP32 from the same quantized data; they differ only in summation
  order (relative error ~1e-6 of the summed magnitudes, far below a bf16 ulp of 2**-8),
  which can move the final bf16 rounding of an element by one ulp;
- positions, x / dt / B rings: bit-exact (dt is processed with the libdevice expf/log1pf
  PyTorch's CUDA softplus uses);
- flush rows: the kernel's FP32 state S (debug variant) within FP32 summation noise of
  the reference fold, and the FP16 checkpoint / FP8 read copy / scales bit-exact with the
  reference quantizers (`to_fp16` with `checkpoint_rbits`, `fp8_encode`) applied to S;
- everything else (state of non-flushing and padding slots, the bytes between slots)
  untouched, with NaN-poisoned memory everywhere the kernels must not read.
A captured CUDA graph of 32 steps replayed twice gives the same bits as eager steps.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from replayssm import layout as L
from replayssm import reference as ref
from replayssm.api import normalize_decode_inputs, selective_state_update_replayssm
from replayssm.api import initialize_replayssm_state
from replayssm.quant.formats import fp8_encode
from replayssm.quant.minifloat import to_fp16
from replayssm.quant.rng import checkpoint_rbits
from replayssm.synthetic import layer_params, prefill_states, token

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("cutlass") is None,
        reason="nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')",
    ),
]

DEVICE = "cuda"
NAN = float("nan")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


class World:
    """A NaN-poisoned, slot-padded FP8 cache with live slots at mixed ring positions
    (valid ring entries below the position, NaN at and above it) and a batch that mixes
    them with padding rows."""

    def __init__(
        self, heads=16, groups=2, seed=0, live=(3, 5, 1, 7, 2, 9, 4, 8, 10), num_slots=12, sync=False, wide=False
    ):
        self.heads, self.groups, self.seed = heads, groups, seed
        self.gen = torch.Generator().manual_seed(seed)
        self.params = layer_params(heads, generator=self.gen, device=DEVICE)
        self.cache = L.allocate_cache(num_slots, heads, groups, "fp8", DEVICE, slot_padding=64, fill=NAN)
        live_t = torch.tensor(live, dtype=torch.int32, device=DEVICE)
        states = prefill_states(self.params, len(live), groups, 24, generator=self.gen, device=DEVICE)
        # `wide`: the first live slot's state spans 10**-12 .. 1 within every row and its
        # tokens have x = 0, so its flushes meet FP16-subnormal and e4m3-subnormal results
        # (the encoders' general path).
        self.wide_slot = live[0] if wide else None
        if wide:
            mag = torch.pow(10.0, -12.0 * torch.rand(heads, 64, 128, generator=self.gen)).to(DEVICE)
            states[0] = torch.randn(heads, 64, 128, generator=self.gen).to(DEVICE) * mag
        initialize_replayssm_state(self.cache, states, live_t, state_dtype="fp8", seed=seed)
        xr, dtr, br, pos = self.cache[L.X_RING], self.cache[L.DT_RING], self.cache[L.B_RING], self.cache[L.POSITIONS]
        # Slot 0 (padding) and every unused slot: NaN rings.
        for t in (xr, dtr, br):
            t.fill_(NAN)
        for i, s in enumerate(live):
            # Mixed ring positions (several rows flush on some steps, one or none on
            # others), or all rows at ring index 13 (every row flushes on the same steps).
            q = 16 * (i % 3) + (13 if sync else (5 * i) % 16)
            r = q % 16
            pos[s] = q
            tok = token(r, heads, groups, generator=self.gen, device=DEVICE)
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
        storage = self.cache[L.CHECKPOINT].untyped_storage()
        page = torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(storage).view(num_slots, -1)
        assert all(t.untyped_storage().data_ptr() == storage.data_ptr() for t in self.cache[1:])
        self.page = page
        # Bytes between the tensors of a slot: never written by anyone.
        gap = torch.ones(page.shape[1], dtype=torch.bool, device=DEVICE)
        for t in self.cache[1:]:
            off = t.data_ptr() - page.data_ptr()
            gap[off : off + math.prod(t.shape[1:]) * t.element_size()] = False
        self.gap = gap

    def token(self):
        tok = token(self.batch, self.heads, self.groups, generator=self.gen, device=DEVICE)
        if self.wide_slot is not None:
            tok.x[self.ids == self.wide_slot] = 0
        return tok

    def inputs(self, tok):
        p = self.params
        return normalize_decode_inputs(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, self.batch, self.heads, self.groups)

    def gaps_untouched(self) -> bool:
        return bool((self.page[:, self.gap] == 0xFF).all())


def _ulp_bf16(m: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at magnitude m (8 significant bits)."""
    e = torch.floor(torch.log2(m.clamp_min(2.0**-120)))
    return torch.exp2(e - 7)


@pytest.mark.parametrize(
    "heads,groups,sync,e4m3",
    [
        pytest.param(16, 2, False, "hw", id="fp8-h16-g2-mixed"),
        # The opt-in tensor-core non-flush kernel ($REPLAYSSM_FP8_DECODE=mma).
        pytest.param(16, 2, False, "hw-mma", id="fp8-h16-g2-mixed-mma-decode"),
        pytest.param(16, 1, False, "hw-mma", id="fp8-h16-g1-mixed-mma-decode"),
        pytest.param(16, 1, False, "hw", id="fp8-h16-g1-mixed"),
        pytest.param(16, 2, True, "hw", id="fp8-h16-g2-sync"),
        # sm_90a only: the software e4m3 encode instead of the e4m3x2 cvt.
        pytest.param(16, 2, False, "soft", id="fp8-h16-g2-mixed-soft-e4m3"),
        # Subnormal FP16 / e4m3 results: the encoders' general (warp-voted) path.
        pytest.param(16, 2, "wide", "hw", id="fp8-h16-g2-wide-range"),
        pytest.param(16, 2, "wide", "soft", id="fp8-h16-g2-wide-range-soft-e4m3"),
    ],
)
def test_kernels_match_reference_over_three_periods(heads, groups, sync, e4m3, monkeypatch):
    from replayssm.kernels import triton_backend
    from replayssm.kernels.cute import launch

    if e4m3.endswith("-mma"):
        monkeypatch.setenv(launch.FP8_DECODE_ENV, "mma")
        e4m3 = e4m3.removesuffix("-mma")

    w = World(heads, groups, sync=sync is True, wide=sync == "wide")
    backend = triton_backend()
    cache, H, P, N = w.cache, heads, L.HEAD_DIM, L.STATE_DIM
    out = torch.empty(w.batch, H, P, dtype=torch.bfloat16, device=DEVICE)
    state = torch.empty(w.batch, H, P, N, dtype=torch.float32, device=DEVICE)
    flushed = 0
    worst = 0.0
    for step in range(48):
        tok = w.token()
        x, dt, A, B, C, D, dt_bias = w.inputs(tok)
        before = [t.clone() for t in cache]
        # Kernels: prepare (Triton), then both CuTe kernels, the flush with its S dump.
        out.fill_(NAN)
        state.fill_(NAN)
        plan = backend.prepare(cache, w.ids, out, nvfp4=False, seed=w.seed)
        launch.decode_fp8(cache, x, dt, A, B, C, D, dt_bias, plan, out, state_out=state, e4m3=e4m3)
        # Reference from the same starting state.
        expect = [t.clone() for t in before]
        out_ref = torch.full_like(out, NAN)
        ref.decode(expect, x, dt, A, B, C, D, dt_bias, w.ids, out_ref, nvfp4=False, seed=w.seed)
        torch.cuda.synchronize()

        valid = ref.valid_rows(w.ids.long(), cache[1].shape[0])
        assert bool((out[~valid] == 0).all()), f"step {step}: padding rows must be zero"
        y, yr = out[valid].float(), out_ref[valid].float()
        assert not bool(torch.isnan(y).any()), f"step {step}: NaN in outputs"
        rowmax = yr.abs().amax(dim=-1, keepdim=True)
        err = (y - yr).abs()
        ratio = float((err / _ulp_bf16(rowmax)).amax())
        worst = max(worst, ratio)
        assert ratio <= 2.0, f"step {step}: output differs by {ratio:.2f} bf16 ulps of the row max"

        for i in (L.X_RING, L.DT_RING, L.B_RING, L.POSITIONS):
            assert _same(cache[i], expect[i]), f"step {step}: cache[{i}] differs from the reference"

        fl = plan.flush.clone()
        slots = plan.slot[fl]
        untouched = torch.ones(cache[1].shape[0], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        for i in (L.CHECKPOINT, L.READ_COPY, L.SCALES):
            assert _same(cache[i][untouched], before[i][untouched]), f"step {step}: cache[{i}] of a non-flushing slot changed"
        if slots.numel():
            flushed += slots.numel()
            S = state[fl]
            xs, Bs = x[fl], B[fl]
            dts = ref.softplus_dt(dt[fl], dt_bias.view(1, -1))
            S_ref = ref.fold(before, slots, xs, dts, Bs, A, plan.ring_index[fl])
            scale = S_ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            assert float(((S - S_ref).abs() / scale).amax()) < 1e-5, f"step {step}: FP32 state differs"
            ck = to_fp16(S, checkpoint_rbits(plan.key[fl], H))
            codes, scales = fp8_encode(S)
            assert _same(cache[L.CHECKPOINT][slots], ck), f"step {step}: checkpoint bits differ from to_fp16(S)"
            assert _same(cache[L.READ_COPY][slots], codes), f"step {step}: read copy bits differ from fp8_encode(S)"
            assert _same(cache[L.SCALES][slots], scales), f"step {step}: scales differ from fp8_encode(S)"
        assert w.gaps_untouched(), f"step {step}: bytes between slot tensors were written"
    live = int(valid.sum())
    assert flushed == 3 * live, (flushed, live)
    print(f"[{heads}h/{groups}g sync={sync} e4m3={e4m3}] 48 steps, {flushed} row flushes, worst output error {worst:.2f} bf16 ulps of row max")


def test_cuda_graph_replays_whole_periods():
    from replayssm.kernels import triton_backend

    w = World(16, 2, seed=1)
    twin = World(16, 2, seed=1)  # the same construction: identical bits
    for a, b in zip(w.cache, twin.cache):
        assert _same(a, b)
    steps = 32
    toks = [w.token() for _ in range(steps)]
    p = w.params

    def run(cache, outs):
        for t, o in zip(toks, outs):
            selective_state_update_replayssm(
                cache, t.x, t.dt, p.A, t.B, t.C, p.D, p.dt_bias, w.ids, o, state_dtype="fp8", seed=w.seed
            )

    backend = triton_backend()
    assert backend.cute_for(w.cache) is not None, "the CuTe kernels must run this cache"
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
            assert _same(a, b), f"replay {rep}, step {s}: graph output differs from eager"
        for i, (a, b) in enumerate(zip(w.cache, twin.cache)):
            assert _same(a, b), f"replay {rep}: cache[{i}] differs from eager"
    assert w.gaps_untouched()


def test_warmup_compiles_and_launches_both_kernels_without_changing_the_cache():
    from replayssm import ReplaySSMCache

    cache = ReplaySSMCache(num_slots=6, num_heads=16, num_groups=2, state_dtype="fp8", device=DEVICE, slot_padding=64)
    before = [t.clone() for t in cache.tensors]
    names = cache.warmup()
    torch.cuda.synchronize()
    assert any(n.startswith("cute.decode_fp8[") for n in names), names
    assert any(n.startswith("cute.flush_fp8[") for n in names), names
    for i, (a, b) in enumerate(zip(before, cache.tensors)):
        assert _same(a, b), f"warmup changed cache[{i}]"
