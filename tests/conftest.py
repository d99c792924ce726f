"""Test configuration. TRITON_INTERPRET must be set before any Triton kernel is defined,
so it is set here, first, whenever no GPU is present (CPU CI runs the Triton kernels in
the interpreter; a GPU machine runs them for real)."""

import os
import pathlib

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
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _default_kernels():
    """Tests expect the default CuTe non-flush kernels (the warp-per-head ones, also as
    the batch-1 PDL variant) and prepare kernel whatever the shell exports; a test that
    wants another sets the variable itself (monkeypatch)."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("REPLAYSSM_FP8_DECODE", "REPLAYSSM_NVFP4_DECODE", "REPLAYSSM_PDL_KERNEL", "REPLAYSSM_PREPARE_TRIGGER"):
            mp.delenv(var, raising=False)
        yield


CUTE_ARCHS = ("sm_90a", "sm_100a", "sm_103a")


@pytest.fixture(scope="session")
def simt_pdl_ptx(tmp_path_factory):
    """PTX of the SIMT non-flush kernels as the batch-1 PDL variant
    ($REPLAYSSM_PDL_KERNEL=simt; compile_all builds the default, the warp kernels), both
    formats, compile_all's geometries: {arch: {"decode_<fmt>-h<H>g<G>-pdl": text}}."""
    from replayssm.kernels.cute import launch, launch_nvfp4

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(launch.PDL_KERNEL_ENV, "simt")
        for arch in CUTE_ARCHS:
            root = tmp_path_factory.mktemp(f"simt-{arch}")
            texts = {}
            for heads, groups in launch.COMPILE_ALL_GEOMETRIES:
                for kind, mod, args in (("decode_fp8", launch, ("hw",)), ("decode_nvfp4", launch_nvfp4, ())):
                    obj = mod._kernel_object(kind, arch, heads, groups, *args, True)
                    sub = f"{kind}-h{heads}g{groups}-pdl"
                    (ptx,) = [q for q in launch.compile_into(obj, mod._fake_args(kind), arch, root / sub) if q.endswith(".ptx")]
                    texts[sub] = pathlib.Path(ptx).read_text()
            out[arch] = texts
    return out
