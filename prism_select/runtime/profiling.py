"""Where a long loop's time goes, on request: ``PRISM_SELECT_PROFILE=DIR``.

With the variable set, each step loop of a run (the target direction's batches, every
pass of the curvature fit, the scoring) is profiled with ``torch.profiler`` over a few
of its steps: it skips :data:`SKIP` steps (warm-up, CUDA graph captures), then records
:data:`ACTIVE` steps (``PRISM_SELECT_PROFILE_STEPS=SKIP,ACTIVE`` changes both), and
writes ``DIR/<loop>-rank<r>-<n>.txt``: the operators and kernels with the most device
time (CPU time without a GPU) and the recorded steps' wall time. Without the variable
nothing is recorded. Profiling slows the recorded steps, so a run's stage
timings are not comparable with an unprofiled run's.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from . import distributed

ENV = "PRISM_SELECT_PROFILE"
SKIP, ACTIVE = 3, 4
#: rows of the written table
ROWS = 40

_written: dict = {}


def _window() -> tuple:
    raw = os.environ.get(ENV + "_STEPS")
    if not raw:
        return SKIP, ACTIVE
    skip, active = (int(x) for x in raw.split(","))
    return max(skip, 0), max(active, 1)


def steps(name: str, items):
    """Yield from ``items``, profiling a few of them when ``PRISM_SELECT_PROFILE`` is set
    (module docstring); ``name`` names the loop in the file written."""
    out = os.environ.get(ENV)
    if not out:
        yield from items
        return

    skip, active = _window()
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof, t0, n = None, None, 0
    try:
        for item in items:
            if n == skip:
                if cuda:
                    torch.cuda.synchronize()
                prof = profile(activities=acts)
                prof.__enter__()
                t0 = time.perf_counter()
            yield item
            n += 1
            if prof is not None and n == skip + active:
                _finish(prof, t0, name, cuda, active, distributed.rank(), out)
                prof = None
    finally:
        if prof is not None:  # the loop ended inside the window
            _finish(prof, t0, name, cuda, n - skip, distributed.rank(), out)


def _finish(prof, t0, name: str, cuda: bool, recorded: int, rank: int, out: str):
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prof.__exit__(None, None, None)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "loop"
    k = _written[(out, slug, rank)] = _written.get((out, slug, rank), 0) + 1
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=ROWS)
    path = Path(out) / f"{slug}-rank{rank}-{k}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{name}: {recorded} steps recorded, {wall:.3f} s wall ({wall / max(recorded, 1):.4f} s a step)\n"
                    + table)
