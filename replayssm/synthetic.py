"""Synthetic but realistic Mamba-2 layer data and the exact FP64 recurrence. Ranges follow
Mamba-2's initialization: A = -exp(U(log 1, log 16)) per head, dt_bias = softplus^-1(dt0)
with dt0 log-uniform in [0.001, 0.1], D = 1, the raw dt a small Gaussian around 0. Prefill
states are the exact recurrence over a random prompt: the magnitudes a real prefill makes.
"""

from __future__ import annotations

import attrs
import torch

from .layout import HEAD_DIM, STATE_DIM


@attrs.frozen
class LayerParams:
    A: torch.Tensor  # [H] float32, negative
    D: torch.Tensor  # [H] float32
    dt_bias: torch.Tensor  # [H] float32


@attrs.frozen
class Token:
    x: torch.Tensor  # [b, H, P] bf16
    dt: torch.Tensor  # [b, H] float32 (raw, before softplus)
    B: torch.Tensor  # [b, G, N] bf16
    C: torch.Tensor  # [b, G, N] bf16


def layer_params(heads: int, *, generator: torch.Generator, device="cpu") -> LayerParams:
    A = -torch.exp(torch.rand(heads, generator=generator) * torch.log(torch.tensor(16.0)))
    lo, hi = torch.log(torch.tensor(1e-3)), torch.log(torch.tensor(0.1))
    dt0 = torch.exp(torch.rand(heads, generator=generator) * (hi - lo) + lo)
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # softplus^-1(dt0)
    return LayerParams(A.to(device), torch.ones(heads, device=device), dt_bias.to(device))


def token(
    batch: int, heads: int, groups: int, *, generator: torch.Generator, device="cpu", head_dim: int = HEAD_DIM,
    state_dim: int = STATE_DIM,
) -> Token:
    g, bf16 = generator, torch.bfloat16
    x = torch.randn(batch, heads, head_dim, generator=g).to(device, bf16)
    dt = 0.5 * torch.randn(batch, heads, generator=g)
    B, C = (torch.randn(batch, groups, state_dim, generator=g).to(device, bf16) for _ in range(2))
    return Token(x, dt.to(device), B, C)


def engine_inputs(tok: Token, params: LayerParams) -> tuple[torch.Tensor, ...]:
    """One step's (x, dt, A, B, C, D, dt_bias) shaped as a serving engine's Mamba-2 mixer
    passes them: x, B, C column slices of one projection row [z | x | B | C | dt] (row
    stride = its width), dt in bf16 [b, H, P] tied over the head dim (stride 0), A fp32
    [H, P, N] with strides (1, 0, 0), D and dt_bias [H, P] tied. dt holds `tok.dt`
    rounded to bf16; everything else holds `tok`'s and `params`' values exactly."""
    b, heads = tok.dt.shape
    P, N = tok.x.shape[2], tok.B.shape[2]
    # z (the gate applied after the norm: not read) | x | B | C | dt
    parts = [tok.x.new_zeros(b, heads * P), *(t.reshape(b, -1) for t in (tok.x, tok.B, tok.C)), tok.dt]
    proj = torch.cat([p.to(torch.bfloat16) for p in parts], dim=1)
    _, x, B, C, dt = proj.split([p.shape[1] for p in parts], dim=1)
    A = params.A.view(heads, 1, 1).expand(heads, P, N)
    D = params.D.view(heads, 1).expand(heads, P)
    dt_bias = params.dt_bias.view(heads, 1).expand(heads, P)
    return x, dt.unsqueeze(-1).expand(b, heads, P), A, B, C, D, dt_bias


def plain_inputs(tok: Token, params: LayerParams) -> tuple[torch.Tensor, ...]:
    """The values of `engine_inputs(tok, params)` as contiguous tensors, dt in FP32
    (bf16 -> FP32 is exact, so both give the same bits)."""
    return (tok.x.contiguous(), tok.dt.to(torch.bfloat16).float(), params.A, tok.B.contiguous(), tok.C.contiguous(), params.D, params.dt_bias)


class ExactRecurrence:
    """The Mamba-2 recurrence in FP64 (no quantization anywhere): the ground truth."""

    def __init__(self, params: LayerParams, state: torch.Tensor):
        self.p = params
        self.S = state.double().clone()

    def step(self, tok: Token) -> torch.Tensor:
        heads, groups = self.S.shape[1], tok.B.shape[1]
        dt = torch.nn.functional.softplus(tok.dt.double() + self.p.dt_bias.double().to(tok.dt.device))
        a = torch.exp(self.p.A.double().to(dt.device) * dt)
        Bh, Ch = (t.double().repeat_interleave(heads // groups, 1) for t in (tok.B, tok.C))
        x = tok.x.double()
        self.S = a[:, :, None, None] * self.S + (dt[:, :, None] * x)[:, :, :, None] * Bh[:, :, None, :]
        return torch.einsum("bhpn,bhn->bhp", self.S, Ch) + self.p.D.double().to(x.device)[None, :, None] * x


def prefill_states(
    params: LayerParams, batch: int, groups: int, prompt_len: int, *, generator: torch.Generator, device="cpu",
    head_dim: int = HEAD_DIM, state_dim: int = STATE_DIM,
) -> torch.Tensor:
    """FP32 states [batch, H, head_dim, state_dim] after an exact recurrence over
    `prompt_len` random tokens from zero."""
    heads = params.A.shape[0]
    rec = ExactRecurrence(params, torch.zeros(batch, heads, head_dim, state_dim, dtype=torch.float64, device=device))
    for _ in range(prompt_len):
        rec.step(token(batch, heads, groups, generator=generator, device=device, head_dim=head_dim, state_dim=state_dim))
    return rec.S.float()


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - approx|^2) in dB."""
    ref = reference.double()
    err = (approx.double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / err.clamp_min(1e-300)))
