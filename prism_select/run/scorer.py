"""The run's scoring of the pool along preconditioned directions (``g_z . H^-1 d``),
resumable from ``.partial``: one direction (:meth:`Scorer.score_direction`) or several
target sets in one pass (:meth:`Scorer.score_tasks`), each by the route the run allows
(:meth:`Scorer._score_with`: streamed from the pool file, scored inside the curvature
fit, from the fit's spill, or the model's pass over the encoded pool; under
``--shard fsdp`` ``v`` lives in the layers), and its figures recorded in ``timings`` and
``info["throughput"]``."""

from __future__ import annotations

import json
import math
import time

import torch
from safetensors.torch import load_file

from ..runtime import distributed, sharding
from ..errors import ConfigError, InputError
from ..gradients import release_host_memory
from ..io import atomic_write_json
from ..scoring import Chunking, score_encoded, score_stream
from .folder import save_v
from .part import RunPart


class Scorer(RunPart):
    """Scores the pool for one run; ``provider``: the run's
    :class:`~prism_select.run.curvature_provider.CurvatureProvider`."""

    def __init__(self, run, provider):
        super().__init__(run)
        self.provider = provider

    def score_direction(self, direction: dict, tag: str = "scores", last: bool = False) -> torch.Tensor | None:
        """``g_z . H^-1 direction`` for every pool example (resumable).

        Under ``settings.stream`` the pool file is scored a window at a time into
        ``.partial/<tag>.jsonl`` (id, score, rank), recorded in the run's ``streamed``, and
        None is returned. ``last``: the method needs neither the curvature nor the
        direction afterwards (the caller keeps no reference to ``direction``); both are
        released once ``v`` is formed, before scoring (the fit stays in the cache).
        """
        partial = self.out_dir / ".partial"
        # under --shard fsdp each rank keeps (and saves) its rows of v
        fsdp = self.execution.sharded
        name = f"{tag}_v.rank{self.execution.rank:05d}-of-{self.execution.world:05d}" if fsdp else f"{tag}_v"
        v_path = partial / f"{name}.safetensors"
        info_path = partial / f"{tag}_curvature.json"  # run.json's "curvature" entry, for a resumed run
        saved = distributed.all_or_nothing(v_path.exists()) if fsdp else v_path.exists()
        in_fit = None  # the pool's scores formed by the fit (CurvatureProvider.score_in_fit)
        if not saved and last:  # the direction is left to precondition when the fit does not score
            in_fit, direction = self.provider.score_in_fit(direction)
        if saved:
            v = load_file(str(v_path))
            distributed.say(f"H^-1 direction ({tag}) reused from {v_path.parent}: no fit", self.settings.progress)
            if "curvature" not in self.info and info_path.exists():
                self.info["curvature"] = {**json.loads(info_path.read_text()), "resumed": True}
        elif in_fit is not None:
            # no v to save: a run stopped from here on finds the fit in the cache, and
            # preconditions and scores with the model (scores_from_fit's float rounding)
            v = None
        else:
            # written below once v is whole: every fit group of a transient plan was
            # preconditioned by an earlier process of this run
            earlier = json.loads(info_path.read_text()) if info_path.exists() else None
            v = self.provider.precondition(direction, tag, last=last)  # last: direction and curvature freed as used
            if earlier is not None and self.info.get("curvature", {}).get("resumed_groups"):
                self.info["curvature"] = {**earlier, **self.info["curvature"], "resumed": True}
            if self.execution.main:
                partial.mkdir(parents=True, exist_ok=True)
                atomic_write_json(info_path, self.info["curvature"])
            distributed.barrier()
            # a transient plan's group files already hold v: a merged copy beside them would
            # need v's size again on disk at once (26 GiB at Qwen3-14B's shape)
            if (self.execution.main or fsdp) and not self.provider.transient():
                save_v(v, partial, name, tag)
        if last:
            direction = None
            self.provider.hold(None)
            release_host_memory()
        if fsdp:  # v moves into the layers' sharded prism_v parameters
            sharding.set_v(self.modules, v)
            v = None
        t = time.perf_counter()
        s, stats = self._score_with(v, tag, in_fit, last)
        self._record_scoring(tag, stats, time.perf_counter() - t)
        return s

    def score_tasks(self, directions, tag: str = "scores") -> torch.Tensor | None:
        """``g_z . H^-1 d_k`` for every pool example and each direction ``d_k`` that the
        iterable ``directions`` yields (one per target set): ``(N, K)`` float64, or None
        under ``settings.stream`` (as :meth:`score_direction`; the rows carry ``scores``
        and ``ranks`` per task).

        Each direction is preconditioned by the run's one curvature as it comes (one
        float32 direction alive at a time), and the ``K`` preconditioned directions are
        stacked per layer (``K x out x in [+1]``) and saved whole in ``.partial`` (a resumed
        run reuses them; the directions are formed again for the pairs' rows). The pool
        is then scored along all of them from one forward and one activation-only backward
        per batch (:class:`~prism_select.engine.ExactScorer` with stacked ``V``), the
        resumable chunk files holding ``K`` columns. Refused with a :class:`ConfigError`
        under ``--shard fsdp``, a transient memory plan, ``--precision split32`` and
        ``--damping-rule split-half``."""
        self._check_tasks_supported()
        partial = self.out_dir / ".partial"
        v_path = partial / f"{tag}_v.safetensors"
        info_path = partial / f"{tag}_curvature.json"
        if v_path.exists():
            v = load_file(str(v_path))
            for _ in directions:  # the pairs' rows (pi, margins) come with the directions
                pass
            distributed.say(f"H^-1 directions ({tag}, {len(self.tasks)} tasks) reused from {partial}: no fit",
                            self.settings.progress)
            if "curvature" not in self.info and info_path.exists():
                self.info["curvature"] = {**json.loads(info_path.read_text()), "resumed": True}
        else:
            vs = []
            for direction in directions:
                vs.append(self.provider.precondition(direction, tag))
                direction.clear()
                del direction
                release_host_memory()
            v = {n: torch.stack([vk.pop(n) for vk in vs]) for n in self.modules}
            del vs
            if self.execution.main:
                partial.mkdir(parents=True, exist_ok=True)
                atomic_write_json(info_path, self.info["curvature"])
                save_v(v, partial, f"{tag}_v", tag)
            distributed.barrier()
        self.provider.hold(None)  # the fit stays in the cache
        release_host_memory()
        t = time.perf_counter()
        s, stats = self._score_with(v, tag, None, True)
        del v
        self._record_scoring(tag, stats, time.perf_counter() - t)
        return s

    def _check_tasks_supported(self) -> None:
        """The settings under which several target sets cannot be scored in one pass."""
        ex, fix = self.execution, "score one task per run (--targets ONE_FILE), or pass --combine-tasks"
        if ex.sharded:
            raise ConfigError("shard", "several target sets are not scored under --shard fsdp (v lives sharded in "
                              "the layers, one direction per layer)", fix + ", or drop --shard")
        if self.provider.transient():
            raise ConfigError("targets", "several target sets need the fitted curvature kept while each set's "
                              "direction is preconditioned; this run's memory plan fits it group by group "
                              "(transient)", fix + ", or give the run more host memory")
        if ex.precision == "split32":
            raise ConfigError("precision", "several target sets are scored in the model's own arithmetic, not "
                              "under --precision split32", fix + ", or drop --precision")
        if self.provider.damping_rule() == "split-half":
            raise ConfigError("damping_rule", "the split-half damping rule is chosen along one direction, and "
                              "this run has several target sets", fix + ", or use the heuristic damping rule")

    def _score_with(self, v: dict | None, tag: str, in_fit, last: bool) -> tuple:
        """``(scores, stats)`` of the pool along ``v`` (None: under FSDP, ``v`` is in the
        layers): streamed from the pool file, the fit's own scores (``in_fit``), scores
        formed from the fit's spill, or the model's pass over the encoded pool."""
        st, partial = self.settings, self.out_dir / ".partial"
        stats: dict = {}
        common = {"batch_size": self.scoring_batch(), "execution": self.execution,
                  "chunking": Chunking(st.chunk_size, partial / tag, self.info.get("run_key"))}
        if st.stream:
            out = partial / f"{tag}.jsonl"
            res = score_stream(self.lm.model, self.lm.tokenizer, self.modules, v, self.inputs.pool_path, out,
                               max_length=st.max_length, window=st.stream_window, skip_invalid=st.skip_invalid,
                               tasks=self.run.task_names or None, **common)
            if not res["count"]:
                raise InputError("no valid pool record left", path=self.inputs.pool_path)
            stats = {k: res.pop(k) for k in ("examples", "real_tokens", "padded_tokens") if k in res}
            self.run.streamed = {**res, "path": out}
            return None, stats
        if in_fit is not None:
            return in_fit, {"examples": len(self.inputs.encoded),
                            "real_tokens": sum(len(e.input_ids) for e in self.inputs.encoded),
                            "from_fit_spill": True, "in_fit": True}
        s = None
        if self.provider.spill is not None:  # the fit's gradients are the scoring's: no model pass
            s = self.provider.spill.scores(self.modules, v, len(self.inputs.encoded))
            if s is not None:
                n_tok = sum(len(e.input_ids) for e in self.inputs.encoded)
                stats = {"examples": len(self.inputs.encoded), "real_tokens": n_tok,
                         "padded_tokens": sum(math.prod(rec[0][1][1][:2]) for rec in self.provider.spill.batches),
                         "from_fit_spill": True}
            if last or s is None:
                self.provider.drop_spill()
        if s is None:
            s = score_encoded(self.lm.model, self.modules, self.inputs.encoded, v, pad_id=self.pad_id,
                              ids=[e.id for e in self.inputs.pool], stats=stats, **common)
        return s, stats

    def _record_scoring(self, tag: str, stats: dict, dt: float) -> None:
        """The scoring's time on the console and in ``timings``, its throughput in ``info``."""
        self.timings[f"{tag}_s"] = self.timings.get(f"{tag}_s", 0) + dt
        what = "scoring" if tag == "scores" else f"scoring ({tag})"
        distributed.say(f"{what}: inside the curvature fit" if stats.get("in_fit") else f"{what}: {dt:.1f} s",
                        self.settings.progress)
        self.meter.stage_peak("scoring")
        if stats.get("in_fit"):  # scored inside the fit: no time of its own
            self.info.setdefault("throughput", {})[tag] = {**stats, "ranks": self.execution.world}
        elif stats.get("examples"):  # this rank's share; tokens/s counts real (non-padding) tokens
            self.info.setdefault("throughput", {})[tag] = {
                **stats, "ranks": self.execution.world, "real_tokens_per_s_rank": stats["real_tokens"] / dt,
                "padding_fraction": 1 - stats["real_tokens"] / max(stats["padded_tokens"], 1)}

