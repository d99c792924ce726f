"""Output accuracy against the exact FP64 recurrence, per format and geometry (GPU: the
kernels; CPU: the reference, slowly).

For each shape HxG (head dim 64, state dim 128) or HxGxPxN and format: `--batch` rows prefilled from the exact recurrence (16
tokens), then `--tokens` tokens a row through
- single-token decode (`ReplaySSMCache.decode`), every output compared;
- pending mode (`spec_tokens = T - 1`, `--T` tokens a row and call; token 0 always
  accepted, each later draft with probability `--accept`, the verdict passed to the next
  call), the accepted tokens' outputs compared, until `--tokens` are committed;
and, for format "bf16", the standard decode with a bf16 state (benchmarks/standard_decode.py,
single-token only). SQNR (dB) of all compared outputs, of those of the first and of the last
256 tokens (drift: the two within 1 dB). `--out FILE` writes the rows and the run's meta.

    python benchmarks/accuracy.py --shapes 16x2,64x8 --formats bf16,fp8,nvfp4,fp16
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from replayssm import ReplaySSMCache  # noqa: E402
from replayssm.synthetic import ExactRecurrence, Token, layer_params, prefill_states, sqnr_db, token  # noqa: E402

from benchmarks.common import commit, write_json  # noqa: E402

EDGE = 256  # tokens in the first / last window


def _summary(pairs: list[tuple[int, torch.Tensor, torch.Tensor]], tokens: int) -> dict:
    """SQNR of (token index, exact, got) pairs: all, first EDGE tokens, last EDGE tokens."""

    def db(sel):
        return sqnr_db(torch.cat([e for _, e, _ in sel]), torch.cat([g for _, _, g in sel]))

    return {"all": db(pairs), "first": db([p for p in pairs if p[0] < EDGE]), "last": db([p for p in pairs if p[0] >= tokens - EDGE])}


def _dims(args) -> dict:
    """The state geometry of a run: head_dim / state_dim of `args` (64 / 128 when absent)."""
    return {"head_dim": getattr(args, "head_dim", 64), "state_dim": getattr(args, "state_dim", 128)}


def single(fmt: str, heads: int, groups: int, args, device) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    dims = _dims(args)
    p = layer_params(heads, generator=gen, device=device)
    states = prefill_states(p, args.batch, groups, 16, generator=gen, device=device, **dims)
    exact = ExactRecurrence(p, states)
    if fmt == "bf16":
        from benchmarks.standard_decode import standard_decode, standard_decode_ref

        run = standard_decode if device.type == "cuda" else standard_decode_ref
        st = torch.zeros(args.batch + 1, heads, 64, 128, dtype=torch.bfloat16, device=device)
        st[1:] = states.to(torch.bfloat16)
        ids = torch.arange(1, args.batch + 1, dtype=torch.int32, device=device)
        D = p.D[:, None].expand(heads, 64)

        def step(tok):
            return run(st, tok.x, tok.dt, p.A, tok.B, tok.C, D, p.dt_bias, ids)
    else:
        cache = ReplaySSMCache(args.batch + 1, heads, groups, fmt, device, seed=args.seed, backend=args.backend, **dims)
        ids = cache.allocate(args.batch)
        cache.prefill_init(states, ids)

        def step(tok):
            return cache.decode(tok.x, tok.dt, p.A, tok.B, tok.C, p.D, p.dt_bias, ids)

    pairs = []
    for t in range(args.tokens):
        tok = token(args.batch, heads, groups, generator=gen, device=device, **dims)
        pairs.append((t, exact.step(tok).cpu(), step(tok).double().cpu()))
    return _summary(pairs, args.tokens)


def pending(fmt: str, heads: int, groups: int, args, device) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    dims = _dims(args)
    p = layer_params(heads, generator=gen, device=device)
    b, T = args.batch, args.T
    states = prefill_states(p, b, groups, 16, generator=gen, device=device, **dims)
    cache = ReplaySSMCache(b + 1, heads, groups, fmt, device, seed=args.seed, backend=args.backend, spec_tokens=T - 1, **dims)
    ids = cache.allocate(b)
    cache.prefill_init(states, ids)
    base = [ExactRecurrence(p, states[r : r + 1]) for r in range(b)]  # each row's committed exact state
    committed = [0] * b
    drafts: list[list[Token]] = [[] for _ in range(b)]
    acc, pairs = None, []
    while min(committed) < args.tokens:
        if acc is not None:  # the previous call's verdicts commit its accepted tokens
            for r in range(b):
                for tok in drafts[r][: int(acc[r])]:
                    base[r].step(tok)
                committed[r] += int(acc[r])
        tok = token(b * T, heads, groups, generator=gen, device=device, **dims)
        x, dt, B, C = (v.unflatten(0, (b, T)) for v in (tok.x, tok.dt, tok.B, tok.C))
        out = cache.decode(x, dt, p.A, B, C, p.D, p.dt_bias, ids, num_accepted_tokens=acc)
        verdict = []
        for r in range(b):
            a = 1
            while a < T and rng.random() < args.accept:
                a += 1
            verdict.append(a)
            drafts[r] = [Token(x[r, t : t + 1], dt[r, t : t + 1], B[r, t : t + 1], C[r, t : t + 1]) for t in range(T)]
            probe = ExactRecurrence(p, base[r].S)
            for t in range(a):
                if committed[r] + t < args.tokens:
                    pairs.append((committed[r] + t, probe.step(drafts[r][t])[0].cpu(), out[r, t].double().cpu()))
        acc = torch.tensor(verdict, dtype=torch.int32, device=device)
    return _summary(pairs, args.tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16x2,64x8", help="HEADSxGROUPS or HEADSxGROUPSxHEADDIMxSTATEDIM list")
    ap.add_argument("--formats", default="bf16,fp8,nvfp4,fp16")
    ap.add_argument("--modes", default="single,pending")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--accept", type=float, default=0.7)
    ap.add_argument("--backend", default="auto", choices=["auto", "kernels", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    print(f"{'shape':>13} {'format':>6} {'mode':>8} {'all dB':>7} {'first':>7} {'last':>7}")
    for shape in args.shapes.split(","):
        heads, groups, args.head_dim, args.state_dim = (list(map(int, shape.split("x"))) + [64, 128])[:4]
        for fmt in args.formats.split(","):
            for mode in args.modes.split(","):
                if fmt == "bf16" and (mode == "pending" or (args.head_dim, args.state_dim) != (64, 128)):
                    continue
                r = (single if mode == "single" else pending)(fmt, heads, groups, args, device)
                rows.append({"heads": heads, "groups": groups, **_dims(args), "format": fmt, "mode": mode, **r})
                print(f"{shape:>13} {fmt:>6} {mode:>8} {r['all']:7.2f} {r['first']:7.2f} {r['last']:7.2f}", flush=True)
    if args.out:
        meta = {"commit": commit(), "command": " ".join(sys.argv), "device": str(device),
                "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}  # fmt: skip
        write_json({"meta": meta, "rows": rows}, Path(args.out))


if __name__ == "__main__":
    main()
