"""The package's environment variables, read in one place (no Triton or CuTe DSL import):
each read is an `os.environ` lookup, and a value outside the documented set a ValueError."""

from __future__ import annotations

import os

DEBUG_ENV = "REPLAYSSM_DEBUG"
ARCH_ENV = "REPLAYSSM_ARCH"

# compute capability -> CuTe DSL / ptxas target (the one table; `cute.arch` picks by it)
ARCHS: dict[tuple[int, int], str] = {
    (9, 0): "sm_90a",  # H100 / H200: software stochastic rounding and FP4
    (10, 0): "sm_100a",  # B200: cvt.rs.satfinite.f16x2.f32, cvt.rn.satfinite.e4m3x2.f32
    (10, 3): "sm_103a",  # B300: as sm_100a
}
SUPPORTED = tuple(ARCHS.values())


def debug() -> bool:
    """$REPLAYSSM_DEBUG="1": the host-side checks (unique live slots, slot ownership, finite
    prefill states), which synchronize with the host; "0", empty or unset: off."""
    value = os.environ.get(DEBUG_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${DEBUG_ENV} must be '0' or '1' (or unset); got {value!r}")
    return value == "1"


def arch_override() -> str | None:
    """$REPLAYSSM_ARCH: the CuTe target to compile for instead of asking the GPU, one of
    `SUPPORTED`; None when unset or empty."""
    value = os.environ.get(ARCH_ENV, "")
    if not value:
        return None
    if value not in SUPPORTED:
        raise ValueError(f"${ARCH_ENV} must be one of {SUPPORTED} (or unset); got {value!r}")
    return value


__all__ = ["ARCHS", "ARCH_ENV", "DEBUG_ENV", "SUPPORTED", "arch_override", "debug"]
