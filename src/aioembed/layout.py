"""Per-token fields of a request: what one token's row holds."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch

from aioembed.errors import LayoutError

__all__ = ["Field", "Layout", "bytes_are_values", "plain_values"]


@dataclass(frozen=True)
class Field:
    """One per-token field: the shape of a single token's row and its dtype.

    ``Field((3584,), torch.bfloat16)`` is one embedding row; ``Field((), torch.int32)``
    is a scalar per token (a token id).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in shape):
            raise LayoutError(f"field shape must be positive ints, got {self.shape!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"field dtype must be a torch.dtype, got {self.dtype!r}")
        object.__setattr__(self, "shape", shape)

    # Computed once (kept in the instance's __dict__, not a dataclass field: asdict() and pickles are as
    # before): every request's planning asks for them several times per field.
    @cached_property
    def row_elements(self) -> int:
        """Number of elements in one token's row."""
        return math.prod(self.shape)

    @cached_property
    def row_bytes(self) -> int:
        """Bytes in one token's row."""
        return self.row_elements * self.dtype.itemsize

    def rows_over(self, raw: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``num_tokens`` rows of this field over ``raw``, a contiguous uint8 tensor of exactly their bytes
        (memory allocated as bytes: on huge pages, or lent by a cache); no copy."""
        return raw.view(self.dtype).view((num_tokens, *self.shape))


class Layout(Mapping[str, Field]):
    """The named per-token fields of a request, in declaration order.

    Order matters: it fixes the order of the registered pool regions and is part of the
    fingerprint, so two processes must declare fields in the same order.
    """

    __slots__ = ("_bytes_per_token", "_fields", "_fingerprint")

    def __init__(self, **fields: Field) -> None:
        if not fields:
            raise LayoutError("a Layout needs at least one field")
        for name, f in fields.items():
            if not name.isidentifier():
                raise LayoutError(f"field name {name!r} must be a Python identifier (letters, digits, '_')")
            if not isinstance(f, Field):
                raise LayoutError(f"field {name!r} must be a Field, got {type(f).__name__}")
        self._fields: dict[str, Field] = dict(fields)
        canon = ";".join(
            f"{name}:{'x'.join(map(str, f.shape)) or 'scalar'}:{str(f.dtype).removeprefix('torch.')}"
            for name, f in self._fields.items()
        )
        self._fingerprint = "v1-" + hashlib.sha256(canon.encode()).hexdigest()[:32]
        self._bytes_per_token = sum(f.row_bytes for f in self._fields.values())

    def __getitem__(self, name: str) -> Field:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}=Field({f.shape}, {f.dtype})" for n, f in self._fields.items())
        return f"Layout({inner})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other._fingerprint == self._fingerprint

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    @property
    def fingerprint(self) -> str:
        """Stable digest of names, shapes, dtypes and order; peers must agree on it."""
        return self._fingerprint

    @property
    def bytes_per_token(self) -> int:
        """Bytes of all fields for one token (a layout never changes: summed once, read several times per room)."""
        return self._bytes_per_token

    def validate(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Check ``tensors`` against the layout and return their common token count.

        Every field must be present (and nothing else), with the right dtype and row shape,
        and all fields must have the same number of tokens (rows).
        """
        missing = [n for n in self._fields if n not in tensors]
        extra = [n for n in tensors if n not in self._fields]
        if missing or extra:
            raise LayoutError(
                f"tensors do not match the layout: missing fields {missing}, unexpected fields {extra}; "
                f"expected exactly {list(self._fields)}"
            )
        num_tokens: int | None = None
        first = ""
        for name, f in self._fields.items():
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"field {name!r}: expected a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:
                raise LayoutError(f"field {name!r}: expected a dense (strided) tensor, got layout {t.layout} "
                                  "(call .to_dense() first)")
            if t.dtype != f.dtype:
                raise LayoutError(f"field {name!r}: expected dtype {f.dtype}, got {t.dtype}")
            if t.dim() != 1 + len(f.shape) or tuple(t.shape[1:]) != f.shape:
                raise LayoutError(
                    f"field {name!r}: expected shape (tokens, {', '.join(map(str, f.shape))}) "
                    f"-> row shape {f.shape}, got {tuple(t.shape)}"
                )
            n = int(t.shape[0])
            if num_tokens is None:
                num_tokens, first = n, name
            elif n != num_tokens:
                raise LayoutError(
                    f"field {name!r} has {n} tokens but field {first!r} has {num_tokens}; "
                    "every field needs the same token count"
                )
        assert num_tokens is not None
        return num_tokens

    def empty(self, num_tokens: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Allocate uninitialised tensors for ``num_tokens`` tokens of every field."""
        return {
            name: torch.empty((num_tokens, *f.shape), dtype=f.dtype, device=device)
            for name, f in self._fields.items()
        }


def bytes_are_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its values as they read: not a conjugate view (``x.conj()`` of a complex
    tensor) or a negative view, which torch applies a bit to when the tensor is read. A transport, and a
    ``memmove``, move bytes: such a tensor is contiguous, yet moving its memory as it lies moves other values."""
    return not (t.is_conj() or t.is_neg())


def plain_values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in contiguous memory that holds them as bytes (a copy unless ``t`` already is that)."""
    return t.resolve_conj().resolve_neg().contiguous()
