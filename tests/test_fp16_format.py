"""state_dtype="fp16": no read copy, a step reads the FP16 checkpoint itself (docs/format.md
section 4b). The slot's tensors and bytes, the kernel backend taking the format (its
CPU path's bits against the reference), accuracy against the exact
FP64 recurrence in single-token and pending mode (verdicts with p 0.7) on the reference,
and a hand-off round trip."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from replayssm import ReplaySSMCache, allocate_cache, layout as L, selective_state_update_replayssm
from replayssm.formats import FP16, format_of
from replayssm.kernels import backend_for, kernel_backend
from replayssm.synthetic import ExactRecurrence, layer_params, prefill_states, sqnr_db, token

from .helpers import same_bits
from .tolerances import FOLD_REL_TOL

H, G = 16, 2
# Output SQNR floor against the exact recurrence (the bf16 output's own rounding is ~52-56
# dB on these inputs: the checkpoint's FP16 rounding must stay below it) and the drift
# allowed between the first and the last quarter of the tokens.
FP16_SQNR_DB, DRIFT_DB = 52.0, 1.0


def test_fp16_slot_holds_checkpoint_rings_and_positions_only():
    cache = allocate_cache(4, H, G, "fp16")
    assert [tuple(t.shape[1:]) for t in cache[1:]] == [(H, 64, 128), (H, 16, 64), (H, 16), (G, 16, 128), ()]
    assert [t.dtype for t in cache[1:]] == [torch.float16, torch.bfloat16, torch.float32, torch.bfloat16, torch.int32]
    assert format_of("fp16") is FP16 and len(cache) == FP16.cache_len() == 6
    c = ReplaySSMCache(4, H, G, "fp16", "cpu", backend="reference")
    want = H * 64 * 128 * 2 + H * 16 * 64 * 2 + H * 16 * 4 + G * 16 * 128 * 2 + 4
    assert c.bytes_per_slot() == want == 304132  # 297 KiB at 16 heads (FP8: 429 KiB)


def test_the_kernel_backend_runs_fp16():
    """backend="kernels" takes fp16 (on the CPU the Triton interpreter: materialize and
    the slot copies; the CuTe kernels run on a GPU, tests/test_cute_decode_gpu.py and
    tests/test_triton_bookkeeping.py): a cache on it holds the reference's bits after a
    prefill, 20 steps (a flush), a copy and a reset, and materializes the reference's
    states up to FP32 summation order."""
    assert backend_for("cpu", "kernels", allocate_cache(4, H, G, "fp16"), FP16) is kernel_backend()
    g = torch.Generator().manual_seed(5)
    p = layer_params(H, generator=g)
    states = prefill_states(p, 2, G, 8, generator=g)
    caches = [ReplaySSMCache(6, H, G, "fp16", "cpu", backend=b, seed=7) for b in ("kernels", "reference")]
    outs = []
    for cache in caches:
        slots = cache.allocate(2)
        cache.prefill_init(states, slots)
        g.manual_seed(6)
        outs.append([cache.decode(*_step_args(p, g), slots) for _ in range(20)])
        cache.copy_slots(slots[:1], cache.allocate(1))
        cache.reset(slots[1:])
        outs[-1].append(cache.materialize(torch.arange(4)))  # slots 1..3 and a padding row
    assert caches[0].backend_name == "kernels"
    assert all(same_bits(a, b) for a, b in zip(outs[0][:-1], outs[1][:-1]))
    got, want = outs[0][-1], outs[1][-1]
    assert float((got - want).abs().max()) <= FOLD_REL_TOL * float(want.abs().max())
    for a, b in zip(caches[0].tensors, caches[1].tensors):
        assert same_bits(a, b)


def _step_args(p, g):
    tok = token(2, H, G, generator=g)
    return tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias


def test_fp16_decode_tracks_the_exact_recurrence():
    """256 tokens (16 flushes), 2 rows: mean output SQNR at least FP16_SQNR_DB, the first
    and last 64 tokens within DRIFT_DB; the functional API gives the cache's bits."""
    g = torch.Generator().manual_seed(1)
    p = layer_params(H, generator=g)
    cache = ReplaySSMCache(4, H, G, "fp16", "cpu", backend="reference", seed=3)
    slots = cache.allocate(2)
    states = prefill_states(p, 2, G, 32, generator=g)
    cache.prefill_init(states, slots)
    tup = allocate_cache(4, H, G, "fp16")
    ids = slots.to(torch.int32)
    from replayssm import initialize_replayssm_state

    initialize_replayssm_state(tup, states, ids, state_dtype="fp16", seed=3, backend="reference")
    exact = ExactRecurrence(p, states)
    sq = []
    for _ in range(256):
        tok = token(2, H, G, generator=g)
        y = cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
        out = torch.empty_like(y)
        selective_state_update_replayssm(tup, tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, ids, out,
                                         state_dtype="fp16", seed=3, backend="reference")  # fmt: skip
        assert same_bits(out, y)
        sq.append(sqnr_db(exact.step(tok), y))
    for a, b in zip(tup[1:], cache.tensors[1:]):
        assert same_bits(a, b)
    first, last = statistics.mean(sq[:64]), statistics.mean(sq[-64:])
    assert statistics.mean(sq) >= FP16_SQNR_DB and abs(first - last) <= DRIFT_DB, (statistics.mean(sq), first, last)
    assert sqnr_db(exact.S, cache.materialize(slots)) >= 60.0


def test_fp16_pending_mode_tracks_the_exact_recurrence():
    """Pending mode, T = 4, 2 rows, 48 calls, each draft accepted with p 0.7 (the first
    rejection ends acceptance), verdicts passed with the next call: every output of a
    call against the exact recurrence after the committed tokens and the call's tokens
    0..t, mean SQNR at least FP16_SQNR_DB."""
    T, b = 4, 2
    g = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    p = layer_params(H, generator=g)
    cache = ReplaySSMCache(4, H, G, "fp16", "cpu", backend="reference", spec_tokens=T - 1)
    slots = cache.allocate(b)
    states = prefill_states(p, b, G, 32, generator=g)
    cache.prefill_init(states, slots)
    rows = [ExactRecurrence(p, states[i : i + 1]) for i in range(b)]
    verdict, previous, sq = None, None, []
    for _ in range(48):
        toks = [token(b, H, G, generator=g) for _ in range(T)]
        x, dt, B, C = (torch.stack([getattr(t, k) for t in toks], 1) for k in ("x", "dt", "B", "C"))
        y = cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, slots, num_accepted_tokens=verdict)
        for r, rec in enumerate(rows):
            if previous is not None:  # commit the previous call's accepted tokens
                for t in range(int(verdict[r])):
                    rec.step(_row(previous[t], r))
            keep = rec.S.clone()
            want = torch.cat([rec.step(_row(toks[t], r)) for t in range(T)])
            rec.S = keep
            sq.append(sqnr_db(want, y[r]))
        accepted = []
        for _ in range(b):
            a = 1
            while a < T and rng.random() < 0.7:
                a += 1
            accepted.append(a)
        verdict, previous = torch.tensor(accepted), toks
    assert statistics.mean(sq) >= FP16_SQNR_DB, statistics.mean(sq)
    assert all(math.isfinite(v) for v in sq)


def _row(tok, r):
    return type(tok)(*(getattr(tok, k)[r : r + 1] for k in ("x", "dt", "B", "C")))


def test_fp16_export_import_round_trip():
    g = torch.Generator().manual_seed(4)
    p = layer_params(H, generator=g)
    cache = ReplaySSMCache(6, H, G, "fp16", "cpu", backend="reference")
    slots = cache.allocate(2)
    cache.prefill_init(prefill_states(p, 2, G, 8, generator=g), slots)
    for _ in range(5):
        tok = token(2, H, G, generator=g)
        cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots)
    data = cache.export(slots[:1])
    assert sorted(data) == ["b_ring", "checkpoint", "dt_ring", "positions", "x_ring"]
    (other,) = cache.allocate(1).tolist()
    cache.import_(data, [other])
    for t in cache.tensors[1:]:
        assert same_bits(t[other], t[int(slots[0])])
    bad = dict(data, positions=torch.full_like(data["positions"], -1))
    before = [t.clone() for t in cache.tensors]
    with pytest.raises(ValueError, match=r"data\['positions'\] must hold token counts >= 0"):
        cache.import_(bad, [other])
    assert all(same_bits(a, b) for a, b in zip(before, cache.tensors))
    assert L.POSITIONS == -1
