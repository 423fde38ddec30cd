"""Write planning: which bytes go where, coalesced into as few write ops as possible.

Pure functions. The source and destination are each a sequence of rows addressed through a
block list (or directly, for a contiguous source); runs that are adjacent on *both* sides
merge into one op, so a contiguous allocation costs one op per field however many blocks it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aioembed.errors import PlanError
from aioembed.transports.base import WriteOp

__all__ = ["FieldSpan", "RowRun", "plan_inline", "plan_row_runs", "plan_writes"]


@dataclass(frozen=True, slots=True)
class RowRun:
    """``count`` consecutive rows from source row ``src_row`` to destination row ``dst_row``."""

    src_row: int
    dst_row: int
    count: int


@dataclass(frozen=True, slots=True)
class FieldSpan:
    """Where one field lives on both sides: base addresses and bytes per row."""

    src_base: int
    dst_base: int
    row_bytes: int


def _check_blocks(name: str, blocks: Sequence[int], start: int, num_tokens: int, block_size: int) -> None:
    capacity = len(blocks) * block_size
    if start < 0 or start + num_tokens > capacity:
        raise PlanError(
            f"{name} blocks hold {capacity} tokens ({len(blocks)} x {block_size}), "
            f"cannot address tokens [{start}, {start + num_tokens})"
        )


def plan_row_runs(
    *,
    num_tokens: int,
    block_size: int,
    dst_blocks: Sequence[int],
    dst_start: int = 0,
    src_blocks: Sequence[int] | None = None,
    src_start: int = 0,
) -> list[RowRun]:
    """Row runs moving tokens ``[src_start, src_start + num_tokens)`` of the source to
    tokens ``[dst_start, ...)`` of the destination block list.

    ``src_blocks=None`` means the source is contiguous (token ``i`` is row ``i``). A partial
    last block only moves the rows that exist. O(blocks touched).
    """
    if num_tokens < 0 or block_size < 1:
        raise PlanError(f"bad plan: num_tokens={num_tokens}, block_size={block_size}")
    _check_blocks("destination", dst_blocks, dst_start, num_tokens, block_size)
    if src_blocks is not None:
        _check_blocks("source", src_blocks, src_start, num_tokens, block_size)
    elif src_start < 0:
        raise PlanError(f"source start {src_start} is negative")

    runs: list[RowRun] = []
    run_src = run_dst = run_count = 0  # the run being extended (plain ints: a RowRun per block is slow)
    done = 0
    while done < num_tokens:
        s_tok = src_start + done
        d_tok = dst_start + done
        d_blk, d_off = divmod(d_tok, block_size)
        d_row = dst_blocks[d_blk] * block_size + d_off
        step = min(num_tokens - done, block_size - d_off)
        if src_blocks is None:
            s_row = s_tok
        else:
            s_blk, s_off = divmod(s_tok, block_size)
            s_row = src_blocks[s_blk] * block_size + s_off
            step = min(step, block_size - s_off)
        if run_count and run_src + run_count == s_row and run_dst + run_count == d_row:
            run_count += step
        else:
            if run_count:
                runs.append(RowRun(run_src, run_dst, run_count))
            run_src, run_dst, run_count = s_row, d_row, step
        done += step
    if run_count:
        runs.append(RowRun(run_src, run_dst, run_count))
    return runs


def plan_writes(runs: Sequence[RowRun], fields: Sequence[FieldSpan]) -> list[WriteOp]:
    """Byte-level write ops for every field, one op per (field, run)."""
    return [
        WriteOp(
            src=f.src_base + r.src_row * f.row_bytes,
            dst=f.dst_base + r.dst_row * f.row_bytes,
            length=r.count * f.row_bytes,
        )
        for f in fields
        for r in runs
    ]


def plan_inline(field_bytes: Sequence[int | None], limit: int) -> tuple[int, ...]:
    """The fields (indices, increasing) whose rows of a round ride inside its STATUS instead of a write.

    ``field_bytes``: each field's bytes in the round, ``None`` where it cannot go inline (its source is not
    in CPU memory: it is written). Smallest first while the total stays within ``limit``. The round always
    keeps a write: of its ``None`` fields if it has any, else of its largest field (the first of equals), so
    that only small fields, whose transfers each cost more than their bytes, leave the transport.
    """
    if limit <= 0 or len(field_bytes) < 2:
        return ()
    written = -1
    if None not in field_bytes:
        written = field_bytes.index(max(n for n in field_bytes if n is not None))
    chosen: list[int] = []
    for n, i in sorted((n, i) for i, n in enumerate(field_bytes) if i != written and n is not None):
        if n > limit:
            break
        limit -= n
        chosen.append(i)
    chosen.sort()
    return tuple(chosen)
