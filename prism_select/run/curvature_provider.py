"""The run's curvature: fitted (or loaded from the cache) once, as the memory plan says,
and applied to directions (``v = H^-1 direction``), with the small fits' split-half
damping check (:mod:`prism_select.run.split_half`), the fit's spill kept to score from,
the pool scored inside the fit, and a transient plan's group-by-group preconditioning
saved in ``.partial`` so that a resumed run fits only the groups not done
(:class:`TransientFit`)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..runtime import distributed, sharding
from ..curvature import Curvature, CurvatureSettings, FitCache, FitLayout, FitSpill, load_or_fit_curvature
from ..curvature.fit import fit_indices
from ..curvature.spill import FitScores
from ..data.tokenize import encoded_fingerprint
from ..engine import cpu_response_split, split_causal_lm
from ..gradients import SpilledLayers, release_host_memory
from ..runtime.layers import layer_shape
from ..io import atomic_write_json
from ..plan import stored_bytes
from ..methods import registry as methods
from .folder import resume_groups
from .meter import summarize
from .part import RunPart
from .split_half import SplitHalfCheck

log = logging.getLogger(__name__)


def damping_rule_of(cs: CurvatureSettings) -> str:
    """The damping rule a fitted curvature takes: ``split-half`` where asked for, else
    ``heuristic`` (``auto`` decides before the fit, :func:`prism_select.run.preflight.small_pool_rule`)."""
    return "split-half" if cs.damping_rule == "split-half" else "heuristic"


class CurvatureProvider(RunPart):
    """Gives one run its curvature (:meth:`curvature`) and preconditions its directions
    (:meth:`precondition`, :meth:`last_use`)."""

    def __init__(self, run):
        super().__init__(run)
        self._curvature: Curvature | None = None
        self._fit_timings: dict = {}  # the fit's running phase totals
        #: the fit's spill (:meth:`prism_select.curvature.spill._Spill.scores`) when it holds the
        #: scoring loss's gradients of every pool example (:meth:`_spill_scores_pool`)
        self.spill = None
        self.split_half = SplitHalfCheck(run, self)

    def hold(self, cur: Curvature | None) -> None:
        """``cur`` becomes the run's curvature (None: the run's is let go; the fit stays in the cache)."""
        self._curvature = cur

    def curvature(self, on_group=None, groups: list | None = None, fit_scores=None) -> Curvature:
        """The run's one curvature object, fitted (or loaded from cache) on first use, as
        the memory plan says (groups of layers, where the fitted tensors are kept).
        ``on_group(layers, part)`` sees each finished group; ``groups`` restricts a
        transient fit to these groups (the others were finished before a resume).
        ``fit_scores`` (:class:`prism_select.curvature.spill.FitScores`): handed to the fit
        when its spill would hold the scoring gradients (:meth:`_spill_scores_pool`)."""
        if self._curvature is None or on_group is not None:
            t = time.perf_counter()
            fit = self.inputs.encoded if self.inputs.fit_encoded is None else self.inputs.fit_encoded
            phases = self._fit_timings = {}
            plan = self.plan
            cs = self.curvature_settings
            if plan is not None and plan.fit.get("batch_size"):
                cs = replace(cs, batch_size=plan.fit["batch_size"])
            store = plan.curvature_store if plan is not None else "device"
            if groups is None:
                groups = plan.fit_groups if plan is not None and plan.fit_groups else None
            modules = self.modules
            if groups is not None and store == "transient":
                modules = {n: self.modules[n] for g in groups for n in g}
            st = self.settings
            from_spill = self._spill_scores_pool(cs, groups)
            layout = FitLayout(groups, store, offload=plan.fit.get("offload") if plan is not None else None,
                               sums=plan.fit.get("sums", "step") if plan is not None else "step")
            cur, directory, reused = load_or_fit_curvature(
                self.lm.model, modules, fit, cs, pad_id=self.pad_id, cache=self.fit_cache(fit),
                execution=self.execution,
                timings=phases, layout=layout, on_group=on_group,
                spill=FitSpill(on_spill=self._keep_spill if from_spill else None,
                               scores=fit_scores if from_spill else None))
            dt = time.perf_counter() - t
            self.timings["curvature_s"] = self.timings.get("curvature_s", 0) + dt
            how = f"loaded from the cache {directory}" if reused else "fitted"
            distributed.say(f"curvature ({cur.kind}): " + ("nothing to fit" if cur.kind == "identity" else
                                                           f"{how} in {dt:.1f} s"), st.progress)
            self.meter.stage_peak("fit")
            info = self.info.get("curvature", {})
            merged = {k: phases.get(k, 0) + info.get("phases_s", {}).get(k, 0) for k in phases}
            damping = list(cur.damping.values())
            self.info["curvature"] = {**info, "kind": cur.kind, "path": str(directory) if directory else None,
                                      "reused": reused, "damping": summarize(damping), "store": store,
                                      "damping_factor": cs.damping_factor if cs.damping is None
                                      and cur.kind != "identity" else None,
                                      "groups": len(plan.fit_groups) if plan is not None and plan.fit_groups else 1,
                                      "phases_s": merged}  # factors / eigendecompositions / eigenvalues
            if cur.meta.get("owners"):  # each rank's share of the fitted curvature (sharded factors)
                acc = 8 if next(self.lm.model.parameters()).dtype == torch.float64 else 4
                per = [0] * self.execution.world
                for n, r in cur.meta["owners"].items():
                    per[r] += stored_bytes(cur.kind, *layer_shape(self.modules[n]), acc)
                self.info["curvature"]["factor_shards"] = {"ranks": self.execution.world,
                                                           "stored_bytes_per_rank": per}
            if on_group is not None:
                return cur
            self._curvature = cur
        return self._curvature

    def fit_cache(self, encoded: list) -> FitCache:
        """Where a curvature fitted on ``encoded`` is cached (the run's cache folder, keyed
        by the model and that fit sample)."""
        st = self.settings
        return FitCache(Path(self.lm.settings.resolved_cache_dir()) / "curvature", self.lm.fingerprint,
                        encoded_fingerprint(encoded), st.max_length, st.cache_max_bytes)

    def _spill_scores_pool(self, cs: CurvatureSettings, groups) -> bool:
        """Whether the fit (EK-FAC on the CPU, :func:`prism_select.curvature.fit.fit_curvature`)
        is to score the pool (:meth:`score_in_fit`) or keep its spill to score from: asked
        for (``settings.scores_from_fit``), for a method that scores a direction, and the
        spill would hold exactly the per-example gradients that exact scoring of the pool
        forms: the fit runs on every pool record (not a sample, not a separate fit set) with the
        empirical Fisher (the records' own labels: the scoring loss, summed over response
        tokens per example), in one group of layers, in the model's own arithmetic, both
        with the same loss route (the logits at response positions, or the model's), and
        the pool is scored in memory by the exact route."""
        st, ex = self.settings, self.execution
        model = self.lm.model
        return (st.scores_from_fit and methods.get(st.method).kind == "direction"
                and self.damping_rule() == "heuristic"
                and len(self.tasks) <= 1
                and self.inputs.fit_encoded is None and cs.kind == "ekfac" and cs.fisher == "empirical"
                and len(fit_indices(len(self.inputs.encoded), cs)) == len(self.inputs.encoded)
                and not (groups and len(groups) > 1) and not st.stream
                and ex.precision == "model" and not ex.sharded and ex.world == 1
                and (split_causal_lm(model) is None) == (cpu_response_split(model, self.modules) is None))

    def score_in_fit(self, direction: dict):
        """The pool's scores along ``H^-1 direction`` formed by the fit itself
        (:class:`prism_select.curvature.spill.FitScores`), when the curvature is still to be
        fitted and its spill would hold the scoring gradients (:meth:`_spill_scores_pool`):
        no ``v`` is formed and no scoring pass runs. Returns ``(scores, direction)``:
        ``scores`` None when the fit did not score (the curvature came from the cache, or
        the kept products would be too large), and the direction then left to precondition
        (waiting in a temporary file during the fit, as :meth:`last_use` does; the run's
        curvature is the fitted one)."""
        if (self._curvature is not None or not self.settings.scores_from_fit or not direction
                or self.transient() or self.execution.sharded
                or any(t.device.type != "cpu" for t in direction.values())):
            return None, direction
        direction = self._set_aside(direction)
        fs = FitScores(direction, self.curvature_settings, len(self.inputs.encoded))
        try:
            self.curvature(fit_scores=fs)
        except BaseException:
            if isinstance(direction, SpilledLayers):
                direction.close()
            raise
        return fs.scores, direction

    def _set_aside(self, direction: dict):
        """``direction`` (on the CPU) as a :class:`SpilledLayers` file next to the cache, so
        that it takes no memory while the curvature is fitted; the dict itself when the
        file cannot be written (e.g. a full disk)."""
        cache_root = Path(self.lm.settings.resolved_cache_dir()) / "curvature"
        try:
            cache_root.mkdir(parents=True, exist_ok=True)
            direction = SpilledLayers(direction, cache_root)
        except OSError as exc:
            log.info("the direction stays in memory during the fit (no temporary file: %s)", exc)
        release_host_memory()
        return direction

    def _keep_spill(self, spill) -> None:
        if self.spill is not None:
            self.spill.close()
        self.spill = spill

    def drop_spill(self) -> None:
        """The fit's spill closed (its files removed)."""
        if self.spill is not None:
            self.spill.close()
            self.spill = None

    def precondition(self, direction: dict, tag: str = "scores", last: bool = False) -> dict:
        """``v = H^-1 direction`` in the dtype the scores use (the model's), layer by layer on
        the model's device. Under a ``transient`` memory plan each group of layers is
        preconditioned as soon as its curvature is fitted and saved in ``.partial`` (a
        resumed run fits only the groups not done). Under ``--shard fsdp`` ``direction``
        holds this rank's rows and so does the result; each layer's curvature is kept by one
        rank, which preconditions that layer for all: the rank that fitted its factors
        (``meta["owners"]`` of a sharded fit), or for a curvature every rank holds whole
        (reused from the cache, diagonal) :func:`prism_select.runtime.sharding.curvature_owners`.
        ``last`` (one process): the caller's last use of ``direction`` and of the curvature.
        The direction's layers are taken out of ``direction`` as their ``v`` is formed; with
        one fit group this goes through :meth:`last_use` (the direction waits on disk while
        the curvature is fitted or loaded, each layer's curvature is freed once used, and
        the run's curvature is dropped; it stays in the cache)."""
        dev = self.lm.device
        vdt = self.lm.dtype
        transient = self.transient()
        if self.damping_rule() == "split-half":
            self.split_half.apply(direction)

        if self.execution.sharded:
            sizes = {n: m.out_features ** 3 + m.in_features ** 3 for n, m in self.modules.items()}
            owners = sharding.curvature_owners(list(self.modules), sizes)

            def compute(part, layers):
                own = part.meta.get("owners") or owners
                return sharding.precondition_rows(sharding.keep_owned(part, own), direction, self.modules, own, dev)
        else:
            def compute(part, layers):
                # layer by layer, in the model's dtype: one layer's float32 v at a time in host
                # memory (the plan's figure)
                out = {}
                for n in layers:
                    g = {n: direction.pop(n) if last else direction[n]}
                    out[n] = part.precondition(g, device=dev)[n].to(dtype=vdt)
                return out

        if transient:
            v = TransientFit(self).precondition(tag, compute)
        elif self.execution.sharded:
            v = compute(self.curvature(), list(self.modules))
        elif last:
            v = self.last_use(direction, device=dev)
        else:
            v = self.curvature().precondition(direction, device=dev)
        return {n: v.pop(n).to(dtype=vdt) for n in self.modules}  # each float32 layer let go once converted

    def damping_rule(self) -> str:
        """This run's damping rule (:func:`damping_rule_of`)."""
        return damping_rule_of(self.curvature_settings)


    def transient(self) -> bool:
        """The memory plan keeps no curvature: each fit group preconditions its layers and
        is dropped, its part of ``v`` saved in ``.partial``."""
        return bool(self.plan is not None and self.plan.curvature_store == "transient" and self.plan.fit_groups)

    def last_use(self, direction: dict, device=None) -> dict:
        """``H^-1 direction`` (in the direction's dtype) when neither the direction nor the
        curvature is needed afterwards, holding the least host memory: a direction whose
        layers are all in host memory waits in a temporary file (in the cache directory,
        :class:`prism_select.gradients.SpilledLayers`) while the curvature is fitted or
        loaded (without the file when the disk refuses it); then each layer of the
        direction is read back and each layer's curvature freed as it is used, and the
        run's curvature is dropped (the fit stays in the cache). ``direction`` is left
        empty. On the CPU the embedded model's fit held its 540 MB direction to the end."""
        if self.damping_rule() == "split-half":  # the run's damping, whichever method asks (once a run)
            self.split_half.apply(direction)
        if self._curvature is None and isinstance(direction, dict) and direction \
                and all(t.device.type == "cpu" for t in direction.values()):
            direction = self._set_aside(direction)
        cur = self.curvature()
        self._curvature = None
        try:
            return cur.precondition(direction, device=device, consume=True, release=True)
        finally:
            if isinstance(direction, SpilledLayers):
                direction.close()



class TransientFit(RunPart):
    """A transient memory plan's preconditioning (the plan keeps no curvature): each fit
    group preconditions its layers as soon as it is fitted and is dropped, its part of
    ``v`` saved in ``.partial``; ``provider``: the run's :class:`CurvatureProvider`."""

    def __init__(self, provider: CurvatureProvider):
        super().__init__(provider.run)
        self.provider = provider

    def precondition(self, tag: str, compute) -> dict:
        """A transient plan's preconditioning: ``compute(part, layers)`` for each fit group
        as soon as it is fitted, each group's result saved in ``.partial`` (under
        ``--shard fsdp`` every rank saves its rows, and a group is done when every rank's
        file is there); a resumed run loads the finished groups and fits only the others."""
        partial = self.out_dir / ".partial"
        ex = self.execution
        mine = f".rank{ex.rank:05d}-of-{ex.world:05d}" if ex.sharded else ""  # whose part a file holds
        # a resumed run keeps the saved layout's finished groups (their parts are saved) and
        # groups the other layers as its own plan does (resume_groups)
        layout = partial / f"{tag}_v_groups.json"
        groups = self.plan.fit_groups
        if distributed.all_or_nothing(layout.exists()):
            groups = resume_groups(json.loads(layout.read_text()), groups, lambda k: distributed.all_or_nothing(
                (partial / f"{tag}_v_group{k:04d}{mine}.safetensors").exists()))
            distributed.barrier()  # every rank has read the saved layout before it is replaced
        self.plan.fit["groups"] = [g for g in groups if g]
        if ex.main:
            partial.mkdir(parents=True, exist_ok=True)
            atomic_write_json(layout, groups)
        writes = ex.sharded or ex.main
        v: dict = {}
        todo = []
        done_phases: dict = {}
        for k, g in enumerate(groups):
            f = partial / f"{tag}_v_group{k:04d}{mine}.safetensors"
            if not g:  # a position a resumed run's plan left empty
                continue
            if distributed.all_or_nothing(f.exists()):
                v.update(load_file(str(f)))
                meta = partial / f"{tag}_v_group{k:04d}.json"  # what the group cost when it was fitted
                if meta.exists():
                    m = json.loads(meta.read_text())
                    for key, val in m.get("phases_s", {}).items():
                        done_phases[key] = done_phases.get(key, 0) + val
                    self.info["gpu_peak_bytes"] = max(self.info.get("gpu_peak_bytes", 0), m.get("gpu_peak_bytes", 0))
            else:
                todo.append(k)
        last: dict = {}
        dev = self.lm.device

        def on_group(layers, part):
            k = next(i for i in todo if groups[i] == list(layers))
            got = {n: t.to(device="cpu", dtype=self.lm.dtype) for n, t in compute(part, list(layers)).items()}
            phases = self._group_phases(last)
            if writes:
                partial.mkdir(parents=True, exist_ok=True)
                tmp = partial / f".{tag}_v_group{k:04d}{mine}.tmp"
                save_file({n: t.contiguous() for n, t in got.items()}, str(tmp))
                if ex.main:
                    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
                    atomic_write_json(partial / f"{tag}_v_group{k:04d}.json",
                                      {"phases_s": phases, "gpu_peak_bytes": peak})
                tmp.replace(partial / f"{tag}_v_group{k:04d}{mine}.safetensors")
            v.update(got)

        n_groups = sum(1 for g in groups if g)
        if len(todo) < n_groups:
            log.info("resuming: %d of %d fit groups were preconditioned earlier; fitting the other %d",
                     n_groups - len(todo), n_groups, len(todo))
        if todo:
            self.provider.curvature(on_group=on_group, groups=[groups[k] for k in todo])
        if len(todo) < n_groups:
            cur = self.info.setdefault("curvature", {})
            cur["resumed_groups"] = n_groups - len(todo)
            ph = cur.setdefault("phases_s", {})
            for key, val in done_phases.items():  # the whole fit's phases, earlier processes included
                ph[key] = ph.get(key, 0) + val
        return v

    def _group_phases(self, last: dict) -> dict:
        """The fit phases of the group just finished (the running totals minus ``last``,
        which is updated): the fit timings arrive per call, so a group's share is a difference."""
        now = self.provider._fit_timings
        out = {k: now.get(k, 0) - last.get(k, 0) for k in now}
        last.clear()
        last.update(now)
        return out

