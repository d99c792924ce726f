"""A digest of what a fixed workload writes (GPU only): run it from two checkouts on the
same GPU to show that a change keeps every output and cache byte (an A/B of two trees).

Per format (FP8, NVFP4), on the kernel backend with engine-shaped inputs and a padding
row: `prefill_init` of 24 slots, 34 single-token steps of batch 24 (two flushes a row),
then, on a pending-mode cache (3 draft tokens), 12 calls with random verdicts. Prints one
SHA-256 a format over the outputs and every cache tensor's bytes after the workload.

    python benchmarks/bits_digest.py            # in each tree; equal lines: equal bits
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402

from replayssm import ReplaySSMCache  # noqa: E402
from replayssm.synthetic import engine_inputs, layer_params, prefill_states, token  # noqa: E402

HEADS, GROUPS, BATCH, T = 16, 2, 24, 4


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


def digest(fmt: str) -> str:
    h = hashlib.sha256()
    gen = torch.Generator().manual_seed(11)
    params = layer_params(HEADS, generator=gen, device="cuda")
    states = prefill_states(params, BATCH, GROUPS, 8, generator=gen, device="cuda")
    for spec in (0, T - 1):
        cache = ReplaySSMCache(BATCH + 8, HEADS, GROUPS, fmt, "cuda", backend="kernels", seed=5, spec_tokens=spec)
        slots = cache.allocate(BATCH)
        cache.prefill_init(states, slots)
        slots = slots.clone()
        slots[3] = 0  # a padding row
        acc = None
        for _ in range(34 if spec == 0 else 12):
            tokens = BATCH if spec == 0 else BATCH * T
            x, dt, A, B, C, D, dt_bias = engine_inputs(token(tokens, HEADS, GROUPS, generator=gen, device="cuda"), params)
            if spec == 0:
                out = torch.empty(BATCH, HEADS, 64, dtype=torch.bfloat16, device="cuda")
                cache.decode(x, dt, A, B, C, D, dt_bias, slots, out=out)
            else:
                rows = (BATCH, T)
                out = torch.empty(BATCH, T, HEADS, 64, dtype=torch.bfloat16, device="cuda")
                cache.decode(x.unflatten(0, rows), dt.unflatten(0, rows), A, B.unflatten(0, rows), C.unflatten(0, rows), D,
                             dt_bias, slots, out=out, num_accepted_tokens=acc)  # fmt: skip
                acc = torch.randint(0, T + 1, (BATCH,), generator=gen, dtype=torch.int32).cuda()
            h.update(_bytes(out))
        for t in cache.tensors:
            h.update(_bytes(t))
    return h.hexdigest()


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bits_digest needs a CUDA GPU")
    for fmt in ("fp8", "nvfp4"):
        print(f"{fmt} {digest(fmt)}")


if __name__ == "__main__":
    main()
