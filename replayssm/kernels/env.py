"""Environment variables, read in one place (importable without Triton or the CuTe DSL).

The package reads two: `REPLAYSSM_DEBUG` (`debug()`) and `REPLAYSSM_ARCH`
(`arch_override()`). Each call site reads its variable once per call (an `os.environ`
lookup); a value outside the documented set is a ValueError naming the variable, the
accepted values and the value, wherever it is read.
"""

from __future__ import annotations

import os

DEBUG_ENV = "REPLAYSSM_DEBUG"
ARCH_ENV = "REPLAYSSM_ARCH"


def debug() -> bool:
    """$REPLAYSSM_DEBUG: "1" turns on the host-side checks (unique live slots, slot
    ownership in ReplaySSMCache.decode, finite prefill states), which synchronize with the
    host; "0", empty or unset: off."""
    value = os.environ.get(DEBUG_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${DEBUG_ENV} must be '0' or '1' (or unset); got {value!r}")
    return value == "1"


def arch_override() -> str | None:
    """$REPLAYSSM_ARCH: the CuTe target to compile for instead of asking the GPU (so a
    machine without one can compile), one of `cute.arch.SUPPORTED`; None when unset or
    empty."""
    value = os.environ.get(ARCH_ENV, "")
    if not value:
        return None
    from .cute.arch import SUPPORTED  # the arch table; importing it needs no CuTe DSL

    if value not in SUPPORTED:
        raise ValueError(f"${ARCH_ENV} must be one of {SUPPORTED} (or unset); got {value!r}")
    return value


__all__ = ["ARCH_ENV", "DEBUG_ENV", "arch_override", "debug"]
