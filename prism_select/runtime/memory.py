"""The device's and the host's memory as this process sees it: what it may plan with, what
it can still reserve or allocate, and the cap ``max_gpu_memory`` puts on it.

The planner (:mod:`prism_select.plan`) decides with these figures; the CUDA graphs
(:mod:`prism_select.runtime.graphs`), the eigendecompositions' schedule and LESS's projection
ask them at run time.
"""

from __future__ import annotations

import os

import torch

from ..settings import format_size


def gib(b: float) -> str:
    """A byte count as text (e.g. ``"11.0 GiB"``)."""
    return format_size(b)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the physical memory size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


#: memory held outside this process's tensors below which a plan says nothing about it
#: (this process's own CUDA context alone takes several hundred MB)
HELD_ELSEWHERE_NOTE_BYTES = 1 << 30


def device_memory(device) -> tuple[int, int]:
    """``(bytes this process may plan with, bytes held elsewhere)`` on a CUDA ``device``:
    the device's total less what is in use beyond this process's own reserved memory, i.e.
    memory other processes (a notebook, a server) hold now, and CUDA contexts."""
    free, total = torch.cuda.mem_get_info(device)
    elsewhere = max(total - free - torch.cuda.memory_reserved(device), 0)
    return total - elsewhere, elsewhere


def held_elsewhere_note(device, elsewhere: int) -> str:
    """A sentence for a plan error when other processes hold much of the device ('' else)."""
    if elsewhere < HELD_ELSEWHERE_NOTE_BYTES:
        return ""
    return (f" {gib(elsewhere)} of {device} are held outside this run (other processes such as a notebook "
            "or a server, and CUDA contexts) and were left out of the plan: free them, or choose another GPU "
            "with --device")


def host_share_bytes() -> int:
    """This process's share of the host's available memory: MemAvailable divided among the
    ranks torchrun started on this host (``LOCAL_WORLD_SIZE``), which plan at the same time
    and keep their direction, ``v`` and curvature in the same memory."""
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        local = 1
    return host_available_bytes() // max(local, 1)


#: ``{device: bytes}``: the caps :func:`cap_device_memory` set in this process
_CAPS: dict = {}


def cap_device_memory(device, max_bytes: int | None) -> None:
    """Enforce ``max_gpu_memory`` on this process (the caching allocator refuses more),
    not only plan for it."""
    dev = torch.device(device)
    if max_bytes and dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, max_bytes / total), dev)
        _CAPS[_device_key(dev)] = min(int(max_bytes), total)


def _device_key(dev: torch.device) -> str:
    dev = torch.device(dev)
    return f"cuda:{torch.cuda.current_device() if dev.index is None else dev.index}"


def device_headroom(device) -> int:
    """Bytes this process can still reserve on CUDA ``device``: below its cap
    (:func:`cap_device_memory`, else the device's size) less what it reserves now, and no
    more than the device has free (other processes' memory counted)."""
    dev = torch.device(device)
    limit = _CAPS.get(_device_key(dev)) or torch.cuda.get_device_properties(dev).total_memory
    free, _ = torch.cuda.mem_get_info(dev)
    return max(0, min(limit - torch.cuda.memory_reserved(dev), free))


def allocatable_bytes(device) -> int:
    """Bytes a new allocation on CUDA ``device`` can take in this process: what it may still
    reserve (:func:`device_headroom`: within its cap and the device's free memory) plus the
    blocks its caching allocator holds reserved but unused (after a fit's passes the cache
    keeps most of their peak, which the driver does not count as free)."""
    return int(device_headroom(device) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
