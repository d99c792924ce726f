"""The plan buffers the plan kernels write and the decode kernels read (no kernel code here,
so a CPU install needs no CuTe DSL)."""

from __future__ import annotations

import torch

from ..reference import Plan

# Int32 words of a pending plan row: slot or -1, c', f_old, nf, live parity, the fold's
# stream key, the row's first token, T_b (kernels/cute/plan.py writes them).
PLAN_COLS = 8


class PlanScratch:
    """Single-token mode's plan of up to `rows` batch rows in `reference.Plan`'s dtypes;
    `plan(batch)`: views of the first `batch` rows (made once per batch size), so a step
    allocates nothing. The next prepare into it overwrites them."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows = rows
        self.device = torch.device(device)
        flags, ints = dict(dtype=torch.bool, device=device), dict(dtype=torch.int64, device=device)
        self.buffers = Plan(*(torch.zeros(rows, **(flags if i in (0, 3) else ints)) for i in range(6)))
        self.words = tuple(t.data_ptr() for t in self.buffers)  # its plan struct as the kernels take it
        self._plans: dict[int, Plan] = {}

    def plan(self, batch: int) -> Plan:
        plan = self._plans.get(batch)
        if plan is None:
            plan = self._plans[batch] = Plan(*(t[:batch] for t in self.buffers))
        return plan


class PendingPlan:
    """Pending mode's plan for up to `rows` batch rows: `buf` (int32 [rows, PLAN_COLS]) and
    the fold's work list (int32 [rows + 1]: a count, zero between calls, then rows)."""

    def __init__(self, rows: int, device: torch.device | str) -> None:
        self.rows = rows
        self.buf = torch.zeros(rows, PLAN_COLS, dtype=torch.int32, device=device)
        self.fold_list = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.words = (self.buf.data_ptr(), self.fold_list.data_ptr())

    def view(self, batch: int) -> torch.Tensor:
        return self.buf[:batch]


__all__ = ["PLAN_COLS", "PlanScratch", "PendingPlan"]
