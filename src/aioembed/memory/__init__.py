"""Memory: the receive pool, its block allocator, and write planning."""

from aioembed.memory.allocator import AllocatorStats, BlockAllocator
from aioembed.memory.plan import FieldSpan, RowRun, plan_row_runs, plan_writes
from aioembed.memory.pool import BlockPool

__all__ = ["AllocatorStats", "BlockAllocator", "BlockPool", "FieldSpan", "RowRun", "plan_row_runs", "plan_writes"]
