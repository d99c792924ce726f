"""Which kernel variants a decode step launches: a frozen config chosen by the rules of
docs/design.md section 7 (each with its measurement), never by the environment; a benchmark
passes `dataclasses.replace(config, ...)` to `launch.decode_step(config=...)`."""

from __future__ import annotations

import dataclasses
import functools

# The non-flush kernel takes the programmatic dependent launch (PDL) behind the prepare
# kernel up to this batch; above it the flush does (at most one kernel can).
PDL_MAX_BATCH = 1
# FP8: the read copy's loads fetch whole 128-byte lines into L2 from heads x batch on.
FP8_READ_HINT, FP8_READ_HINT_MIN_WORK = ".L2::128B", 8192
# NVFP4 (and fp16, not measured): the read copy streams (evict first) but at batch 1.
NVFP4_READ_HINT = ".cs"
# FP8 flush row groups: 32 batch rows from this many heads and rows on, else 16.
ROWS, WIDE_ROWS, WIDE_ROWS_HEADS, WIDE_ROWS_BATCH = 16, 32, 64, 128


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The variants of one step's kernels (each a compile-cache key with the geometry)."""

    arch: str  # "sm_90a", "sm_100a" or "sm_103a"
    state_dtype: str  # "fp8", "nvfp4" or "fp16"
    heads: int
    groups: int
    nonflush_pdl: bool  # the non-flush kernel waits for prepare by griddepcontrol
    flush_pdl: bool  # the flush does (never both)
    read_hint: str  # PTX cache qualifier of the non-flush kernel's read-copy loads
    flush_rows: int  # batch rows a flush CTA takes at a time (one flag ballot)

    def __post_init__(self) -> None:
        if self.nonflush_pdl and self.flush_pdl:
            raise ValueError("StepConfig: at most one of nonflush_pdl and flush_pdl; got both")
        if self.flush_rows not in (ROWS, WIDE_ROWS):
            raise ValueError(f"StepConfig.flush_rows must be {ROWS} or {WIDE_ROWS}; got {self.flush_rows}")


@functools.lru_cache(maxsize=4096)
def step_config(arch: str, state_dtype: str, heads: int, groups: int, batch: int) -> StepConfig:
    """The measured-best variants for a `batch`-row step of this geometry."""
    nonflush_pdl = batch <= PDL_MAX_BATCH
    if state_dtype == "fp8":
        hint = FP8_READ_HINT if heads * batch >= FP8_READ_HINT_MIN_WORK else ""
        rows = WIDE_ROWS if heads >= WIDE_ROWS_HEADS and batch >= WIDE_ROWS_BATCH else ROWS
    else:
        hint = "" if nonflush_pdl else NVFP4_READ_HINT
        rows = ROWS
    return StepConfig(arch, state_dtype, heads, groups, nonflush_pdl, not nonflush_pdl, hint, rows)


def step_configs(arch: str, state_dtype: str, heads: int, groups: int) -> tuple[StepConfig, ...]:
    """Every config `step_config` gives this geometry at some batch (warmup compiles them
    all): the rules switch at batch 2, WIDE_ROWS_BATCH and the read hint's threshold."""
    hint_batch = -(-FP8_READ_HINT_MIN_WORK // heads)
    batches = (1, PDL_MAX_BATCH + 1, WIDE_ROWS_BATCH, hint_batch, max(WIDE_ROWS_BATCH, hint_batch))
    configs = (step_config(arch, state_dtype, heads, groups, max(b, 1)) for b in batches)
    return tuple(dict.fromkeys(configs))


__all__ = ["StepConfig", "step_config", "step_configs"]
