"""Command line: `python -m replayssm demo` (the main job).

The demo builds one Mamba-2-shaped layer cache, prefills a batch of requests with
realistic states, decodes N tokens on the best available backend (GPU kernels when a GPU
is present, the PyTorch reference on the CPU) and reports tokens/s, output SQNR against
an exact FP64 recurrence, and state bytes per token against standard decoding. The
layer's geometry comes from the options or from a Hugging Face Mamba-2 config.json
(--config); the table's backend column says whether the GPU kernels or the PyTorch
reference ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from . import layout as L
from .cache import ReplaySSMCache
from .synthetic import ExactRecurrence, layer_params, prefill_states, sqnr_db, token


def state_bytes_per_token(state_dtype: str, heads: int, head_dim: int = L.HEAD_DIM, state_dim: int = L.STATE_DIM) -> float:
    """State bytes moved per token per layer over a 16-token period: 15 steps read the read
    copy and its scales; the flush reads and writes the FP16 checkpoint and writes the
    read copy and scales. Ring bytes (inputs) are not included."""
    n = head_dim * state_dim
    if state_dtype not in ("fp8", "nvfp4"):  # fp16: 15 steps read the checkpoint, the flush both ways
        return heads * (15 * 2 * n + 2 * n * 2) / 16
    # e4m3 codes + one fp32 scale per row; e2m1 codes + e4m3 block scales
    copy = n + head_dim * 4 if state_dtype == "fp8" else n // 2 + n // L.NVFP4_BLOCK
    return heads * (15 * copy + 2 * n * 2 + copy) / 16  # the flush: the checkpoint both ways and the copy


def standard_bytes_per_token(itemsize: int, heads: int, head_dim: int = L.HEAD_DIM, state_dim: int = L.STATE_DIM) -> int:
    """Standard decode reads and writes the whole state every token."""
    return heads * head_dim * state_dim * itemsize * 2


class _Progress:
    """Progress on `stream` in tokens/s (the table's unit). `mode`: "bar" redraws one line
    (a terminal), "lines" writes a line at each tenth of the decode (pipes), None nothing."""

    def __init__(self, stream: TextIO, mode: str | None):
        self.stream, self.mode = stream, mode

    def note(self, text: str, end: str = "\n") -> None:
        if self.mode is not None:
            self.stream.write(text + end)
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
            fill = int(30 * done / self.total)
            bar = f"[{'#' * fill}{'.' * (30 - fill)}] {done}/{self.total} steps {rate:9.1f} tokens/s"
            self.note(f"\r{self.label} {bar}", "\n" if done == self.total else "")
        else:
            self.note(f"{self.label}: {done}/{self.total} steps, {rate:.1f} tokens/s")


def run_demo(
    *, device: str = "auto", formats=("fp8", "nvfp4"), batch: int = 8, steps: int = 256, heads: int = 16,
    groups: int = 2, head_dim: int = L.HEAD_DIM, state_dim: int = L.STATE_DIM, prompt: int = 64,
    seed: int = 0, progress: bool | None = None, out: TextIO | None = None,
) -> list[dict]:
    """Run the demo and print its table on `out` (stdout). `progress`: None writes progress
    to stderr (a bar on a terminal, plain lines elsewhere), False nothing, True lines.
    Returns one dict per format; `tokens_per_s` is batch * steps / `elapsed_s`, the wall
    time of the decode loop alone."""
    out = sys.stdout if out is None else out
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    tty = progress is None and sys.stderr.isatty()
    bar = _Progress(sys.stderr, None if progress is False else "bar" if tty else "lines")
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    # The CPU has no kernels: name the reference there (no fallback warning). On a GPU,
    # "auto" takes the kernels; the table's backend column shows which ran.
    backend = "reference" if dev.type == "cpu" else "auto"
    dims, results = {"head_dim": head_dim, "state_dim": state_dim}, []
    print(
        f"replayssm demo: {heads} heads, {groups} groups, head dim {head_dim}, state dim {state_dim}, "
        f"batch {batch}, {steps} tokens, device {dev}",
        file=out, flush=True,  # a pipe reader sees it now, not when the demo ends
    )
    for fmt in formats:
        bar.note(f"{fmt}: prefill states ({prompt} prompt tokens), cache init and warmup")
        gen = torch.Generator().manual_seed(seed)
        params = layer_params(heads, generator=gen, device=dev)
        cache = ReplaySSMCache(batch + 1, heads, groups, fmt, dev, seed=seed, backend=backend, **dims)
        slots = cache.allocate(batch)
        states = prefill_states(params, batch, groups, prompt, generator=gen, device=dev, **dims)
        cache.prefill_init(states, slots)
        cache.warmup()  # compile every kernel first: tokens/s measures decoding, not compiling
        exact = ExactRecurrence(params, states)
        tokens = [token(batch, heads, groups, generator=gen, device=dev, **dims) for _ in range(steps)]
        out_buf = torch.empty(steps, batch, heads, head_dim, dtype=torch.bfloat16, device=dev)
        sync()
        bar.start(fmt, steps, batch)
        t0 = time.perf_counter()
        for i, tok in enumerate(tokens):
            cache.decode(tok.x, tok.dt, params.A, tok.B, tok.C, params.D, params.dt_bias, slots, out=out_buf[i])
            bar.update(i + 1)
        sync()
        elapsed = time.perf_counter() - t0
        rate = steps * batch / elapsed
        bar.note(f"{fmt}: {steps} steps x batch {batch} decoded in {elapsed:.2f} s: {rate:.1f} tokens/s")
        bar.note(f"{fmt}: the exact FP64 recurrence, for the SQNR")
        ref = torch.stack([exact.step(tok) for tok in tokens])
        half = steps // 2  # the halves show drift; a 1-step demo has none
        results.append({
            "format": fmt, "backend": cache.backend_name, "elapsed_s": elapsed, "tokens_per_s": rate,
            "sqnr_db": sqnr_db(ref, out_buf),
            "sqnr_first_half_db": sqnr_db(ref[:half], out_buf[:half]) if half else None,
            "sqnr_second_half_db": sqnr_db(ref[half:], out_buf[half:]) if half else None,
            "state_bytes_per_token": state_bytes_per_token(fmt, heads, **dims),
            "standard_bf16_bytes_per_token": standard_bytes_per_token(2, heads, **dims),
            "standard_fp32_bytes_per_token": standard_bytes_per_token(4, heads, **dims),
            "cache_bytes_per_slot": cache.bytes_per_slot(),
        })
    print(
        f"{'format':>6} {'backend':>16} {'tokens/s':>10} {'SQNR dB':>8} {'1st/2nd half':>13} "
        f"{'state B/token':>13} {'vs bf16':>8} {'vs fp32':>8}", file=out,
    )
    for r in results:
        h1, h2, b = r["sqnr_first_half_db"], r["sqnr_second_half_db"], r["state_bytes_per_token"]
        halves = f"{'-':>6}/{'-':<6}" if h1 is None else f"{h1:>6.2f}/{h2:<6.2f}"
        print(
            f"{r['format']:>6} {r['backend']:>16} {r['tokens_per_s']:>10.0f} {r['sqnr_db']:>8.2f} {halves} "
            f"{b:>13.0f} {r['standard_bf16_bytes_per_token'] / b:>7.2f}x "
            f"{r['standard_fp32_bytes_per_token'] / b:>7.2f}x", file=out,
        )
    print(
        "tokens/s: batch rows x decode steps a second, one layer; SQNR: decode outputs vs an exact "
        "FP64 recurrence (over all steps, and over the first and second half); state B/token: state "
        "bytes moved per token per layer over a 16-token period (standard decode reads and writes "
        "the whole state).",
        file=out, flush=True,
    )
    return results


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


# (heads, groups, head dim, state dim) keys per transformers `model_type`: Mamba2Config and
# the hybrids' configs (nemotron_h's own head_dim is the attention's).
CONFIG_KEYS = {
    "mamba2": ("num_heads", "n_groups", "head_dim", "state_size"),
    "nemotron_h": ("mamba_num_heads", "n_groups", "mamba_head_dim", "ssm_state_size"),
    "falcon_h1": ("mamba_n_heads", "mamba_n_groups", "mamba_d_head", "mamba_d_state"),
    "bamba": ("mamba_n_heads", "mamba_n_groups", "mamba_d_head", "mamba_d_state"),
    "granitemoehybrid": ("mamba_n_heads", "mamba_n_groups", "mamba_d_head", "mamba_d_state"),
}


def read_mamba2_config(text: str) -> tuple[int, int, int, int]:
    """An argparse type: (heads, groups, head dim, state dim) of the Mamba-2 config.json at
    `text` (the file, or a directory holding it), read with json alone (no transformers)."""
    path = Path(text) / "config.json" if Path(text).is_dir() else Path(text)
    where = repr(str(path))
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"no such file: {where}") from None
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{where} is not JSON: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {where}: {exc}") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError(f"{where}: expected a JSON object; got {type(cfg).__name__}")
    model = cfg.get("model_type", "mamba2")
    keys = CONFIG_KEYS.get(model)
    if keys is None:
        raise argparse.ArgumentTypeError(f"{where}: model_type must be one of {tuple(CONFIG_KEYS)}; got {model!r}")
    for key in keys:
        if key not in cfg:
            raise argparse.ArgumentTypeError(f"{where}: missing key {key!r} (a {model} config has {', '.join(keys)})")
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1:
            raise argparse.ArgumentTypeError(f"{where}: {key} must be a positive integer; got {cfg[key]!r}")
    heads, groups, head_dim, state_dim = (cfg[key] for key in keys)
    for key, value, allowed in ((keys[2], head_dim, L.HEAD_DIMS), (keys[3], state_dim, L.STATE_DIMS)):
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{where}: {key} must be one of {allowed}; got {value}")
    if L.group_error(heads, groups):
        raise argparse.ArgumentTypeError(f"{where}: {keys[0]} {heads}, {keys[1]} {groups}: {L.group_error(heads, groups)}")
    return heads, groups, head_dim, state_dim


class _Geometry(argparse.Action):
    """Stores a geometry option and notes that it was given, so that --config can refuse
    it (argparse's defaults cannot tell --heads 16 from no --heads)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.geometry_given = [*namespace.geometry_given, self.option_strings[0]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replayssm", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="decode a synthetic Mamba-2 layer and report speed and accuracy",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = demo.add_argument
    add("--device", type=_device, default="auto",
        help="auto (cuda when a GPU is present, else cpu), cpu or cuda[:N]")
    add("--format", default="both", choices=["fp8", "nvfp4", "fp16", "both"],
        help="read-copy format (both: fp8 and nvfp4; fp16: no read copy)")
    add("--batch", type=_int_at_least(1), default=8, help="requests decoded together")
    add("--steps", type=_int_at_least(1), default=256,
        help="tokens decoded per request; every 16th is a flush")
    add("--heads", type=_int_at_least(1), default=16, action=_Geometry, help="SSM heads of the layer")
    add("--groups", type=_int_at_least(1), default=2, action=_Geometry,
        help="B/C groups (1 to 128 heads per group)")
    add("--head-dim", type=int, choices=L.HEAD_DIMS, default=L.HEAD_DIM, action=_Geometry,
        help="head dim P (80: Nemotron Nano 2's)")
    add("--state-dim", type=int, choices=L.STATE_DIMS, default=L.STATE_DIM, action=_Geometry,
        help="state dim N (256: Nemotron-H 47B / 56B's, Falcon-H1's)")
    add("--config", type=read_mamba2_config, metavar="PATH",
        help="a Hugging Face config.json of a Mamba-2 model or hybrid (mamba2, nemotron_h, falcon_h1, bamba, "
        "granitemoehybrid), or a directory holding one: its Mamba heads, groups, head dim and state size set the "
        "geometry (not allowed with --heads, --groups, --head-dim, --state-dim)")
    demo.set_defaults(geometry_given=[])
    add("--prompt", type=_int_at_least(0), default=64, help="prefill tokens that build each request's state")
    # the cache takes its seed mod 2**64 (quant/rng.py); torch.Generator too
    add("--seed", type=_int_at_least(0, 1 << 64, "2**64"), default=0,
        help="seed of the data and of the stochastic rounding")
    add("--threads", type=_int_at_least(1), default=1,
        help="torch CPU threads (on a 2-core CPU two threads ran the demo 1.25x faster on idle cores and 3-4x "
        "slower on busy ones)")
    add("--no-progress", action="store_true", help="print no progress on stderr")
    args = parser.parse_args(argv)  # "demo" is the one command
    # Every option is checked here, before anything is printed. --config sets the whole
    # geometry: an explicit geometry option with it is an error, not an override.
    if args.config is not None:
        if args.geometry_given:
            demo.error(f"argument {args.geometry_given[0]}: not allowed with argument --config (the config "
                       "sets heads, groups, head dim and state dim)")
        args.heads, args.groups, args.head_dim, args.state_dim = args.config
    if L.group_error(args.heads, args.groups):
        demo.error(f"--heads {args.heads} --groups {args.groups}: {L.group_error(args.heads, args.groups)}")
    try:
        torch.set_num_threads(args.threads)
        run_demo(
            device=args.device, formats=("fp8", "nvfp4") if args.format == "both" else (args.format,),
            batch=args.batch, steps=args.steps, heads=args.heads, groups=args.groups, head_dim=args.head_dim,
            state_dim=args.state_dim, prompt=args.prompt, seed=args.seed,
            progress=False if args.no_progress else None,
        )
    except (ValueError, TypeError) as exc:
        demo.error(str(exc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
