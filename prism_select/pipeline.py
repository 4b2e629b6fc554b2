"""The `score` job as plain functions: inputs -> preference -> curvature -> scores -> files.

``score_pool`` is what ``prism-select score`` runs. A run directory holds:

``scores.jsonl``  ``id``, ``score``, ``rank`` (1 = highest score), one line a candidate,
                  and any per-candidate column a method adds (``RunContext.columns``);
``pairs.jsonl``   ``id``, ``pi``, ``margin``, ``weight``, ``loss_chosen``, ``loss_rejected``
                  (the controls of the weights add ``pi_before``, and ``prism_shuffled``
                  ``weight_from``: the pair whose ``pi`` a pair got);
``run.json``      settings, versions, fingerprints, timings, counts, skipped records.

While running, ``.partial/`` holds the finished score chunks and the preconditioned
target ``v``, so the same command resumes an interrupted run; the outputs appear
(each atomically) only when every candidate is scored.

With ``ScoreSettings.stream`` the pool is never loaded: one streaming pass validates it
and draws the curvature's fit sample (:func:`prepare_stream_inputs`), and
:func:`prism_select.scoring.score_stream` scores it a window at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from . import __version__, locks
from .runtime import distributed, sharding
from .curvature import Curvature, CurvatureSettings, FitCache, FitLayout, FitSpill, load_or_fit_curvature
from .curvature import support
from .curvature.base import apply_damping
from .curvature.base import DEFAULT_DAMPING_FACTOR, DEFAULT_SHRINKAGE
from .curvature.fit import fit_indices
from .curvature.spill import FitScores
from .data import load_pool, load_targets
from .data.readers import detect_format, scan_pool
from .data.records import InvalidRecord, Loaded
from .data.tokenize import (
    DEFAULT_MAX_LENGTH,
    encode,
    encoded_fingerprint,
    has_chat_template,
    tokenizer_fingerprint,
)
from .errors import CacheError, ConfigError, InputError, OutOfResourceError, OutputError, resource_error
from .engine import cpu_response_split, split_causal_lm
from .runtime.execution import ExecutionContext, direction_kernels
from .runtime.execution import deterministic as deterministic_kernels
from .runtime.execution import resolve as resolve_execution
from .gradients import SpilledLayers, host_peak_mib, release_host_memory, set_run_dtype
from .runtime.layers import layer_shape
from .engine.policy import direction_policy
from .io import (
    atomic_write_json,
    atomic_write_jsonl,
    check_writable_dir,
    read_saved_state,
    remove_stale_temps,
    sha256_file,
    sha256_json,
)
from .model.moe import tracking_summary
from .model import (LoadedModel, ModelSettings, check_adapter_dir, check_finite_weights, load_model,
                    tracked_linear_modules)
from .plan import ExampleSize, MemoryPlan, PlanError, Shards, make_plan, measure_example_bytes, stored_bytes
from .runtime.memory import cap_device_memory, device_memory, gib, held_elsewhere_note, host_share_bytes
from .preference import METHODS as DIRECTION_METHODS
from .preference import GIVEN_WEIGHTS, compute_preference, pair_margins, shuffled_weights, top_half_weights
from .scoring import Chunking, score_directions, score_encoded, score_stream
from .tasks import check_stems, name_tasks, target_paths, task_groups
from .settings import DEFAULT_STREAM_WINDOW, DIRECTION_OPTIONS, STREAM_FIT_EXAMPLES, ScoreSettings, key_of  # noqa: F401 (re-exported)
from .settings import MULTI_TASK_METHODS

log = logging.getLogger(__name__)

#: the small-pool rule (``--damping-rule auto``, the default): an EK-FAC fit on fewer
#: examples that no damping option shapes is not fitted, and the run ranks with identity
#: curvature (``v = g``). On the 60-record pools of seven families measured before the
#: rule was fixed (39 pools, embedded 135M model, CPU and H200;
#: benchmarks/results/small_pools_rule_cpu.md) EK-FAC at every damping of the ladder
#: 0.1-100 x the mean eigenvalue ranked more than 0.02 AUROC below identity on some pool
#: (up to 0.16, GSM8K mistakes); on the 300-record pools measured (four families, 11
#: pools) plain EK-FAC was never more than 0.012 below identity and up to 0.12 above it
SMALL_FIT_EXAMPLES = 300


def small_pool_rule(cs: CurvatureSettings, n_fit: int) -> tuple[CurvatureSettings, dict]:
    """The curvature a run applies, decided from its settings and the size of its fit
    sample alone (so every method of a ``compare`` applies the same one), and the
    record of that decision for ``run.json`` (``curvature_applied``): under the default
    ``--damping-rule auto`` an EK-FAC fit on fewer than :data:`SMALL_FIT_EXAMPLES`
    examples that none of ``--damping``, ``--damping-factor``, ``--damping-noise``,
    ``--shrinkage`` shapes becomes identity curvature (no fit); any other settings are
    applied as given."""
    plain = (cs.damping is None and cs.damping_factor == DEFAULT_DAMPING_FACTOR and not cs.damping_noise
             and cs.shrinkage == DEFAULT_SHRINKAGE)
    record = {"requested": cs.kind, "kind": cs.kind, "n_fit": n_fit,
              "rule": damping_rule_of(cs) if cs.kind != "identity" else "none"}
    if cs.damping_rule == "split-half" and n_fit < support.MIN_FIT_EXAMPLES:
        raise ConfigError("damping_rule", f"split-half fits EK-FAC on two halves of the fit sample and compares their "
                          f"rankings; the fit sample has {n_fit} example(s), fewer than {support.MIN_FIT_EXAMPLES}",
                          "leave out --damping-rule (auto ranks a small pool with identity curvature), or pass "
                          "--curvature identity")
    if cs.damping_rule == "auto" and cs.kind == "ekfac" and plain and n_fit < SMALL_FIT_EXAMPLES:
        record.update(kind="identity", rule="small-pool", identity_below=SMALL_FIT_EXAMPLES)
        return replace(cs, kind="identity"), record
    return cs, record


def describe_applied(applied: dict) -> str:
    """One line naming the curvature a run applied and why (the summary line, compare.md)."""
    kind, n = applied.get("kind"), applied.get("n_fit")
    if applied.get("rule") == "small-pool":
        return (f"identity (the small-pool rule: the fit sample has {n} examples, fewer than "
                f"{applied.get('identity_below')}; --damping-rule heuristic fits EK-FAC anyway)")
    damping = applied.get("damping") or {}
    if kind == "identity":
        return "identity" + (" (the split-half check: its halves agreed at no damping)"
                             if applied.get("rule") == "split-half" else "")
    how = f", damping factor {applied['damping_factor']:g}" if applied.get("damping_factor") is not None else ""
    if damping:
        how += f", damping {damping.get('min'):.3g}-{damping.get('max'):.3g}"
    return f"{kind} ({applied.get('rule')}{how}, fitted on {n} examples)"


def damping_rule_of(cs: CurvatureSettings) -> str:
    """The damping rule a fitted curvature takes: ``split-half`` where asked for, else
    ``heuristic`` (``auto`` decides before the fit, :func:`small_pool_rule`)."""
    return "split-half" if cs.damping_rule == "split-half" else "heuristic"


@dataclass
class Inputs:
    """A pool and target pairs, read, validated and tokenised."""

    pool: list  # PoolExample
    encoded: list  # Encoded, aligned with pool
    pairs: list  # TargetPair
    chosen: list  # Encoded (q, y+)
    rejected: list  # Encoded (q, y-)
    invalid: list  # InvalidRecord
    truncated: dict  # {"pool": n, "targets": n}
    pool_path: str = ""
    targets_path: str = ""  # the one target file ("" with none or several: targets_paths)
    targets_paths: list = field(default_factory=list)  # every target file, in order
    pool_format: str = ""
    pool_fingerprint: str = ""  # names the pool in the run key and run.json
    # Under stream (``pool`` and ``encoded`` stay empty): the curvature's fit sample
    # (Encoded) and how it was drawn. ``fit_encoded`` None: fit on ``encoded``.
    fit_encoded: list | None = None
    fit_sample: dict | None = None


def _encode_all(tokenizer, items, fields, max_length, path, skip_invalid, invalid, check=None):
    """``items`` that tokenise (and pass ``check(item, encodings, path)``), with their
    encodings; the others raise, or under ``skip_invalid`` join ``invalid``."""
    kept, encs = [], []
    for item in items:
        try:
            enc = [encode(tokenizer, item.prompt, getattr(item, f), max_length, path=path,
                          row=item.row, line=item.line, field=f) for f in fields]
            if check is not None:
                check(item, enc, path)
            encs.append(enc)
            kept.append(item)
        except InputError as exc:
            if not skip_invalid:
                raise
            invalid.append(InvalidRecord.of(exc, path))
    return kept, encs


def _distinct_tokens(pair, enc, path) -> None:
    """A pair whose two responses tokenise to the same ids (text that differs only in
    characters the vocabulary lacks, which all become its unknown token) has a margin and
    a direction of exactly zero: every score would be 0 and the ranking the pool's order."""
    chosen, rejected = enc
    if chosen.input_ids == rejected.input_ids:
        raise InputError("'chosen' and 'rejected' differ as text but tokenise to the same tokens (characters "
                         "outside the tokenizer's vocabulary become one unknown token), so the pair carries no "
                         "preference", path=path, row=pair.row, line=pair.line, field="rejected",
                         fix="make the responses differ in characters the model's tokenizer knows, or drop the "
                             "pair (--skip-invalid skips it)")


def _with_targets(tokenizer, targets_path, max_length: int, skip_invalid: bool, *, invalid: list,
                  truncated_pool: int, **pool_fields) -> Inputs:
    """Inputs of an already read pool, with the target pairs read and tokenised."""
    pairs, chosen, rejected = [], [], []
    paths = target_paths(targets_path)
    check_stems(paths)
    for path in paths:  # several files: each its own task (tasks.name_tasks)
        tg = load_targets(path, skip_invalid=skip_invalid)
        invalid += tg.invalid
        kept, penc = _encode_all(tokenizer, name_tasks(tg.items, path, len(paths) > 1), ["chosen", "rejected"],
                                 max_length, path, skip_invalid, invalid, check=_distinct_tokens)
        if not kept:
            raise InputError("no valid target pair left", path=path)
        pairs += kept
        chosen += [c for c, _ in penc]
        rejected += [r for _, r in penc]
    truncated = {"pool": truncated_pool,
                 "targets": sum(c.truncated or r.truncated for c, r in zip(chosen, rejected))}
    return Inputs(pairs=pairs, chosen=chosen, rejected=rejected, invalid=invalid, truncated=truncated,
                  targets_path=str(paths[0]) if len(paths) == 1 else "",
                  targets_paths=[str(p) for p in paths], **pool_fields)


def prepare_inputs(tokenizer, pool_path, targets_path=None, *, max_length: int = DEFAULT_MAX_LENGTH,
                   skip_invalid: bool = False, pool: Loaded | None = None) -> Inputs:
    """Read and tokenise the pool and (optionally) the target pairs. ``pool``: the pool
    as :func:`prism_select.data.load_pool` already read it (not read again)."""
    pool = pool if pool is not None else load_pool(pool_path, skip_invalid=skip_invalid)
    invalid = list(pool.invalid)
    examples, enc = _encode_all(tokenizer, pool.items, ["response"], max_length, pool_path,
                                skip_invalid, invalid)
    encoded = [e[0] for e in enc]
    inputs = _with_targets(tokenizer, targets_path, max_length, skip_invalid, pool=examples, encoded=encoded,
                           invalid=invalid, truncated_pool=sum(e.truncated for e in encoded),
                           pool_path=str(pool_path), pool_format=pool.format,
                           pool_fingerprint=encoded_fingerprint(encoded))
    if not examples:
        raise InputError("no valid pool record left", path=pool_path)
    return inputs


def prepare_stream_inputs(tokenizer, pool_path, targets_path=None, *, max_length: int = DEFAULT_MAX_LENGTH,
                          skip_invalid: bool = False, fit_examples: int = STREAM_FIT_EXAMPLES,
                          seed: int = 0) -> Inputs:
    """The inputs of a streamed run, without the pool in memory.

    One streaming pass (:func:`prism_select.data.readers.scan_pool`) validates the pool,
    checks its ids and draws a seeded sample of ``fit_examples`` valid records; only
    the sample is tokenised (``fit_encoded``: the curvature's fit set). The pool is
    named by the sha256 of its file bytes (every file of a datasets directory), the
    tokenizer and ``max_length``. ``pool`` and ``encoded`` stay empty; ``invalid`` and
    ``truncated`` count the targets only: the scoring pass reports the pool's.
    """
    scan = scan_pool(pool_path, fit_examples, seed=seed, skip_invalid=skip_invalid)
    _, enc = _encode_all(tokenizer, scan.sample, ["response"], max_length, pool_path, skip_invalid, [])
    if not enc:
        raise InputError(f"none of the {len(scan.sample)} records sampled to fit the curvature can be "
                         f"tokenised within max_length={max_length}", path=pool_path,
                         fix="raise --max-length or --fit-examples")
    fingerprint = sha256_json({"file_sha256": sha256_file(pool_path), "max_length": max_length,
                               "tokenizer": tokenizer_fingerprint(tokenizer)})
    return _with_targets(tokenizer, targets_path, max_length, skip_invalid, pool=[], encoded=[], invalid=[],
                         truncated_pool=0, pool_path=str(pool_path), pool_format=scan.format,
                         pool_fingerprint=fingerprint, fit_encoded=[e[0] for e in enc],
                         fit_sample={"valid_records": scan.count, "requested": fit_examples,
                                     "drawn": len(scan.sample), "tokenised": len(enc), "seed": seed})


@dataclass
class RunContext:
    """Everything a scoring method needs; gradient methods share ``curvature()``."""

    lm: LoadedModel
    modules: dict
    inputs: Inputs
    settings: ScoreSettings
    curvature_settings: CurvatureSettings
    out_dir: Path
    timings: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    streamed: dict | None = None  # under stream: what score_stream returned, and the file it wrote
    #: per-candidate numbers a method reports beside its score (name -> one value per pool
    #: record, in pool order), written as extra fields of ``scores.jsonl``; not under stream
    columns: dict = field(default_factory=dict)
    #: device, precision, CUDA graphs, process group, memory plan, kernels (resolved once;
    #: from ``settings`` and the model when not given)
    execution: ExecutionContext | None = None
    _curvature: Curvature | None = None
    _fit_timings: dict = field(default_factory=dict)  # the fit's running phase totals
    _alloc_retries: int = 0  # the CUDA allocator's retries when the last stage ended (stage_peak)
    _stages: list = field(default_factory=list)  # the finished stages, in order (stage_peak)
    #: the fit's spill (:meth:`prism_select.curvature.spill._Spill.scores`) when it holds the
    #: scoring loss's gradients of every pool example (:meth:`_spill_scores_pool`)
    _spill: object | None = None
    #: the target sets, ``[(task, [pair indices])]`` (:func:`run_tasks`); empty: one set
    tasks: list = field(default_factory=list)

    @property
    def task_names(self) -> list:
        """The named target sets' names, in order (empty for one unnamed set)."""
        return [t for t, _ in self.tasks if t is not None]

    def __post_init__(self):
        if self.execution is None:
            self.execution = resolve_execution(self.settings, self.lm.model, self.lm.device)
        if self.lm.device.type == "cuda":  # a model loaded once for several runs (compare) has counted before
            self._alloc_retries = int(torch.cuda.memory_stats(self.lm.device).get("num_alloc_retries", 0))

    @property
    def plan(self) -> MemoryPlan | None:
        """Where each stage keeps what (:mod:`prism_select.plan`)."""
        return self.execution.plan

    @property
    def pad_id(self) -> int:
        return self.lm.tokenizer.pad_token_id

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
        self._stages.append(stage)
        peak = host_peak_mib()
        if peak is not None:
            self.info.setdefault("host_peak_mib_by_stage", {})[stage] = round(peak, 1)
        dev = self.lm.device
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
                self.lm.model, modules, fit, cs, pad_id=self.pad_id, cache=self._fit_cache(fit),
                execution=self.execution,
                timings=phases, layout=layout, on_group=on_group,
                spill=FitSpill(on_spill=self._keep_spill if from_spill else None,
                               scores=fit_scores if from_spill else None))
            dt = time.perf_counter() - t
            self.timings["curvature_s"] = self.timings.get("curvature_s", 0) + dt
            how = f"loaded from the cache {directory}" if reused else "fitted"
            distributed.say(f"curvature ({cur.kind}): " + ("nothing to fit" if cur.kind == "identity" else
                                                           f"{how} in {dt:.1f} s"), st.progress)
            self.stage_peak("fit")
            info = self.info.get("curvature", {})
            merged = {k: phases.get(k, 0) + info.get("phases_s", {}).get(k, 0) for k in phases}
            damping = list(cur.damping.values())
            self.info["curvature"] = {**info, "kind": cur.kind, "path": str(directory) if directory else None,
                                      "reused": reused, "damping": _summary(damping), "store": store,
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

    def _fit_cache(self, encoded: list) -> FitCache:
        """Where a curvature fitted on ``encoded`` is cached (the run's cache folder, keyed
        by the model and that fit sample)."""
        st = self.settings
        return FitCache(Path(self.lm.settings.resolved_cache_dir()) / "curvature", self.lm.fingerprint,
                        encoded_fingerprint(encoded), st.max_length, st.cache_max_bytes)

    def _spill_scores_pool(self, cs: CurvatureSettings, groups) -> bool:
        """Whether the fit (EK-FAC on the CPU, :func:`prism_select.curvature.fit.fit_curvature`)
        is to score the pool (:meth:`_score_in_fit`) or keep its spill to score from: asked
        for (``settings.scores_from_fit``), for a method that scores a direction, and the
        spill would hold exactly the per-example gradients that exact scoring of the pool
        forms: the fit runs on every pool record (not a sample, not a separate fit set) with the
        empirical Fisher (the records' own labels: the scoring loss, summed over response
        tokens per example), in one group of layers, in the model's own arithmetic, both
        with the same loss route (the logits at response positions, or the model's), and
        the pool is scored in memory by the exact route."""
        st, ex = self.settings, self.execution
        model = self.lm.model
        return (st.scores_from_fit and st.method in DIRECTION_METHODS and self._damping_rule() == "heuristic"
                and len(self.tasks) <= 1
                and self.inputs.fit_encoded is None and cs.kind == "ekfac" and cs.fisher == "empirical"
                and len(fit_indices(len(self.inputs.encoded), cs)) == len(self.inputs.encoded)
                and not (groups and len(groups) > 1) and not st.stream
                and ex.precision == "model" and not ex.sharded and ex.world == 1
                and (split_causal_lm(model) is None) == (cpu_response_split(model, self.modules) is None))

    def _score_in_fit(self, direction: dict):
        """The pool's scores along ``H^-1 direction`` formed by the fit itself
        (:class:`prism_select.curvature.spill.FitScores`), when the curvature is still to be
        fitted and its spill would hold the scoring gradients (:meth:`_spill_scores_pool`):
        no ``v`` is formed and no scoring pass runs. Returns ``(scores, direction)``:
        ``scores`` None when the fit did not score (the curvature came from the cache, or
        the kept products would be too large), and the direction then left to precondition
        (waiting in a temporary file during the fit, as :meth:`last_use` does; the run's
        curvature is the fitted one)."""
        if (self._curvature is not None or not self.settings.scores_from_fit or not direction
                or self._transient() or self.execution.sharded
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
        if self._spill is not None:
            self._spill.close()
        self._spill = spill

    def _drop_spill(self) -> None:
        if self._spill is not None:
            self._spill.close()
            self._spill = None

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
        transient = self._transient()
        if self._damping_rule() == "split-half":
            self._split_half_damping(direction)

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
            v = self._precondition_by_group(tag, compute)
        elif self.execution.sharded:
            v = compute(self.curvature(), list(self.modules))
        elif last:
            v = self.last_use(direction, device=dev)
        else:
            v = self.curvature().precondition(direction, device=dev)
        return {n: v.pop(n).to(dtype=vdt) for n in self.modules}  # each float32 layer let go once converted

    def _damping_rule(self) -> str:
        """This run's damping rule (:func:`damping_rule_of`)."""
        return damping_rule_of(self.curvature_settings)

    def _split_half_damping(self, direction: dict) -> None:
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
        if cs.kind != "ekfac" or self._transient() or self.execution.sharded or self.execution.world > 1:
            raise ConfigError("damping_rule", "split-half needs an EK-FAC curvature kept whole by one process",
                              "use --curvature ekfac on one process with the curvature on the device or host, "
                              "or --damping-rule heuristic")
        cur = self.curvature()
        t = time.perf_counter()
        with self._curvature_aside(cur):
            check = self._split_half_walk(direction)
        if check.factor is None:
            cur = Curvature("identity", cur.layers, {}, {n: 0.0 for n in cur.layers})
        else:
            cur = apply_damping(cur, replace(cs, damping_factor=check.factor))
        self._curvature = cur
        self.stage_peak("split_half")
        self.timings["split_half_s"] = time.perf_counter() - t
        self.info["curvature"] = {**self.info.get("curvature", {}), "split_half": check.to_json(), "kind": cur.kind,
                                  "damping": _summary(list(cur.damping.values())), "damping_factor": check.factor}
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

    def _split_half_walk(self, direction: dict) -> support.SplitHalf:
        """The split-half check's halves, fitted (or loaded from the cache), scored down the
        damping ladder (:meth:`_split_half_damping`)."""
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
                                                cache=self._fit_cache(half), execution=quiet,
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
                    agreement.update({f: support.spearman(scores[:, 2 * i], scores[:, 2 * i + 1])
                                      for i, f in enumerate(rungs)})
                    bar.update(len(rungs))
                else:
                    a, b = (score_encoded(self.lm.model, self.modules, scored, v_at(h, factor), pad_id=self.pad_id,
                                          batch_size=self.scoring_batch(), execution=quiet) for h in halves)
                    agreement[factor] = support.spearman(a, b)
                    bar.update(1)
            return agreement[factor]

        try:
            return support.split_half(len(fit), support.walk_ladder(agreement_at))
        finally:
            bar.close()

    def scoring_batch(self) -> int:
        """The scoring batch: the memory plan's (it may have lowered the settings'). A
        method whose passes over the pool hold what a scoring step holds (one batch's
        activations and logits, V beside the weights; IF-Guide's token scores) uses it too."""
        plan = self.plan
        return plan.scoring["batch_size"] if plan is not None and plan.scoring else self.settings.batch_size

    def direction_batch(self) -> int:
        """The target pairs' batch: the memory plan's (it may have lowered the settings')."""
        plan = self.plan
        return plan.direction["batch_size"] if plan is not None and plan.direction else self.settings.batch_size

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

    def _transient(self) -> bool:
        """The memory plan keeps no curvature: each fit group preconditions its layers and
        is dropped, its part of ``v`` saved in ``.partial``."""
        return bool(self.plan is not None and self.plan.curvature_store == "transient" and self.plan.fit_groups)

    def _precondition_by_group(self, tag: str, compute) -> dict:
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
            self.curvature(on_group=on_group, groups=[groups[k] for k in todo])
        if len(todo) < n_groups:
            cur = self.info.setdefault("curvature", {})
            cur["resumed_groups"] = n_groups - len(todo)
            ph = cur.setdefault("phases_s", {})
            for key, val in done_phases.items():  # the whole fit's phases, earlier processes included
                ph[key] = ph.get(key, 0) + val
        return v

    def last_use(self, direction: dict, device=None) -> dict:
        """``H^-1 direction`` (in the direction's dtype) when neither the direction nor the
        curvature is needed afterwards, holding the least host memory: a direction whose
        layers are all in host memory waits in a temporary file (in the cache directory,
        :class:`prism_select.gradients.SpilledLayers`) while the curvature is fitted or
        loaded (without the file when the disk refuses it); then each layer of the
        direction is read back and each layer's curvature freed as it is used, and the
        run's curvature is dropped (the fit stays in the cache). ``direction`` is left
        empty. On the CPU the embedded model's fit held its 540 MB direction to the end."""
        if self._damping_rule() == "split-half":  # the run's damping, whichever method asks (once a run)
            self._split_half_damping(direction)
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

    def _group_phases(self, last: dict) -> dict:
        """The fit phases of the group just finished (the running totals minus ``last``,
        which is updated): the fit timings arrive per call, so a group's share is a difference."""
        now = self._fit_timings
        out = {k: now.get(k, 0) - last.get(k, 0) for k in now}
        last.clear()
        last.update(now)
        return out

    def score_direction(self, direction: dict, tag: str = "scores", last: bool = False) -> torch.Tensor | None:
        """``g_z . H^-1 direction`` for every pool example (resumable).

        Under ``settings.stream`` the pool file is scored a window at a time into
        ``.partial/<tag>.jsonl`` (id, score, rank), recorded in ``self.streamed``, and
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
        in_fit = None  # the pool's scores formed by the fit (_score_in_fit)
        if not saved and last:  # the direction is left to precondition when the fit does not score
            in_fit, direction = self._score_in_fit(direction)
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
            v = self.precondition(direction, tag, last=last)  # last: direction and curvature freed as used
            if earlier is not None and self.info.get("curvature", {}).get("resumed_groups"):
                self.info["curvature"] = {**earlier, **self.info["curvature"], "resumed": True}
            if self.execution.main:
                partial.mkdir(parents=True, exist_ok=True)
                atomic_write_json(info_path, self.info["curvature"])
            distributed.barrier()
            # a transient plan's group files already hold v: a merged copy beside them would
            # need v's size again on disk at once (26 GiB at Qwen3-14B's shape)
            if (self.execution.main or fsdp) and not self._transient():
                _save_v(v, partial, name, tag)
        if last:
            direction = None
            self._curvature = None
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
                vs.append(self.precondition(direction, tag))
                direction.clear()
                del direction
                release_host_memory()
            v = {n: torch.stack([vk.pop(n) for vk in vs]) for n in self.modules}
            del vs
            if self.execution.main:
                partial.mkdir(parents=True, exist_ok=True)
                atomic_write_json(info_path, self.info["curvature"])
                _save_v(v, partial, f"{tag}_v", tag)
            distributed.barrier()
        self._curvature = None  # the fit stays in the cache
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
        if self._transient():
            raise ConfigError("targets", "several target sets need the fitted curvature kept while each set's "
                              "direction is preconditioned; this run's memory plan fits it group by group "
                              "(transient)", fix + ", or give the run more host memory")
        if ex.precision == "split32":
            raise ConfigError("precision", "several target sets are scored in the model's own arithmetic, not "
                              "under --precision split32", fix + ", or drop --precision")
        if self._damping_rule() == "split-half":
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
                               tasks=self.task_names or None, **common)
            if not res["count"]:
                raise InputError("no valid pool record left", path=self.inputs.pool_path)
            stats = {k: res.pop(k) for k in ("examples", "real_tokens", "padded_tokens") if k in res}
            self.streamed = {**res, "path": out}
            return None, stats
        if in_fit is not None:
            return in_fit, {"examples": len(self.inputs.encoded),
                            "real_tokens": sum(len(e.input_ids) for e in self.inputs.encoded),
                            "from_fit_spill": True, "in_fit": True}
        s = None
        if self._spill is not None:  # the fit's gradients are the scoring's: no model pass
            s = self._spill.scores(self.modules, v, len(self.inputs.encoded))
            if s is not None:
                n_tok = sum(len(e.input_ids) for e in self.inputs.encoded)
                stats = {"examples": len(self.inputs.encoded), "real_tokens": n_tok,
                         "padded_tokens": sum(math.prod(rec[0][1][1][:2]) for rec in self._spill.batches),
                         "from_fit_spill": True}
            if last or s is None:
                self._drop_spill()
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
        self.stage_peak("scoring")
        if stats.get("in_fit"):  # scored inside the fit: no time of its own
            self.info.setdefault("throughput", {})[tag] = {**stats, "ranks": self.execution.world}
        elif stats.get("examples"):  # this rank's share; tokens/s counts real (non-padding) tokens
            self.info.setdefault("throughput", {})[tag] = {
                **stats, "ranks": self.execution.world, "real_tokens_per_s_rank": stats["real_tokens"] / dt,
                "padding_fraction": 1 - stats["real_tokens"] / max(stats["padded_tokens"], 1)}


def _save_v(v: dict, partial: Path, name: str, tag: str) -> None:
    """``v`` saved whole in ``partial`` (written beside, then renamed), the files of its
    fit groups removed."""
    tmp = partial / f".{name}.tmp"
    save_file({k: t.detach().contiguous().cpu() for k, t in v.items()}, str(tmp))
    tmp.replace(partial / f"{name}.safetensors")
    for f in partial.glob(f"{tag}_v_group*"):
        f.unlink(missing_ok=True)


def resume_groups(saved: list, planned: list, finished) -> list:
    """The fit groups of a resumed transient run: the saved layout's finished groups
    (``finished(k)``: group ``k``'s part of ``v`` is saved) where they are, and the other
    layers grouped as this process's plan groups them (each a part of a planned group, so
    it fits), in the unfinished positions, then appended; positions left over are empty.
    The saved layout is the earlier process's plan, made for other memory: kept whole, a
    2-group layout of an uncapped H200 run was fitted under a 79.6 GiB cap (5 groups
    planned) and ran out of GPU memory in its first group. Idempotent: the result given
    back as ``saved`` gives itself."""
    done = [k for k, g in enumerate(saved) if g and finished(k)]
    kept = {n for k in done for n in saved[k]}
    fresh = [f for f in ([n for n in g if n not in kept] for g in planned) if f]
    out = [g if k in done else [] for k, g in enumerate(saved)]
    free = [k for k in range(len(saved)) if k not in done]
    for g in fresh:
        if free:
            out[free.pop(0)] = g
        else:
            out.append(g)
    return out


def _summary(xs: list) -> dict:
    if not xs:
        return {}
    return {"min": min(xs), "max": max(xs), "mean": sum(xs) / len(xs)}


def _versions() -> dict:
    import transformers
    return {"prism_select": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


def prism_method(ctx: RunContext) -> tuple[torch.Tensor, list]:
    """PRISM and its ablations: scores and per-pair rows for pairs.jsonl. With several
    target sets (``ctx.tasks``) each set gets its own direction and the scores are
    ``(N, tasks)``: :func:`_prism_tasks`."""
    if not ctx.inputs.pairs:
        raise ConfigError("targets", f"method {ctx.settings.method!r} needs target pairs", "pass --targets FILE")
    if len(ctx.tasks) > 1:
        return _prism_tasks(ctx)
    t = time.perf_counter()
    d = ctx.plan.direction if ctx.plan is not None and ctx.plan.direction else {}
    # split32 accumulates its float32 gradients itself (precision.float32_grads)
    ex = ctx.execution
    accumulate = d.get("accumulate", "device") if ex.precision != "split32" else "device"
    # one half's graph alive at a time: under a bounded plan (GPU) and on the CPU (host
    # memory: with both halves' activations at once the direction stage reached 2.7-2.9 GB
    # at 60 records, model and gradients included), for one more forward of the
    # rejected half without a graph
    one_graph = ctx.plan is not None and ctx.plan.bounded or ctx.lm.device.type == "cpu"
    kernels = direction_kernels(ex.kernels)
    with direction_policy(ctx.lm.model, ex):
        weights, given = _given_weights(ctx, kernels)
        pref = compute_preference(ctx.lm.model, ctx.modules, ctx.inputs.chosen, ctx.inputs.rejected,
                                  method=ctx.settings.method, pad_id=ctx.pad_id,
                                  batch_size=ctx.direction_batch(),
                                  ids=[p.id for p in ctx.inputs.pairs], accumulate=accumulate,
                                  store=d.get("store", "device"), one_graph=one_graph,
                                  execution=replace(ex, kernels=kernels), weights=weights)
    ctx.timings["preference_s"] = time.perf_counter() - t
    ctx.stage_peak("direction")
    log.info("target direction (%s, %d pairs): %.1f s", ctx.settings.method, len(ctx.inputs.pairs),
             ctx.timings["preference_s"])
    distributed.say(f"target direction ({ctx.settings.method}, {len(ctx.inputs.pairs)} pairs): "
                    f"{ctx.timings['preference_s']:.1f} s", ctx.settings.progress)
    ctx.info["pi"] = _summary(pref.pi.tolist())
    pairs = [{"id": p.id, "pi": float(pref.pi[i]), "margin": float(pref.margin[i]),
              "weight": float(pref.weights[i]), "loss_chosen": float(pref.loss_chosen[i]),
              "loss_rejected": float(pref.loss_rejected[i]), **({"task": p.task} if p.task else {}),
              **{k: v[i] for k, v in given.items()}}
             for i, p in enumerate(ctx.inputs.pairs)]
    return ctx.score_direction(_take_direction(pref), last=True), pairs


def _prism_tasks(ctx: RunContext) -> tuple[torch.Tensor, list]:
    """Several target sets in one pass: each task's pairs give their own ``pi``, margins and
    direction (:func:`compute_preference` on that task's pairs alone, so each direction is
    what a run on that task alone forms), each direction is preconditioned by the run's
    one curvature, and the pool is scored along all of them from one forward and backward
    per batch (:meth:`RunContext.score_tasks`). Returns ``(N, tasks)`` scores (None under
    stream) and the pairs' rows, each with its task."""
    ex = ctx.execution
    d = ctx.plan.direction if ctx.plan is not None and ctx.plan.direction else {}
    accumulate = d.get("accumulate", "device") if ex.precision != "split32" else "device"
    one_graph = ctx.plan is not None and ctx.plan.bounded or ctx.lm.device.type == "cpu"
    kernels = direction_kernels(ex.kernels)
    method, inputs = ctx.settings.method, ctx.inputs
    rows: dict = {}
    pis: dict = {}

    def directions():
        for task, idx in ctx.tasks:
            t = time.perf_counter()
            with direction_policy(ctx.lm.model, ex):
                pref = compute_preference(ctx.lm.model, ctx.modules, [inputs.chosen[i] for i in idx],
                                          [inputs.rejected[i] for i in idx], method=method, pad_id=ctx.pad_id,
                                          batch_size=ctx.direction_batch(), ids=[inputs.pairs[i].id for i in idx],
                                          accumulate=accumulate, store=d.get("store", "device"),
                                          one_graph=one_graph, execution=replace(ex, kernels=kernels))
            dt = time.perf_counter() - t
            ctx.timings["preference_s"] = ctx.timings.get("preference_s", 0) + dt
            ctx.stage_peak("direction")
            distributed.say(f"target direction ({method}, task {task}, {len(idx)} pairs): {dt:.1f} s",
                            ctx.settings.progress)
            pis[task] = _summary(pref.pi.tolist())
            for j, i in enumerate(idx):
                p = inputs.pairs[i]
                rows[i] = {"id": p.id, "pi": float(pref.pi[j]), "margin": float(pref.margin[j]),
                           "weight": float(pref.weights[j]), "loss_chosen": float(pref.loss_chosen[j]),
                           "loss_rejected": float(pref.loss_rejected[j]), "task": p.task}
            yield _take_direction(pref)

    scores = ctx.score_tasks(directions())
    ctx.info["pi"] = _summary([rows[i]["pi"] for i in sorted(rows)])
    ctx.info["target_sets"] = [{"task": task, "pairs": len(idx), "pi": pis[task]} for task, idx in ctx.tasks]
    return scores, [rows[i] for i in sorted(rows)]


def _given_weights(ctx: RunContext, kernels) -> tuple:
    """``(weights, per-pair columns for pairs.jsonl)`` of a control of PRISM's weights
    (``preference.GIVEN_WEIGHTS``), from every pair's ``pi`` by forward passes first;
    ``(None, {})`` for the other directions. ``prism_shuffled``'s permutation is seeded by
    the run's seed and its option ``shuffle_seed`` (``seed * 1000 + shuffle_seed``); each
    pair's row names the pair whose ``pi`` it got (``weight_from``)."""
    method = ctx.settings.method
    if method not in GIVEN_WEIGHTS:
        return None, {}
    _, pi = pair_margins(ctx.lm.model, ctx.inputs.chosen, ctx.inputs.rejected, pad_id=ctx.pad_id,
                         batch_size=ctx.direction_batch(), modules=ctx.modules, kernels=kernels)
    ids = [p.id for p in ctx.inputs.pairs]
    if method == "equal_top_half":
        w = top_half_weights(pi)
        ctx.info["weights"] = {"rule": "1 above the median pi, else 0", "median_pi": float(torch.quantile(pi, 0.5)),
                               "n_weighted": int(w.sum())}
        return w, {"pi_before": [float(x) for x in pi]}
    shuffle_seed = ctx.settings.method_options.get("shuffle_seed", DIRECTION_OPTIONS[method]["shuffle_seed"][1])
    seed = ctx.settings.seed * 1000 + shuffle_seed
    w, perm = shuffled_weights(pi, seed)
    ctx.info["weights"] = {"rule": "pi permuted across the pairs", "shuffle_seed": shuffle_seed,
                           "permutation_seed": seed, "fixed_points": int((perm == torch.arange(len(perm))).sum())}
    return w, {"pi_before": [float(x) for x in pi], "weight_from": [ids[j] for j in perm.tolist()]}


def _take_direction(pref) -> dict:
    """``pref.direction``, no longer referenced by ``pref`` (so scoring can release it)."""
    direction, pref.direction = pref.direction, None
    return direction


def run_tasks(inputs: Inputs, settings: ScoreSettings) -> list:
    """The run's target sets: ``[(task, [pair indices])]`` (:func:`prism_select.tasks.task_groups`),
    or one group ``(None, every pair)`` for a method that reads the pairs' tasks itself
    (the baselines, e.g. LESS), under ``combine_tasks``, and for one unnamed set. The
    controls of PRISM's weights (``preference.GIVEN_WEIGHTS``) take one set only."""
    groups = task_groups(inputs.pairs)
    every = [(None, list(range(len(inputs.pairs))))]
    if settings.method not in DIRECTION_METHODS or settings.combine_tasks or not groups:
        return every
    _check_task_method(groups, settings)
    return groups


def _check_task_method(groups: list, settings: ScoreSettings) -> None:
    """A control of PRISM's weights with several target sets is refused (it weighs
    every pair at once): :func:`run_tasks`, and before the model loads."""
    if (len(groups) > 1 and settings.method in DIRECTION_METHODS and settings.method not in MULTI_TASK_METHODS
            and not settings.combine_tasks):
        raise ConfigError("targets", f"method {settings.method!r} weighs every target pair at once and scores one "
                          f"target set, but the targets hold {len(groups)} tasks "
                          f"({', '.join(str(t) for t, _ in groups[:4])}{', ...' if len(groups) > 4 else ''})",
                          "pass --combine-tasks (one direction from every pair), or use --method "
                          + " / ".join(MULTI_TASK_METHODS))
    several = len(groups) > 1 and settings.method in MULTI_TASK_METHODS and not settings.combine_tasks
    for name, flag, value in (("shard", "--shard", "fsdp"), ("precision", "--precision", "split32")):
        if several and getattr(settings, name) == value:
            raise ConfigError(name, f"{len(groups)} target sets are not scored in one pass under {flag} {value}",
                              f"drop {flag}, score one task per run, or pass --combine-tasks")


def _method_fn(name: str):
    if name in DIRECTION_METHODS:
        return prism_method
    from .baselines import REGISTRY
    return REGISTRY[name]


def ranks(scores: torch.Tensor) -> list:
    """1 = highest score; ties keep input order (stable)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    r = [0] * len(scores)
    for k, i in enumerate(order):
        r[i] = k + 1
    return r


def _differences(a, b, prefix: str = "") -> list:
    """Dotted names of the entries where two JSON-like dicts differ."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [prefix or "(value)"] if a != b else []
    out = []
    for k in sorted(set(a) | set(b)):
        out += _differences(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else k)
    return out


def _finished_run(out_dir: Path, run_key: dict) -> dict | None:
    """``run.json`` of a finished run in ``out_dir`` whose recorded ``run_key`` is
    ``run_key``, else None."""
    try:
        done = json.loads((out_dir / "run.json").read_text())
    except (OSError, ValueError):
        return None
    same = (isinstance(done, dict) and done.get("status") == "complete"
            and done.get("run_key") == json.loads(json.dumps(run_key)))
    return done if same and (out_dir / "scores.jsonl").is_file() else None


def _prepare_out_dir(out_dir: Path, run_key: dict, overwrite: bool) -> bool:
    """Make ``out_dir`` ready for the run ``run_key``; True where it resumes an unfinished one."""
    check_writable_dir(out_dir)
    run_json = out_dir / "run.json"
    partial = out_dir / ".partial"
    for f in ("scores.jsonl", "pairs.jsonl", "run.json"):
        remove_stale_temps(out_dir / f)  # what a killed earlier run left of its files
    if overwrite:
        remove_tree(partial)  # a planted link is removed as a link, never through
        for f in ("scores.jsonl", "pairs.jsonl", "run.json"):
            (out_dir / f).unlink(missing_ok=True)
        return False
    refuse_links(partial)
    if run_json.exists():
        raise OutputError(f"{out_dir} already holds a finished run (run.json); "
                          "pass --overwrite to replace it, or choose another --out")
    state = partial / "key.json"
    if state.exists():
        old = read_saved_state(state)
        if old != run_key:
            raise CacheError(f"{out_dir} holds an unfinished run with other settings or inputs (differs in: "
                             f"{', '.join(_differences(old, json.loads(json.dumps(run_key)))) or 'types'}); "
                             "rerun its own command to resume it, or pass --overwrite")
        log.info("resuming the unfinished run in %s", out_dir)
        return True
    partial.mkdir(parents=True, exist_ok=True)
    atomic_write_json(state, run_key)
    return False


def plan_run(lm: LoadedModel, modules: dict, inputs: Inputs, settings: ScoreSettings,
             curvature: CurvatureSettings, directions: int = 1) -> MemoryPlan:
    """The run's memory plan (:mod:`prism_select.plan`), from one measured example of the
    longest length among the pool, the fit sample and the target pairs; logged.
    ``directions``: the target sets scored together (each its own ``v``)."""
    examples = list(inputs.encoded) + list(inputs.fit_encoded or []) + list(inputs.chosen) + list(inputs.rejected)
    longest = max(examples, key=lambda e: len(e.input_ids)) if examples else None
    nbytes = 0
    cap_device_memory(lm.device, settings.max_gpu_memory)
    sharded = sharding.is_sharded(lm.model)
    fixed = None  # device bytes a step holds whatever its batch size: FSDP's gathered weights
    if longest is not None and lm.device.type == "cuda":
        nbytes = measure_example_bytes(lm.model, longest, lm.tokenizer.pad_token_id, lm.device)
        if sharded:  # two points: per example, and the weights FSDP gathers for every step
            two = measure_example_bytes(lm.model, longest, lm.tokenizer.pad_token_id, lm.device, copies=2)
            per = max(two - nbytes, 0)
            fixed = torch.cuda.memory_allocated(lm.device) + max(nbytes - per, 0)
            nbytes = per
    head = lm.model.get_output_embeddings() if hasattr(lm.model, "get_output_embeddings") else None
    vocab = head.out_features if isinstance(head, torch.nn.Linear) else len(lm.tokenizer)
    gpu_total = host = None
    elsewhere = 0
    if lm.device.type == "cuda":  # what other processes hold now is not the run's to plan with
        gpu_total, elsewhere = device_memory(lm.device)
    if distributed.active():
        # one plan on every rank: the ranks split the same fit batches and run the same
        # collectives, so each plans for the largest measurement and the smallest memory
        if lm.device.type == "cuda":
            mine = fixed if fixed is not None else torch.cuda.memory_allocated(lm.device)
            fixed = max(distributed.gather_values(mine))
            gpu_total = min(distributed.gather_values(gpu_total))
        nbytes = max(distributed.gather_values(nbytes))
        host = min(distributed.gather_values(host_share_bytes()))
    try:
        example = ExampleSize(nbytes, len(longest.input_ids) if longest is not None else 1, vocab)
        shards = Shards(distributed.world() if sharded else 1, settings.fsdp_sums, settings.fsdp_keep_gathered,
                        sum(p.numel() * p.element_size() for p in lm.model.parameters()) if sharded else None)
        plan = make_plan(lm.model, modules, kind=curvature.kind, device=lm.device, batch_size=settings.batch_size,
                         fit_batch_size=curvature.batch_size, example=example,
                         max_gpu_memory=settings.max_gpu_memory, weights=fixed, gpu_total=gpu_total,
                         host_available=host, shards=shards, directions=directions)
    except PlanError as e:
        note = held_elsewhere_note(lm.device, elsewhere)
        if not note:
            raise
        raise PlanError(str(e) + note) from None
    if distributed.is_main():
        log.info("%s", plan.describe())
        if settings.progress and (plan.bounded and (len(plan.fit_groups) > 1 or plan.notes)):
            print(plan.describe(), file=sys.stderr)
    return plan


#: free disk kept beside the saved ``v`` of a transient plan (score chunks, run.json, logs)
DISK_MARGIN_BYTES = 1 << 30


def check_disk_for_v(plan: MemoryPlan | None, modules: dict, dtype: torch.dtype, out_dir: Path,
                     shards: int = 1) -> None:
    """Before a transient plan's fit: its preconditioned direction ``v`` (the tracked
    weights' size in ``dtype``; this rank's ``1 / shards`` under FSDP) is saved in
    ``<out>/.partial`` group by group, and a run whose disk cannot hold it would stop only
    after the whole fit. Raises :class:`OutOfResourceError` (``disk``) in seconds instead;
    what earlier processes of this run saved there counts as written."""
    if plan is None or plan.curvature_store != "transient" or not plan.fit_groups:
        return
    size = torch.tensor([], dtype=dtype).element_size()
    need = sum(o * i for o, i in map(layer_shape, modules.values())) * size // max(shards, 1)
    partial = Path(out_dir) / ".partial"
    saved = sum(f.stat().st_size for f in partial.glob("*_v_group*.safetensors")) if partial.is_dir() else 0
    free = shutil.disk_usage(out_dir).free
    if free + saved < need + DISK_MARGIN_BYTES:
        raise OutOfResourceError(
            "disk", f"the fit saves the preconditioned direction ({need / 2**30:.1f} GiB) group by group in "
            f"{partial}, and {out_dir}'s filesystem has {free / 2**30:.1f} GiB free", "free disk space there "
            "(e.g. prism-select cache prune, if the cache shares that disk) or pass an --out on a larger disk",
            "nothing had started yet")


def check_before_loading(model: ModelSettings | LoadedModel, pool_path, targets_path,
                         settings: ScoreSettings) -> Loaded | None:
    """What can be checked without the model, so that a mistake fails in a second rather
    than after the model has loaded: the device and adapter directory, that the input
    files exist in a supported format, that the method has the target pairs it needs,
    and every record of the targets and (unless ``settings.stream``) of the pool.
    Returns the read pool (None under ``stream``, whose own pass reads it)."""
    if targets_path is None and settings.method in DIRECTION_METHODS:
        raise ConfigError("targets", f"method {settings.method!r} needs target pairs", "pass --targets FILE")
    own = DIRECTION_OPTIONS.get(settings.method, {})
    extra = sorted(set(settings.method_options) - set(own)) if settings.method in DIRECTION_METHODS else []
    if extra:
        takes = f"takes only {', '.join(own)}" if own else "takes no options"
        raise ConfigError("method_options", f"method {settings.method!r} {takes}, got {', '.join(map(str, extra))}",
                          "drop --option: options belong to the baselines (see `prism-select methods`); "
                          f"{settings.method}'s own settings are flags (see `prism-select score --help`)")
    for k, (kind, _, _) in own.items():
        v = settings.method_options.get(k)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool) or v < 0):
            raise ConfigError("method_options", f"{settings.method}'s {k} must be an integer >= 0, got {v!r}",
                              f"e.g. --option {k}=1")
    for pattern in settings.modules or []:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError("modules", f"{pattern!r} is not a regular expression ({e})",
                              "pass e.g. --modules 'mlp' 'self_attn\\.(q|v)_proj'") from None
    if isinstance(model, ModelSettings):
        check_cache_dir(model.resolved_cache_dir())
        model.resolved_device()
        if model.adapter is not None:
            check_adapter_dir(Path(model.adapter).expanduser().resolve())
    detect_format(pool_path)
    paths = target_paths(targets_path)
    if len(paths) > 1 and settings.method not in MULTI_TASK_METHODS and not settings.combine_tasks:
        raise ConfigError("targets", f"method {settings.method!r} scores one target set; several --targets files "
                          f"are scored by {', '.join(MULTI_TASK_METHODS)}",
                          "pass one --targets file (its records' 'task' field groups the pairs), --combine-tasks "
                          f"(the files' pairs as one set, each pair's task its file's stem), or use --method "
                          f"{' / '.join(MULTI_TASK_METHODS)}")
    check_stems(paths)
    pairs = []
    for path in paths:
        pairs += name_tasks(load_targets(path, skip_invalid=settings.skip_invalid).items, path, len(paths) > 1)
    _check_task_method(task_groups(pairs), settings)
    return None if settings.stream else load_pool(pool_path, skip_invalid=settings.skip_invalid)


def check_cache_dir(root: Path) -> None:
    """The cache (``--cache-dir``) is a folder this process can create and write in: the
    fitted curvature and converted models are saved there. Raises :class:`ConfigError`."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError("cache_dir", f"{root} is a file, not a folder",
                          "pass --cache-dir a folder (it is created if missing), or move the file away")
    try:
        check_writable_dir(root)
    except OutputError as e:
        raise ConfigError("cache_dir", f"{root} cannot be written: {e.__cause__.strerror or e.__cause__}"
                          if isinstance(e.__cause__, OSError) else str(e),
                          "pass --cache-dir a writable folder (or set PRISM_SELECT_CACHE)") from None


#: the lock file of a run folder (:mod:`prism_select.locks`), held while a run writes it
RUN_LOCK = ".prism-select.lock"


def remove_tree(path: Path) -> None:
    """Remove ``path``: a link (or file) as itself, a folder with what it holds (links in
    it removed as links). Never follows a link."""
    path = Path(path)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def refuse_links(partial: Path) -> None:
    """:class:`OutputError` if the run folder's ``.partial`` is a symbolic link or holds
    one: a run never writes, reads or resumes through a link planted there."""
    partial = Path(partial)
    found = [partial] if partial.is_symlink() else []
    if not found and partial.is_dir():
        for root, dirs, files in os.walk(partial):  # links are not followed
            found += [Path(root) / n for n in dirs + files if (Path(root) / n).is_symlink()]
            if found:
                break
    if found:
        link = found[0]
        raise OutputError(f"{link} is a symbolic link (to {os.readlink(link)}): a run never writes through a link in "
                          "its run folder; remove the link, or pass --overwrite (which removes it as a link and "
                          "starts the run again)")


@contextlib.contextmanager
def run_folder_lock(out_dir: Path):
    """Hold ``<out>/.prism-select.lock`` for the run (on the main process; every process
    refuses together): a second run with the same ``--out`` is refused by name while
    this one runs. The lock goes with the process however it ends."""
    busy, lock = None, None
    if distributed.is_main():
        lock = locks.held(Path(out_dir) / RUN_LOCK, wait=False)
        try:
            lock.__enter__()
        except locks.Busy as e:
            busy, lock = e, None
        except OSError as e:
            raise OutputError(f"cannot lock the run folder {out_dir}: {e.strerror or e}") from e
    if not distributed.all_or_nothing(busy is None):
        if lock is not None:
            lock.__exit__(None, None, None)
        raise OutputError(f"{out_dir} is in use by another prism-select run ({busy.holder if busy else 'on rank 0'}"
                          " holds its lock): wait for it to finish (run the same command again then to reuse or "
                          "resume it), or choose another --out")
    try:
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)


def pool_file_sha(pool_path) -> str | None:
    """The pool file's sha256 (a saved dataset's files together), None where it cannot be
    read, or is no regular file or saved dataset (the checks of the inputs name that: a
    device or a pipe is never read)."""
    try:
        detect_format(pool_path)
        return sha256_file(pool_path)
    except InputError:
        return None


def check_pool_unchanged(pool_path, read_sha: str | None, out_dir: Path) -> str:
    """The pool's sha256 now, which must be the one taken when the run read it: a pool
    rewritten while it was scored stops the run (:class:`InputError`), its ``.partial``
    removed (its work scored a file that is no longer there)."""
    now = sha256_file(pool_path)
    if read_sha is not None and now != read_sha:
        if distributed.is_main():
            remove_tree(Path(out_dir) / ".partial")
        raise InputError(f"the pool file changed while the run read and scored it (sha256 {read_sha[:12]}... when "
                         f"read, {now[:12]}... at the end), so its scores would not belong to the file select and "
                         "report read; nothing was written", path=pool_path,
                         fix="run the command again once nothing writes to the pool (copy it first if it is being "
                             "written)")
    return now


def _drop_partial_without_chunks(out_dir: Path) -> None:
    """After a failed run: remove ``.partial`` unless it holds finished work (a score chunk,
    a preconditioned direction or a part of one), so that the corrected command (other
    settings) is not refused as an unfinished run."""
    partial = out_dir / ".partial"
    if partial.is_dir() and not partial.is_symlink() and not any(partial.rglob("*.safetensors")):
        shutil.rmtree(partial, ignore_errors=True)


def score_pool(model: ModelSettings | LoadedModel, pool_path, targets_path, out_dir, settings: ScoreSettings | None = None,
               curvature: CurvatureSettings | None = None, *, reuse_finished: bool = False) -> dict:
    """Score every pool example and write ``scores.jsonl``, ``pairs.jsonl`` and ``run.json``.

    ``targets_path``: one target file, or a list of them, each a target set named by its
    stem; a file whose records carry ``task`` holds a set per task. Several sets are
    scored in one pass (:mod:`prism_select.tasks`, :meth:`RunContext.score_tasks`).

    Returns the run summary (the content of run.json). ``reuse_finished``: a finished run
    in ``out_dir`` with the same inputs and settings (its ``run.json``'s ``run_key``) is
    returned as it is instead of refused (``prism-select compare`` resumed). Under
    ``settings.stream`` the pool is read a window at a time (see
    :func:`prepare_stream_inputs`); an unset ``curvature.fit_examples`` then becomes
    ``STREAM_FIT_EXAMPLES``. Under
    ``settings.deterministic`` the whole run uses deterministic kernels
    (:func:`prism_select.runtime.execution.deterministic`).
    """
    settings = settings or ScoreSettings()
    out_dir = Path(out_dir)
    missing = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # the folders this run creates
    try:
        with deterministic_kernels(settings.deterministic):
            return _score_pool(model, pool_path, targets_path, out_dir, settings, curvature, reuse_finished)
    except BaseException:
        if missing:  # a run that failed before any finished work leaves no empty --out behind
            _remove_empty_dirs(missing)
        raise


def _remove_empty_dirs(created: list) -> None:
    """Remove the folders a failed run created (``--out`` first, then its new parents),
    each only when nothing but an empty ``.partial`` (or its ``key.json``) is in it."""
    partial = created[0] / ".partial"
    if partial.is_dir() and not partial.is_symlink() and {p.name for p in partial.iterdir()} <= {"key.json"}:
        shutil.rmtree(partial, ignore_errors=True)
    for d in created:
        try:
            d.rmdir()
        except OSError:
            return  # not empty (finished work is kept), or already gone


def _load_for_run(model, settings: ScoreSettings, timings: dict) -> tuple:
    """``(lm, model_bytes)``: the model loaded (and under ``--shard fsdp`` sharded over the
    ranks), and on a GPU the weights' bytes each rank holds."""
    t = time.perf_counter()
    fsdp = settings.shard == "fsdp"
    lm = model if isinstance(model, LoadedModel) else load_model(model, host=fsdp)
    if isinstance(model, LoadedModel):  # load_model checked the weights of a model it loaded
        name = (lm.source or {}).get("path") or getattr(lm.settings, "model", "the model")
        check_finite_weights(lm.model, str(name))
    set_run_dtype(lm.dtype)
    timings["load_model_s"] = time.perf_counter() - t
    if not isinstance(model, LoadedModel):
        distributed.say(f"model loaded in {timings['load_model_s']:.1f} s", settings.progress)
    model_bytes = None
    if fsdp:
        t = time.perf_counter()
        device = model.resolved_device() if isinstance(model, ModelSettings) else lm.device
        sharding.shard_model(lm.model, tracked_linear_modules(lm.model, settings.modules), device)
        lm.source["device"] = str(device)
        timings["shard_model_s"] = time.perf_counter() - t
    if lm.device.type == "cuda":  # the weights (and v's shards) each rank holds
        model_bytes = distributed.gather_values(torch.cuda.memory_allocated(lm.device))
    return lm, model_bytes


def _read_inputs(lm, pool_path, targets_path, settings: ScoreSettings, curvature, pool, timings: dict):
    """The run's inputs, tokenised: the whole pool, or under ``--stream`` the fit sample only."""
    t = time.perf_counter()
    if settings.stream:
        inputs = prepare_stream_inputs(lm.tokenizer, pool_path, targets_path, max_length=settings.max_length,
                                       skip_invalid=settings.skip_invalid, fit_examples=curvature.fit_examples,
                                       seed=curvature.seed)
    else:
        inputs = prepare_inputs(lm.tokenizer, pool_path, targets_path, max_length=settings.max_length,
                                skip_invalid=settings.skip_invalid, pool=pool)
    timings["read_inputs_s"] = time.perf_counter() - t
    distributed.say(f"inputs read in {timings['read_inputs_s']:.1f} s", settings.progress)
    return inputs


def _write_scores(ctx: RunContext, scores, pairs) -> tuple:
    """``scores.jsonl`` and ``pairs.jsonl`` in the output directory (by the main process);
    returns the pool's count, its skipped records and its truncated prompts."""
    main, out_dir, inputs = distributed.is_main(), ctx.out_dir, ctx.inputs
    if ctx.streamed is None:
        n_pool, invalid, truncated_pool = len(inputs.pool), [r.to_json() for r in inputs.invalid], inputs.truncated["pool"]
        if main:
            cols = {}
            for name, values in ctx.columns.items():
                if name in ("id", "score", "rank", "scores", "ranks") or len(values) != n_pool:
                    raise ValueError(f"column {name!r}: a new name and one value per pool record are needed")
                cols[name] = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
            atomic_write_jsonl(out_dir / "scores.jsonl",
                               ({**row, **{name: vals[i] for name, vals in cols.items()}}
                                for i, row in enumerate(score_rows([ex.id for ex in inputs.pool], scores,
                                                                   ctx.task_names))))
    else:  # score_stream wrote the ranked file into .partial; the pool's skipped records come from it
        n_pool, truncated_pool = ctx.streamed["count"], ctx.streamed["truncated"]
        invalid = ctx.streamed["invalid"] + [r.to_json() for r in inputs.invalid]
        if main:
            os.replace(ctx.streamed["path"], out_dir / "scores.jsonl")
    if pairs and main:
        atomic_write_jsonl(out_dir / "pairs.jsonl", pairs)
    return n_pool, invalid, truncated_pool


def score_rows(ids: list, scores, tasks: list):
    """The rows of ``scores.jsonl``: ``id``, ``score`` and ``rank`` (1 is the highest; ties
    in input order), and with named target sets ``scores`` (``{task: score}``) and
    ``ranks`` (``{task: rank}``), ``score`` / ``rank`` being the first task's. ``scores``:
    ``(N,)``, or ``(N, len(tasks))`` for several sets."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    cols = scores.reshape(len(ids), -1)
    if tasks and cols.shape[1] != len(tasks):
        raise ValueError(f"{cols.shape[1]} score columns for {len(tasks)} tasks")
    rks = [ranks(cols[:, k]) for k in range(cols.shape[1])]
    for i, rid in enumerate(ids):
        row = {"id": rid, "score": float(cols[i, 0]), "rank": rks[0][i]}
        if tasks:
            row["scores"] = {t: float(cols[i, k]) for k, t in enumerate(tasks)}
            row["ranks"] = {t: rks[k][i] for k, t in enumerate(tasks)}
        yield row


def _score_warnings(ctx: RunContext, scores) -> list:
    """What run.json warns of: scores all equal (the ranking is then the pool's order), and
    the method's own warnings (``ctx.info["method"]["warnings"]``, logged by the method)."""
    warnings = list((ctx.info.get("method") or {}).get("warnings") or [])
    cols = scores.reshape(len(scores), -1) if ctx.streamed is None else None
    names = ctx.task_names if cols is not None and len(ctx.task_names) == cols.shape[1] else [None]
    for k in range(cols.shape[1] if cols is not None and len(scores) > 1 else 0):
        if bool((cols[:, k] == cols[0, k]).all()):
            of = f" of task {names[k]}" if names[k] is not None and len(names) > 1 else ""
            warnings.append(f"every score{of} is {float(cols[0, k])!r}, so the ranking is the pool's own order: the "
                            "direction or the preconditioned curvature vanished (check the target pairs, --damping "
                            "and pairs.jsonl)")
            log.warning("%s", warnings[-1])
    return warnings


def _fit_size(inputs: Inputs, cs: CurvatureSettings) -> int:
    """The number of examples the curvature is fitted on."""
    pool = inputs.encoded if inputs.fit_encoded is None else inputs.fit_encoded
    return len(fit_indices(len(pool), cs))


def _applied_curvature(decided: dict, info: dict) -> dict | None:
    """``run.json``'s ``curvature_applied``: the decision of :func:`small_pool_rule` with
    what the fit then applied (its kind, after a split-half check that found no damping
    supported: identity; its damping factor and per-layer damping); None for a method
    that used no curvature."""
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


def _add_device_figures(summary: dict, lm, info: dict, model_bytes) -> None:
    """The GPU memory measured (the largest over the processes of a resumed run) and the
    process group's size, into ``summary``."""
    if lm.device.type == "cuda":
        summary["gpu_peak_bytes"] = max(torch.cuda.max_memory_allocated(lm.device), info.pop("gpu_peak_bytes", 0),
                                        *info.get("gpu_peak_bytes_by_stage", {}).values())
        summary["gpu_bytes_per_rank"] = {"model": model_bytes,
                                         "peak": distributed.gather_values(summary["gpu_peak_bytes"])}
    if distributed.active():
        summary["distributed"] = {"world_size": distributed.world()}


def _score_pool(model, pool_path, targets_path, out_dir, settings: ScoreSettings, curvature,
                reuse_finished: bool = False) -> dict:
    curvature = curvature or CurvatureSettings()
    fit_default = settings.stream and curvature.fit_examples is None
    if fit_default:
        curvature = replace(curvature, fit_examples=STREAM_FIT_EXAMPLES)
    out_dir = Path(out_dir)
    t0 = time.perf_counter()
    timings = {}
    if not isinstance(model, LoadedModel) and distributed.init_from_env(model.device):  # torchrun / accelerate
        model = replace(model, device=distributed.local_device(model.device))
    pool_sha = pool_file_sha(pool_path)  # before the pool is read: checked again at the end
    pool = check_before_loading(model, pool_path, targets_path, settings)  # before --out is made
    check_writable_dir(out_dir)  # fail before any long work
    with run_folder_lock(out_dir):
        if not settings.overwrite and not reuse_finished and distributed.is_main():
            refuse_links(out_dir / ".partial")
            if (out_dir / "run.json").exists():  # before the model loads
                raise OutputError(f"{out_dir} already holds a finished run (run.json); "
                                  "pass --overwrite to replace it, or choose another --out")
        timings["check_inputs_s"] = time.perf_counter() - t0
        return _score_locked(model, pool_path, targets_path, out_dir, settings, curvature, reuse_finished,
                             pool, pool_sha, fit_default, t0, timings)


def _score_locked(model, pool_path, targets_path, out_dir, settings: ScoreSettings, curvature, reuse_finished,
                  pool, pool_sha, fit_default, t0, timings) -> dict:
    lm, model_bytes = _load_for_run(model, settings, timings)
    inputs = _read_inputs(lm, pool_path, targets_path, settings, curvature, pool, timings)
    modules = tracked_linear_modules(lm.model, settings.modules)
    tracking = tracking_summary(lm.model, modules)
    for w in tracking["warnings"]:
        log.warning("untracked parameters: %s", w)
    fingerprints = {"model": lm.fingerprint, "pool": inputs.pool_fingerprint,
                    "targets": encoded_fingerprint(inputs.chosen + inputs.rejected)}
    tasks = run_tasks(inputs, settings)
    run_key = {"settings": settings.run_key(), "curvature": key_of(curvature), "fingerprints": fingerprints,
               "dtype": str(lm.dtype), "modules": sha256_json(list(modules))}
    if len(tasks) > 1:  # which pair is in which target set, in order (one set: the key of before)
        run_key["tasks"] = [[t, len(idx)] for t, idx in tasks]
    requested = curvature
    curvature, decided = small_pool_rule(curvature, _fit_size(inputs, curvature))
    if decided["rule"] == "small-pool":
        distributed.say("curvature: " + describe_applied(decided), settings.progress)
    finished = _finished_run(out_dir, run_key) if reuse_finished and not settings.overwrite else None
    if finished is not None:  # before the plan, which measures an example on the device
        distributed.say(f"reusing the finished run in {out_dir} (same inputs and settings)", settings.progress)
        return finished
    plan = plan_run(lm, modules, inputs, settings, curvature, directions=len(tasks))
    if distributed.is_main():
        if _prepare_out_dir(out_dir, run_key, settings.overwrite):
            distributed.say(f"resuming the unfinished run in {out_dir}: its finished work in .partial is reused",
                            settings.progress)
    distributed.barrier()
    check_disk_for_v(plan, modules, lm.dtype, out_dir, distributed.world() if sharding.is_sharded(lm.model) else 1)
    ctx = RunContext(lm, modules, inputs, settings, curvature, out_dir, timings,
                     info={"run_key": run_key, "memory_plan": plan.to_json()},
                     execution=resolve_execution(settings, lm.model, lm.device, plan), tasks=tasks)
    try:
        with sharding.weights_gathered(lm.model, plan.keep_gathered):
            scores, pairs = _method_fn(settings.method)(ctx)
    except BaseException as exc:
        if distributed.is_main():
            _drop_partial_without_chunks(out_dir)
        # out of memory or disk: say what is kept and what to do
        named = resource_error(exc, out_dir, (ctx.info.get("curvature") or {}).get("path"), ctx._stages)
        if named is not None:
            raise named from exc
        raise
    main = distributed.is_main()  # every rank holds the gathered scores; rank 0 writes them
    pool_sha = check_pool_unchanged(pool_path, pool_sha, out_dir)
    n_pool, invalid, truncated_pool = _write_scores(ctx, scores, pairs)
    warnings = _score_warnings(ctx, scores) + [f"untracked parameters: {w}" for w in tracking["warnings"]]
    timings["total_s"] = time.perf_counter() - t0
    info = dict(ctx.info)  # run_key included: a resumed compare reuses a finished run with the same key
    if "method" in info:  # a method's own record of the options it used
        info["method_info"] = info.pop("method")
    summary = {
        "status": "complete",
        "command": "score",
        "method": settings.method,
        "settings": asdict(settings),
        "curvature_settings": asdict(requested),
        "model": {**lm.source, "settings": asdict(lm.settings), "dtype": str(lm.dtype),
                  "device": str(lm.device), "chat_template": has_chat_template(lm.tokenizer)},
        "tracked_modules": list(modules),
        # per kind of tracked module: modules, parameters, share of the model's parameters
        "tracking": tracking,
        # absolute: `select` and `report` find the files from any working directory
        "inputs": {"pool": str(Path(inputs.pool_path).absolute()), "pool_format": inputs.pool_format,
                   "targets": str(Path(inputs.targets_path).absolute()) if inputs.targets_path else "",
                   **({"target_files": [str(Path(p).absolute()) for p in inputs.targets_paths]}
                      if len(inputs.targets_paths) > 1 else {})},
        **({"tasks": ctx.task_names} if ctx.task_names else {}),
        # pool_file: the pool's bytes, which `select` checks without loading a tokenizer
        "fingerprints": {**fingerprints, "pool_file": pool_sha},
        "versions": _versions(),
        "counts": {"pool": n_pool, "pairs": len(inputs.pairs), "invalid": len(invalid),
                   "truncated_pool": truncated_pool, "truncated_targets": inputs.truncated["targets"]},
        "invalid_records": invalid,
        "timings": timings,
        "warnings": warnings,
        "stream": settings.stream,
        **info,
    }
    applied = _applied_curvature(decided, info)
    if applied is not None:  # what was applied, where curvature_settings says what was asked
        summary["curvature_applied"] = applied
    if settings.stream:
        summary["fit_sample"] = {**inputs.fit_sample, "default_size": fit_default}
    _add_device_figures(summary, lm, info, model_bytes)
    if main:
        atomic_write_json(out_dir / "run.json", summary)
        remove_tree(out_dir / ".partial")
    distributed.barrier()
    return summary
