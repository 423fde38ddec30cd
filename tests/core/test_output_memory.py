"""Fresh outputs of a copying receive: large CPU fields on huge pages, the rest as ``Layout.empty``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from aioembed import Field, Layout
from aioembed.memory.huge_pages import HUGE_PAGE_BYTES, HUGE_PAGE_MIN_BYTES
from aioembed.memory.output import empty_output

LAYOUT = Layout(
    embeddings=Field((4096,), torch.bfloat16),  # 8 KiB a row: 1024 rows make the 8 MiB threshold
    token_ids=Field((), torch.int32),
    mrope_positions=Field((3,), torch.int64),
)
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    if not THP.exists():
        return None
    found = re.search(r"\[(\w+)\]", THP.read_text())
    return found.group(1) if found else None


def _anon_huge_kib(address: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_fields_have_the_layout_shape_dtype_and_are_contiguous() -> None:
    tokens = 3000
    out = empty_output(LAYOUT, tokens, torch.device("cpu"))
    assert out.keys() == LAYOUT.empty(0).keys()
    for name, f in LAYOUT.items():
        t = out[name]
        assert t.shape == (tokens, *f.shape) and t.dtype == f.dtype and t.is_contiguous(), name
    # Writing every byte of each field leaves the others untouched (no overlap inside the slack).
    for i, name in enumerate(LAYOUT):
        out[name].view(torch.uint8).fill_(i + 1)
    for i, name in enumerate(LAYOUT):
        assert bool((out[name].view(torch.uint8) == i + 1).all()), name


@pytest.mark.skipif(not THP.parent.exists(),
                    reason="this kernel has no transparent huge pages (not Linux, or built without them)")
def test_a_large_field_starts_on_a_huge_page_and_small_ones_are_plain() -> None:
    tokens = HUGE_PAGE_MIN_BYTES // LAYOUT["embeddings"].row_bytes
    out = empty_output(LAYOUT, tokens, torch.device("cpu"))
    big = out["embeddings"]
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0
    for name in ("token_ids", "mrope_positions"):  # 4 / 24 bytes a row: far under the threshold
        assert out[name].storage_offset() == 0
        assert out[name].untyped_storage().nbytes() == out[name].nbytes
    # Just under the threshold: an ordinary allocation.
    small = empty_output(LAYOUT, tokens - 1, torch.device("cpu"))["embeddings"]
    assert small.storage_offset() == 0 and small.untyped_storage().nbytes() == small.nbytes


_HUGE_PAGE_TRIES = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import test_output_memory as t
from aioembed.memory import huge_pages, output, pool
tokens = 4 * huge_pages.HUGE_PAGE_MIN_BYTES // t.LAYOUT["embeddings"].row_bytes
got = {"output_kib": 0, "pool_kib": 0}
for _ in range(int(sys.argv[2])):
    if not got["output_kib"]:
        big = output.empty_output(t.LAYOUT, tokens, torch.device("cpu"))["embeddings"]
        big.view(torch.uint8).fill_(7)
        got["output_kib"] = t._anon_huge_kib(big.data_ptr())
        del big
    if not got["pool_kib"]:  # the pool zeroes its memory as it makes it
        field = pool.BlockPool(t.LAYOUT, num_blocks=tokens // 128, block_size=128).tensors["embeddings"]
        got["pool_kib"] = t._anon_huge_kib(field.data_ptr())
        del field
    print(json.dumps({**got, "plain_kib": t._plain_mapping_huge_kib(),
                      "asking": huge_pages._ADVISOR._madvise is not None}), flush=True)
    if got["output_kib"] and got["pool_kib"]:
        break
"""


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="this kernel grants no transparent huge pages to memory that asks")
def test_a_large_output_field_and_pool_field_are_backed_by_huge_pages_once_written() -> None:
    # The kernel may fail to find a free huge page at a given moment (fragmented memory, defrag
    # "madvise" gives up rather than wait), so one unlucky allocation proves nothing: a few fresh tries,
    # each followed at once by the same question for a plain mapping that asks (mmap + madvise). Outputs
    # that do not ask lose every pair to the plain mapping; a kernel short of huge pages just now loses
    # some pairs on both sides (skip, saying so). The tries run in a fresh process: inside a test worker
    # that had run many other tests, outputs lost every pair in two of five full runs on 2026-11-26 while
    # passing alone and in a fresh process every time (cause not found; the message below says whether
    # the outputs' advisor was still asking).
    import json
    import subprocess

    tries = 6
    done = subprocess.run([sys.executable, "-c", _HUGE_PAGE_TRIES, str(Path(__file__).parent), str(tries)],
                          capture_output=True, text=True, timeout=120, check=True)
    results = [json.loads(line) for line in done.stdout.splitlines()]
    last = results[-1]
    huge = HUGE_PAGE_BYTES // 1024
    if last["output_kib"] >= huge and last["pool_kib"] >= huge:
        return
    plain_granted = sum(r["plain_kib"] >= huge for r in results)
    if plain_granted < len(results):
        pytest.skip(f"the kernel granted a huge page to a plain mapping that asked in {plain_granted} of "
                    f"{len(results)} tries just now: too short of huge pages to tell ({last})")
    lost = " and ".join(k[:-4] + "s" for k in ("output_kib", "pool_kib") if last[k] < huge)
    raise AssertionError(f"{tries} {lost} got no huge page, while a plain mapping that asked right after each did "
                         f"(the advisor {'still asks' if last['asking'] else 'stopped asking after a refusal'})")


def _plain_mapping_huge_kib() -> int:
    """``AnonHugePages`` of a fresh anonymous mapping of 8 MiB advised for huge pages and written."""
    import ctypes
    import mmap

    size = 4 * HUGE_PAGE_BYTES
    with mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
        buf = (ctypes.c_char * size).from_buffer(m)
        address = ctypes.addressof(buf)
        start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        m.madvise(mmap.MADV_HUGEPAGE)
        ctypes.memset(address, 7, size)
        kib = _anon_huge_kib(start)
        del buf
    return kib


def test_refused_advice_falls_back_to_ordinary_pages_and_is_not_asked_again(refused_huge_pages: list[int]) -> None:
    tokens = HUGE_PAGE_MIN_BYTES // LAYOUT["embeddings"].row_bytes
    for _ in range(3):
        big = empty_output(LAYOUT, tokens, torch.device("cpu"))["embeddings"]
        assert big.storage_offset() == 0 and big.shape == (tokens, 4096)
    assert len(refused_huge_pages) == 1
