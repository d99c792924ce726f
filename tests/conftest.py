"""Test configuration. TRITON_INTERPRET must be set before any Triton kernel is defined,
so it is set here, first, whenever no GPU is present (CPU CI runs the Triton kernels in
the interpreter; a GPU machine runs them for real)."""

import os

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _default_kernels():
    """Tests expect the default CuTe non-flush kernels (the warp-per-head ones, and the
    SIMT ones as the batch-1 PDL variant) whatever the shell exports; a test that wants
    another sets $REPLAYSSM_FP8_DECODE / $REPLAYSSM_NVFP4_DECODE itself (monkeypatch)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("REPLAYSSM_FP8_DECODE", raising=False)
        mp.delenv("REPLAYSSM_NVFP4_DECODE", raising=False)
        yield
