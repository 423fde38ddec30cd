"""``aioembed.samples.same_rows``: the bit-for-bit check of the tests, the GPU suite and the bench."""

from __future__ import annotations

import pytest
import torch

from aioembed.samples import same_rows


def _want() -> dict[str, torch.Tensor]:
    return {"emb": torch.arange(60, dtype=torch.float32).reshape(10, 6),
            "ids": torch.arange(10, dtype=torch.int32)}


def test_equal_rows_whole_and_in_pieces() -> None:
    want = _want()
    assert same_rows({k: v.clone() for k, v in want.items()}, want)
    pieces = {k: [v[:3].clone(), v[3:4].clone(), v[4:].clone()] for k, v in want.items()}
    assert same_rows(pieces, want)


def test_a_changed_byte_a_short_field_or_another_dtype_differs() -> None:
    want = _want()
    got = {k: v.clone() for k, v in want.items()}
    got["emb"].view(torch.uint8)[-1, -1] ^= 1
    assert not same_rows(got, want)
    assert not same_rows({k: v[:9].clone() for k, v in want.items()}, want)
    assert not same_rows(dict(want, ids=want["ids"].to(torch.int64)), want)
    assert not same_rows({k: [v[:5].clone()] for k, v in want.items()}, want)


def test_non_contiguous_rows_are_compared_by_value() -> None:
    """Not the memcmp path: a strided view (and, on a GPU host, a tensor on another device) goes through
    ``torch.equal`` of the bytes."""
    want = _want()
    wide = torch.zeros(20, 6)
    wide[::2] = want["emb"]
    got = {"emb": wide[::2], "ids": want["ids"].clone()}
    assert not got["emb"].is_contiguous()
    assert same_rows(got, want)
    wide[4, 0] += 1
    assert not same_rows(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_a_gpu_are_compared_with_rows_on_the_cpu() -> None:
    """Either side may be on the GPU (the bench's checks, a lease's views); the comparison runs there."""
    want = _want()
    on_gpu = {k: v.to("cuda:0") for k, v in want.items()}
    assert same_rows(on_gpu, want)
    assert same_rows(want, on_gpu)
    on_gpu["ids"][3] += 1
    assert not same_rows(on_gpu, want)
    assert not same_rows(want, on_gpu)


@pytest.mark.parametrize("lazy", [torch.Tensor.conj, torch.Tensor._neg_view], ids=["conj", "neg"])
def test_a_conjugate_or_negative_view_is_compared_and_hashed_as_its_values(lazy: object) -> None:
    """``x.conj()`` of a complex field (or a negative view) is contiguous, but its memory holds ``x``'s rows: the
    ``memcmp`` path took it for ``x`` (and found the rows sent as its values different), the ``torch.equal`` path
    raised (a byte view of it is refused), and ``checksum`` hashed ``x``'s bytes."""
    from aioembed.samples import checksum

    x = torch.randn(10, 6, dtype=torch.complex64) if lazy is torch.Tensor.conj else torch.randn(10, 6)
    view = lazy(x)  # type: ignore[operator]
    values = view.resolve_conj().resolve_neg()
    assert view.is_contiguous() and not torch.equal(values, x)
    assert same_rows({"f": values}, {"f": view})
    assert same_rows({"f": view}, {"f": values})
    assert not same_rows({"f": x.clone()}, {"f": view})
    assert not same_rows({"f": view}, {"f": x.clone()})
    wide = torch.zeros(20, 6, dtype=x.dtype)
    wide[::2] = values
    assert same_rows({"f": wide[::2]}, {"f": view})  # the torch.equal path
    assert checksum({"f": view}) == checksum({"f": values})
    assert checksum({"f": view}) != checksum({"f": x})
