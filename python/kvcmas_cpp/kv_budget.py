"""The KV budget: the one home of KV byte accounting, in the engine's blocks.

Sequences and stored spans take KV memory in whole blocks of Model.kv_block_rows rows (the core allocates them);
what is in use is read from the core, so rows a sequence reads from a shared span or a fork cost nothing twice. A
reservation is what a holder may still allocate: its rows rounded up to blocks, plus one spare block for a partly
filled first one. The scheduler admits a job only while the in-use bytes, every admitted job's outstanding
reservation and the new one's fit the budget; the prefix cache bounds its entries by their distinct rows; the
server's history prices a nonshared request's rows. All of them count here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol


class KVMemory(Protocol):
    """What the budget reads of a model (kvcmas_cpp.model.Model)."""

    @property
    def kv_budget(self) -> int: ...

    @property
    def kv_block_rows(self) -> int: ...

    @property
    def kv_block_bytes(self) -> int: ...

    @property
    def kv_bytes_in_use(self) -> int: ...


class KVBudget:
    """Byte accounting against a budget of `budget` bytes (default: the model's, Model.kv_budget)."""

    def __init__(self, model: KVMemory, budget: int | None = None) -> None:
        self.model = model
        self.budget = model.kv_budget if budget is None else budget
        self.block_rows = model.kv_block_rows
        self.block_bytes = model.kv_block_bytes

    @property
    def row_bytes(self) -> int:
        """Bytes one row (one token's K and V, every layer) takes inside a block."""
        return self.block_bytes // self.block_rows

    @property
    def in_use(self) -> int:
        """Bytes of the KV blocks that sequences and stored spans hold now (the core's count)."""
        return self.model.kv_bytes_in_use

    @property
    def free(self) -> int:
        return self.budget - self.in_use

    def rows_bytes(self, rows: int) -> int:
        """Bytes of `rows` distinct rows, block rounding left out (what rows cost where blocks are shared)."""
        return rows * self.row_bytes

    def reservation_bytes(self, rows: int) -> int:
        """Bytes reserved for a holder that may grow by `rows` rows: whole blocks, one spare for a partly filled
        first one."""
        return (math.ceil(rows / self.block_rows) + 1) * self.block_bytes

    def reservations_bytes(self, rows: Iterable[int]) -> int:
        """reservation_bytes of each holder, summed (each rounds up on its own)."""
        return sum(self.reservation_bytes(n) for n in rows)

    def fits(self, *reserved: int) -> bool:
        """Whether what is in use plus these reserved bytes stays within the budget."""
        return self.in_use + sum(reserved) <= self.budget

    def max_tokens_fitting(self, n_prompt: int) -> int:
        """The most tokens one holder with this prompt may generate within the budget alone (may be <= 0)."""
        blocks = self.budget // self.block_bytes - 1
        return blocks * self.block_rows - n_prompt
