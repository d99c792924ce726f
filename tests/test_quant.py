"""Quantizers and the random hash: known encodings, bit-exact cross-checks against
independent implementations, and the statistics of stochastic rounding."""

import numpy as np
import pytest
import torch

from replayssm.quant import formats as Q
from replayssm.quant import minifloat as M
from replayssm.quant import rng

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def codes(x, fmt, rbits=None):
    return M.encode(torch.tensor(x, dtype=torch.float32), fmt, rbits).tolist()


# -- e2m1 -------------------------------------------------------------------------------


def test_e2m1_every_value_round_trips():
    vals = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES])
    c = M.to_e2m1(vals)
    assert c.tolist() == list(range(8)) + [8 + i for i in range(8)]
    assert torch.equal(M.decode_e2m1(c), vals)


@pytest.mark.parametrize(
    "x,code",
    [
        pytest.param(0.25, 0, id="tie-0.25-to-0"),
        pytest.param(0.75, 2, id="tie-0.75-to-1.0"),
        pytest.param(1.25, 2, id="tie-1.25-to-1.0"),
        pytest.param(1.75, 4, id="tie-1.75-to-2.0"),
        pytest.param(2.5, 4, id="tie-2.5-to-2.0"),
        pytest.param(3.5, 6, id="tie-3.5-to-4.0"),
        pytest.param(5.0, 6, id="tie-5-to-4"),
        pytest.param(5.01, 7, id="above-5-to-6"),
        pytest.param(7.0, 7, id="saturate-7"),
        pytest.param(float("inf"), 7, id="inf-saturates"),
        pytest.param(float("-inf"), 15, id="neg-inf-saturates"),
        pytest.param(float("nan"), 7, id="nan-to-plus-6"),
        pytest.param(-0.0, 8, id="neg-zero"),
        pytest.param(0.26, 1, id="above-quarter"),
    ],
)
def test_e2m1_known_encodings(x, code):
    assert codes([x], M.E2M1) == [code]


# -- e4m3 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "x,code",
    [
        pytest.param(2.0**-9, 0x01, id="min-subnormal"),
        pytest.param(2.0**-10, 0x00, id="half-min-subnormal-ties-to-zero"),
        pytest.param(1.5 * 2.0**-9, 0x02, id="subnormal-tie-to-even"),
        pytest.param(7 * 2.0**-9, 0x07, id="max-subnormal"),
        pytest.param(2.0**-6, 0x08, id="min-normal"),
        pytest.param(7.5 * 2.0**-9, 0x08, id="subnormal-rounds-into-normal"),
        pytest.param(1.0, 0x38, id="one"),
        pytest.param(1.0625, 0x38, id="tie-down-to-even"),
        pytest.param(1.1875, 0x3A, id="tie-up-to-even"),
        pytest.param(448.0, 0x7E, id="max-normal"),
        pytest.param(464.0, 0x7E, id="past-max-saturates"),
        pytest.param(1e30, 0x7E, id="huge-saturates"),
        pytest.param(float("inf"), 0x7E, id="inf-saturates"),
        pytest.param(-448.0, 0xFE, id="neg-max"),
        pytest.param(float("-inf"), 0xFE, id="neg-inf-saturates"),
        pytest.param(float("nan"), 0x7F, id="nan"),
        pytest.param(-0.0, 0x80, id="neg-zero"),
        pytest.param(1e-30, 0x00, id="underflow"),
    ],
)
def test_e4m3_known_encodings(x, code):
    assert codes([x], M.E4M3) == [code]


def test_e4m3_matches_torch_cast_in_range():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 4)
    x = x.clamp(-448, 448)
    ours = M.to_e4m3(x).view(torch.uint8)
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)


def test_e4m3_every_code_round_trips():
    all_codes = torch.arange(256, dtype=torch.int64)
    finite = (all_codes & 0x7F) != 0x7F
    vals = M.decode_e4m3(all_codes[finite])
    assert torch.equal(M.encode(vals, M.E4M3), all_codes[finite])


# -- fp16 -------------------------------------------------------------------------------


def test_fp16_matches_torch_cast():
    allh = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    f = allh.float()
    fin = torch.isfinite(f)
    assert torch.equal(M.to_fp16(f[fin]).view(torch.int16), allh[fin].view(torch.int16))
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 5)).clamp(-65504, 65504)
    assert torch.equal(M.to_fp16(x).view(torch.int16), x.half().view(torch.int16))


def test_fp16_satfinite_and_nan():
    x = torch.tensor([65520.0, 1e10, float("inf"), float("-inf"), float("nan")])
    assert M.encode(x, M.FP16).tolist() == [0x7BFF, 0x7BFF, 0x7BFF, 0xFBFF, 0x7FFF]


def test_fp16_stochastic_rule_matches_ptx_definition():
    """PTX cvt.rs: round away from zero iff the 13 random bits plus the 13 discarded
    mantissa bits carry out. Checked with Python integers, independently of `encode`."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=g) * 3
    r = torch.randint(0, 1 << 13, (4096,), generator=g)
    got = M.encode(x, M.FP16, r).tolist()
    for xi, ri, gi in zip(x.tolist(), r.tolist(), got):
        bits = int(np.float32(xi).view(np.uint32))
        sign, a = bits >> 31, bits & 0x7FFFFFFF
        down = np.float32(np.uint32(a & ~0x1FFF).view(np.float32))
        trunc = int(np.float16(down).view(np.uint16))  # exact: down is an fp16 value
        up = (a & 0x1FFF) + ri >= (1 << 13)
        assert gi == (trunc + up) | (sign << 15)


@pytest.mark.parametrize("fmt", [M.FP16, M.E4M3, M.E2M1], ids=lambda f: f.name)
def test_stochastic_rounding_is_unbiased(fmt):
    """Mean of SR over many draws equals the input to within the statistical error and
    the 2**-k resolution of k random bits; each draw is one of the two neighbours."""
    n = 20_000
    vals = {"fp16": [1.0 + 1 / 3 * 2**-10, 0.1, -3.14159], "e4m3": [1.03, 0.3, -17.0], "e2m1": [0.3, 2.6, -4.9]}
    key = rng.stream_key(7, torch.tensor([3]), torch.tensor([15]))
    for v in vals[fmt.name]:
        x = torch.full((n,), v)
        r = rng.random_words(key, torch.arange(n)) & ((1 << fmt.rand_bits) - 1)
        c = M.encode(x, fmt, r)
        dec = {"fp16": M.decode_fp16, "e4m3": M.decode_e4m3, "e2m1": M.decode_e2m1}[fmt.name](c)
        lo, hi = dec.min().item(), dec.max().item()
        assert len(torch.unique(dec)) <= 2 and lo <= v <= hi
        ulp = hi - lo
        if ulp == 0:
            continue
        p = (v - lo) / ulp
        mean = dec.double().mean().item()
        tol = 5 * ulp * (p * (1 - p) / n) ** 0.5 + ulp * 2.0**-fmt.rand_bits
        assert abs(mean - v) <= tol, (fmt.name, v, mean)


# -- read-copy formats -------------------------------------------------------------------


def test_fp8_row_scale_is_tight_power_of_two():
    g = torch.Generator().manual_seed(4)
    amax = torch.exp(torch.randn(10_000, generator=g) * 10).float()
    s = Q.fp8_row_scale(amax)
    m, e = torch.frexp(s)
    assert torch.all(m == 0.5)
    ratio = amax.double() / s.double()
    assert torch.all(ratio <= 448) and torch.all(ratio > 224)
    assert Q.fp8_row_scale(torch.zeros(1)).item() == 1.0


def test_fp8_encode_decode_error_bound():
    g = torch.Generator().manual_seed(5)
    s = torch.randn(3, 2, 64, 128, generator=g) * torch.exp(torch.randn(3, 2, 64, 1, generator=g))
    c, sc = Q.fp8_encode(s)
    d = Q.fp8_decode(c, sc)
    # Relative error of e4m3 nearest rounding: half an ulp = 2**-4 of the value (normals);
    # subnormal codes are absolutely bounded by half the smallest step times the scale.
    bound = torch.maximum(s.abs() * 2.0**-4, sc.unsqueeze(-1) * 2.0**-10)
    assert torch.all((d - s).abs() <= bound)


def test_nvfp4_known_encoding_and_nibble_order():
    # One row: block 0 holds [6, 0.5, 1, ..] * 2 so its scale is exactly 2/ (g = 1).
    state = torch.zeros(1, 1, 64, 128)
    state[0, 0, 0, :4] = torch.tensor([12.0, 1.0, -2.0, 3.0])
    amax = torch.tensor([[12.0]])
    g = Q.nvfp4_global_scale(amax)  # smallest power of two with 12 / g <= 168 -> 2**-3
    assert g.item() == 2.0**-3
    packed, bs = Q.nvfp4_encode(state, amax)
    # block scale t = 12 * 8 / 6 = 16 -> e4m3 0x58; d = 16 * 2**-3 = 2; codes 6,0.5,-1,1.5
    assert bs.view(torch.uint8)[0, 0, 0, 0].item() == 0x58
    assert packed[0, 0, 0, :2].tolist() == [0x7 | (0x1 << 4), 0xA | (0x3 << 4)]
    dec = Q.nvfp4_decode(packed, bs, amax)
    assert torch.equal(dec[0, 0, 0, :4], state[0, 0, 0, :4])
    assert torch.equal(dec[0, 0, 0, 4:], torch.zeros(124)) and torch.equal(dec[0, 0, 1:], torch.zeros(63, 128))


def test_nvfp4_error_bound_and_headroom():
    gen = torch.Generator().manual_seed(6)
    s = torch.randn(2, 8, 64, 128, generator=gen)
    amax = s.abs().amax(dim=(1, 2, 3)).unsqueeze(1).expand(2, 8)
    packed, bs = Q.nvfp4_encode(s, amax)
    d = Q.nvfp4_decode(packed, bs, amax)
    # Largest block scale is amax / (6 g) <= 28, leaving a 16x headroom below 448.
    assert bs.float().max().item() <= 28
    blocks = s.reshape(2, 8, 64, 8, 16)
    step = blocks.abs().amax(-1, keepdim=True) / 6 * (1 + 2.0**-3)  # e4m3 scale rounding
    err = (d - s).reshape(2, 8, 64, 8, 16).abs()
    assert torch.all(err <= step)  # at most one e2m1 step (2 units at the top binade)


# -- random hash -------------------------------------------------------------------------


def _mix_numpy(x):
    x = np.asarray(x, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = x * np.uint32(0x7FEB352D)
        x = x ^ (x >> np.uint32(15))
        x = x * np.uint32(0x846CA68B)
        x = x ^ (x >> np.uint32(16))
    return x


def test_mix32_matches_numpy_uint32():
    g = torch.Generator().manual_seed(8)
    x = torch.randint(0, 1 << 32, (100_000,), generator=g, dtype=torch.int64)
    assert np.array_equal(rng.mix32(x).numpy().astype(np.uint32), _mix_numpy(x.numpy()))
    assert all(rng.mix32_int(int(v)) == int(_mix_numpy(v)) for v in x[:100].tolist())


# Golden words of the hash (docs/format.md): seed 0, slots 1 and 2, position 15, indices 0..3.
GOLDEN_KEYS = [0xCB6F0C0A, 0xAB0D286C]
GOLDEN_WORDS = [
    [0xEECBC113, 0xD50B1440, 0x353505F5, 0xCFA29101],
    [0x3B20DBBB, 0x350FFBDA, 0xC482AD1B, 0xEB237169],
]


def _stream_key_numpy(seed, slot, position):
    """The documented key chain, written again with numpy uint32 arithmetic."""
    lo, hi = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
    k = _mix_numpy(lo ^ np.uint32(0x9E3779B9))
    k = _mix_numpy(k ^ hi)
    k = _mix_numpy(k ^ np.uint32(slot))
    return _mix_numpy(k ^ np.uint32(position & 0xFFFFFFFF))


def test_hash_golden_values():
    """The hash is part of the format: these words must never change."""
    assert rng.mix32_int(1) == 0x688990C0
    key = rng.stream_key(0, torch.tensor([1, 2]), torch.tensor([15, 15]))
    assert key.tolist() == GOLDEN_KEYS
    assert [int(_stream_key_numpy(0, s, 15)) for s in (1, 2)] == GOLDEN_KEYS
    words = rng.random_words(key.view(2, 1), torch.arange(4).view(1, 4))
    assert words.tolist() == GOLDEN_WORDS
    with np.errstate(over="ignore"):
        idx = np.arange(4, dtype=np.uint32) * np.uint32(0x9E3779B9)
    for row, k in enumerate(GOLDEN_KEYS):
        assert _mix_numpy(np.uint32(k) ^ idx).tolist() == GOLDEN_WORDS[row]


def test_stream_key_large_and_negative_seeds():
    for seed in (1 << 40, (1 << 64) - 1, -1, 123456789):
        got = rng.stream_key(seed, torch.tensor([7]), torch.tensor([0xFFFFFFFF])).item()
        assert got == int(_stream_key_numpy(seed % (1 << 64), 7, 0xFFFFFFFF))


def test_hash_depends_on_each_input_not_on_layout():
    base = rng.stream_key(5, torch.tensor([3]), torch.tensor([31]))
    for other in (
        rng.stream_key(6, torch.tensor([3]), torch.tensor([31])),
        rng.stream_key(5, torch.tensor([4]), torch.tensor([31])),
        rng.stream_key(5, torch.tensor([3]), torch.tensor([47])),
        rng.stream_key(5 + (1 << 32), torch.tensor([3]), torch.tensor([31])),
    ):
        assert other.item() != base.item()
    w = rng.random_words(base, torch.arange(1 << 16))
    # Roughly uniform bits: each bit set about half the time.
    ones = torch.stack([(w >> b) & 1 for b in range(32)]).double().mean(dim=1)
    assert torch.all((ones - 0.5).abs() < 0.01)
    assert torch.unique(w).numel() > 0.999 * w.numel()


def test_checkpoint_rbits_layout():
    key = rng.stream_key(1, torch.tensor([9]), torch.tensor([15]))
    r = rng.checkpoint_rbits(key, heads=2)
    h, p, n = 1, 5, 77
    word = rng.random_words(key, torch.tensor([((h * 64 + p) * 128 + n) // 2])).item()
    assert r[0, h, p, n].item() == (word >> 16) & 0x1FFF  # odd n: upper half, bits [28:16]
    assert r[0, h, p, n - 1].item() == word & 0x1FFF  # even n: lower half, bits [12:0]
