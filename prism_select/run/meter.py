"""The run's stage accounting: each stage's seconds (``timings``) and memory peaks
(``info``: ``host_peak_mib_by_stage``, on CUDA ``gpu_peak_bytes_by_stage`` and
``gpu_alloc_retries_by_stage``), recorded as each stage ends; both dicts go to run.json."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..gradients import host_peak_mib


def summarize(xs: list) -> dict:
    """``{"min", "max", "mean"}`` of ``xs`` for run.json (``{}`` for none)."""
    if not xs:
        return {}
    return {"min": min(xs), "max": max(xs), "mean": sum(xs) / len(xs)}


@dataclass
class StageMeter:
    """Where a run's stages record their time and memory: ``timings`` and ``info`` are the
    run's own dicts (:class:`prism_select.run.RunContext`), ``device`` the model's."""

    timings: dict
    info: dict
    device: torch.device
    #: the finished stages, in order (:meth:`stage_peak`; a failed run names its last one)
    stages: list = field(default_factory=list)
    _alloc_retries: int = 0  # the CUDA allocator's retries when the last stage ended (stage_peak)

    def __post_init__(self):
        if self.device.type == "cuda":  # a model loaded once for several runs (compare) has counted before
            self._alloc_retries = int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))

    def end_stage(self, stage: str, started: float) -> None:
        """A baseline's own stage is over: its seconds since ``started`` (``perf_counter``)
        under ``timings[stage + "_s"]``, and its memory peaks (:meth:`stage_peak`)."""
        self.timings[f"{stage}_s"] = time.perf_counter() - started
        self.stage_peak(stage)

    def stage_peak(self, stage: str) -> None:
        """At the end of a stage (the memory plan's stage names: direction, fit, scoring;
        ``split_half``: the split-half damping check;
        a baseline's own stages by the names of their timings, e.g. IF-Guide's ``target``
        and ``token_scores``), record the process's host high-water mark so far under
        ``host_peak_mib_by_stage[stage]`` (resident memory, MiB; a value above the previous
        stage's was set by this stage) and, on CUDA, the GPU peak since the last stage under
        ``gpu_peak_bytes_by_stage[stage]`` and the allocator's retries under
        ``gpu_alloc_retries_by_stage[stage]``, starting the next stage's count."""
        self.stages.append(stage)
        peak = host_peak_mib()
        if peak is not None:
            self.info.setdefault("host_peak_mib_by_stage", {})[stage] = round(peak, 1)
        dev = self.device
        if dev.type != "cuda":
            return
        peaks = self.info.setdefault("gpu_peak_bytes_by_stage", {})
        peaks[stage] = max(peaks.get(stage, 0), torch.cuda.max_memory_allocated(dev))
        # the caching allocator's retries (a failed allocation that freed its cached blocks
        # and synchronised the device before trying again): a stage near its memory limit
        # pays them in time, not in peak bytes
        retries = int(torch.cuda.memory_stats(dev).get("num_alloc_retries", 0))
        by_stage = self.info.setdefault("gpu_alloc_retries_by_stage", {})
        by_stage[stage] = by_stage.get(stage, 0) + retries - self._alloc_retries
        self._alloc_retries = retries
        torch.cuda.reset_peak_memory_stats(dev)
