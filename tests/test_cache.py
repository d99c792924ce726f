"""ReplaySSMCache end to end on the reference backend: the lifecycle a scheduler drives."""

import numpy as np
import torch

from replayssm import ReplaySSMCache, layout as L
from replayssm.synthetic import ExactRecurrence, layer_params, prefill_states, sqnr_db, token
from . import tolerances as tol


def test_lifecycle_matches_exact_recurrence_and_reuses_slots():
    g = torch.Generator().manual_seed(0)
    p = layer_params(16, generator=g)
    cache = ReplaySSMCache(5, 16, 2, "nvfp4", "cpu", seed=1)
    slots = cache.allocate(2)
    states = prefill_states(p, 2, 2, 16, generator=g)
    cache.prefill_init(states, slots)
    exact = ExactRecurrence(p, states)
    outs, refs = [], []
    for _ in range(40):
        tok = token(2, 16, 2, generator=g)
        outs.append(cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots))
        refs.append(exact.step(tok))
    assert sqnr_db(torch.stack(refs), torch.stack(outs)) >= 22
    assert cache.positions[slots.long()].tolist() == [40, 40]
    # materialize uses the A seen by decode
    assert sqnr_db(exact.S, cache.materialize(slots)) >= 60
    cache.release(slots[:1])
    assert cache.positions[slots[0]].item() == 0
    assert torch.count_nonzero(cache.tensors[L.X_RING][slots[0]].float()) == 0
    again = cache.allocate(1)
    assert again.tolist() == slots[:1].tolist()
    cache.reset(again)
    assert torch.count_nonzero(cache.tensors[L.CHECKPOINT][again.long()].float()) == 0


def test_out_buffer_is_used_and_returned():
    cache = ReplaySSMCache(3, 16, 2, "fp8", "cpu")
    slots = cache.allocate(2)
    cache.reset(slots)
    g = torch.Generator().manual_seed(1)
    tok = token(2, 16, 2, generator=g)
    p = layer_params(16, generator=g)
    out = torch.full((2, 16, 64), float("nan"), dtype=torch.bfloat16)
    got = cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, slots, out=out)
    assert got is out
    # from a zero state the first output is the current token's term plus D x
    dt = torch.nn.functional.softplus(tok.dt + p.dt_bias)
    bc = (tok.B.float() * tok.C.float()).sum(-1).repeat_interleave(8, 1)
    expect = (dt * bc)[:, :, None] * tok.x.float() + p.D[None, :, None] * tok.x.float()
    torch.testing.assert_close(out.float(), expect, rtol=tol.BF16_OUTPUT_RTOL, atol=tol.BF16_OUTPUT_ATOL)


def test_bytes_per_slot_matches_format():
    fp8 = ReplaySSMCache(3, 16, 2, "fp8", "cpu")
    nv = ReplaySSMCache(3, 16, 2, "nvfp4", "cpu")
    common = 16 * 64 * 128 * 2 + 16 * 16 * 64 * 2 + 16 * 16 * 4 + 2 * 16 * 128 * 2 + 4
    assert fp8.bytes_per_slot() == common + 16 * 64 * 128 + 16 * 64 * 4
    assert nv.bytes_per_slot() == common + 16 * 64 * 64 + 16 * 64 * 8 + 2 * 2 * 4 + 4
    assert fp8.warmup() == []


def test_slots_accept_lists_and_ints_and_conv_dtype_is_configurable():
    cache = ReplaySSMCache(4, 16, 2, "fp8", "cpu", conv_state_shape=(3, 8), conv_state_dtype=torch.float32)
    assert cache.tensors[0].dtype == torch.float32 and cache.tensors[0].shape == (4, 3, 8)
    cache.allocate(2)
    cache.reset([1, 2])
    states = torch.randn(1, 16, 64, 128)
    cache.prefill_init(states, [2])
    ref = ReplaySSMCache(4, 16, 2, "fp8", "cpu")
    ref.allocate(2)
    ref.prefill_init(states, torch.tensor([2]))
    assert torch.equal(cache.tensors[L.CHECKPOINT][2], ref.tensors[L.CHECKPOINT][2])
    assert torch.equal(cache.materialize(2), ref.materialize(torch.tensor([2])))
    cache.release(1)
    cache.release([np.int64(2)])  # NumPy integers and integer 0-D tensors are ids too
    again = cache.allocate(3)
    cache.reset([again[0]])
    cache.release(np.array(again[:2].tolist(), dtype=np.int32))
    assert cache.allocator.num_free == 2


def test_repr_is_short_and_says_geometry_format_device_backend_and_slots():
    cache = ReplaySSMCache(9, 16, 2, "nvfp4", "cpu", backend="reference")
    want = (
        "ReplaySSMCache(num_slots=9, num_heads=16, num_groups=2, state_dtype='nvfp4', device='cpu', "
        "backend='reference', seed=0, max_batch=8, slots_in_use={}/8)"
    )
    assert repr(cache) == want.format(0)
    slots = cache.allocate(3)
    cache.release(slots[1:2])
    assert repr(cache) == want.format(2)
    padded = ReplaySSMCache(
        1025, 64, 8, "fp8", "cpu", seed=7, max_batch=256, slot_padding=64, conv_state_shape=(3, 8), backend="reference"
    )
    text = repr(padded)
    assert text == (
        "ReplaySSMCache(num_slots=1025, num_heads=64, num_groups=8, state_dtype='fp8', device='cpu', "
        "backend='reference', seed=7, max_batch=256, slot_padding=64, conv_state_shape=(3, 8), slots_in_use=0/1024)"
    )
    assert len(text) < 200 and "tensor" not in text
