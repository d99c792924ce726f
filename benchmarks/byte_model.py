"""Byte model: the DRAM bytes one decode step must move, per format, from the cache layout.

A decode step is memory-bound: its floor is (bytes moved) / (copy bandwidth). This module
counts those bytes per batch row (one slot of one layer), from `replayssm.layout`'s
tensor specs, so the benchmark can report achieved bandwidth and the fraction of the
copy bandwidth a kernel reaches. Pure Python; only `cache_bytes_per_slot` imports
`replayssm.layout` (and so torch).

Notation: H heads, G groups, P (head dim, 64 unless `Shape` says otherwise), N (state dim,
128 unless said otherwise), L = 16 (ring), one token per row. Every row also moves its
step inputs and output, the same for all formats:

    inputs:  x  H*P*2 (bf16)  +  dt  H*4 (fp32 raw, per head)  +  B, C  2*G*N*2 (bf16)
             + the slot id 4 (int32)
    output:  y  H*P*2 (bf16)

Per-layer constants (A, D, dt_bias: a few hundred bytes shared by all rows) are left out.

Standard decode (state dtype of e bytes: fp32 4, bf16 / fp16 2): read and write the
state, H*P*N*e each way, plus inputs and output. Every step is the same.

ReplaySSM, per slot (the ring holds r entries before the step, r = position mod 16):

- ring entry = one token's x (H*P*2), processed dt (H*4) and B (G*N*2).
- read copy: FP8 H*P*N*1 codes + H*P*4 row scales (fp32);
  NVFP4 H*P*N/2 codes + H*P*(N/16)*1 block scales (e4m3) + meta G*2*4 + parity 4.
- position: read 4 and write 4 bytes every step.
- non-flush step (r = 0..14): read the read copy and the r live ring entries, write one
  ring entry (the current token); no state is written.
- flush step (r = 15): read the FP16 checkpoint (H*P*N*2) and 15 ring entries; write the
  checkpoint, the read copy and its scales (NVFP4: also the meta pair and the parity). The
  current token is folded directly, not written to the ring.
- period average: (sum over r = 0..14 of the non-flush bytes + the flush bytes) / 16.
  Ring entries read over a period: 0 + 1 + ... + 14 + 15 = 120, i.e. 7.5 per step on
  average over all 16 steps (7 per non-flush step).

Per head per token this gives ~10.5 kB of state traffic for FP8 and ~6.7 kB for NVFP4
(design brief §6: ~11,000 / ~7,500), against 65,536 (fp32) / 32,768 (16-bit) for the
standard decode; ring and inputs come on top. Caveats: bytes are counted at their exact
size (DRAM moves 32-byte sectors; every tensor here is a multiple of 32 bytes per slot
except the 4-byte position, parity and slot id, and the 4H-byte dt); the NVFP4 meta read
counts both halves; L2 hits are assumed to be zero (the benchmark rotates enough layers'
caches to keep the working set above twice the L2 at large batch).

"Synchronized" batches (all rows flush at the same step) move the same bytes per period
as desynchronized ones (1/16 of the rows flush each step); only the per-step peak differs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from replayssm.formats import FORMATS, FP8, NVFP4

HEAD_DIM = 64
STATE_DIM = 128
RING = 16
NVFP4_BLOCK = 16

STANDARD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}
REPLAY_FORMATS = ("fp8", "nvfp4", "fp16")


@dataclass(frozen=True)
class Shape:
    heads: int
    groups: int
    head_dim: int = HEAD_DIM
    state_dim: int = STATE_DIM

    @property
    def state_elems(self) -> int:
        return self.heads * self.head_dim * self.state_dim


def io_bytes(s: Shape) -> dict[str, int]:
    """Per-row step inputs and output (all providers)."""
    return {
        "x": s.heads * s.head_dim * 2,
        "dt": s.heads * 4,
        "B": s.groups * s.state_dim * 2,
        "C": s.groups * s.state_dim * 2,
        "slot_id": 4,
        "out": s.heads * s.head_dim * 2,
    }


def ring_entry_bytes(s: Shape) -> int:
    """One token's ring entry of one slot: x (bf16), processed dt (fp32), B (bf16)."""
    return s.heads * s.head_dim * 2 + s.heads * 4 + s.groups * s.state_dim * 2


def read_copy_bytes(s: Shape, fmt: str) -> dict[str, int]:
    """The read copy of one slot and everything a reader needs to decode it."""
    if fmt == "fp8":
        return {"codes": s.state_elems, "scales": s.heads * s.head_dim * 4}
    if fmt == "fp16":  # no read copy: the steps read the checkpoint
        return {"codes": s.state_elems * 2, "scales": 0}
    if fmt == "nvfp4":
        return {
            "codes": s.state_elems // 2,
            "scales": s.heads * s.head_dim * (s.state_dim // NVFP4_BLOCK),
            "meta": s.groups * 2 * 4,
            "parity": 4,
        }
    raise ValueError(f"fmt must be one of {REPLAY_FORMATS}; got {fmt!r}")


@dataclass(frozen=True)
class StepBytes:
    read: int
    write: int

    @property
    def total(self) -> int:
        return self.read + self.write


def standard_step(s: Shape, dtype: str) -> StepBytes:
    """Bytes per row of one standard decode step (state dtype `dtype`)."""
    e = STANDARD_DTYPES[dtype]
    io = io_bytes(s)
    state = s.state_elems * e
    return StepBytes(read=state + sum(io.values()) - io["out"], write=state + io["out"])


def fold_bytes(s: Shape, fmt: str, entries: int) -> StepBytes:
    """The state traffic of one fold of `entries` ring entries into the checkpoint (a flush,
    or a pending-mode fold): read the checkpoint and the entries (NVFP4: and the meta pair
    and parity), write the checkpoint and the read copy (fp16: the checkpoint only)."""
    rcb = read_copy_bytes(s, fmt)
    ckpt = s.state_elems * 2
    read = ckpt + entries * ring_entry_bytes(s) + (rcb["meta"] + rcb["parity"] if fmt == "nvfp4" else 0)
    return StepBytes(read, ckpt + (0 if fmt == "fp16" else sum(rcb.values())))


def replay_step(s: Shape, fmt: str, ring_index: int) -> StepBytes:
    """Bytes per row of one ReplaySSM step at ring index `ring_index` (0..15; 15 flushes)."""
    if not 0 <= ring_index < RING:
        raise ValueError(f"ring_index must be in [0, 15]; got {ring_index}")
    io = io_bytes(s)
    rc = sum(read_copy_bytes(s, fmt).values())
    entry = ring_entry_bytes(s)
    inputs = sum(io.values()) - io["out"]
    if ring_index < RING - 1:
        read = rc + ring_index * entry + inputs + 4
        write = entry + io["out"] + 4
    else:
        fold = fold_bytes(s, fmt, RING - 1)
        read = fold.read + inputs + 4
        write = fold.write + io["out"] + 4
    return StepBytes(read, write)


def replay_period_average(s: Shape, fmt: str) -> StepBytes:
    """Bytes per row per step, averaged over a 16-token period (15 non-flush + 1 flush).
    Integer division rounds down by less than one byte."""
    steps = [replay_step(s, fmt, r) for r in range(RING)]
    return StepBytes(sum(b.read for b in steps) // RING, sum(b.write for b in steps) // RING)


def pending_call(s: Shape, fmt: str, tokens: int, committed: float) -> StepBytes:
    """Bytes per row of one pending-mode call (docs/format.md section 5b) of `tokens` tokens
    a row (M = tokens, fold grid Gd = 17 - M) that commits `committed` tokens a row on
    average, so that committed / Gd of the rows fold. The plan reads and writes the
    positions (two int32) and reads the slot id and the verdict; a folding row reads the
    checkpoint and its Gd committed ring entries (NVFP4: and the meta pair and parity) and
    writes the checkpoint and the read copy, as a flush does; every row's step reads the read
    copy, the (Gd - 1) / 2 committed entries it replays on average (c' - f(c') taken as
    uniform over 0 .. Gd - 1) and its tokens' inputs, and writes their ring entries and
    outputs. Rounded to whole bytes."""
    if not 1 <= tokens <= 8:
        raise ValueError(f"tokens must be in [1, 8]; got {tokens}")
    if not 0 <= committed <= tokens:
        raise ValueError(f"committed must be in [0, tokens={tokens}]; got {committed}")
    gd = RING + 1 - tokens
    io = io_bytes(s)
    entry = ring_entry_bytes(s)
    fold = fold_bytes(s, fmt, gd)
    share = committed / gd  # of the rows that fold
    positions, verdict = 8, 4  # [S, 2] int32; int32
    per_token_in = io["x"] + io["dt"] + io["B"] + io["C"]
    step_read = sum(read_copy_bytes(s, fmt).values()) + (gd - 1) / 2 * entry + tokens * per_token_in
    read = positions + io["slot_id"] + verdict + share * fold.read + step_read
    write = positions + share * fold.write + tokens * (entry + io["out"])
    return StepBytes(round(read), round(write))


def step_bytes(provider: str, s: Shape) -> StepBytes:
    """Per-row bytes of one decode step for a provider name: "replayssm-fp8",
    "replayssm-nvfp4" (period average) or "standard-fp32" / "-bf16" / "-fp16"."""
    kind, _, fmt = provider.partition("-")
    if kind == "replayssm":
        return replay_period_average(s, fmt)
    if kind == "standard":
        return standard_step(s, fmt)
    raise ValueError(f"unknown provider {provider!r}")


def state_bytes_per_head_token(provider: str) -> float:
    """The state-only traffic per head per token (design brief §6's table): no ring, no
    inputs. ReplaySSM: period average of 15 read-copy reads and one flush."""
    s = Shape(1, 1)
    kind, _, fmt = provider.partition("-")
    if kind == "standard":
        return 2.0 * s.state_elems * STANDARD_DTYPES[fmt]
    rc = read_copy_bytes(s, fmt)
    rc_state = rc["codes"] + rc["scales"]
    flush = 2 * s.state_elems * 2 + (0 if fmt == "fp16" else rc_state)
    return (15 * rc_state + flush) / RING


def cache_bytes_per_slot(provider: str, s: Shape) -> int:
    """Memory per slot per layer (conv state excluded): the ReplaySSM cache tensors of
    `replayssm.layout.tensor_specs`, or the standard state."""
    kind, _, fmt = provider.partition("-")
    if kind == "standard":
        return s.state_elems * STANDARD_DTYPES[fmt]
    import math

    from replayssm import layout

    specs = layout.tensor_specs(s.heads, s.groups, FORMATS[fmt], head_dim=s.head_dim, state_dim=s.state_dim)
    return sum(math.prod(shape) * dt.itemsize for _, shape, dt in specs)


def describe(provider: str, s: Shape) -> dict:
    """Everything the model says about one provider and shape (for JSON reports)."""
    b = step_bytes(provider, s)
    return {
        "provider": provider,
        "heads": s.heads,
        "groups": s.groups,
        "bytes_per_row_step": b.total,
        "read_per_row_step": b.read,
        "write_per_row_step": b.write,
        "state_bytes_per_head_token": state_bytes_per_head_token(provider),
        "cache_bytes_per_slot": cache_bytes_per_slot(provider, s),
        "shape": asdict(s),
    }


PROVIDERS = ("replayssm-fp8", "replayssm-nvfp4", "standard-fp32", "standard-bf16", "standard-fp16")

__all__ = [
    "Shape",
    "StepBytes",
    "PROVIDERS",
    "io_bytes",
    "ring_entry_bytes",
    "read_copy_bytes",
    "standard_step",
    "fold_bytes",
    "replay_step",
    "replay_period_average",
    "pending_call",
    "step_bytes",
    "state_bytes_per_head_token",
    "cache_bytes_per_slot",
    "describe",
]
