"""The numbers every layer of replayssm shares: the state geometry and the cache tuple's
indices (docs/format.md). Imports nothing of the package, so every module may import it."""

from __future__ import annotations

from typing import NamedTuple

HEAD_DIM = 64  # P: head dimension (the default)
STATE_DIM = 128  # N: state dimension (the default)
HEAD_DIMS = (64, 80)  # P a cache may have (Nemotron Nano 2: 80)
STATE_DIMS = (128, 256)  # N a cache may have (Nemotron-H 47B / 56B, Falcon-H1: 256)
RING = 16  # L: ring entries; one flush every RING tokens
NVFP4_BLOCK = 16  # values per NVFP4 block scale
MAX_HEADS_PER_GROUP = 128  # heads sharing one group's B and C: 1 (a tensor-parallel shard) .. 128

# Cache tuple indices shared by every format.
CONV, CHECKPOINT, X_RING, DT_RING, B_RING, READ_COPY, SCALES = 0, 1, 2, 3, 4, 5, 6
# NVFP4 only.
META, PARITY = 7, 8
POSITIONS = -1


class Geometry(NamedTuple):
    """A cache's shape, as `layout.check_cache` reads it from the tensors."""

    num_slots: int
    heads: int
    groups: int
    head_dim: int  # P
    state_dim: int  # N


def dims_error(head_dim: object, state_dim: object) -> str | None:
    """Why (head_dim, state_dim) is no cache geometry (None when it is one)."""
    if head_dim not in HEAD_DIMS or state_dim not in STATE_DIMS or isinstance(head_dim, bool) or isinstance(state_dim, bool):
        return f"head_dim must be one of {HEAD_DIMS} and state_dim one of {STATE_DIMS}; got {head_dim!r} and {state_dim!r}"
    return None


def group_error(heads: int, groups: int) -> str | None:
    """Why `heads` heads cannot share B and C in `groups` groups (None when they can):
    groups divide heads, 1 .. MAX_HEADS_PER_GROUP heads a group."""
    if groups <= 0 or heads % groups or not 1 <= heads // groups <= MAX_HEADS_PER_GROUP:
        return f"heads must be a multiple of groups with 1 to {MAX_HEADS_PER_GROUP} heads a group; got {heads} heads in {groups} groups"
    return None
