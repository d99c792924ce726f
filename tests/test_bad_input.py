"""Bad input against the public API: each probe must raise the documented exception with a
message naming the argument, and leave every cache tensor and the slot allocator exactly
as they were (bits compared). Run on the PyTorch reference, on the kernel backend (the
Triton interpreter on the CPU) and on a GPU.

Each probe is a function of a `World` (a separate-mode and a pending-mode cache with live,
decoded slots) returning the call to make; the cache is shared by the probes of a
parametrization, so a probe that wrote anything would also show in the ones after it.
"""

from __future__ import annotations

import pytest
import torch

from replayssm import DTypeError, ReplaySSMCache, allocate_cache, selective_state_update_replayssm
from replayssm import layout as L
from replayssm.kernels.env import DEBUG_ENV

from .helpers import same_bits

H, G, S = 16, 2, 6


class World:
    """Caches of one format / backend / device with three live slots each, decoded past a
    flush (rings, positions and read copies all hold data), and one allocated spare slot."""

    def __init__(self, fmt: str, device: str, backend: str):
        self.fmt, self.device, self.backend = fmt, device, backend
        g = torch.Generator().manual_seed(1)
        kw = dict(device=device, backend=backend)
        self.A = -torch.linspace(0.5, 4.0, H).to(device)
        self.D, self.dt_bias = torch.ones(H, device=device), torch.full((H,), -2.0, device=device)
        self.sep = ReplaySSMCache(S, H, G, fmt, **kw)
        self.pend = ReplaySSMCache(S, H, G, fmt, spec_tokens=1, **kw)
        self.ids, self.spare = {}, {}  # by cache: the live slots, one allocated spare slot
        for c in (self.sep, self.pend):
            ids = c.allocate(3)
            c.prefill_init(0.1 * torch.randn(3, H, 64, 128, generator=g).to(device), ids)
            self.ids[c], self.spare[c] = ids, c.allocate(1)
        for _ in range(17):
            x, dt, B, C = self.token(3)
            self.sep.decode(x, dt, self.A, B, C, self.D, self.dt_bias, self.ids[self.sep])
        for _ in range(3):
            x, dt, B, C = self.token(3, 2)
            acc = torch.tensor([2, 1, 0], device=device)
            self.pend.decode(x, dt, self.A, B, C, self.D, self.dt_bias, self.ids[self.pend], num_accepted_tokens=acc)
        self.gen = g

    def token(self, b: int, T: int | None = None):
        g = torch.Generator().manual_seed(b)
        lead = (b,) if T is None else (b, T)
        x = torch.randn(*lead, H, 64, generator=g).bfloat16()
        dt = torch.randn(*lead, H, generator=g)
        B = torch.randn(*lead, G, 128, generator=g).bfloat16()
        C = torch.randn(*lead, G, 128, generator=g).bfloat16()
        return tuple(t.to(self.device) for t in (x, dt, B, C))

    def decode(self, **change):
        """The call of a separate-mode decode of the live slots with `change` applied."""
        x, dt, B, C = self.token(3)
        args = dict(x=x, dt=dt, A=self.A, B=B, C=C, D=self.D, dt_bias=self.dt_bias, slots=self.ids[self.sep])
        args.update(change)
        return lambda: self.sep.decode(*args.values())

    def decode_fn(self, **change):
        """The functional API's decode of the separate cache's tuple."""
        x, dt, B, C = self.token(3)
        out = torch.empty(3, H, 64, dtype=torch.bfloat16, device=self.device)
        args = dict(x=x, dt=dt, A=self.A, B=B, C=C, D=self.D, dt_bias=self.dt_bias, state_indices=self.ids[self.sep], out=out)
        args.update(change)
        return lambda: selective_state_update_replayssm(
            self.sep.tensors, *args.values(), state_dtype=self.fmt, backend=self.backend
        )

    def import_(self, cache: ReplaySSMCache, **change):
        data = cache.export(self.ids[cache][:1])
        for k, v in change.items():
            data[k] = v(data[k])
        return lambda: cache.import_(data, self.spare[cache])


def _set(value):
    return lambda t: torch.full_like(t, value)


# (id, probe, exception, message regex, REPLAYSSM_DEBUG value, formats it applies to)
PROBES = [
    # data lost by a failing import
    ("import-meta-positions", lambda w: w.import_(w.sep, positions=lambda t: torch.empty_like(t, device="meta")),
     ValueError, r"data\['positions'\] must be on the host", None, None),
    ("import-negative-positions", lambda w: w.import_(w.sep, positions=_set(-5)),
     ValueError, r"data\['positions'\] must hold token counts >= 0", None, None),
    ("import-pending-count", lambda w: w.import_(w.pend, positions=lambda t: torch.stack([t[:, 0], t[:, 1] + 7], 1)),
     ValueError, r"data\['positions'\]\[:, 1\]", None, None),
    ("import-parity", lambda w: w.import_(w.sep, parity=_set(7)), ValueError, r"data\['parity'\] must be 0 or 1", None, ("nvfp4",)),
    ("import-dtype", lambda w: w.import_(w.sep, checkpoint=lambda t: t.float()), DTypeError, r"data\['checkpoint'\]", None, None),
    # silently reinterpreted shapes, single-token mode (both entries)
    ("x-transposed", lambda w: w.decode(x=w.token(3)[0].transpose(1, 2)), ValueError, r"^x must be", None, None),
    ("x-regrouped", lambda w: w.decode(x=w.token(3)[0].reshape(3, 2, 512)), ValueError, r"^x must be", None, None),
    ("B-transposed", lambda w: w.decode(B=w.token(3)[2].transpose(1, 2)), ValueError, r"^B must be", None, None),
    ("C-regrouped", lambda w: w.decode(C=w.token(3)[3].reshape(3, 4, 64)), ValueError, r"^C must be", None, None),
    ("D-cube", lambda w: w.decode(D=torch.ones(H, 8, 8, device=w.device)), ValueError, r"^D must be", None, None),
    ("out-transposed", lambda w: w.decode(out=torch.empty(3, 64, H, dtype=torch.bfloat16, device=w.device)),
     ValueError, r"^out must be", None, None),
    ("fn-x-transposed", lambda w: w.decode_fn(x=w.token(3)[0].transpose(1, 2)), ValueError, r"^x must be", None, None),
    ("fn-out-transposed", lambda w: w.decode_fn(out=torch.empty(3, 64, H, dtype=torch.bfloat16, device=w.device)),
     ValueError, r"^out must be", None, None),
    ("fn-D-cube", lambda w: w.decode_fn(D=torch.ones(H, 8, 8, device=w.device)), ValueError, r"^D must be", None, None),
    # checks that differed by entry
    ("accept-unallocated", lambda w: (lambda: w.pend.accept([5], torch.tensor([1], device=w.device))),
     ValueError, r"^slots must be allocated", "1", None),
    ("materialize-untied-A", lambda w: (lambda: w.sep.materialize(w.ids[w.sep], torch.randn(H, 64, device=w.device))),
     ValueError, r"^A must hold one value per head", None, None),
    ("materialize-int-A", lambda w: (lambda: w.sep.materialize(w.ids[w.sep], torch.ones(H, dtype=torch.int32, device=w.device))),
     DTypeError, r"^A must be a floating-point tensor", None, None),
    ("materialize-positive-A", lambda w: (lambda: w.sep.materialize(w.ids[w.sep], -w.A)), ValueError, r"^A must be finite and <= 0", "1", None),
    ("decode-positive-A", lambda w: w.decode(A=-w.A), ValueError, r"^A must be finite and <= 0", "1", None),
    ("decode-float-slots", lambda w: w.decode(slots=w.ids[w.sep].float()), DTypeError, r"^slots must be int32", None, None),
    ("prefill-float-slots", lambda w: (lambda: w.sep.prefill_init(torch.zeros(3, H, 64, 128, device=w.device), w.ids[w.sep].float())),
     DTypeError, r"^slots must be int32", None, None),
    ("verdict-above-max", lambda w: _pending(w, torch.tensor([3, 0, 1], device=w.device)),
     ValueError, r"^num_accepted_tokens must be in 0\.\.max_seqlen=2", "1", None),
    ("verdict-negative", lambda w: _pending(w, torch.tensor([0, -1, 1], device=w.device)),
     ValueError, r"^num_accepted_tokens must be in 0\.\.max_seqlen=2", "1", None),
    ("verdict-float", lambda w: _pending(w, torch.tensor([0.0, 1.0, 1.0], device=w.device)),
     DTypeError, r"^num_accepted_tokens must be int32", None, None),
    # ids in a list cast to another slot (1.5 and True to 1), or on the meta device
    ("release-float-ids", lambda w: (lambda: w.sep.release([1.5])), TypeError, r"^slots must hold ints", None, None),
    ("decode-bool-ids", lambda w: w.decode(slots=[True] + w.ids[w.sep][1:].tolist()), TypeError, r"^slots must hold ints", None, None),
    ("copy-float-ids", lambda w: (lambda: w.sep.copy_slots([1.5], w.spare[w.sep])), TypeError, r"^src must hold ints", None, None),
    ("release-meta-ids", lambda w: (lambda: w.sep.release(torch.ones(1, dtype=torch.int32, device="meta"))),
     ValueError, r"^slots must be on the cache device", None, None),
    ("prefill-count", lambda w: (lambda: w.sep.prefill_init(torch.zeros(2, H, 64, 128, device=w.device), w.ids[w.sep])),
     ValueError, r"^slots must hold one slot per state", None, None),
    ("fork-zero", lambda w: (lambda: w.sep.fork(w.ids[w.sep][:1], 0)), ValueError, r"^n must be >= 1", None, None),
    ("fork-float", lambda w: (lambda: w.sep.fork(w.ids[w.sep][:1], 1.0)), TypeError, r"^n must be a Python int", None, None),
    ("copy-unallocated", lambda w: (lambda: w.sep.copy_slots([1], [5])), ValueError, r"^dst must be allocated", None, None),
    ("snapshot-positive-A", lambda w: (lambda: w.sep.snapshot(w.ids[w.sep][:1], w.spare[w.sep], -w.A)),
     ValueError, r"^A must be finite and <= 0", "1", None),
    # junk $REPLAYSSM_DEBUG: an error for every entry
    ("debug-allocate", lambda w: (lambda: w.sep.allocate(1)), ValueError, r"REPLAYSSM_DEBUG", "yes", None),
    ("debug-release", lambda w: (lambda: w.sep.release(w.spare[w.sep])), ValueError, r"REPLAYSSM_DEBUG", "yes", None),
    ("debug-materialize", lambda w: (lambda: w.sep.materialize(w.ids[w.sep], w.A)), ValueError, r"REPLAYSSM_DEBUG", "yes", None),
    ("debug-export", lambda w: (lambda: w.sep.export(w.ids[w.sep])), ValueError, r"REPLAYSSM_DEBUG", "yes", None),
    ("debug-import", lambda w: w.import_(w.sep), ValueError, r"REPLAYSSM_DEBUG", "yes", None),
    ("debug-decode", lambda w: w.decode(), ValueError, r"REPLAYSSM_DEBUG", "yes", None),
]


def _pending(w: World, acc: torch.Tensor):
    x, dt, B, C = w.token(3, 2)
    return lambda: w.pend.decode(x, dt, w.A, B, C, w.D, w.dt_bias, w.ids[w.pend], num_accepted_tokens=acc)


def _state(w: World):
    return {
        id(c): ([t.clone() for t in c.tensors], c.allocator.num_used, sorted(c.allocator._used))
        for c in (w.sep, w.pend)
    }


def _assert_unchanged(w: World, before) -> None:
    for c in (w.sep, w.pend):
        tensors, used, ids = before[id(c)]
        for i, (a, b) in enumerate(zip(tensors, c.tensors)):
            assert same_bits(a, b), f"cache[{i}] changed"
        assert (c.allocator.num_used, sorted(c.allocator._used)) == (used, ids)


PLACES = [
    pytest.param(("cpu", "reference"), id="reference"),
    pytest.param(("cpu", "kernels"), id="interpreter"),
    pytest.param(("cuda", "kernels"), id="gpu", marks=pytest.mark.gpu),
]
_WORLDS: dict = {}


@pytest.fixture(params=PLACES)
def place(request):
    return request.param


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("name,probe,exc,match,debug,formats", [pytest.param(*p, id=p[0]) for p in PROBES])
def test_probe_raises_and_changes_nothing(place, fmt, name, probe, exc, match, debug, formats, monkeypatch):
    if formats is not None and fmt not in formats:
        pytest.skip(f"{name} applies to {formats}")
    device, backend = place
    key = (device, backend, fmt)
    if key not in _WORLDS:
        _WORLDS[key] = World(fmt, device, backend)
    w = _WORLDS[key]
    call = probe(w)
    before = _state(w)
    if debug is not None:
        monkeypatch.setenv(DEBUG_ENV, debug)
    with pytest.raises(exc, match=match) as err:
        call()
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert issubclass(err.type, exc)
    _assert_unchanged(w, before)


CONSTRUCTORS = [
    ("conv-shape-negative", lambda: ReplaySSMCache(4, H, G, "fp8", "cpu", conv_state_shape=(-1, 4)), ValueError, r"^conv_state_shape"),
    ("conv-dtype-str", lambda: ReplaySSMCache(4, H, G, "fp8", "cpu", conv_state_dtype="bf16"), TypeError, r"^conv_state_dtype"),
    ("slot-padding-negative", lambda: ReplaySSMCache(4, H, G, "fp8", "cpu", slot_padding=-16), ValueError, r"^slot_padding"),
    ("alloc-negative-slots", lambda: allocate_cache(-1, H, G, "fp8"), ValueError, r"^num_slots must be positive"),
    ("alloc-bad-ratio", lambda: allocate_cache(8, 12, 5, "fp8"), ValueError, r"^heads must be a multiple of groups"),
    ("alloc-float-heads", lambda: allocate_cache(8, 16.0, 2, "fp8"), TypeError, r"^num_heads must be an int"),
    ("alloc-padding-negative", lambda: allocate_cache(8, H, G, "fp8", slot_padding=-16), ValueError, r"^slot_padding"),
    ("cache-debug-junk", lambda: ReplaySSMCache(4, H, G, "fp8", "cpu"), ValueError, r"REPLAYSSM_DEBUG"),
]


@pytest.mark.parametrize("name,make,exc,match", [pytest.param(*c, id=c[0]) for c in CONSTRUCTORS])
def test_constructor_rejects_bad_arguments(name, make, exc, match, monkeypatch):
    if name == "cache-debug-junk":
        monkeypatch.setenv(DEBUG_ENV, "on")
    with pytest.raises(exc, match=match):
        make()


def test_verdicts_outside_the_window_are_clamped_without_debug():
    """Without REPLAYSSM_DEBUG a verdict outside 0..max_seqlen is clamped to 0..q (the
    pending count), as README and docs/format.md section 5b say: the same bits as the
    clamped verdict."""
    a, b = World("fp8", "cpu", "reference"), World("fp8", "cpu", "reference")
    x, dt, B, C = a.token(3, 2)
    a.pend.decode(x, dt, a.A, B, C, a.D, a.dt_bias, a.ids[a.pend], num_accepted_tokens=torch.tensor([9, -4, 2]))
    b.pend.decode(x, dt, b.A, B, C, b.D, b.dt_bias, b.ids[b.pend], num_accepted_tokens=torch.tensor([2, 0, 2]))
    for i, (s, t) in enumerate(zip(a.pend.tensors, b.pend.tensors)):
        assert same_bits(s, t), f"cache[{i}] differs"
    assert L.POSITIONS == -1 and a.pend.positions.tolist() == b.pend.positions.tolist()
