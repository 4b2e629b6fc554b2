"""The base of a run's parts (its curvature provider, split-half check, scorer): each
reads the run's state from the :class:`~prism_select.run.RunContext` it serves, under
the context's own names (``self.lm``, ``self.settings``, ``self.plan``, ...)."""

from __future__ import annotations


def _from_run(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.run, name), doc=doc)


class RunPart:
    """A part of one run; ``run``: the :class:`~prism_select.run.RunContext` it serves."""

    def __init__(self, run):
        self.run = run

    lm = _from_run("lm", "The loaded model (model, tokenizer, device, dtype).")
    modules = _from_run("modules", "The tracked linear modules, by name.")
    inputs = _from_run("inputs", "The pool and target pairs, tokenised.")
    settings = _from_run("settings", "The run's ScoreSettings.")
    curvature_settings = _from_run("curvature_settings", "The curvature the run applies (after the small-pool rule).")
    out_dir = _from_run("out_dir", "The run folder.")
    execution = _from_run("execution", "Device, precision, process group, memory plan, kernels.")
    plan = _from_run("plan", "The memory plan (None: none made).")
    info = _from_run("info", "The run's records for run.json.")
    timings = _from_run("timings", "The run's stage seconds for run.json.")
    tasks = _from_run("tasks", "The target sets, [(task, [pair indices])].")
    pad_id = _from_run("pad_id", "The tokenizer's padding id.")
    meter = _from_run("meter", "The run's stage meter (prism_select.run.meter.StageMeter).")

    def scoring_batch(self) -> int:
        """The run's scoring batch (:meth:`prism_select.run.RunContext.scoring_batch`)."""
        return self.run.scoring_batch()
