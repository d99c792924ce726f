"""Shared test utilities: a realistic layer driven through the functional API next to the
exact FP64 recurrence."""

from __future__ import annotations

import torch

from replayssm import allocate_cache, initialize_replayssm_state, selective_state_update_replayssm
from replayssm.synthetic import ExactRecurrence, Token, layer_params, prefill_states, token


def snapshot(cache):
    """Bit copies of every cache tensor (NaN-safe comparison through byte views)."""
    return [t.detach().clone() for t in cache]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    # Flat copies with stride 1 (a size-1 view may be "contiguous" with another stride).
    flat = [torch.empty(t.numel(), dtype=t.dtype, device=t.device).copy_(t.reshape(-1)) for t in (a, b)]
    return torch.equal(flat[0].view(torch.uint8), flat[1].view(torch.uint8))


def assert_cache_equal(before, after):
    for i, (a, b) in enumerate(zip(before, after)):
        assert same_bits(a, b), f"cache[{i}] changed"


class Layer:
    """One layer: a cache tuple, realistic parameters, prefilled rows and their exact twin."""

    def __init__(self, fmt, *, heads=16, groups=2, num_slots=10, rows=(1, 2, 3), seed=0, prompt=32, **alloc):
        self.fmt, self.heads, self.groups, self.seed = fmt, heads, groups, seed
        self.gen = torch.Generator().manual_seed(seed)
        self.params = layer_params(heads, generator=self.gen)
        self.cache = allocate_cache(num_slots, heads, groups, fmt, **alloc)
        self.slots = torch.tensor(rows, dtype=torch.int32)
        states = prefill_states(self.params, len(rows), groups, prompt, generator=self.gen)
        initialize_replayssm_state(self.cache, states, self.slots, state_dtype=fmt, seed=seed)
        self.exact = {int(s): ExactRecurrence(self.params, states[i : i + 1]) for i, s in enumerate(rows)}

    def token(self, batch) -> Token:
        return token(batch, self.heads, self.groups, generator=self.gen)

    def step(self, ids, tok: Token | None = None, **inputs):
        """Decode one token for batch rows `ids` (padding allowed); returns (out, exact
        outputs per live row as {row: y}, tok)."""
        ids = torch.as_tensor(ids, dtype=torch.int32)
        tok = tok or self.token(ids.numel())
        p = self.params
        out = torch.empty(ids.numel(), self.heads, 64, dtype=torch.bfloat16)
        args = dict(x=tok.x, dt=tok.dt, A=p.A, B=tok.B, C=tok.C, D=p.D, dt_bias=p.dt_bias)
        args.update(inputs)
        selective_state_update_replayssm(
            self.cache, args["x"], args["dt"], args["A"], args["B"], args["C"], args["D"], args["dt_bias"],
            ids, out, state_dtype=self.fmt, seed=self.seed,
        )
        ref = {}
        for r, s in enumerate(ids.tolist()):
            if s in self.exact:
                sub = Token(tok.x[r : r + 1], tok.dt[r : r + 1], tok.B[r : r + 1], tok.C[r : r + 1])
                ref[r] = self.exact[s].step(sub)[0]
        return out, ref, tok
