"""Read-copy formats as objects, made from the user's `state_dtype` by `format_of`: the cache
tensors a format adds after the rings (docs/format.md sections 3-4b) and the reference's four
format-specific steps. A new format also needs `quant.formats` and `kernels.cute.read_copy`."""

from __future__ import annotations

import torch

from .geometry import CHECKPOINT, HEAD_DIM, META, NVFP4_BLOCK, PARITY, READ_COPY, SCALES, STATE_DIM
from .quant import formats as Q


def group_amax(state: torch.Tensor, groups: int) -> torch.Tensor:
    """[n, H, P, N] FP32 -> [n, G] max |value| over each group's heads, taken on the
    floats' bits (docs/format.md section 4: a NaN keeps its payload, as in the kernels)."""
    n, heads, P, N = state.shape
    mag = state.float().contiguous().view(torch.int32) & 0x7FFFFFFF
    # An explicit group size: with n = 0 (a batch of padding rows only) -1 is ambiguous.
    return mag.reshape(n, groups, (heads // groups) * P * N).amax(dim=-1).view(torch.float32)


class Format:
    """A read-copy format named by its `state_dtype`; `two_level`: a double-buffered scale
    per (slot, group) with a parity per slot (the cache's `meta` and `parity` tensors)."""

    name: str = ""
    two_level: bool = False
    has_read_copy: bool = True  # fp16's steps read the checkpoint instead
    on_kernels: bool = True  # else backend="auto" runs it on the PyTorch reference, with a warning

    def specs(self, heads: int, groups: int, P: int = HEAD_DIM, N: int = STATE_DIM) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """[(name, per-slot shape, dtype)] of the tensors this format adds after the rings."""
        raise NotImplementedError

    def cache_len(self) -> int:
        """Tensors in the cache tuple: conv, checkpoint, three rings, this format's, positions."""
        return 5 + len(self.specs(1, 1)) + 1

    def init(self, cache, slot: torch.Tensor, state: torch.Tensor) -> None:
        """Write the read copy (and its scales) of live `slot`s from FP32 `state` at init."""
        raise NotImplementedError

    def flip(self, cache, slot: torch.Tensor) -> torch.Tensor:
        """A fold of `slot`s begins: returns each slot's live half before it (int64; 0
        where the format has none) after making the other half live."""
        return torch.zeros_like(slot)

    def refresh(self, cache, slot: torch.Tensor, state: torch.Tensor, old_parity: torch.Tensor) -> None:
        """Re-derive the read copy of `slot`s from their folded FP32 `state` (as at init)."""
        self.init(cache, slot, state)

    def read(self, cache, slot: torch.Tensor) -> torch.Tensor:
        """The dequantized read copy [n, H, P, N] (FP32) of `slot`s."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"Format({self.name!r})"


class Fp8Format(Format):
    """FP8 e4m3 codes with one power-of-two scale per state row (docs/format.md section 3)."""

    name = "fp8"

    def specs(self, heads, groups, P=HEAD_DIM, N=STATE_DIM):
        return [
            ("read_copy", (heads, P, N), torch.float8_e4m3fn),
            ("row_scales", (heads, P), torch.float32),
        ]

    def init(self, cache, slot, state) -> None:
        cache[READ_COPY][slot], cache[SCALES][slot] = Q.fp8_encode(state)

    def read(self, cache, slot):
        return Q.fp8_decode(cache[READ_COPY][slot], cache[SCALES][slot])


class Nvfp4Format(Format):
    """NVFP4: e2m1 code pairs, e4m3 block scales per 16 values and a delayed power-of-two
    second-level scale per (slot, group) in `meta`, whose live half `parity` names
    (docs/format.md section 4)."""

    name = "nvfp4"
    two_level = True

    def specs(self, heads, groups, P=HEAD_DIM, N=STATE_DIM):
        return [
            ("read_copy", (heads, P, N // 2), torch.uint8),
            ("block_scales", (heads, P, N // NVFP4_BLOCK), torch.float8_e4m3fn),
            ("meta", (groups, 2), torch.float32),
            ("parity", (), torch.int32),
        ]

    def _per_head(self, cache, amax: torch.Tensor) -> torch.Tensor:
        """[n, G] -> [n, H]: each head takes its group's (group of head h: h // (H / G))."""
        heads = cache[READ_COPY].shape[1]
        return amax[:, torch.arange(heads, device=amax.device) // (heads // cache[META].shape[1])]

    def _live_amax(self, cache, slot, parity) -> torch.Tensor:
        """The group amax in the half of `meta` that `parity` names, per head [n, H]."""
        index = parity.view(-1, 1, 1).expand(-1, cache[META].shape[1], 1)
        return self._per_head(cache, cache[META][slot].gather(2, index).squeeze(-1))

    def init(self, cache, slot, state) -> None:
        live_amax = group_amax(state, cache[META].shape[1])
        cache[META][slot] = live_amax.unsqueeze(-1).expand(-1, -1, 2)
        cache[PARITY][slot] = 0
        cache[READ_COPY][slot], cache[SCALES][slot] = Q.nvfp4_encode(state, self._per_head(cache, live_amax))

    def flip(self, cache, slot):
        """The parity flips; the half that was live becomes the amax accumulator (zeroed)."""
        old = cache[PARITY][slot].to(torch.int64)
        cache[PARITY][slot] = (1 - old).to(torch.int32)
        cache[META][slot, :, old] = 0.0
        return old

    def refresh(self, cache, slot, state, old_parity) -> None:
        """Encode with the amax of the previous fold (the new live half); store the folded
        state's group amax in the half that was live."""
        live_amax = self._live_amax(cache, slot, 1 - old_parity)
        cache[META][slot, :, old_parity] = group_amax(state, cache[META].shape[1])
        cache[READ_COPY][slot], cache[SCALES][slot] = Q.nvfp4_encode(state, live_amax)

    def read(self, cache, slot):
        live_amax = self._live_amax(cache, slot, cache[PARITY][slot].to(torch.int64))
        return Q.nvfp4_decode(cache[READ_COPY][slot], cache[SCALES][slot], live_amax)


class Fp16Format(Format):
    """No read copy: a step reads the FP16 checkpoint itself (docs/format.md section 4b)."""

    name = "fp16"
    has_read_copy = False

    def specs(self, heads, groups, P=HEAD_DIM, N=STATE_DIM):
        return []

    def init(self, cache, slot, state) -> None:
        pass  # the checkpoint is the read copy

    def read(self, cache, slot):
        return cache[CHECKPOINT][slot].float()


FP8, NVFP4, FP16 = Fp8Format(), Nvfp4Format(), Fp16Format()
FORMATS: dict[str, Format] = {f.name: f for f in (FP8, NVFP4, FP16)}


def format_of(state_dtype: object) -> Format:
    """The `Format` of a `state_dtype` string ("fp8", "nvfp4", "fp16"); a Format passes as is.
    TypeError for another type, ValueError for another name."""
    if isinstance(state_dtype, Format):
        return state_dtype
    if not isinstance(state_dtype, str):
        raise TypeError(f"state_dtype must be a str in {tuple(FORMATS)}; got {type(state_dtype).__name__}")
    fmt = FORMATS.get(state_dtype)
    if fmt is None:
        raise ValueError(f"state_dtype must be one of {tuple(FORMATS)}; got {state_dtype!r}")
    return fmt


__all__ = ["FORMATS", "FP16", "FP8", "NVFP4", "Format", "format_of"]
