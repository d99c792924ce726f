"""replayssm: fast Mamba-2 decoding with an FP16 checkpoint, a 16-entry input ring and an
FP8 / NVFP4 read copy of the recurrent state."""

from . import ops  # registers the torch custom ops replayssm::* (ops.py)
from .api import (
    clear_replayssm_slots,
    initialize_replayssm_state,
    materialize_replayssm_state,
    selective_state_update_replayssm,
)
from .cache import ReplaySSMCache
from .handoff import (
    copy_replayssm_slots,
    copy_slots,
    export_replayssm_slots,
    export_slots,
    import_replayssm_slots,
    import_slots,
    snapshot_replayssm_slots,
)
from .layout import allocate_cache
from .slots import NULL_SLOT, SlotAllocator

__version__ = "0.1.0"

__all__ = [
    "ReplaySSMCache",
    "SlotAllocator",
    "NULL_SLOT",
    "allocate_cache",
    "initialize_replayssm_state",
    "selective_state_update_replayssm",
    "clear_replayssm_slots",
    "materialize_replayssm_state",
    "copy_replayssm_slots",
    "copy_slots",
    "snapshot_replayssm_slots",
    "export_replayssm_slots",
    "import_replayssm_slots",
    "export_slots",
    "import_slots",
]
