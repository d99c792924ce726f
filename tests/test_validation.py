"""Every check of the public entry points: the right exception, a message naming the
argument, and a cache left untouched."""

import pytest
import torch

from replayssm import (
    ReplaySSMCache,
    allocate_cache,
    initialize_replayssm_state,
    layout as L,
    selective_state_update_replayssm,
)

from .helpers import assert_cache_equal, snapshot

H, G, S = 16, 2, 6


def _decode_args(batch=2):
    g = torch.Generator().manual_seed(0)
    return dict(
        x=torch.randn(batch, H, 64, generator=g).bfloat16(),
        dt=torch.randn(batch, H, generator=g),
        A=-torch.rand(H, generator=g),
        B=torch.randn(batch, G, 128, generator=g).bfloat16(),
        C=torch.randn(batch, G, 128, generator=g).bfloat16(),
        D=torch.ones(H),
        dt_bias=torch.zeros(H),
        state_indices=torch.tensor([1, 2], dtype=torch.int32)[:batch],
        out=torch.empty(batch, H, 64, dtype=torch.bfloat16),
    )


def _cache(fmt="fp8"):
    c = allocate_cache(S, H, G, fmt)
    initialize_replayssm_state(c, torch.randn(2, H, 64, 128), torch.tensor([1, 2]), state_dtype=fmt)
    return c


DECODE_CASES = [
    pytest.param({"x": torch.zeros(2, H, 64)}, ValueError, "x must be bfloat16", id="x-dtype"),
    pytest.param({"x": torch.zeros(2, H, 32, dtype=torch.bfloat16)}, ValueError, "x must be", id="x-shape"),
    pytest.param({"B": torch.zeros(2, G, 128, dtype=torch.float16)}, ValueError, "B must be bfloat16", id="B-dtype"),
    pytest.param({"C": torch.zeros(2, G, 64, dtype=torch.bfloat16)}, ValueError, "C must be", id="C-shape"),
    pytest.param({"dt": torch.zeros(2, H + 1)}, ValueError, "dt must be", id="dt-shape"),
    pytest.param({"dt": torch.zeros(2, H, dtype=torch.int32)}, ValueError, "dt must be a floating", id="dt-dtype"),
    pytest.param({"A": torch.zeros(H + 2)}, ValueError, "A must be", id="A-shape"),
    pytest.param({"D": torch.zeros(H, 3)}, ValueError, "D must be", id="D-shape"),
    pytest.param({"dt_bias": torch.zeros(3)}, ValueError, "dt_bias must be", id="dt_bias-shape"),
    pytest.param({"state_indices": torch.tensor([1.0, 2.0])}, ValueError, "state_indices must be int32", id="ids-dtype"),
    pytest.param({"out": torch.empty(2, H, 64)}, ValueError, "out must be contiguous bfloat16", id="out-dtype"),
    pytest.param({"out": torch.empty(2, 64, H, dtype=torch.bfloat16).transpose(1, 2)}, ValueError, "out must be contiguous", id="out-noncontig"),
    pytest.param({"out": torch.empty(3, H, 64, dtype=torch.bfloat16)}, ValueError, "out must be", id="out-shape"),
    pytest.param({"x": "nope"}, TypeError, "x must be a torch.Tensor", id="x-type"),
    pytest.param({"state_dtype": "fp4"}, ValueError, "state_dtype must be one of", id="bad-format"),
    pytest.param({"state_dtype": 8}, TypeError, "state_dtype must be a str", id="format-type"),
    pytest.param({"max_seqlen": 2}, ValueError, "max_seqlen must be 1", id="max-seqlen"),
    pytest.param({"cu_seqlens": torch.tensor([0, 1, 2])}, ValueError, "pending-mode", id="cu-seqlens"),
    pytest.param({"num_accepted_tokens": torch.tensor([1, 1])}, ValueError, "pending-mode", id="num-accepted"),
    pytest.param({"seed": 1.5}, TypeError, "seed must be a Python int", id="seed-type"),
]


@pytest.mark.parametrize("change,exc,match", DECODE_CASES)
def test_decode_rejects_bad_input_and_leaves_cache_untouched(change, exc, match):
    cache = _cache()
    args = _decode_args()
    kw = {"state_dtype": "fp8"}
    for k, v in change.items():
        (kw if k in ("state_dtype", "max_seqlen", "cu_seqlens", "num_accepted_tokens", "seed") else args)[k] = v
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        selective_state_update_replayssm(cache, *args.values(), **kw)
    assert_cache_equal(before, cache)


def _bad_cache(kind):
    c = _cache()
    if kind == "short":
        return c[:-1]
    if kind == "ckpt-dtype":
        c[1] = c[1].float()
    elif kind == "ckpt-shape":
        c[1] = torch.zeros(S, H, 64, 64, dtype=torch.float16)
    elif kind == "ring-shape":
        c[2] = torch.zeros(S, H, 8, 64, dtype=torch.bfloat16)
    elif kind == "heads-per-group":
        c[4] = torch.zeros(S, 3, 16, 128, dtype=torch.bfloat16)
    elif kind == "positions-dtype":
        c[-1] = c[-1].long()
    elif kind == "inner-stride":
        c[5] = torch.zeros(S, H, 128, 64, dtype=torch.float8_e4m3fn).transpose(2, 3)
    elif kind == "not-a-tensor":
        c[3] = [0.0]
    elif kind == "one-slot":
        c = [t[:1] for t in allocate_cache(S, H, G, "fp8")]  # allocate_cache itself refuses one slot
    return c


@pytest.mark.parametrize(
    "kind,exc,match",
    [
        pytest.param("short", ValueError, "must hold 8 tensors", id="tuple-length"),
        pytest.param("ckpt-dtype", ValueError, r"cache\[1\] \(checkpoint\)", id="checkpoint-dtype"),
        pytest.param("ckpt-shape", ValueError, r"cache\[1\] \(checkpoint\) must be", id="checkpoint-shape"),
        pytest.param("ring-shape", ValueError, r"cache\[2\] \(x_ring\)", id="x-ring-shape"),
        pytest.param("heads-per-group", ValueError, "heads must be a multiple of groups", id="heads-per-group"),
        pytest.param("positions-dtype", ValueError, r"cache\[7\] \(positions\)", id="positions-dtype"),
        pytest.param("inner-stride", ValueError, "contiguous within a slot", id="inner-stride"),
        pytest.param("not-a-tensor", TypeError, r"cache\[3\] must be a torch.Tensor", id="not-a-tensor"),
        pytest.param("one-slot", ValueError, "at least 2 slots", id="one-slot"),
    ],
)
def test_cache_tuple_is_validated(kind, exc, match):
    cache = _bad_cache(kind)
    with pytest.raises(exc, match=match):
        selective_state_update_replayssm(cache, *_decode_args().values(), state_dtype="fp8")


def test_format_mismatch_is_rejected():
    cache = _cache("fp8")
    with pytest.raises(ValueError, match="must hold 10 tensors"):
        selective_state_update_replayssm(cache, *_decode_args().values(), state_dtype="nvfp4")


INIT_CASES = [
    pytest.param(lambda: torch.zeros(2, H, 64, 128, dtype=torch.float64), torch.tensor([1, 2]), ValueError, "states must be float32", id="states-dtype"),
    pytest.param(lambda: torch.zeros(2, H, 64, 64), torch.tensor([1, 2]), ValueError, "states must be float32", id="states-shape"),
    pytest.param(lambda: torch.zeros(2, H, 64, 128), torch.tensor([1, 2, 3]), ValueError, "one slot per state", id="count"),
    pytest.param(lambda: torch.zeros(2, H, 64, 128), torch.tensor([1.0, 2.0]), ValueError, "int32 or int64", id="ids-dtype"),
    pytest.param(lambda: "states", torch.tensor([1, 2]), TypeError, "states must be a torch.Tensor", id="states-type"),
]


@pytest.mark.parametrize("make_states,ids,exc,match", INIT_CASES)
def test_initialize_rejects_bad_input(make_states, ids, exc, match):
    cache = _cache()
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        initialize_replayssm_state(cache, make_states(), ids, state_dtype="fp8")
    assert_cache_equal(before, cache)


def test_debug_mode_rejects_duplicate_live_slots(monkeypatch):
    cache = _cache()
    args = _decode_args()
    args["state_indices"] = torch.tensor([2, 2], dtype=torch.int32)
    monkeypatch.setenv("REPLAYSSM_DEBUG", "1")
    before = snapshot(cache)
    with pytest.raises(ValueError, match="each live slot once"):
        selective_state_update_replayssm(cache, *args.values(), state_dtype="fp8")
    assert_cache_equal(before, cache)
    # repeated padding is allowed
    args["state_indices"] = torch.tensor([0, 0], dtype=torch.int32)
    selective_state_update_replayssm(cache, *args.values(), state_dtype="fp8")


def test_empty_batch_is_a_no_op():
    cache = _cache()
    before = snapshot(cache)
    args = _decode_args(0)
    args["state_indices"] = torch.zeros(0, dtype=torch.int32)
    selective_state_update_replayssm(cache, *args.values(), state_dtype="fp8")
    assert_cache_equal(before, cache)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        pytest.param(dict(num_heads=12, num_groups=5), ValueError, "heads must be a multiple of groups", id="geometry"),
        pytest.param(dict(num_heads=256, num_groups=1), ValueError, "1 to 128 heads a group", id="geometry-ratio"),
        pytest.param(dict(state_dtype="int8"), ValueError, "state_dtype must be one of", id="format"),
        pytest.param(dict(num_slots=1), ValueError, "num_slots must be >= 2", id="slots"),
        pytest.param(dict(num_slots=2.5), TypeError, "num_slots must be an int", id="slots-type"),
        pytest.param(dict(max_batch=0), ValueError, "max_batch must be positive", id="max-batch"),
        pytest.param(dict(seed="x"), TypeError, "seed must be a Python int", id="seed"),
    ],
)
def test_cache_constructor_validation(kwargs, exc, match):
    base = dict(num_slots=4, num_heads=16, num_groups=2, state_dtype="fp8", device="cpu")
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        ReplaySSMCache(**base)


def test_cache_decode_rejects_batch_above_max_batch():
    cache = ReplaySSMCache(8, 16, 2, "fp8", "cpu", max_batch=1)
    args = _decode_args()
    with pytest.raises(ValueError, match="max_batch=1"):
        cache.decode(args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"], args["dt_bias"], args["state_indices"])
    assert cache.positions.sum().item() == 0


@pytest.mark.parametrize(
    "name,value",
    [
        pytest.param("A", torch.randn(H, 64), id="A-per-dim"),
        pytest.param("dt", torch.randn(2, H, 64), id="dt-per-dim"),
        pytest.param("dt_bias", torch.randn(H, 64), id="dt_bias-per-dim"),
        pytest.param("dt", torch.randn(2, H * 64), id="dt-flat"),
    ],
)
def test_untied_per_head_parameters_are_rejected(name, value):
    cache = _cache()
    args = _decode_args()
    args[name] = value
    before = snapshot(cache)
    # [b, H*64] is no layout dt has: refused for its shape before its strides are read
    with pytest.raises(ValueError, match=rf"{name} must (hold one value per head|be \[2, {H}\] or a tied)"):
        selective_state_update_replayssm(cache, *args.values(), state_dtype="fp8")
    assert_cache_equal(before, cache)


def test_scratch_smaller_than_batch_is_rejected():
    cache = _cache()

    class Scratch:
        rows = 1

    before = snapshot(cache)
    with pytest.raises(ValueError, match="scratch holds 1 rows"):
        selective_state_update_replayssm(cache, *_decode_args().values(), state_dtype="fp8", scratch=Scratch())
    assert_cache_equal(before, cache)


def test_rejected_release_and_materialize_change_nothing():
    cache = ReplaySSMCache(4, 16, 2, "fp8", "cpu")
    slots = cache.allocate(2)
    cache.reset(slots)
    before = snapshot(cache.tensors)
    with pytest.raises(TypeError, match="int32 or int64"):
        cache.release(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="not allocated"):
        cache.release(torch.tensor([1, 3]))
    assert cache.allocator.num_used == 2
    assert_cache_equal(before, cache.tensors)
