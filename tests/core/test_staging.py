"""The sender's staging area hands out row ranges, and takes back one whose copy failed."""

from __future__ import annotations

import pytest
import torch

from aioembed import Field, Layout
from aioembed.memory.staging import StagingArea


def test_rows_are_copied_in_and_a_failed_copy_gives_its_range_back() -> None:
    layout = Layout(ids=Field((), torch.int32), emb=Field((4,), torch.bfloat16))
    area = StagingArea(layout, 16, 16)
    bad = {"ids": torch.arange(4, dtype=torch.int32), "emb": torch.zeros(4, 4, dtype=torch.bfloat16).to_sparse()}
    with pytest.raises(RuntimeError):
        area.stage(bad, 4)  # the second field cannot be copied (the first already was)
    assert area.used == 0  # the range went back (it leaked for good)
    src = {"ids": torch.arange(16, dtype=torch.int32), "emb": torch.randn(16, 4).to(torch.bfloat16)}
    staged = area.stage(src, 16)  # the whole area is free again
    assert staged is not None and area.used == 16
    assert all(torch.equal(staged.tensors[n], src[n]) for n in src)
    area.release(staged)
    assert area.used == 0
