"""Test configuration. TRITON_INTERPRET must be set before any Triton kernel is defined,
so it is set here, first, whenever no GPU is present (CPU CI runs the Triton kernels in
the interpreter; a GPU machine runs them for real).

Torch runs on one CPU thread (OMP_NUM_THREADS=1 unless set, inherited by the subprocesses
the tests start: demo, notebook kernels, torchrun): the tests work on small tensors, and
two OpenMP threads on a busy 2-core machine run them about 10x slower."""

import os

_THREADS = os.environ.setdefault("OMP_NUM_THREADS", "1")  # read when torch is imported

try:
    import torch

    if _THREADS == "1":
        torch.set_num_threads(1)  # also when a plugin imported torch before this file
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
