"""The registered receive pool: one contiguous tensor per field, split into blocks.

One tensor per field (not one interleaved buffer) keeps every field's rows contiguous, so a
run of adjacent blocks is one write op and one copy per field, and the pool can be
registered with a transport once, as ``len(layout)`` regions. A large CPU field lies on huge pages
(:mod:`aioembed.memory.huge_pages`): a transport that writes through the kernel pins and walks the
destination's pages on every write, and over shared memory that made an 8192-token NIXL write take
7.4-7.9 ms into ordinary pages against 4.7-5.3 ms into huge ones.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence

import torch

from aioembed.errors import ConfigError, LayoutError, PlanError
from aioembed.layout import Layout, bytes_are_values
from aioembed.memory.huge_pages import zeroed_memory
from aioembed.memory.plan import RowRun, plan_row_runs
from aioembed.transports.base import MemoryRegion

__all__ = ["BlockPool"]


class BlockPool:
    """``num_blocks * block_size`` rows of every field of ``layout``, on ``device``."""

    def __init__(self, layout: Layout, *, num_blocks: int, block_size: int, device: str = "cpu") -> None:
        if num_blocks < 1 or block_size < 1:
            raise PlanError(f"pool needs positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        rows = num_blocks * block_size
        if self.device.type == "cuda":
            visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (self.device.index or 0) >= visible:
                raise ConfigError(f"device={device!r}: this process sees {visible} CUDA device(s)"
                                  + ("" if torch.version.cuda else " (torch was built without CUDA)"))
        try:
            self.tensors: dict[str, torch.Tensor] = {
                name: (f.rows_over(zeroed_memory(rows * f.row_bytes), rows)
                       if self.device.type == "cpu"
                       else torch.zeros((rows, *f.shape), dtype=f.dtype, device=self.device))
                for name, f in layout.items()
            }
        except (RuntimeError, MemoryError) as exc:  # torch's out-of-memory errors are RuntimeErrors
            raise ConfigError(f"the receive pool of {rows} tokens x {layout.bytes_per_token} B = "
                              f"{rows * layout.bytes_per_token} B cannot be allocated on {device} (pool_tokens): "
                              f"{exc}") from exc
        self._row_fields = [(name, f.row_bytes, self.tensors[name].data_ptr()) for name, f in layout.items()
                            if self.device.type == "cpu"]
        """Per field: its name, bytes per row and base address (for :meth:`write_rows`)."""
        if self.device.type != "cpu" and self.tensors:
            # "cuda" is whatever device is current: name the one the pool is on ("cuda:0"), which is what
            # tensors made there report (an out= on it was refused as "on cuda:0; the pool is on cuda").
            self.device = next(iter(self.tensors.values())).device

    @property
    def num_tokens(self) -> int:
        """Rows per field."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of all field tensors together."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def regions(self) -> list[MemoryRegion]:
        """One memory region per field, in layout order, for transport registration."""
        return [MemoryRegion.of_tensor(t) for t in self.tensors.values()]

    def runs(self, blocks: Sequence[int], num_tokens: int, *, start: int = 0) -> list[RowRun]:
        """Row runs of tokens ``[start, start + num_tokens)`` of ``blocks``; ``src_row`` is the
        token index relative to ``start`` and ``dst_row`` the pool row."""
        self._check_ids(blocks)
        return plan_row_runs(num_tokens=num_tokens, block_size=self.block_size, dst_blocks=blocks,
                             dst_start=start)

    def views(self, blocks: Sequence[int], num_tokens: int) -> dict[str, list[torch.Tensor]]:
        """Zero-copy views of the first ``num_tokens`` tokens of ``blocks``: per field, one
        view per run of adjacent blocks, in token order."""
        runs = self.runs(blocks, num_tokens)
        return {
            name: [t[r.dst_row:r.dst_row + r.count] for r in runs] for name, t in self.tensors.items()
        }

    def copy_in(
        self, blocks: Sequence[int], src: Mapping[str, torch.Tensor], *, src_start: int, num_tokens: int
    ) -> None:
        """Copy tokens ``[src_start, src_start + num_tokens)`` of ``src`` into ``blocks``."""
        if src_start < 0 or num_tokens < 0:
            raise PlanError(f"copy_in needs src_start >= 0 and num_tokens >= 0, got {src_start}, {num_tokens}")
        runs = self.runs(blocks, num_tokens)
        for name, t in self.tensors.items():
            s = self._field(src, name)
            if s.dtype != t.dtype or tuple(s.shape[1:]) != tuple(t.shape[1:]):
                raise LayoutError(f"field {name!r}: source is {s.dtype} {tuple(s.shape)}, the pool holds "
                                  f"{t.dtype} rows of shape {tuple(t.shape[1:])}")
            if src_start + num_tokens > s.shape[0]:
                raise PlanError(f"field {name!r}: source has {s.shape[0]} tokens, "
                                f"asked for [{src_start}, {src_start + num_tokens})")
            with torch.no_grad():  # see copy_out
                for r in runs:
                    t[r.dst_row:r.dst_row + r.count].copy_(s[src_start + r.src_row:src_start + r.src_row + r.count])

    def copy_out(
        self, blocks: Sequence[int], num_tokens: int, out: Mapping[str, torch.Tensor], *, out_start: int
    ) -> None:
        """Copy the first ``num_tokens`` tokens of ``blocks`` into ``out[f][out_start:...]``."""
        if out_start < 0 or num_tokens < 0:
            raise PlanError(f"copy_out needs out_start >= 0 and num_tokens >= 0, got {out_start}, {num_tokens}")
        runs = self.runs(blocks, num_tokens)
        for name, t in self.tensors.items():
            o = self._field(out, name)
            if out_start + num_tokens > o.shape[0]:
                raise PlanError(f"field {name!r}: output has {o.shape[0]} tokens, "
                                f"cannot hold [{out_start}, {out_start + num_tokens})")
            if o.dtype != t.dtype or tuple(o.shape[1:]) != tuple(t.shape[1:]):
                raise LayoutError(f"field {name!r}: output is {o.dtype} {tuple(o.shape)}, the pool holds "
                                  f"{t.dtype} rows of shape {tuple(t.shape[1:])}")
            if o.device.type == "cpu" and t.device.type == "cpu" and o.is_contiguous() and bytes_are_values(o):
                # One memmove per run: on few cores it beats torch's threaded copy_ (no pool hop).
                row = self.layout[name].row_bytes
                obase = o.data_ptr() + out_start * row
                tbase = t.data_ptr()
                for r in runs:
                    ctypes.memmove(obase + r.src_row * row, tbase + r.dst_row * row, r.count * row)
                continue
            # Bytes moved, not math recorded: with autograd on, an output that requires grad (a float field) raised
            # "a view of a leaf Variable that requires grad is being used in an in-place operation" after rows had
            # landed, and a source that requires grad made the destination part of its graph, keeping it alive.
            with torch.no_grad():
                for r in runs:
                    o[out_start + r.src_row:out_start + r.src_row + r.count].copy_(t[r.dst_row:r.dst_row + r.count])

    def status_inline_budget(self, setting: int) -> int:
        """The bytes of a round's rows a receiver of this pool takes inside a STATUS (``Hello.status_inline_bytes``,
        announced and enforced alike): ``setting`` on the CPU, where :meth:`write_rows` is a memmove on the loop;
        none elsewhere."""
        return setting if self.device.type == "cpu" else 0

    def write_rows(self, blocks: Sequence[int], rows: Sequence[tuple[int, bytes]], num_tokens: int) -> None:
        """Put ``num_tokens`` packed rows of each ``(field number, bytes)`` of ``rows`` into the first tokens of
        ``blocks``; every entry is checked before any is written. CPU pools only: rows a peer sent inside a
        control frame."""
        if self.device.type != "cpu":
            raise PlanError(f"rows are written into a pool on {self.device} only by a transport")
        fields = self._row_fields
        for i, data in rows:
            if not 0 <= i < len(fields):
                raise PlanError(f"field number {i}: the layout has {len(fields)} fields")
            name, row, _ = fields[i]
            if len(data) != num_tokens * row:
                raise PlanError(f"{len(data)} bytes of field {name!r}, expected {num_tokens} rows of {row} B")
        runs = self.runs(blocks, num_tokens)
        for i, data in rows:
            _, row, base = fields[i]
            src = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value
            assert src is not None  # the address of bytes' own buffer (no copy), never NULL
            for r in runs:
                ctypes.memmove(base + r.dst_row * row, src + r.src_row * row, r.count * row)

    def _field(self, tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise LayoutError(f"missing field {name!r}; the pool's layout has {list(self.layout)}") from None

    def _check_ids(self, blocks: Sequence[int]) -> None:
        n = self.num_blocks
        for b in blocks:
            if not 0 <= b < n:
                raise PlanError(f"block id {b} is outside this pool (0..{n - 1})")
        if len(set(blocks)) != len(blocks):
            raise PlanError("duplicate block ids in a block list")
