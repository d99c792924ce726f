"""The public environment variables, REPLAYSSM_DEBUG and REPLAYSSM_ARCH: a bad value is a
ValueError naming the variable wherever it is read, on the CPU too, and a rejected call
leaves the cache untouched."""

from __future__ import annotations

import pytest
import torch

from replayssm import (
    ReplaySSMCache,
    allocate_cache,
    clear_replayssm_slots,
    initialize_replayssm_state,
    materialize_replayssm_state,
    selective_state_update_replayssm,
)
from replayssm.kernels import compile_all
from replayssm.kernels.cute.arch import arch_for
from replayssm.kernels.env import ARCH_ENV, DEBUG_ENV, arch_override, debug

from .helpers import assert_cache_equal, snapshot

H, G = 16, 2


def _calls(cache):
    """Every functional entry point, each on a live slot."""
    ids = torch.tensor([1], dtype=torch.int32)
    x = torch.zeros(1, H, 64, dtype=torch.bfloat16)
    bc = torch.zeros(1, G, 128, dtype=torch.bfloat16)
    out = torch.empty(1, H, 64, dtype=torch.bfloat16)
    A = -torch.ones(H)
    return {
        "initialize": lambda: initialize_replayssm_state(cache, torch.ones(1, H, 64, 128), ids, state_dtype="fp8"),
        "clear": lambda: clear_replayssm_slots(cache, ids, state_dtype="fp8"),
        "decode": lambda: selective_state_update_replayssm(
            cache, x, torch.zeros(1, H), A, bc, bc, torch.ones(H), torch.zeros(H), ids, out, state_dtype="fp8"
        ),
        "materialize": lambda: materialize_replayssm_state(cache, ids, A, state_dtype="fp8"),
    }


@pytest.mark.parametrize("op", ["initialize", "clear", "decode", "materialize"])
@pytest.mark.parametrize("value", ["2", "true", "yes", "on", " 1", "debug"])
def test_bad_debug_value_is_rejected_by_every_entry_point(monkeypatch, value, op):
    cache = allocate_cache(4, H, G, "fp8")
    initialize_replayssm_state(cache, torch.randn(1, H, 64, 128), torch.tensor([1]), state_dtype="fp8")
    before = snapshot(cache)
    monkeypatch.setenv(DEBUG_ENV, value)
    with pytest.raises(ValueError, match=rf"^\$REPLAYSSM_DEBUG must be '0' or '1' \(or unset\); got {value!r}$"):
        _calls(cache)[op]()
    assert_cache_equal(before, cache)


@pytest.mark.parametrize("value,expected", [(None, False), ("", False), ("0", False), ("1", True)])
def test_debug_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(DEBUG_ENV, raising=False)
    else:
        monkeypatch.setenv(DEBUG_ENV, value)
    assert debug() is expected


def test_debug_off_values_do_not_check_and_on_does(monkeypatch):
    """"0" and "" leave duplicate live slots unchecked (the documented precondition); "1"
    rejects them."""
    cache = allocate_cache(4, H, G, "fp8")
    ids = torch.tensor([1, 1])
    states = torch.ones(2, H, 64, 128)
    for value in ("0", ""):
        monkeypatch.setenv(DEBUG_ENV, value)
        initialize_replayssm_state(cache, states, ids, state_dtype="fp8")
    monkeypatch.setenv(DEBUG_ENV, "1")
    before = snapshot(cache)
    with pytest.raises(ValueError, match="each live slot once"):
        initialize_replayssm_state(cache, states, ids, state_dtype="fp8")
    assert_cache_equal(before, cache)


BAD_ARCH = ["sm_42", "sm_90", "SM_90A", "90a", "sm_100"]


@pytest.mark.parametrize("value", BAD_ARCH)
def test_bad_arch_is_rejected_when_a_cache_is_built_on_the_cpu(monkeypatch, value):
    monkeypatch.setenv(ARCH_ENV, value)
    msg = rf"^\$REPLAYSSM_ARCH must be one of \('sm_90a', 'sm_100a', 'sm_103a'\) \(or unset\); got {value!r}$"
    with pytest.raises(ValueError, match=msg):
        ReplaySSMCache(4, H, G, "fp8", "cpu")
    with pytest.raises(ValueError, match=msg):
        arch_override()
    with pytest.raises(ValueError, match=msg):
        arch_for()


@pytest.mark.parametrize("value", BAD_ARCH)
def test_bad_arch_is_rejected_by_compile_all(monkeypatch, tmp_path, value):
    monkeypatch.setenv(ARCH_ENV, value)
    with pytest.raises(ValueError, match=r"^\$REPLAYSSM_ARCH must be one of"):
        compile_all("sm_90a", tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value,expected", [(None, None), ("", None), ("sm_90a", "sm_90a"), ("sm_103a", "sm_103a")])
def test_arch_override_values(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(ARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(ARCH_ENV, value)
    assert arch_override() == expected
    if expected is not None:
        assert arch_for() == expected
        assert ReplaySSMCache(4, H, G, "nvfp4", "cpu").num_slots == 4
