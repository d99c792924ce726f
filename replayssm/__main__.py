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
from typing import TextIO

import torch

from . import layout as L
from .cache import ReplaySSMCache
from .synthetic import ExactRecurrence, layer_params, prefill_states, sqnr_db, token


def state_bytes_per_token(state_dtype: str, heads: int) -> float:
    """State bytes moved per token per layer, averaged over a 16-token period (design
    brief section 6): 15 non-flush steps read the read copy and its scales; the flush
    reads and writes the FP16 checkpoint and writes the read copy and scales (fp16: every
    step reads the checkpoint, the flush writes it). Ring bytes are not included (they are
    inputs, ~150 bytes per head per live entry)."""
    n = L.HEAD_DIM * L.STATE_DIM
    if state_dtype == "fp8":
        copy = n + L.HEAD_DIM * 4  # e4m3 codes + one fp32 scale per row
    elif state_dtype == "nvfp4":
        copy = n // 2 + n // L.NVFP4_BLOCK  # e2m1 codes + e4m3 block scales
    else:  # fp16: 15 steps read the checkpoint, the flush reads and writes it
        return heads * (15 * 2 * n + 2 * n * 2) / 16
    flush = 2 * n * 2 + copy
    return heads * (15 * copy + flush) / 16


def standard_bytes_per_token(itemsize: int, heads: int) -> int:
    """Standard decode reads and writes the whole state every token."""
    return heads * L.HEAD_DIM * L.STATE_DIM * itemsize * 2


class _Progress:
    """Progress of the demo on `stream` (stderr). Rates are tokens/s, the table's unit:
    batch rows x decode steps a second. `mode`: "bar" redraws one line (a terminal),
    "lines" writes a plain line at each tenth of the decode (pipes, CI logs), None is silent."""

    def __init__(self, stream: TextIO, mode: str | None):
        self.stream, self.mode = stream, mode

    def note(self, text: str) -> None:
        if self.mode is not None:
            self.stream.write(text + "\n")
            self.stream.flush()

    def start(self, label: str, total: int, batch: int) -> None:
        self.label, self.total, self.batch = label, total, batch
        self.every = max(1, total // (50 if self.mode == "bar" else 10))
        self.t0 = time.perf_counter()

    def update(self, done: int) -> None:
        if self.mode is None or (done % self.every and done != self.total):
            return
        rate = done * self.batch / max(time.perf_counter() - self.t0, 1e-9)
        if self.mode == "bar":
            width = 30
            fill = int(width * done / self.total)
            bar = f"[{'#' * fill}{'.' * (width - fill)}]"
            self.stream.write(f"\r{self.label} {bar} {done}/{self.total} steps {rate:9.1f} tokens/s")
            if done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"{self.label}: {done}/{self.total} steps, {rate:.1f} tokens/s\n")
        self.stream.flush()


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
    out: TextIO | None = None,
) -> list[dict]:
    """Run the demo and print its table on `out` (stdout). `progress`: None writes progress
    to stderr (a bar on a terminal, plain lines elsewhere), False nothing, True lines
    even on a terminal. Returns one dict per format; `tokens_per_s` is
    batch * steps / `elapsed_s`, the wall time of the decode loop alone."""
    out = sys.stdout if out is None else out
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if progress is False:
        mode = None
    elif progress is None and sys.stderr.isatty():
        mode = "bar"
    else:
        mode = "lines"
    bar = _Progress(sys.stderr, mode)
    results = []
    print(
        f"replayssm demo: {heads} heads, {groups} groups, batch {batch}, {steps} tokens, device {dev}",
        file=out,
        flush=True,  # a pipe reader sees it now, not when the demo ends
    )
    for fmt in formats:
        bar.note(f"{fmt}: prefill states ({prompt} prompt tokens), cache init and warmup")
        gen = torch.Generator().manual_seed(seed)
        params = layer_params(heads, generator=gen, device=dev)
        # The CPU has no kernels: name the reference there (no fallback warning).
        cache = ReplaySSMCache(batch + 1, heads, groups, fmt, dev, seed=seed, backend="reference" if dev.type == "cpu" else "auto")
        slots = cache.allocate(batch)
        states = prefill_states(params, batch, groups, prompt, generator=gen, device=dev)
        cache.prefill_init(states, slots)
        cache.warmup()  # compile every kernel first: tokens/s measures decoding, not compiling
        exact = ExactRecurrence(params, states)
        tokens = [token(batch, heads, groups, generator=gen, device=dev) for _ in range(steps)]
        out_buf = torch.empty(steps, batch, heads, L.HEAD_DIM, dtype=torch.bfloat16, device=dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        bar.start(fmt, steps, batch)
        t0 = time.perf_counter()
        for i, tok in enumerate(tokens):
            cache.decode(tok.x, tok.dt, params.A, tok.B, tok.C, params.D, params.dt_bias, slots, out=out_buf[i])
            bar.update(i + 1)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        rate = steps * batch / elapsed
        bar.note(f"{fmt}: {steps} steps x batch {batch} decoded in {elapsed:.2f} s: {rate:.1f} tokens/s")
        bar.note(f"{fmt}: the exact FP64 recurrence, for the SQNR")
        ref = torch.stack([exact.step(tok) for tok in tokens])
        half = steps // 2  # the halves show drift; a 1-step demo has none
        r = {
            "format": fmt,
            "backend": cache.backend_name,
            "elapsed_s": elapsed,
            "tokens_per_s": rate,
            "sqnr_db": sqnr_db(ref, out_buf),
            "sqnr_first_half_db": sqnr_db(ref[:half], out_buf[:half]) if half else None,
            "sqnr_second_half_db": sqnr_db(ref[half:], out_buf[half:]) if half else None,
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
        if r["sqnr_first_half_db"] is None:
            halves = f"{'-':>6}/{'-':<6}"
        else:
            halves = f"{r['sqnr_first_half_db']:>6.2f}/{r['sqnr_second_half_db']:<6.2f}"
        print(
            f"{r['format']:>6} {r['backend']:>16} {r['tokens_per_s']:>10.0f} {r['sqnr_db']:>8.2f} "
            f"{halves} "
            f"{r['state_bytes_per_token']:>13.0f} "
            f"{r['standard_bf16_bytes_per_token'] / r['state_bytes_per_token']:>7.2f}x "
            f"{r['standard_fp32_bytes_per_token'] / r['state_bytes_per_token']:>7.2f}x",
            file=out,
        )
    print(
        "tokens/s: batch rows x decode steps a second, one layer; SQNR: decode outputs vs an exact "
        "FP64 recurrence (over all steps, and over the first and second half); state B/token: state "
        "bytes moved per token per layer over a 16-token period (standard decode reads and writes "
        "the whole state).",
        file=out,
        flush=True,
    )
    return results


SEED_LIMIT = 1 << 64  # the cache takes its seed mod 2**64 (quant/rng.py); torch.Generator too


def _int_at_least(low: int, high: int | None = None, high_text: str | None = None):
    """An argparse type: a decimal int in [low, high)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer; got {text!r}") from None
        if value < low or (high is not None and value >= high):
            bound = f">= {low}" if high is None else f"in [{low}, {high_text or high})"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}; got {value}")
        return value

    return parse


def _device(text: str) -> str:
    """An argparse type: auto, cpu, or cuda[:N] naming a GPU this machine has."""
    if text == "auto":
        return text
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected auto, cpu or cuda[:N]; got {text!r}") from None
    if dev.type == "cpu":
        return text
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(f"expected auto, cpu or cuda[:N]; got {text!r} (the demo runs on CPU or CUDA)")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA GPU is available here; use cpu or auto")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA GPU(s), cuda:0 .. cuda:{count - 1}")
    return text


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="python -m replayssm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="decode a synthetic Mamba-2 layer and report speed and accuracy",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument(
        "--device", type=_device, default="auto", help="auto (cuda when a GPU is present, else cpu), cpu or cuda[:N]"
    )
    demo.add_argument("--format", default="both", choices=["fp8", "nvfp4", "fp16", "both"],
                      help="read-copy format (both: fp8 and nvfp4; fp16: no read copy)")
    demo.add_argument("--batch", type=_int_at_least(1), default=8, help="requests decoded together")
    demo.add_argument(
        "--steps", type=_int_at_least(1), default=256, help="tokens decoded per request; every 16th is a flush"
    )
    demo.add_argument("--heads", type=_int_at_least(1), default=16, help="SSM heads of the layer")
    demo.add_argument("--groups", type=_int_at_least(1), default=2, help="B/C groups (1 to 128 heads per group)")
    demo.add_argument(
        "--prompt", type=_int_at_least(0), default=64, help="prefill tokens that build each request's state"
    )
    demo.add_argument(
        "--seed",
        type=_int_at_least(0, SEED_LIMIT, "2**64"),
        default=0,
        help="seed of the data and of the stochastic rounding",
    )
    demo.add_argument(
        "--threads",
        type=_int_at_least(1),
        default=1,
        help="torch CPU threads (on a 2-core CPU two threads ran the demo 1.25x faster on idle cores and 3-4x "
        "slower on busy ones)",
    )
    demo.add_argument("--no-progress", action="store_true", help="print no progress on stderr")
    return parser, demo


def main(argv=None) -> int:
    parser, demo = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        # Every option is checked here, before anything is printed.
        if L.group_error(args.heads, args.groups):
            demo.error(f"--heads {args.heads} --groups {args.groups}: {L.group_error(args.heads, args.groups)}")
        formats = ("fp8", "nvfp4") if args.format == "both" else (args.format,)
        try:
            _run_cli_demo(args, formats)
        except (ValueError, TypeError) as exc:
            demo.error(str(exc))
    return 0


def _run_cli_demo(args, formats) -> None:
    torch.set_num_threads(args.threads)
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
