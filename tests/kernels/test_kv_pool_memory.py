"""The CPU KV pool's memory (`troupe.kernels.base.zeros`): zero, aligned, committed only where written, on
4 KiB pages (the weight arena's memory, advised for huge pages, comes from the same helper)."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from troupe.kernels.base import HUGE_PAGE, anonymous_bytes, zeros

MIB = 1 << 20


def _resident_bytes() -> int:
    """This process's resident set, from /proc (Linux only)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _advised_for_huge_pages(address: int) -> bool:
    """Whether the mapping holding `address` carries the `hg` (MADV_HUGEPAGE) flag in /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_pool_is_zero_aligned_and_shaped() -> None:
    """Every dtype the cpu set keeps a pool in: the requested shape, all zeros, on a 2 MiB boundary."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        pool = zeros((5, 3, 64, 16), dtype)
        assert pool.shape == (5, 3, 64, 16) and pool.dtype == dtype and pool.is_contiguous()
        assert pool.data_ptr() % HUGE_PAGE == 0
        assert not pool.any()
        pool[4, 2, 63, 15] = 1  # the last element is writable: the view covers the whole pool
        assert pool.sum().item() == 1


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_pool_memory_is_committed_on_first_write() -> None:
    """A 512 MiB pool adds almost nothing to the resident set until written; writing one 1 MiB block
    commits about that block, and the pool is not advised for huge pages while the arena's memory is."""
    before = _resident_bytes()
    pool = zeros((512, 256, 1024), torch.float32)  # 512 MiB, 1 MiB per block
    allocated = _resident_bytes()
    assert allocated - before < 16 * MIB, (allocated - before) / MIB
    pool[100].fill_(1.0)
    written = _resident_bytes()
    assert MIB <= written - allocated <= 3 * MIB, (written - allocated) / MIB
    assert pool[100].eq(1.0).all() and not pool[99].any() and not pool[101].any()
    assert not _advised_for_huge_pages(pool.data_ptr())
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert _advised_for_huge_pages(anonymous_bytes(HUGE_PAGE, huge_pages=True).data_ptr())


def test_anonymous_bytes_outlives_its_mapping_object() -> None:
    """The memory stays valid as long as a view of it lives (the mmap object is held by the tensor)."""
    view = anonymous_bytes(3 * MIB, huge_pages=False)[MIB:2 * MIB]
    view.fill_(7)
    gc.collect()
    assert view.numel() == MIB and int(view.sum()) == 7 * MIB
