"""The CUDA driver entry points the launchers call directly (through ctypes, on raw
handles): the CuTe step's side-stream fork and join, the Triton kernels' relaunch."""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def _library(hold_gil: bool):
    try:
        return (ctypes.PyDLL if hold_gil else ctypes.CDLL)("libcuda.so.1")
    except OSError:
        return None


def function(name: str, argtypes: list, *, hold_gil: bool = False):
    """Driver function `name` (it returns a CUresult) taking `argtypes`, or None where the
    driver library or the function cannot be loaded. `hold_gil`: called without releasing
    the GIL (no other Python thread runs during the call)."""
    lib = _library(hold_gil)
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn
