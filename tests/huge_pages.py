"""Whether a tensor's memory was advised for transparent huge pages (lora.native.huge_page_copy's promise)."""
from __future__ import annotations

import torch


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte was madvised MADV_HUGEPAGE ("hg" among its VmFlags)."""
    address, inside = t.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:   # a mapping's first line: "start-end perms ..."
                start, end = (int(v, 16) for v in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False
