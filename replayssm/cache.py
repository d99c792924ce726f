"""ReplaySSMCache: the per-layer cache manager.

Vocabulary (used the same way everywhere in replayssm):

- slot: one request's share of the cache; dim 0 of every cache tensor. Slot 0 is the
  padding slot. A padding row is a batch row whose slot id is <= 0 or >= num_slots: its
  output is zeros and it changes nothing.
- checkpoint: the FP16 state [heads, P, N] of a slot as of its last flush (head dim P 64
  or 80, state dim N 128 or 256); the only tensor the recurrence accumulates into.
- read copy: the checkpoint quantized to FP8 (e4m3, per-row scales) or NVFP4 (e2m1 codes,
  e4m3 block scales, second-level scale); what a non-flush step reads.
- ring: 16 entries per slot, the inputs since the checkpoint; an entry is one token's x
  [heads, P], processed dt [heads] and B [groups, N].
- position: tokens decoded since the slot's last `prefill_init`; ring index = position
  mod 16. A flush is the step at ring index 15: it folds the period's 16 tokens into the
  checkpoint and re-derives the read copy.
- group: heads sharing B and C (1 to 128 heads per group).
- parity: NVFP4 only; which half of the double-buffered second-level scale is live.
- pending mode (speculative decoding, `spec_tokens` > 0): positions are (committed,
  pending) per slot; a call brings up to max_seqlen tokens a row and the verdict on the
  previous call's (docs/format.md section 5b).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
import weakref

import attrs
import torch

from . import api, handoff, ops
from . import checks as chk
from . import layout as L
from .formats import Format, format_of
from .kernels import backend_for, check_backend
from .kernels.env import arch_override, debug
from .pending import MAX_SEQLEN, checkpoint_index
from .slots import NULL_SLOT, SlotAllocator


@attrs.define(eq=False, repr=False)
class ReplaySSMCache:
    """One model layer's state for `num_slots` slots (slot 0 reserved): the cache tuple
    `.tensors` (docs/format.md; checked once here, not per call), its slots, prefill and
    decode. `max_batch` (default num_slots - 1) bounds a call's rows; `backend` as for the
    functional API. `spec_tokens` k in 1..7: pending mode with k draft tokens (max_seqlen k + 1)."""

    num_slots: int
    num_heads: int
    num_groups: int
    state_dtype: str
    device: torch.device = attrs.field(converter=L.check_device)
    seed: int = 0
    max_batch: int | None = None
    conv_state_shape: tuple[int, ...] | None = None
    conv_state_dtype: torch.dtype = torch.bfloat16
    slot_padding: int = 0
    backend: str = attrs.field(default="auto", kw_only=True)
    # The model's head of this cache's head 0 in a tensor-parallel shard (docs/format.md section 6).
    head_offset: int = attrs.field(default=0, kw_only=True)
    spec_tokens: int = attrs.field(default=0, kw_only=True)
    head_dim: int = attrs.field(default=L.HEAD_DIM, kw_only=True)
    state_dim: int = attrs.field(default=L.STATE_DIM, kw_only=True)
    tensors: tuple[torch.Tensor, ...] = attrs.field(init=False)
    allocator: SlotAllocator = attrs.field(init=False)
    _format: Format = attrs.field(init=False, repr=False)
    _geometry: L.Geometry = attrs.field(init=False, repr=False)
    _backend: object = attrs.field(init=False, repr=False)
    # The A of the last decode call (a reference, not a copy), None before the first.
    _last_A: torch.Tensor | None = attrs.field(init=False, default=None, repr=False)
    _scratch: object = attrs.field(init=False, default=None, repr=False)
    _direct: bool = attrs.field(init=False, default=False, repr=False)
    # id -> (weak reference, version, host values) of the id tensors `allocate` returned.
    _issued: dict = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        self._format = format_of(self.state_dtype)
        check_backend(self.backend)
        arch_override()  # a bad $REPLAYSSM_ARCH fails here, on any device, not at the first GPU launch
        debug()  # a bad $REPLAYSSM_DEBUG fails here too
        L.check_geometry(self.num_slots, self.num_heads, self.num_groups, self.head_dim, self.state_dim)
        chk.seed(self.seed)
        chk.head_offset(self.head_offset)
        if not isinstance(self.spec_tokens, int) or isinstance(self.spec_tokens, bool):
            raise TypeError(f"spec_tokens must be an int; got {type(self.spec_tokens).__name__}")
        if not 0 <= self.spec_tokens <= MAX_SEQLEN - 1:
            raise ValueError(
                f"spec_tokens must be in 0..{MAX_SEQLEN - 1} (max_seqlen = spec_tokens + 1 <= {MAX_SEQLEN}); "
                f"got {self.spec_tokens}"
            )
        if self.max_batch is None:
            self.max_batch = self.num_slots - 1
        if not isinstance(self.max_batch, int) or isinstance(self.max_batch, bool):
            raise TypeError(f"max_batch must be an int or None; got {type(self.max_batch).__name__}")
        if self.max_batch <= 0:
            raise ValueError(f"max_batch must be positive; got {self.max_batch}")
        # A tuple: entries cannot be swapped for tensors the validation below never saw.
        self.tensors = tuple(
            L.allocate_cache(
                self.num_slots, self.num_heads, self.num_groups, self.state_dtype, self.device,
                conv_shape=self.conv_state_shape, conv_dtype=self.conv_state_dtype,
                slot_padding=self.slot_padding, pending=self.spec_tokens > 0, head_dim=self.head_dim,
                state_dim=self.state_dim,
            )
        )
        self._geometry = L.check_cache(self.tensors, self._format)
        self._backend = backend_for(self.device, self.backend, self.tensors, self._format)
        self._direct = getattr(self._backend, "name", None) == "kernels" and self.device.type == "cuda"
        self.allocator = SlotAllocator(self.num_slots)
        # The kernel backend's plan scratch, sized for max_batch: a decode step allocates nothing.
        make = getattr(self._backend, "new_scratch", None)
        self._scratch = make(self.device, self.max_batch) if make else None
        ops.register_scratch(self._scratch)  # now, so a compiled decode only looks it up

    def _slots(self, slots) -> torch.Tensor:
        """Slot ids as a 1-D integer tensor on the cache device (lists and ints accepted)."""
        if isinstance(slots, torch.Tensor):
            if slots.dim() == 1 and slots.get_device() == self.tensors[L.CHECKPOINT].get_device() and not slots.is_meta:
                if slots.dtype not in (torch.int32, torch.int64):
                    chk.int_ids("slots", slots)
                return slots  # already on the cache device (the common case: no view made)
            if slots.is_meta:
                raise ValueError(f"slots must be on the cache device {self.device}; got {slots.device}")
            return chk.int_ids("slots", slots).to(self.device)
        return self._issue(chk.id_list("slots", slots))

    def _issue(self, host: torch.Tensor) -> torch.Tensor:
        """Host ids on the cache device (no GPU wait), remembered so `_host_ids` reads nothing back."""
        ids = host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host
        if len(self._issued) >= 1024:  # drop the records of tensors gone
            self._issued = {k: v for k, v in self._issued.items() if v[0]() is not None}
        self._issued[id(ids)] = (weakref.ref(ids), ids._version, host.tolist())
        return ids

    def _host_ids(self, ids: torch.Tensor) -> list[int]:
        """Slot ids' values: `_issue`'s record of a tensor it made, if unchanged, else read."""
        hit = self._issued.get(id(ids))
        if hit is not None and hit[0]() is ids and hit[1] == ids._version:
            return hit[2]
        return ids.tolist()

    def _live(self, slots) -> torch.Tensor:
        """`_slots`, live ids checked allocated and unique (on the host); padding ids pass."""
        ids = self._slots(slots)
        self.allocator.check_live(self._host_ids(ids))
        return ids

    def _rows(self, slots, checks: bool) -> torch.Tensor:
        """A decode call's slot ids: at most max_batch, live ones checked with `checks`."""
        slots = self._slots(slots)
        if slots.numel() > self.max_batch:
            raise ValueError(f"slots must hold at most max_batch={self.max_batch} rows; got {slots.numel()}")
        if checks and not torch.compiler.is_compiling():  # host reads: eager only (ops.py)
            self._live(slots)
        return slots

    def _default_A(self, A: torch.Tensor | None, slots: torch.Tensor, caller: str) -> torch.Tensor:
        """`A`, else the last decode call's, else (none yet) zeros if no live slot has
        tokens to fold: pending ones for `accept`, committed since the checkpoint else."""
        if A is not None or self._last_A is not None:
            return self._last_A if A is None else A
        pos = self.tensors[L.POSITIONS][slots[(slots > 0) & (slots < self.num_slots)].long()]
        if caller == "accept":
            live = pos[:, 1]
        elif self.spec_tokens:
            live = pos[:, 0].long() - checkpoint_index(pos[:, 0].long(), self.max_seqlen)
        else:
            live = pos % L.RING
        if bool((live != 0).any()):
            raise ValueError(f"{caller} needs A: no decode call has supplied one yet")
        return torch.zeros(self.num_heads, dtype=torch.float32, device=self.device)

    def allocate(self, n: int) -> torch.Tensor:
        """n unique free slot ids (int32, on the cache device); passing the tensor back
        (to `prefill_init`, `release`, ...) reads nothing from the device (`_issue`)."""
        debug()
        return self._issue(self.allocator.allocate(n))

    def release(self, slots: torch.Tensor) -> None:
        """Return slots to the pool and clear their rings and positions."""
        debug()
        ids = self._slots(slots)
        self.allocator.release(self._host_ids(ids))  # validates every id before changing anything
        api.clear(self.tensors, self._backend, ids)

    def prefill_init(self, states: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the checkpoint and read copy of `slots` from FP32 `states` [n, heads,
        head_dim, state_dim], clear their rings and positions. Live ids must be allocated
        and unique (checked on the host); padding ids are ignored."""
        slots = self._live(slots)
        api.initialize(
            self.tensors, self._geometry, self._backend, states, slots,
            fmt=self._format, seed=self.seed, checks=debug(), head_offset=self.head_offset, ids_name="slots",
        )

    def reset(self, slots: torch.Tensor) -> None:
        """Start `slots` from a zero state (a request with no prefill)."""
        debug()
        slots = self._slots(slots)
        zero = torch.zeros(1, self.num_heads, self.head_dim, self.state_dim, device=self.device)
        self.prefill_init(zero.expand(slots.numel(), -1, -1, -1), slots)

    def decode(
        self, x, dt, A, B, C, D, dt_bias, slots, out=None, *, num_accepted_tokens=None, cu_seqlens=None
    ) -> torch.Tensor:
        """One decode step; returns bf16 [batch, heads, P] (`out` if given: pass it when
        capturing a CUDA graph). Live ids must be allocated and unique, checked only with
        REPLAYSSM_DEBUG=1. Pending mode: arguments and layouts (dense, or varlen with
        `cu_seqlens`) as for `selective_state_update_replayssm` (docs/format.md section 5b)."""
        checks = debug()
        direct = not checks and self._direct and not torch.compiler.is_compiling()
        # The eager fast path first (ids as `_slots` returns them, at most max_batch rows).
        if (
            direct and out is not None and not self.spec_tokens and num_accepted_tokens is None and cu_seqlens is None
            and api.direct_decode(self.tensors, self.num_heads, self.num_groups, self._backend, x, dt, A, B, C, D,
                                   dt_bias, slots, out, self._format, self.seed, self._scratch, self.head_offset)
        ):  # fmt: skip
            object.__setattr__(self, "_last_A", A)  # as at the end
            return out
        given, slots = slots, self._rows(slots, checks)
        if not self.spec_tokens and (num_accepted_tokens is not None or cu_seqlens is not None):
            raise ValueError(
                "num_accepted_tokens and cu_seqlens are pending-mode arguments; this cache has spec_tokens=0 "
                "(separate mode): build it with spec_tokens=k for speculative decoding"
            )
        try_direct = direct and (out is None or slots is not given)  # else the fast path above tried these
        if out is None:  # pending mode: [batch, max_seqlen, heads, P], varlen [tokens, heads, P]
            rows = (slots.numel(), self.max_seqlen) if self.spec_tokens else (slots.numel(),)
            lead = (x.shape[0],) if cu_seqlens is not None and isinstance(x, torch.Tensor) else rows
            out = torch.empty(*lead, self.num_heads, self.head_dim, dtype=torch.bfloat16, device=self.device)
        if not self.spec_tokens:
            api.decode(
                self.tensors, self._geometry, self._backend, x, dt, A, B, C, D, dt_bias, slots, out,
                fmt=self._format, seed=self.seed, checks=checks, scratch=self._scratch, head_offset=self.head_offset,
                try_direct=try_direct, ids_name="slots",
            )
        # The eager fast path of the dense layout (api.direct_decode_pending), else the op.
        elif not (
            direct and cu_seqlens is None
            and api.direct_decode_pending(self.tensors, self.num_heads, self.num_groups, self._backend, x, dt, A, B, C,
                                           D, dt_bias, slots, out, self._format, self.seed, self.max_seqlen,
                                           num_accepted_tokens, self.head_offset)
        ):  # fmt: skip
            api.decode_pending(
                self.tensors, self._geometry, self._backend, x, dt, A, B, C, D, dt_bias, slots, out,
                fmt=self._format, seed=self.seed, checks=checks, max_seqlen=self.max_seqlen,
                num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, head_offset=self.head_offset,
                own_seqlen=True, ids_name="slots",
            )
        # Not `self._last_A = A`: torch 2.13's dynamo recurses without end into the attrs
        # __setattr__ of this class (the `device` converter) and breaks the graph.
        object.__setattr__(self, "_last_A", A)
        return out

    def accept(self, slots, num_accepted_tokens, A: torch.Tensor | None = None) -> None:
        """Pending mode: commit the verdict on each row's previous call without new tokens,
        with the bits passing it to the next `decode` would give. A commit may fold the
        checkpoint, which needs `A` (default: the last decode call's)."""
        checks = debug()
        if not self.spec_tokens:
            raise ValueError("accept is pending mode's: this cache has spec_tokens=0 (separate mode)")
        slots = self._rows(slots, checks)
        A = self._default_A(A, slots, "accept")
        # No tokens: empty x, dt, B, C and out, every row's cu_seqlens span empty.
        h, dev, bf = self.num_heads, self.device, torch.bfloat16
        x, out = (torch.empty(0, h, self.head_dim, dtype=bf, device=dev) for _ in range(2))
        BC = torch.empty(0, self.num_groups, self.state_dim, dtype=bf, device=dev)
        dt, D = torch.empty(0, h, device=dev), torch.zeros(h, device=dev)
        cu = torch.zeros(slots.numel() + 1, dtype=torch.int32, device=dev)
        api.decode_pending(
            self.tensors, self._geometry, self._backend, x, dt, A, BC, BC, D, D, slots, out,
            fmt=self._format, seed=self.seed, checks=checks, max_seqlen=self.max_seqlen,
            num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu, head_offset=self.head_offset,
            own_seqlen=True, own_cu=True, ids_name="slots",
        )

    def materialize(self, slots: torch.Tensor, A: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 state [n, heads, head_dim, state_dim] of `slots` after their committed tokens (into
        `out` if given; padding ids: zeros). Live ids as for `prefill_init`; `A` as for `accept`."""
        debug()
        slots = self._live(slots)
        return api.materialize(
            self.tensors, self._geometry, self._backend, slots, self._default_A(A, slots, "materialize"), out,
            max_seqlen=self.max_seqlen if self.spec_tokens else None, ids_name="slots",
        )

    def warmup(self) -> list[str]:
        """Compile every kernel variant this cache launches (before graph capture); their names."""
        debug()
        warm = getattr(self._backend, "warmup", None)
        return list(warm(self)) if warm else []

    def __repr__(self) -> str:
        """Geometry, format, device, backend and slots in use / capacity (no tensor contents)."""
        parts = [
            f"num_slots={self.num_slots}", f"num_heads={self.num_heads}", f"num_groups={self.num_groups}",
            f"state_dtype={self.state_dtype!r}", f"device={str(self.device)!r}",
            f"backend={self.backend_name!r}", f"seed={self.seed}", f"max_batch={self.max_batch}",
        ]
        if (self.head_dim, self.state_dim) != (L.HEAD_DIM, L.STATE_DIM):
            parts += [f"head_dim={self.head_dim}", f"state_dim={self.state_dim}"]
        conv = None if self.conv_state_shape is None else tuple(self.conv_state_shape)
        optional = (("head_offset", self.head_offset), ("spec_tokens", self.spec_tokens),
                    ("slot_padding", self.slot_padding), ("conv_state_shape", conv))  # fmt: skip
        parts += [f"{name}={value}" for name, value in optional if value is not None and value != 0]
        parts.append(f"slots_in_use={self.allocator.num_used}/{self.allocator.capacity}")
        return f"ReplaySSMCache({', '.join(parts)})"

    @property
    def format(self) -> Format:
        """The read-copy format (`replayssm.formats.Format`) of `state_dtype`."""
        return self._format

    @property
    def backend_name(self) -> str:
        """The backend that runs this cache's operations: "kernels" or "reference"."""
        return self._backend.name

    @property
    def max_seqlen(self) -> int:
        """Tokens a row may bring per decode call: spec_tokens + 1 (1 in separate mode)."""
        return self.spec_tokens + 1

    @property
    def positions(self) -> torch.Tensor:
        """Tokens decoded since each slot's last init: int32 [num_slots], or [num_slots, 2]
        (committed, pending) in pending mode; the cache tensor itself, not a copy."""
        return self.tensors[L.POSITIONS]

    def bytes_per_slot(self) -> int:
        """Bytes of replayssm state per slot (cache indices 1.., excluding the conv state)."""
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.tensors[1:])

    # -- slot hand-off (replayssm/handoff.py; docs/format.md "Slot hand-off") --------------
    def _handoff_ids(self, name: str, slots) -> torch.Tensor:
        """Slot ids as a 1-D integer tensor; lists and ints stay on the host (no GPU sync)."""
        if isinstance(slots, torch.Tensor):
            if slots.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be int32 or int64; got {slots.dtype}")
            return slots.reshape(-1)
        return chk.id_list(name, slots)

    def _check_handoff_live(self, ids, name: str, *, unique: bool = True) -> None:
        """Every id in [1, num_slots - 1], allocated and (with `unique`) named once; ids a
        tensor (a host read) or its values."""
        values = [int(v) for v in ids.tolist()] if isinstance(ids, torch.Tensor) else ids
        handoff.check_host_ids(name, values, self.num_slots, unique=unique)
        stray = sorted({s for s in values if not self.allocator.is_allocated(s)})
        if stray:
            raise ValueError(f"{name} must be allocated slots; slot(s) {stray} are not allocated; got {values}")

    def copy_slots(self, src, dst) -> None:
        """Copy every per-slot tensor of slots `src` into the allocated slots `dst`. Ids on
        the GPU are checked only with REPLAYSSM_DEBUG=1, so the copy can be captured (once a
        first call has built the copy kernel's table)."""
        debug()
        src, dst = self._handoff_ids("src", src), self._handoff_ids("dst", dst)
        # Ids are read back when both are on the host; the layer function does when src is.
        if src.device.type == "cpu" and dst.device.type != "cpu":
            src = src.to(self.tensors[L.CHECKPOINT].device)
        copy_slots((self,), src, dst)

    def fork(self, src, n: int = 1) -> torch.Tensor:
        """Allocate `n` slots per slot of `src` and copy it into them; returns the new ids
        (int32 on the cache device), the forks of src[i] at [i * n, (i + 1) * n)."""
        debug()
        chk.integer("n", n, low=1)
        src = self._handoff_ids("src", src)
        self._check_handoff_live(src, "src")
        dst = self.allocate(n * src.numel())  # raises before changing anything if too few are free
        copy_slots((self,), src.to(self.device, torch.int64).repeat_interleave(n), dst)
        return dst

    def snapshot(self, src, dst, A: torch.Tensor | None = None) -> None:
        """Start the allocated slots `dst` as if prefilled with the materialized states of
        slots `src` (`A` as for `materialize`). src and dst unique, allocated, disjoint."""
        checks = debug()
        src, dst = self._handoff_ids("src", src), self._handoff_ids("dst", dst)
        s, d = handoff.validate_pair(src, dst, self.tensors[L.CHECKPOINT].device, self.num_slots)
        self._check_handoff_live(src, "src")
        self._check_handoff_live(dst, "dst")
        states = self.materialize(s, A)
        api.initialize(
            self.tensors, self._geometry, self._backend, states, d, fmt=self._format, seed=self.seed, checks=checks,
            head_offset=self.head_offset,
        )

    def export(self, slots, compact: bool = False, A: torch.Tensor | None = None, *, non_blocking: bool = False) -> dict:
        """Host copies of every per-slot tensor of `slots`: {name: [n, ...]}, names as
        layout.tensor_specs gives them; `compact=True`: the materialized FP32 {"state": [n,
        heads, head_dim, state_dim]} (`A` as for `materialize`) alone."""
        debug()
        ids = self._handoff_ids("slots", slots)
        self._check_handoff_live(ids, "slots")  # always; the layer function: host ids only
        d = ids.to(self.device, torch.int64)
        if not compact:
            return export_slots((self,), d, non_blocking=non_blocking)[0]
        states = self.materialize(d, A)
        host = handoff.host_empty(states.shape, states.dtype)
        host.copy_(states, non_blocking=non_blocking and host.is_pinned())
        handoff.finish(self.tensors, non_blocking)
        return {handoff.COMPACT_KEY: host}

    def import_(self, data: dict, slots) -> None:
        """Write `export`ed data into the allocated slots `slots` (one per exported slot),
        or for the compact form initialize them from it; everything is checked first."""
        debug()
        ids = self._handoff_ids("slots", slots)
        self._check_handoff_live(ids, "slots")  # always, as in `export`
        import_slots((self,), [data], ids.to(self.device, torch.int64))


# -- slot hand-off over every layer of a model (docs/format.md "Slot hand-off") -------------
def _check_layers(caches: Sequence, backend: str) -> tuple[torch.device, bool] | None:
    """The one device (with its index) of caches with one num_slots and whether the copy
    kernel serves them (`handoff.use_kernel`); None for no caches."""
    if isinstance(caches, ReplaySSMCache) or not isinstance(caches, Sequence):
        raise TypeError(f"caches must be a sequence of ReplaySSMCache; got {type(caches).__name__}")
    for i, c in enumerate(caches):
        if not isinstance(c, ReplaySSMCache):
            raise TypeError(f"caches[{i}] must be a ReplaySSMCache; got {type(c).__name__}")
    check_backend(backend)
    if not caches:
        return None
    first = caches[0]
    device = first.tensors[L.CHECKPOINT].device
    for i, c in enumerate(caches):
        if c.num_slots != first.num_slots or c.tensors[L.CHECKPOINT].device != device:
            raise ValueError(
                f"caches must share num_slots and device; caches[{i}] has {c.num_slots} slots on "
                f"{c.tensors[L.CHECKPOINT].device}, caches[0] {first.num_slots} on {device}"
            )
    return device, handoff.use_kernel(device, backend, caches)


def copy_slots(caches: Sequence, src, dst, *, backend: str = "auto") -> None:
    """`ReplaySSMCache.copy_slots(src, dst)` over all layers' caches (one num_slots, one
    device) in one copy-kernel launch. `backend`: "auto" the kernel where it can run and no
    cache chose backend="reference"; "kernels" the kernel or a ValueError; "reference"
    per-tensor copies."""
    if (layers := _check_layers(caches, backend)) is None:
        return
    device, kernel = layers
    first = caches[0]
    src_t, dst_t = first._handoff_ids("src", src), first._handoff_ids("dst", dst)  # lists stay on the host
    s, d = handoff.validate_pair(src_t, dst_t, device, first.num_slots, keep_dtype=kernel)
    if src_t.device.type == "cpu" or debug():
        s_ids, d_ids = [int(v) for v in src_t.tolist()], [int(v) for v in dst_t.tolist()]  # one read for every layer
        for c in caches:
            c._check_handoff_live(s_ids, "src", unique=False)
            c._check_handoff_live(d_ids, "dst")
    if kernel:
        handoff.copy_plan(caches).copy(s, d)
        return
    for c in caches:
        handoff.copy_rows(c.tensors, s, d)


def _layer_ids(caches: Sequence, slots, device: torch.device) -> torch.Tensor:
    """`slots` in range, unique and allocated in every layer (ids on the device checked
    only with REPLAYSSM_DEBUG=1), as int64 on the device."""
    first = caches[0]
    ids = first._handoff_ids("slots", slots)  # lists stay on the host
    d = handoff.validate_slots(ids, device, first.num_slots)
    if ids.device.type == "cpu" or debug():
        values = [int(v) for v in ids.tolist()]  # one read for every layer
        for c in caches:
            c._check_handoff_live(values, "slots")
    return d


def export_slots(caches: Sequence, slots, *, non_blocking: bool = False, backend: str = "auto") -> list[dict[str, torch.Tensor]]:
    """`ReplaySSMCache.export(slots)` over all layers' caches, a dict per layer. With the
    kernel (`backend` as for `copy_slots`) every tensor is a view of one pinned host buffer
    (one gather launch, one device-to-host copy)."""
    if (layers := _check_layers(caches, backend)) is None:
        return []
    device, kernel = layers
    ids = _layer_ids(caches, slots, device)
    if kernel:
        plan = handoff.copy_plan(caches)
        return handoff.export_staged(plan, [c.tensors for c in caches], [c.format for c in caches], ids, non_blocking)
    data = [handoff.export_rows(c.tensors, ids, c.format, True) for c in caches]
    handoff.finish(caches[0].tensors, non_blocking)
    return data


def import_slots(caches: Sequence, data: Sequence[dict], slots, *, backend: str = "auto") -> None:
    """`ReplaySSMCache.import_(data[i], slots)` for every layer i, everything checked
    first. `export_slots`' one buffer goes back in one host-to-device copy and one scatter
    launch (`backend` as for `copy_slots`)."""
    if (layers := _check_layers(caches, backend)) is None:
        return
    device, kernel = layers
    if isinstance(data, dict) or not isinstance(data, Sequence):
        raise TypeError(f"data must be a sequence of dicts (one per cache, from export_slots); got {type(data).__name__}")
    if len(data) != len(caches):
        raise ValueError(f"data must hold one dict per cache; got {len(data)} for {len(caches)} caches")
    ids = _layer_ids(caches, slots, device)
    # Drafts awaiting a verdict must fit each cache's max_seqlen (decode trusts it).
    compact = [handoff.check_export(d, c.tensors, c.format, ids.numel(), c.max_seqlen) for c, d in zip(caches, data)]
    if kernel and not any(compact):
        plan = handoff.copy_plan(caches)
        if handoff.import_staged(plan, [c.tensors for c in caches], [c.format for c in caches], data, ids):
            return
    staged = [handoff.stage_import(c.tensors, d, small, c.format) for c, d, small in zip(caches, data, compact)]
    for c, d, small, st in zip(caches, data, compact, staged):
        handoff.import_rows(
            c.tensors, c._geometry, c._backend, d, ids, small,
            fmt=c.format, seed=c.seed, checks=debug(), head_offset=c.head_offset, staged=st,
        )  # fmt: skip


__all__ = ["ReplaySSMCache", "NULL_SLOT", "copy_slots", "export_slots", "import_slots"]
