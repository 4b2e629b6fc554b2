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

import logging
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from ..runtime import distributed, sharding
from ..curvature import CurvatureSettings
from ..data.tokenize import encoded_fingerprint, has_chat_template
from ..errors import OutputError, resource_error
from ..runtime.execution import deterministic as deterministic_kernels
from ..runtime.execution import resolve as resolve_execution
from ..gradients import set_run_dtype
from ..io import atomic_write_json, atomic_write_jsonl, check_path_name, check_writable_dir, sha256_json
from ..model import LoadedModel, ModelSettings, check_finite_weights, load_model, tracked_linear_modules
from ..model.moe import tracking_summary
from ..settings import STREAM_FIT_EXAMPLES, ScoreSettings, key_of
from ..methods.prism import _method_fn, run_tasks
from .context import RunContext
from .folder import (check_pool_unchanged, drop_partial_without_chunks, finished_run, pool_file_sha,
                     prepare_out_dir, refuse_links, remove_empty_dirs, remove_tree, run_folder_lock)
from .inputs import read_inputs
from .preflight import check_before_loading, check_disk_for_v, describe_applied, fit_size, plan_run, small_pool_rule
from .result import Run, applied_curvature, device_figures, versions

log = logging.getLogger(__name__)


def ranks(scores: torch.Tensor) -> list:
    """1 = highest score; ties keep input order (stable)."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    r = [0] * len(scores)
    for k, i in enumerate(order):
        r[i] = k + 1
    return r



def score_pool(model: ModelSettings | LoadedModel, pool_path, targets_path, out_dir, settings: ScoreSettings | None = None,
               curvature: CurvatureSettings | None = None, *, reuse_finished: bool = False) -> dict:
    """Score every pool example and write ``scores.jsonl``, ``pairs.jsonl`` and ``run.json``.

    ``targets_path``: one target file, or a list of them, each a target set named by its
    stem; a file whose records carry ``task`` holds a set per task. Several sets are
    scored in one pass (:mod:`prism_select.tasks`,
    :meth:`prism_select.run.scorer.Scorer.score_tasks`).

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
    targets = targets_path if isinstance(targets_path, list) else [targets_path]
    for field, value in (("pool", pool_path), ("out", out_dir), *(("targets", t) for t in targets)):
        check_path_name(field, value)
    out_dir = Path(out_dir)
    missing = [d for d in (out_dir, *out_dir.parents) if not d.exists()]  # the folders this run creates
    try:
        with deterministic_kernels(settings.deterministic):
            return _score_pool(model, pool_path, targets_path, out_dir, settings, curvature, reuse_finished)
    except BaseException:
        if missing:  # a run that failed before any finished work leaves no empty --out behind
            remove_empty_dirs(missing)
        raise



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
    inputs = read_inputs(lm, pool_path, targets_path, settings, curvature, pool, timings)
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
    curvature, decided = small_pool_rule(curvature, fit_size(inputs, curvature))
    if decided["rule"] == "small-pool":
        distributed.say("curvature: " + describe_applied(decided), settings.progress)
    finished = finished_run(out_dir, run_key) if reuse_finished and not settings.overwrite else None
    if finished is not None:  # before the plan, which measures an example on the device
        distributed.say(f"reusing the finished run in {out_dir} (same inputs and settings)", settings.progress)
        return finished
    plan = plan_run(lm, modules, inputs, settings, curvature, directions=len(tasks))
    if distributed.is_main():
        if prepare_out_dir(out_dir, run_key, settings.overwrite):
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
            drop_partial_without_chunks(out_dir)
        # out of memory or disk: say what is kept and what to do
        named = resource_error(exc, out_dir, (ctx.info.get("curvature") or {}).get("path"), ctx.meter.stages)
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
    run_key, memory_plan = info.pop("run_key"), info.pop("memory_plan")
    run = Run(
        status="complete",
        command="score",
        method=settings.method,
        settings=asdict(settings),
        curvature_settings=asdict(requested),
        model={**lm.source, "settings": asdict(lm.settings), "dtype": str(lm.dtype),
               "device": str(lm.device), "chat_template": has_chat_template(lm.tokenizer)},
        tracked_modules=list(modules),
        # per kind of tracked module: modules, parameters, share of the model's parameters
        tracking=tracking,
        # absolute: `select` and `report` find the files from any working directory
        inputs={"pool": str(Path(inputs.pool_path).absolute()), "pool_format": inputs.pool_format,
                "targets": str(Path(inputs.targets_path).absolute()) if inputs.targets_path else "",
                **({"target_files": [str(Path(p).absolute()) for p in inputs.targets_paths]}
                   if len(inputs.targets_paths) > 1 else {})},
        tasks=ctx.task_names or None,
        # pool_file: the pool's bytes, which `select` checks without loading a tokenizer
        fingerprints={**fingerprints, "pool_file": pool_sha},
        versions=versions(),
        counts={"pool": n_pool, "pairs": len(inputs.pairs), "invalid": len(invalid),
                "truncated_pool": truncated_pool, "truncated_targets": inputs.truncated["targets"]},
        invalid_records=invalid,
        timings=timings,
        warnings=warnings,
        stream=settings.stream,
        run_key=run_key,
        memory_plan=memory_plan,
        info=info,
        # what was applied, where curvature_settings says what was asked
        curvature_applied=applied_curvature(decided, info),
        fit_sample={**inputs.fit_sample, "default_size": fit_default} if settings.stream else None,
        **device_figures(lm, info, model_bytes),
    )
    summary = run.to_json()
    if main:
        atomic_write_json(out_dir / "run.json", summary)
        remove_tree(out_dir / ".partial")
    distributed.barrier()
    return summary
