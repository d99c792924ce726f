"""The numbers every layer of replayssm shares: the state geometry and the cache tuple's
indices (docs/format.md). Imports nothing of the package, so every module may import it."""

from __future__ import annotations

HEAD_DIM = 64  # P: head dimension
STATE_DIM = 128  # N: state dimension
RING = 16  # L: ring entries; one flush every RING tokens
NVFP4_BLOCK = 16  # values per NVFP4 block scale
HEADS_PER_GROUP = (8, 16)

# Cache tuple indices shared by every format.
CONV, CHECKPOINT, X_RING, DT_RING, B_RING, READ_COPY, SCALES = 0, 1, 2, 3, 4, 5, 6
# NVFP4 only.
META, PARITY = 7, 8
POSITIONS = -1
