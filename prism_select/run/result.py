"""``run.json``: a finished run as a typed :class:`Run` (:meth:`Run.to_json` writes the
file's content, :meth:`Run.from_json` reads one back)."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from .. import __version__
from ..runtime import distributed

#: the optional entries written after the stages' records, in this order, where set
_TRAILING = ("curvature_applied", "fit_sample", "gpu_peak_bytes", "gpu_bytes_per_rank", "distributed")
#: the fields :meth:`Run.to_json` places itself (the others are written in their order)
_PLACED = ("tasks", "run_key", "memory_plan", "info", *_TRAILING)


@dataclass
class Run:
    """One finished ``score`` run, the fields of its ``run.json`` in the file's order."""

    status: str  # "complete"
    command: str  # "score"
    method: str
    settings: dict  # ScoreSettings, as dataclasses.asdict gives it
    curvature_settings: dict  # the CurvatureSettings asked for (curvature_applied: what was applied)
    model: dict  # the model's source, its ModelSettings, dtype, device, chat_template
    tracked_modules: list
    tracking: dict  # per kind of tracked module: modules, parameters, share of the model's parameters
    inputs: dict  # pool, pool_format, targets (absolute paths), target_files with several
    fingerprints: dict  # model, pool, targets, pool_file (the pool's bytes)
    versions: dict  # prism_select, torch, transformers, python
    counts: dict  # pool, pairs, invalid, truncated_pool, truncated_targets
    invalid_records: list
    timings: dict  # seconds per stage, total_s
    warnings: list
    stream: bool
    tasks: list | None = None  # the named target sets' names (written after inputs)
    run_key: dict | None = None  # what a resumed or reused run must match
    memory_plan: dict | None = None
    #: what the stages recorded (curvature, throughput, pi, peaks by stage, method_info, ...),
    #: written after memory_plan in the order recorded
    info: dict = field(default_factory=dict)
    curvature_applied: dict | None = None  # the curvature the run applied (preflight.small_pool_rule)
    fit_sample: dict | None = None  # under stream: how the fit sample was drawn
    gpu_peak_bytes: int | None = None  # on CUDA
    gpu_bytes_per_rank: dict | None = None  # on CUDA: the model's and the peak bytes of each rank
    distributed: dict | None = None  # in a process group: world_size

    def to_json(self) -> dict:
        """The content of ``run.json``: every field in order, ``tasks`` after ``inputs``,
        ``info``'s entries after ``memory_plan``; an optional field left None is left out."""
        out: dict = {}
        for f in fields(self):
            if f.name in _PLACED:
                continue
            out[f.name] = getattr(self, f.name)
            if f.name == "inputs" and self.tasks is not None:
                out["tasks"] = self.tasks
        for name in ("run_key", "memory_plan"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.info)
        for name in _TRAILING:  # a key the stages recorded too keeps its place
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Run:
        """The :class:`Run` of a ``run.json`` content; entries that are no field go to ``info``."""
        names = {f.name for f in fields(cls)} - {"info"}
        return cls(**{k: v for k, v in data.items() if k in names},
                   info={k: v for k, v in data.items() if k not in names})

    @classmethod
    def from_json(cls, path) -> Run:
        """The :class:`Run` written in the ``run.json`` at ``path``."""
        return cls.from_dict(json.loads(Path(path).read_text()))


def versions() -> dict:
    """The versions of prism-select, torch, transformers and Python that made the run."""
    import transformers
    return {"prism_select": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def applied_curvature(decided: dict, info: dict) -> dict | None:
    """``run.json``'s ``curvature_applied``: the decision of
    :func:`prism_select.run.preflight.small_pool_rule` with what the fit then applied (its
    kind, after a split-half check that found no damping supported: identity; its
    damping factor and per-layer damping); None for a method that used no curvature."""
    cur = info.get("curvature")
    if cur is None:
        return None
    out = dict(decided)
    out["kind"] = cur.get("kind", out["kind"])
    if out["kind"] != "identity":
        sh = cur.get("split_half")
        out["damping_factor"] = sh["damping_factor"] if sh else cur.get("damping_factor")
        out["damping"] = cur.get("damping")
    return out


def device_figures(lm, info: dict, model_bytes) -> dict:
    """The GPU memory measured (the largest over the processes of a resumed run) and the
    process group's size: ``gpu_peak_bytes``, ``gpu_bytes_per_rank``, ``distributed``."""
    out: dict = {}
    if lm.device.type == "cuda":
        out["gpu_peak_bytes"] = max(torch.cuda.max_memory_allocated(lm.device), info.get("gpu_peak_bytes", 0),
                                    *info.get("gpu_peak_bytes_by_stage", {}).values())
        out["gpu_bytes_per_rank"] = {"model": model_bytes, "peak": distributed.gather_values(out["gpu_peak_bytes"])}
    if distributed.active():
        out["distributed"] = {"world_size": distributed.world()}
    return out
