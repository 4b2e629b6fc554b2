"""``--damping-rule split-half``: the run's damping chosen by fitting EK-FAC on two
random halves of the fit sample and comparing the rankings they give down the damping
ladder (:mod:`prism_select.curvature.support`), once per run."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

import torch
from tqdm.auto import tqdm

from ..runtime import distributed
from ..curvature import Curvature, FitLayout, load_or_fit_curvature
from ..curvature import support
from ..curvature.base import apply_damping
from ..curvature.fit import fit_indices
from ..errors import ConfigError
from ..metrics import spearman
from ..runtime.memory import gib
from ..scoring import score_directions, score_encoded
from .meter import summarize
from .part import RunPart

log = logging.getLogger(__name__)


class SplitHalfCheck(RunPart):
    """The split-half damping check of one run; ``provider``: the run's
    :class:`~prism_select.run.curvature_provider.CurvatureProvider`, whose curvature the
    check damps (or replaces with identity)."""

    def __init__(self, run, provider):
        super().__init__(run)
        self.provider = provider

    def apply(self, direction: dict) -> None:
        """``--damping-rule split-half``: fit EK-FAC on two random halves of the fit sample,
        score the fit sample (at most :data:`~prism_select.curvature.support.AGREEMENT_EXAMPLES`
        of it, a seeded subset) with each half's ``v`` down the damping ladder until the
        halves disagree, and damp the run's curvature with the least factor from which on
        they agree, or rank with identity when they disagree at the largest
        (:mod:`prism_select.curvature.support`). The half fits go through the curvature
        cache, so other runs on the same pool (another method, other target pairs) reuse
        them. Once per run; the result goes to ``run.json`` (``curvature.split_half``)."""
        if self.info.get("curvature", {}).get("split_half") is not None:
            return
        cs = self.curvature_settings
        if cs.kind != "ekfac" or self.provider.transient() or self.execution.sharded or self.execution.world > 1:
            raise ConfigError("damping_rule", "split-half needs an EK-FAC curvature kept whole by one process",
                              "use --curvature ekfac on one process with the curvature on the device or host, "
                              "or --damping-rule heuristic")
        cur = self.provider.curvature()
        t = time.perf_counter()
        with self._curvature_aside(cur):
            check = self._walk(direction)
        if check.factor is None:
            cur = Curvature("identity", cur.layers, {}, {n: 0.0 for n in cur.layers})
        else:
            cur = apply_damping(cur, replace(cs, damping_factor=check.factor))
        self.provider.hold(cur)
        self.meter.stage_peak("split_half")
        self.timings["split_half_s"] = time.perf_counter() - t
        self.info["curvature"] = {**self.info.get("curvature", {}), "split_half": check.to_json(), "kind": cur.kind,
                                  "damping": summarize(list(cur.damping.values())), "damping_factor": check.factor}
        distributed.say("split-half check: " + (f"damping factor {check.factor:g}" if check.factor is not None else
                                                "the halves agree at no damping; identity curvature")
                        + " (" + ", ".join(f"{f:g}: {a:.3f}" for f, a in check.agreement.items()) + ")",
                        self.settings.progress)

    @contextlib.contextmanager
    def _curvature_aside(self, cur: Curvature):
        """Under a bounded memory plan on a GPU, the run's curvature (its tensors held on the
        device) waits in host memory for the ``with`` block (the split-half check fitting and
        scoring its halves), then goes back to the device. The plan's fit and scoring
        figures count one curvature on the device. With the run's curvature left there, the
        check of a pool's first run peaked 2 GB past the plan's usable memory (10.6 against
        8.6 GB, an 11 GiB cap, the embedded model, a 600-record pool)."""
        plan = self.plan
        aside = (plan is not None and plan.bounded and self.lm.device.type == "cuda"
                 and isinstance(cur.tensors, dict))
        keys = [k for k, t in cur.tensors.items()
                if isinstance(t, torch.Tensor) and t.device.type == "cuda"] if aside else []
        for k in keys:
            cur.tensors[k] = cur.tensors[k].to("cpu")  # each device copy let go as its host copy is made
        try:
            yield
        finally:
            for k in keys:
                cur.tensors[k] = cur.tensors[k].to(self.lm.device)

    def _walk(self, direction: dict) -> support.SplitHalf:
        """The split-half check's halves, fitted (or loaded from the cache), scored down the
        damping ladder (:meth:`apply`)."""
        cs = self.curvature_settings
        pool = self.inputs.encoded if self.inputs.fit_encoded is None else self.inputs.fit_encoded
        fit = [pool[i] for i in fit_indices(len(pool), cs)]
        quiet = replace(self.execution, progress=False)
        fit_settings = replace(cs, fit_examples=None)
        if self.plan is not None and self.plan.fit.get("batch_size"):  # the plan's batch, as the run's own fit
            fit_settings = replace(fit_settings, batch_size=self.plan.fit["batch_size"])
        # its steps: the two half fits, then each rung of the ladder walked
        bar = tqdm(total=2 + len(support.DAMPING_LADDER), desc="split-half check", unit="step", leave=False,
                   disable=not self.settings.progress or not distributed.is_main())
        halves = []
        for idx in support.split_halves(len(fit), cs.seed):
            half = [fit[i] for i in idx]
            halves.append(load_or_fit_curvature(self.lm.model, self.modules, half, fit_settings, pad_id=self.pad_id,
                                                cache=self.provider.fit_cache(half), execution=quiet,
                                                layout=self._half_fit_layout())[0])
            bar.update(1)
        scored = [fit[i] for i in support.agreement_sample(len(fit), cs.seed)]

        def v_at(h, factor):
            return apply_damping(h, replace(cs, damping_factor=factor)).precondition(direction)

        # the walk's rungs are scored k at a time (their 2k directions stacked, one forward and
        # backward a batch for all of them), as many as fit; k = 0: one direction at a time
        walk, k, agreement = sorted(support.DAMPING_LADDER, reverse=True), self._ladder_rungs(direction), {}

        def agreement_at(factor):
            if factor not in agreement:
                if k:
                    rungs = walk[walk.index(factor):walk.index(factor) + k]
                    vs = [v_at(h, f) for f in rungs for h in halves]
                    scores = score_directions(self.lm.model, self.modules, scored, vs, pad_id=self.pad_id,
                                              batch_size=self.scoring_batch(), execution=quiet)
                    del vs
                    agreement.update({f: spearman(scores[:, 2 * i], scores[:, 2 * i + 1])
                                      for i, f in enumerate(rungs)})
                    bar.update(len(rungs))
                else:
                    a, b = (score_encoded(self.lm.model, self.modules, scored, v_at(h, factor), pad_id=self.pad_id,
                                          batch_size=self.scoring_batch(), execution=quiet) for h in halves)
                    agreement[factor] = spearman(a, b)
                    bar.update(1)
            return agreement[factor]

        try:
            return support.split_half(len(fit), support.walk_ladder(agreement_at))
        finally:
            bar.close()

    def _half_fit_layout(self) -> FitLayout:
        """Where the split-half check keeps its two half fits: in host memory under a
        bounded memory plan on a GPU (the plan counts one curvature on the device, the
        run's; each half's layers go to the device only while they precondition), else
        where they are computed."""
        plan = self.plan
        if plan is not None and plan.bounded and self.lm.device.type == "cuda":
            return FitLayout(store="host")
        return FitLayout()

    def _ladder_rungs(self, direction: dict) -> int:
        """How many rungs of the damping ladder the split-half check scores together: their
        stacked directions (:func:`~prism_select.curvature.support.stacked_ladder_bytes`,
        at most :data:`~prism_select.curvature.support.STACKED_LADDER_MAX_ELEMENTS` numbers)
        beside what this process holds now and one scoring batch's activations (the plan's
        scoring peak less the weights and its one ``v``), within a bounded memory plan's
        usable bytes; unbounded: every rung. 0: each direction is scored on its own. Each
        stacked direction also forms, in a layer's backward, one ``tokens x in`` product
        (and its float32 copy) for the scoring batch's tokens and the widest layer input."""
        rungs = len(support.DAMPING_LADDER)
        per_rung = support.stacked_ladder_bytes(direction) // rungs
        numel = sum(int(d.numel()) for d in direction.values())
        fit_elements = support.STACKED_LADDER_MAX_ELEMENTS // max(1, 2 * numel)
        plan = self.plan
        if plan is None or not plan.bounded or plan.usable is None or self.lm.device.type != "cuda":
            return min(rungs, fit_elements)
        widest = max((int(m.weight.shape[-1]) for m in self.modules.values()), default=0)
        tokens = self.scoring_batch() * int(self.settings.max_length)
        per_rung += 2 * tokens * widest * (self.lm.model.dtype.itemsize + 4)
        scoring = plan.scoring or {}
        activations = max(0, int(scoring.get("peak", 0)) - int(plan.weights) - int(scoring.get("v_bytes", 0)))
        held = torch.cuda.memory_allocated(self.lm.device)
        fit_memory = max(0, plan.usable - held - activations) // max(1, per_rung)
        k = int(min(rungs, fit_elements, fit_memory))
        if k < rungs:
            log.info("split-half check: %d of the ladder's %d rungs scored together (each rung's directions %s, "
                     "a scoring batch's activations %s, %s held, the plan's %s usable)", k, rungs, gib(per_rung),
                     gib(activations), gib(held), gib(plan.usable))
        return k

