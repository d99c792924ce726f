"""The reference decode against the exact FP64 recurrence, and the hard cases of the design
brief (section 5): mixed ring positions, padding, reuse, tied inputs, broadcast states,
padded pages, poisoned memory, long decodes."""

import pytest
import torch

from replayssm import allocate_cache, initialize_replayssm_state, layout as L, reference as ref
from replayssm import materialize_replayssm_state
from replayssm.quant import formats as Q
from replayssm.synthetic import sqnr_db
from replayssm.formats import FP8, NVFP4, format_of

from .helpers import Layer, assert_cache_equal, same_bits, snapshot
from . import tolerances as tol

FORMATS = [pytest.param("fp8", id="fp8"), pytest.param("nvfp4", id="nvfp4")]
# Per-row floors over a few periods. The read copy's element SQNR is ~31.5 dB (e4m3) and
# ~20.4 dB (NVFP4) on Gaussian states (3 resp. 1 mantissa bits, nearest rounding); outputs
# also carry the exact ring replay and D x, so they sit above those. Floors leave ~1.5 dB.
ROW_FLOOR = {"fp8": 30.0, "nvfp4": 19.0}


def _desync(layer, advance):
    """Decode slot s alone advance[s] times so that rows sit at different ring positions."""
    for s, n in advance.items():
        for _ in range(n):
            layer.step([s])


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_matches_exact_recurrence_at_mixed_positions(fmt):
    layer = Layer(fmt, rows=(1, 2, 3, 5), num_slots=8)
    _desync(layer, {1: 5, 2: 11, 5: 15})  # slot 5 flushes on the first batched step
    batch = [1, 0, 2, -1, 3, 8, 5, 0]  # padding: 0, -1, >= num_slots, repeated 0
    outs, refs = {r: [] for r in (0, 2, 4, 6)}, {r: [] for r in (0, 2, 4, 6)}
    flushes = {r: 0 for r in outs}
    for _ in range(48):  # three periods
        pos_before = layer.cache[L.POSITIONS].clone()
        out, exact, _ = layer.step(batch)
        for r in outs:
            flushes[r] += int(pos_before[batch[r]] % 16 == 15)
            outs[r].append(out[r])
            refs[r].append(exact[r])
        for r in (1, 3, 5, 7):
            assert torch.equal(out[r], torch.zeros_like(out[r])), "padding rows must read as zeros"
    for r in outs:
        assert flushes[r] == 3
        assert sqnr_db(torch.stack(refs[r]), torch.stack(outs[r])) >= ROW_FLOOR[fmt]
    pos = layer.cache[L.POSITIONS]
    assert pos[[1, 2, 3, 5]].tolist() == [53, 59, 48, 63]
    assert pos[[0, 4, 6, 7]].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_flushes_on_the_same_step_and_none_on_others(fmt):
    layer = Layer(fmt, rows=(1, 2, 3))
    before = snapshot(layer.cache)
    for step in range(16):
        out, exact, _ = layer.step([1, 2, 3])
        ckpt_same = same_bits(layer.cache[L.CHECKPOINT], before[L.CHECKPOINT])
        copy_same = same_bits(layer.cache[L.READ_COPY], before[L.READ_COPY])
        assert ckpt_same == copy_same == (step < 15), "only the flush step writes state"
        for r in range(3):
            assert sqnr_db(exact[r], out[r]) >= ROW_FLOOR[fmt] - 6
    # the ring holds exactly the 15 stored tokens' inputs (entry 15 is never written)
    assert torch.all(layer.cache[L.DT_RING][1:4, :, :15] > 0)
    assert torch.all(layer.cache[L.DT_RING][1:4, :, 15] == 0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_padding_only_batch_writes_nothing_but_zero_outputs(fmt):
    layer = Layer(fmt, num_slots=6, rows=(1, 2))
    _desync(layer, {1: 3})
    before = snapshot(layer.cache)
    ids = torch.tensor([0, -1, 6, 100, 0], dtype=torch.int64)
    tok = layer.token(5)
    p = layer.params
    out = torch.full((5, 16, 64), float("nan"), dtype=torch.bfloat16)
    from replayssm import selective_state_update_replayssm

    selective_state_update_replayssm(layer.cache, tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, ids, out, state_dtype=fmt)
    assert torch.equal(out, torch.zeros_like(out))
    assert_cache_equal(before, layer.cache)


@pytest.mark.parametrize("fmt", FORMATS)
def test_slot_reuse_starts_clean(fmt):
    """Re-initializing a slot clears its ring and position: afterwards it decodes exactly
    like a fresh cache initialized with the same state."""
    used = Layer(fmt, rows=(1, 2), seed=3)
    _desync(used, {2: 21})
    fresh_states = torch.randn(1, 16, 64, 128, generator=torch.Generator().manual_seed(9))
    initialize_replayssm_state(used.cache, fresh_states, torch.tensor([2]), state_dtype=fmt, seed=3)
    assert used.cache[L.POSITIONS][2].item() == 0
    for i in (L.X_RING, L.DT_RING, L.B_RING):
        assert torch.count_nonzero(used.cache[i][2].float()) == 0
    fresh = allocate_cache(10, 16, 2, fmt)
    initialize_replayssm_state(fresh, fresh_states, torch.tensor([2]), state_dtype=fmt, seed=3)
    g = torch.Generator().manual_seed(11)
    from replayssm.synthetic import token
    from replayssm import selective_state_update_replayssm

    p = used.params
    for _ in range(20):
        tok = token(1, 16, 2, generator=g)
        outs = []
        for c in (used.cache, fresh):
            o = torch.empty(1, 16, 64, dtype=torch.bfloat16)
            selective_state_update_replayssm(c, tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, torch.tensor([2]), o, state_dtype=fmt, seed=3)
            outs.append(o)
        assert same_bits(*outs)
    for i in range(1, len(fresh)):
        assert same_bits(used.cache[i][2], fresh[i][2])


@pytest.mark.parametrize("fmt", FORMATS)
def test_tied_stride0_and_flat_inputs_give_identical_bits(fmt):
    a, b = Layer(fmt, rows=(1, 2), seed=4), Layer(fmt, rows=(1, 2), seed=4)
    p = a.params
    for _ in range(18):
        tok = a.token(2)
        out_a, _, _ = a.step([1, 2], tok)
        out_b, _, _ = b.step(
            [1, 2],
            tok,
            x=tok.x.reshape(2, 16 * 64),
            dt=tok.dt[:, :, None].expand(2, 16, 64),
            A=p.A[:, None, None].expand(16, 64, 128),
            dt_bias=p.dt_bias[:, None].expand(16, 64),
            D=p.D[:, None].expand(16, 64),
        )
        assert same_bits(out_a, out_b)
    assert_cache_equal(a.cache, b.cache)


@pytest.mark.parametrize("fmt", FORMATS)
def test_broadcast_zero_states(fmt):
    c1, c2 = allocate_cache(6, 16, 2, fmt, fill=float("nan")), allocate_cache(6, 16, 2, fmt)
    zero = torch.zeros(1, 16, 64, 128)
    ids = torch.tensor([1, 3, 4], dtype=torch.int64)
    initialize_replayssm_state(c1, zero.expand(3, -1, -1, -1), ids, state_dtype=fmt)
    initialize_replayssm_state(c2, torch.zeros(3, 16, 64, 128), ids, state_dtype=fmt)
    for i in range(1, len(c1)):
        assert same_bits(c1[i][ids], c2[i][ids])
    assert torch.count_nonzero(c1[L.CHECKPOINT][ids].float()) == 0
    assert torch.count_nonzero(c1[L.READ_COPY][ids].view(torch.uint8)) == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_padded_byte_pages_give_identical_bits(fmt):
    plain = Layer(fmt, rows=(1, 2, 4), num_slots=6, seed=5)
    paged = Layer(fmt, rows=(1, 2, 4), num_slots=6, seed=5, slot_padding=40, fill=float("nan"))
    for t, u in zip(plain.cache[1:], paged.cache[1:]):
        assert u.stride(0) > (t[0].numel() if t.dim() > 1 else 1)
    for layer in (plain, paged):
        _desync(layer, {2: 7})
    for _ in range(36):
        tok = plain.token(4)
        o1, _, _ = plain.step([2, 0, 1, 4], tok)
        o2, _, _ = paged.step([2, 0, 1, 4], tok)
        assert same_bits(o1, o2)
    live = torch.tensor([1, 2, 4])
    for i in range(1, len(plain.cache)):
        assert same_bits(plain.cache[i][live], paged.cache[i][live])


@pytest.mark.parametrize("fmt", FORMATS)
def test_poisoned_ring_and_padding_slots_never_leak(fmt):
    clean = Layer(fmt, rows=(1, 3), num_slots=5, seed=6)
    dirty = Layer(fmt, rows=(1, 3), num_slots=5, seed=6, fill=float("nan"))
    nan = float("nan")
    # Every ring entry is at or beyond the position (0) right after init: poison them all,
    # and the padding slot 0 and unused slots 2 and 4 everywhere.
    for i in (L.X_RING, L.DT_RING, L.B_RING):
        dirty.cache[i][[1, 3]] = nan
    for i in range(1, len(dirty.cache) - 1):
        if dirty.cache[i].dtype.is_floating_point:
            dirty.cache[i][[0, 2, 4]] = nan
        else:
            dirty.cache[i][[0, 2, 4]] = 0x7F
    for _ in range(40):
        tok = clean.token(4)
        o1, _, _ = clean.step([1, 0, 3, 0], tok)
        o2, _, _ = dirty.step([1, 0, 3, 0], tok)
        assert torch.isfinite(o2.float()).all()
        assert same_bits(o1, o2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_long_decode_accuracy_floor_and_no_drift(fmt):
    """Over 576 steps (36 flushes): output SQNR >= 33 dB (fp8) / 22 dB (nvfp4), and the
    last 128 steps are no worse than the first 128 beyond stochastic-rounding noise."""
    layer = Layer(fmt, rows=(1, 2, 3), seed=7, prompt=64)
    _desync(layer, {2: 6, 3: 11})
    outs, refs = [], []
    for _ in range(576):
        out, exact, _ = layer.step([1, 2, 3])
        outs.append(out)
        refs.append(torch.stack([exact[r] for r in range(3)]))
    outs, refs = torch.stack(outs), torch.stack(refs)
    floor = tol.OUTPUT_SQNR_FLOOR_DB[fmt]
    total = sqnr_db(refs, outs)
    first, last = sqnr_db(refs[:128], outs[:128]), sqnr_db(refs[-128:], outs[-128:])
    assert total >= floor, total
    assert last >= first - 1.0, (first, last)


@pytest.mark.parametrize("fmt", FORMATS)
def test_materialize_tracks_exact_state_and_reads_only(fmt):
    layer = Layer(fmt, rows=(1, 2), seed=8)
    _desync(layer, {1: 3})
    for _ in range(21):
        layer.step([1, 2])
    before = snapshot(layer.cache)
    states = materialize_replayssm_state(layer.cache, torch.tensor([1, 2]), layer.params.A, state_dtype=fmt)
    assert_cache_equal(before, layer.cache)
    for i, s in enumerate((1, 2)):
        # The FP16 checkpoint's stochastic rounding (11 significant bits) bounds the error.
        assert sqnr_db(layer.exact[s].S[0], states[i]) >= 60
    # a padding row reads as a zero state (as decode writes a zero output for it)
    padded = materialize_replayssm_state(layer.cache, torch.tensor([0, 2]), layer.params.A, state_dtype=fmt)
    assert torch.equal(padded[0], torch.zeros_like(states[0])) and torch.equal(padded[1], states[1])


def test_nvfp4_parity_meta_cycle_is_delayed_scaling():
    """Init: both halves hold the prefill group amax, parity 0. At each flush the parity
    flips, codes are encoded with the new live half (the amax measured one flush earlier)
    and the idle half receives the amax of the new FP32 state."""
    layer = Layer("nvfp4", rows=(1,), seed=9)
    c = layer.cache
    assert c[L.PARITY][1].item() == 0 and torch.equal(c[L.META][1, :, 0], c[L.META][1, :, 1])
    for flush_no in range(3):
        for _ in range(15):
            layer.step([1])
        snap = snapshot(c)
        tok = layer.token(1)
        layer.step([1], tok)
        # Recompute the flush's FP32 state from the snapshot with the reference fold.
        slot = torch.tensor([1])
        dts = ref.softplus_dt(tok.dt, layer.params.dt_bias.view(1, -1))
        state = ref.fold(snap, slot, tok.x, dts, tok.B, layer.params.A, torch.tensor([15]))
        old = snap[L.PARITY][1].item()
        assert c[L.PARITY][1].item() == 1 - old
        assert torch.equal(c[L.META][1, :, 1 - old], snap[L.META][1, :, 1 - old])  # live half kept
        measured = state.abs().reshape(1, 2, -1).amax(-1)[0]
        assert torch.equal(c[L.META][1, :, old], measured)
        live = c[L.META][1, :, 1 - old].repeat_interleave(8).view(1, 16)
        codes, bscales = Q.nvfp4_encode(state, live)
        assert same_bits(c[L.READ_COPY][1], codes[0]) and same_bits(c[L.SCALES][1], bscales[0])


def test_pending_positions_layout_is_initialized_and_decode_routes_to_pending_mode():
    """A cache with positions [S, 2]: init clears both columns of its slots only; the
    functional decode takes it in pending mode (dense layout [b, max_seqlen, H, 64]: a
    separate-mode x is rejected naming that layout, the cache untouched), and a dense call
    equals `pending.pending_decode` bit for bit."""
    from replayssm import selective_state_update_replayssm
    from replayssm.pending import pending_decode

    cache = allocate_cache(4, 16, 2, "fp8", pending=True)
    cache[L.POSITIONS].fill_(7)
    initialize_replayssm_state(cache, torch.zeros(1, 16, 64, 128), torch.tensor([2]), state_dtype="fp8")
    assert cache[L.POSITIONS][2].tolist() == [0, 0] and cache[L.POSITIONS][1].tolist() == [7, 7]
    cache[L.POSITIONS][1] = 0
    x = torch.randn(1, 1, 16, 64).bfloat16()
    bc = torch.randn(1, 1, 2, 128).bfloat16()
    h = -torch.ones(16)
    before = [t.clone() for t in cache]
    with pytest.raises(ValueError, match=r"x must be bfloat16 \[1, 1, 16, 64\]"):
        selective_state_update_replayssm(cache, x[:, 0], torch.zeros(1, 16), h, bc, bc, h, h, torch.tensor([2]), torch.empty_like(x), state_dtype="fp8")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, cache))
    out = torch.empty_like(x)
    selective_state_update_replayssm(cache, x, torch.zeros(1, 1, 16), h, bc, bc, h, h, torch.tensor([2]), out, state_dtype="fp8")
    want = [t.clone() for t in before]
    want_out = torch.empty_like(x)
    pending_decode(want, x, torch.zeros(1, 1, 16), h, bc, bc, h, h, torch.tensor([2]), want_out, fmt=FP8, seed=0, max_seqlen=1)
    assert cache[L.POSITIONS][2].tolist() == [0, 1]
    assert torch.equal(out, want_out)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(want, cache))


def test_stochastic_checkpoint_tracks_decay_that_nearest_rounding_loses():
    """Why the checkpoint is rounded stochastically (docs/format.md section 7): a state of
    1.0 decaying by 2e-4 per period changes by less than half an fp16 ulp below 1 (2**-12) each
    flush, so nearest rounding would keep 1.0 forever; stochastic rounding follows the
    decay in expectation."""
    fmt, heads, n_periods = "fp8", 8, 32
    cache = allocate_cache(3, heads, 1, fmt)
    initialize_replayssm_state(cache, torch.ones(1, heads, 64, 128), torch.tensor([1]), state_dtype=fmt, seed=1)
    per_token = 2e-4 / 16
    dt_bias = torch.full((heads,), float(torch.log(torch.expm1(torch.tensor(per_token, dtype=torch.float64)))))
    A = -torch.ones(heads)
    x = torch.zeros(1, heads, 64, dtype=torch.bfloat16)
    bc = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    from replayssm import selective_state_update_replayssm

    for _ in range(16 * n_periods):
        out = torch.empty_like(x)
        selective_state_update_replayssm(cache, x, torch.zeros(1, heads), A, bc, bc, torch.ones(heads), dt_bias, torch.tensor([1]), out, state_dtype=fmt, seed=1)
    ckpt = cache[L.CHECKPOINT][1].double()
    exact = torch.exp(torch.tensor(-per_token * 16 * n_periods, dtype=torch.float64)).item()
    nearest_would_keep = 1.0
    # stochastic rounding: within 5% of the decay; nearest rounding: 100% of it missing
    assert abs(ckpt.mean().item() - exact) < 0.05 * abs(nearest_would_keep - exact)
    # and nearest rounding really does stall: one flush's update rounds back to 1.0
    one_period = torch.tensor(1.0 * (1 - 2e-4), dtype=torch.float32)
    assert one_period.half().item() == 1.0
