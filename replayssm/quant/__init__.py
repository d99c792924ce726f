"""Formats, reference encoders and the random hash (bit-exact twins of the kernels)."""

from ..geometry import HEAD_DIM, NVFP4_BLOCK, STATE_DIM
from .formats import (
    NVFP4_HEADROOM, fp8_decode, fp8_encode, fp8_row_scale, nvfp4_decode, nvfp4_encode, nvfp4_global_scale,
    nvfp4_unpack,
)
from .minifloat import E2M1, E4M3, FP16, decode_e2m1, decode_e4m3, encode, to_e2m1, to_e4m3, to_fp16
from .rng import INIT_POSITION, mix32, mix32_int, random_words, seed_key, stream_key

__all__ = [
    "HEAD_DIM", "STATE_DIM", "NVFP4_BLOCK", "NVFP4_HEADROOM",
    "fp8_encode", "fp8_decode", "fp8_row_scale",
    "nvfp4_encode", "nvfp4_decode", "nvfp4_global_scale", "nvfp4_unpack",
    "E2M1", "E4M3", "FP16", "encode", "decode_e2m1", "decode_e4m3", "to_e2m1", "to_e4m3", "to_fp16",
    "INIT_POSITION", "mix32", "mix32_int", "random_words", "seed_key", "stream_key",
]
