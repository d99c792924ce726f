"""Devices: `replayssm.layout.check_device` accepts the CPU and present CUDA GPUs and gives
one ValueError (TypeError for a non-device type) naming the argument, what it accepts and
what it got, for everything else; the cache constructor and allocate_cache go through it."""

from __future__ import annotations

import pytest
import torch

from replayssm import ReplaySSMCache, allocate_cache
from replayssm.layout import check_device

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

BAD = [
    pytest.param("tpu", id="tpu"),
    pytest.param("gpu", id="type-gpu"),
    pytest.param("mps", id="mps"),
    pytest.param("meta", id="meta"),
    pytest.param("xla", id="xla"),
    pytest.param("", id="empty"),
    pytest.param("CPU", id="upper-case"),
    pytest.param("cpu:1", id="cpu-index"),
    pytest.param("cuda:-1", id="cuda-negative"),
    pytest.param(f"cuda:{NUM_GPUS}", id="cuda-beyond-count"),
    pytest.param(torch.device("cuda", NUM_GPUS + 6), id="cuda-device-object-beyond-count"),
]
if NUM_GPUS == 0:
    BAD += [pytest.param("cuda", id="cuda-without-gpu"), pytest.param("cuda:0", id="cuda0-without-gpu")]


@pytest.mark.parametrize("device", BAD)
def test_bad_devices_are_one_value_error(device):
    with pytest.raises(ValueError) as err:
        check_device(device)
    msg = str(err.value)
    assert msg.startswith("device must be ") and "'cpu'" in msg, msg
    assert f"got {str(device)!r}" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("device", BAD)
def test_cache_and_allocate_cache_reject_bad_devices(device):
    with pytest.raises(ValueError, match="^device must be "):
        ReplaySSMCache(4, 16, 2, "fp8", device)
    with pytest.raises(ValueError, match="^device must be "):
        allocate_cache(4, 16, 2, "nvfp4", device)


def test_without_a_gpu_cuda_says_none_is_visible():
    if NUM_GPUS:
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(ValueError, match=r"^device must be .cpu. \(no CUDA GPU is visible\); got .cuda.$"):
        check_device("cuda")


@pytest.mark.parametrize("device", [3, None, 1.5, True, ["cpu"]], ids=["int", "none", "float", "bool", "list"])
def test_non_device_types_are_type_errors(device):
    with pytest.raises(TypeError, match=f"device must be a str or torch.device; got {type(device).__name__}"):
        check_device(device)


def test_good_devices_come_back_as_torch_devices():
    assert check_device("cpu") == torch.device("cpu")
    assert check_device(torch.device("cpu")) == torch.device("cpu")
    assert check_device("cpu:0") == torch.device("cpu", 0)
    for i in range(NUM_GPUS):
        assert check_device(f"cuda:{i}") == torch.device("cuda", i)
    if NUM_GPUS:
        assert check_device("cuda") == torch.device("cuda")
    cache = ReplaySSMCache(4, 16, 2, "fp8", "cpu")
    assert cache.device == torch.device("cpu") and cache.tensors[1].device == torch.device("cpu")
