"""A decode-state cache for Mamba-2 layers.

Per request slot the cache keeps an FP16 checkpoint of the recurrent state (heads x head
dim x state dim: 64 or 80 x 128 or 256), a ring of the last 16 inputs and an FP8 or NVFP4
read copy. A decode step reads the read copy and the ring and writes no state; every 16th
token a flush folds the ring into the checkpoint. CUDA kernels (CuTe DSL, Triton) on H100 /
H200 and B200 / B300; the PyTorch reference of every operation elsewhere.

`ReplaySSMCache` is one layer's cache (`spec_tokens=k`: speculative decoding); the
`*_replayssm_*` functions and `allocate_cache` are the functional API on the cache tensors
for engines that own their memory; `copy_slots`, `export_slots`, `import_slots` hand slots
off over every layer of a model. `DTypeError` is both a TypeError and a ValueError.
`python -m replayssm demo` decodes a synthetic layer; README.md has a worked example,
docs/format.md specifies every cache tensor and bit, docs/design.md explains the design.
"""

from . import ops  # registers the torch custom ops replayssm::* (ops.py)
from .api import (
    clear_replayssm_slots, initialize_replayssm_state, materialize_replayssm_state,
    selective_state_update_replayssm,
)
from .cache import ReplaySSMCache, copy_slots, export_slots, import_slots
from .checks import DTypeError
from .handoff import (
    copy_replayssm_slots, export_replayssm_slots, import_replayssm_slots, snapshot_replayssm_slots,
)
from .layout import allocate_cache
from .slots import NULL_SLOT, SlotAllocator

__version__ = "0.1.0"

__all__ = [
    "ReplaySSMCache", "SlotAllocator", "NULL_SLOT", "DTypeError", "allocate_cache",
    "initialize_replayssm_state", "selective_state_update_replayssm", "clear_replayssm_slots",
    "materialize_replayssm_state", "copy_replayssm_slots", "copy_slots", "snapshot_replayssm_slots",
    "export_replayssm_slots", "import_replayssm_slots", "export_slots", "import_slots",
]
