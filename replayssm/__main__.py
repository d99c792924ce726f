"""Command line: `python -m replayssm demo` (the main job).

The demo builds one Mamba-2-shaped layer cache, prefills a batch of requests with
realistic states, decodes N tokens on the best available backend (GPU kernels when a GPU
is present, the PyTorch reference on the CPU) and reports tokens/s, output SQNR against
an exact FP64 recurrence, and state bytes per token against standard decoding.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import layout as L
from .cache import ReplaySSMCache
from .kernels import backend_for
from .synthetic import ExactRecurrence, layer_params, prefill_states, sqnr_db, token


def state_bytes_per_token(state_dtype: str, heads: int) -> float:
    """State bytes moved per token per layer, averaged over a 16-token period (design
    brief section 6): 15 non-flush steps read the read copy and its scales; the flush
    reads and writes the FP16 checkpoint and writes the read copy and scales. Ring bytes
    are not included (they are inputs, ~150 bytes per head per live entry)."""
    n = L.HEAD_DIM * L.STATE_DIM
    if state_dtype == "fp8":
        copy = n + L.HEAD_DIM * 4  # e4m3 codes + one fp32 scale per row
    else:
        copy = n // 2 + n // L.NVFP4_BLOCK  # e2m1 codes + e4m3 block scales
    flush = 2 * n * 2 + copy
    return heads * (15 * copy + flush) / 16


def standard_bytes_per_token(itemsize: int, heads: int) -> int:
    """Standard decode reads and writes the whole state every token."""
    return heads * L.HEAD_DIM * L.STATE_DIM * itemsize * 2


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal or forced)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled
        self.t0 = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled or (done % max(1, self.total // 50) and done != self.total):
            return
        width = 30
        fill = int(width * done / self.total)
        rate = done / max(time.perf_counter() - self.t0, 1e-9)
        sys.stderr.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {rate:7.1f} step/s")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_demo(
    *,
    device: str = "auto",
    formats=("fp8", "nvfp4"),
    batch: int = 8,
    steps: int = 256,
    heads: int = 16,
    groups: int = 2,
    prompt: int = 64,
    seed: int = 0,
    progress: bool | None = None,
    out=sys.stdout,
) -> list[dict]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if progress is None:
        progress = sys.stderr.isatty() and steps >= 64
    results = []
    print(f"replayssm demo: {heads} heads, {groups} groups, batch {batch}, {steps} tokens, device {dev}", file=out)
    for fmt in formats:
        gen = torch.Generator().manual_seed(seed)
        params = layer_params(heads, generator=gen, device=dev)
        cache = ReplaySSMCache(batch + 1, heads, groups, fmt, dev, seed=seed)
        slots = cache.allocate(batch)
        states = prefill_states(params, batch, groups, prompt, generator=gen, device=dev)
        cache.prefill_init(states, slots)
        cache.warmup()  # compile every kernel first: tokens/s measures decoding, not compiling
        exact = ExactRecurrence(params, states)
        tokens = [token(batch, heads, groups, generator=gen, device=dev) for _ in range(steps)]
        out_buf = torch.empty(steps, batch, heads, L.HEAD_DIM, dtype=torch.bfloat16, device=dev)
        bar = _Progress(steps, f"{fmt:>5}", progress)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, tok in enumerate(tokens):
            cache.decode(tok.x, tok.dt, params.A, tok.B, tok.C, params.D, params.dt_bias, slots, out=out_buf[i])
            bar.update(i + 1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        ref = torch.stack([exact.step(tok) for tok in tokens])
        r = {
            "format": fmt,
            "backend": type(backend_for(dev)).__name__,
            "tokens_per_s": steps * batch / elapsed,
            "sqnr_db": sqnr_db(ref, out_buf),
            "sqnr_first_half_db": sqnr_db(ref[: steps // 2], out_buf[: steps // 2]),
            "sqnr_second_half_db": sqnr_db(ref[steps // 2 :], out_buf[steps // 2 :]),
            "state_bytes_per_token": state_bytes_per_token(fmt, heads),
            "standard_bf16_bytes_per_token": standard_bytes_per_token(2, heads),
            "standard_fp32_bytes_per_token": standard_bytes_per_token(4, heads),
            "cache_bytes_per_slot": cache.bytes_per_slot(),
        }
        results.append(r)
    print(
        f"{'format':>6} {'backend':>16} {'tokens/s':>10} {'SQNR dB':>8} {'1st/2nd half':>13} "
        f"{'state B/token':>13} {'vs bf16':>8} {'vs fp32':>8}",
        file=out,
    )
    for r in results:
        print(
            f"{r['format']:>6} {r['backend']:>16} {r['tokens_per_s']:>10.0f} {r['sqnr_db']:>8.2f} "
            f"{r['sqnr_first_half_db']:>6.2f}/{r['sqnr_second_half_db']:<6.2f} "
            f"{r['state_bytes_per_token']:>13.0f} "
            f"{r['standard_bf16_bytes_per_token'] / r['state_bytes_per_token']:>7.2f}x "
            f"{r['standard_fp32_bytes_per_token'] / r['state_bytes_per_token']:>7.2f}x",
            file=out,
        )
    print(
        "SQNR: decode outputs vs an exact FP64 recurrence; state B/token: state bytes moved per token "
        "per layer over a 16-token period (standard decode reads and writes the whole state).",
        file=out,
    )
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replayssm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="decode a synthetic Mamba-2 layer and report speed and accuracy")
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: auto)")
    demo.add_argument("--format", default="both", choices=["fp8", "nvfp4", "both"])
    demo.add_argument("--batch", type=int, default=8)
    demo.add_argument("--steps", type=int, default=256, help="tokens to decode (default 256 = 16 periods)")
    demo.add_argument("--heads", type=int, default=16)
    demo.add_argument("--groups", type=int, default=2)
    demo.add_argument("--prompt", type=int, default=64, help="prefill length used to build realistic states")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "demo":
        if args.batch < 1 or args.steps < 1:
            parser.error("--batch and --steps must be >= 1")
        formats = ("fp8", "nvfp4") if args.format == "both" else (args.format,)
        try:
            _run_cli_demo(args, formats)
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
    return 0


def _run_cli_demo(args, formats) -> None:
    run_demo(
        device=args.device,
        formats=formats,
        batch=args.batch,
        steps=args.steps,
        heads=args.heads,
        groups=args.groups,
        prompt=args.prompt,
        seed=args.seed,
        progress=False if args.no_progress else None,
    )


if __name__ == "__main__":
    raise SystemExit(main())
