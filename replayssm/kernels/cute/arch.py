"""Which CuTe DSL target a GPU gets, by the table keyed by compute capability (`env.ARCHS`);
$REPLAYSSM_ARCH overrides the device query, so CPU CI can compile for any target."""

from __future__ import annotations

import torch

from ..env import ARCH_ENV, ARCHS, SUPPORTED, arch_override
# Targets with the `cvt.rs` stochastic-rounding conversion.
HAS_CVT_RS = frozenset({"sm_100a", "sm_103a"})


def check_arch(arch: object) -> str:
    if not isinstance(arch, str) or arch not in SUPPORTED:
        raise ValueError(f"arch must be one of {SUPPORTED}; got {arch!r}")
    return arch


def arch_for(device: torch.device | str | int | None = None) -> str:
    """The target for `device` (current CUDA device by default), or the override in
    $REPLAYSSM_ARCH. Raises ValueError for GPUs outside the table."""
    env = arch_override()
    if env is not None:
        return env
    if not torch.cuda.is_available():
        raise ValueError(
            f"no CUDA device to pick a CuTe target for; set ${ARCH_ENV} to one of {SUPPORTED} "
            "to compile without one"
        )
    cc = torch.cuda.get_device_capability(device)
    arch = ARCHS.get(tuple(cc))
    if arch is None:
        supported = ", ".join(f"sm_{a}{b} ({name})" for (a, b), name in ARCHS.items())
        raise ValueError(
            f"the replayssm CuTe kernels support compute capabilities {supported}; "
            f"got sm_{cc[0]}{cc[1]} ({torch.cuda.get_device_name(device)})"
        )
    return arch


__all__ = ["ARCHS", "ARCH_ENV", "SUPPORTED", "HAS_CVT_RS", "arch_for", "check_arch"]
