"""Environment-variable choices shared by the Triton and the CuTe DSL kernel modules
(importable without the CuTe DSL)."""

from __future__ import annotations

import os


def env_choice(var: str, choices: tuple[str, ...], default: str) -> str:
    """The value of environment variable `var` (`default` when unset), one of `choices`;
    anything else is a ValueError naming the variable, the choices and the value."""
    value = os.environ.get(var, default)
    if value not in choices:
        raise ValueError(f"${var} must be one of {choices}; got {value!r}")
    return value
