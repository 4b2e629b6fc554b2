"""The ``less`` method: its options and its scores, the cosine of each pool example's
projected gradient to the targets', summed over the warm-up checkpoints
(:mod:`prism_select.methods.less`)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...data.tokenize import encoded_fingerprint
from ...errors import ConfigError, InputError
from ...gradients import release_host_memory
from ...io import sha256_json
from ...model.tracking import _is_peft
from ...model import tracked_linear_modules
from ..common import compute_dtype, record, require_pairs, resolve_options
from ..registry import register

log = logging.getLogger(__name__)
from .projection import SJLT_NNZ, TILE_ROWS, _normalise, projected_gradients, resolve_projection
from .warmup import (CACHE_FORMAT, LESS_WARMUP_STEPS, _adam_state, _checkpoint_weights, _saved_projection,
                     _with_adapter, warmup_checkpoints)

log = logging.getLogger(__name__)

TARGET_SIDES = ("chosen", "rejected", "contrast")


@dataclass(frozen=True)
class LessOptions:
    """LESS's options (the module docstring): the warm-up sample and its LoRA fine-tune
    (``warmup_fraction`` .. ``weight_decay``, ``seed``), given warm-up checkpoints and
    their weights (``checkpoints``, ``checkpoint_weights``), the target side
    (:data:`TARGET_SIDES`) and the random projection (``proj_dim``, ``proj_seed``,
    ``proj_chunk``, ``projection`` one of :data:`PROJECTIONS`)."""

    warmup_fraction: float = 0.05
    lr: float = 2e-5
    epochs: float = 4
    lora_r: int = 128
    lora_alpha: float = 512
    lora_dropout: float = 0.1
    train_batch_size: int = 1
    grad_accum: int | None = None
    warmup_steps: int = LESS_WARMUP_STEPS
    warmup_floor: str = "examples"
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lr_scheduler: str = "linear"
    warmup_ratio: float = 0.03
    weight_decay: float = 0.0
    seed: int | None = None
    checkpoints: list | str | os.PathLike | None = None
    checkpoint_weights: list | None = None
    target_side: str = "chosen"
    proj_dim: int = 8192
    proj_seed: int | None = None
    proj_chunk: int = 64
    projection: str = "auto"



def task_max_of_means(sim: torch.Tensor, tasks: list) -> tuple[torch.Tensor, list]:
    """``sim (N, M)`` -> per task (in order of first appearance) the mean over its
    columns, then the max over tasks. Returns the scores and the task names."""
    names = list(dict.fromkeys(tasks))
    per_task = torch.stack([sim[:, [j for j, t in enumerate(tasks) if t == name]].mean(1) for name in names], 1)
    return per_task.max(1).values, names


# --------------------------------------------------------------------------- method

def candidate_features_key(ctx, projection: str, dim: int, proj_seed: int) -> str:
    """The key of a pool's projected candidate gradients at one warm-up checkpoint:
    everything they depend on besides the checkpoint (the tokenised pool, the tracked
    modules, the projection, its dimension and seed, the device type that draws a
    ``rademacher`` matrix, the compute precision)."""
    p = next(ctx.lm.model.parameters())
    return sha256_json({"format": CACHE_FORMAT, "model": ctx.lm.fingerprint,
                        "pool": encoded_fingerprint(ctx.inputs.encoded), "modules": ctx.settings.modules,
                        "projection": projection, "dim": dim, "proj_seed": proj_seed, "tile_rows": TILE_ROWS,
                        "device": p.device.type, "dtype": str(compute_dtype(ctx.lm.model))})[:32]


def _save_features(path: Path, tensors: dict, projection: str):
    """Write projected features to ``path`` atomically (a temporary file beside it, then
    renamed), the projection in the metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"projection": projection})
    os.replace(tmp, path)


def _save_shared(path: Path, cand: torch.Tensor, projection: str):
    """Keep one checkpoint's candidate features for the next target set (a failure only
    logs: the cache is an optimisation)."""
    try:
        _save_features(path, {"candidates": cand}, projection)
    except OSError as e:
        log.warning("LESS: cannot keep the candidate features in %s (%s)", path, e)


@register("less", options=LessOptions,
          description="LESS: Adam-preconditioned LoRA gradient cosine to the targets over warm-up checkpoints")
def less_method(ctx) -> tuple[torch.Tensor, list]:
    """LESS scores (see the module docstring); float64, higher = more aligned."""
    require_pairs(ctx, "less")
    opts = resolve_options(ctx, "less")
    if _is_peft(ctx.lm.model):
        raise ConfigError("model", "LESS trains and loads its own LoRA adapters on the base model, but the run's "
                          "model already carries an adapter", "pass the base model (without --adapter)")
    seed = ctx.settings.seed if opts.seed is None else opts.seed
    proj_seed = seed if opts.proj_seed is None else opts.proj_seed
    projection, why = resolve_projection(opts.projection, next(ctx.lm.model.parameters()).device)
    for name in ("proj_dim", "proj_chunk"):
        v = getattr(opts, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, f"must be a positive integer, got {v!r}")
    if not isinstance(seed, int) or not isinstance(proj_seed, int):
        raise ConfigError("seed", f"seeds must be integers, got {seed!r} / {proj_seed!r}")
    side = opts.target_side
    if side not in TARGET_SIDES:
        raise ConfigError("target_side", f"unknown target side {side!r}", f"use one of {', '.join(TARGET_SIDES)}")

    if opts.checkpoints is not None:
        given = opts.checkpoints
        if isinstance(given, (str, os.PathLike)):
            given = [given]
        if not isinstance(given, (list, tuple)) or not given:
            raise ConfigError("checkpoints", f"must be a non-empty list of directories, got {given!r}")
        ckpts = [Path(c).expanduser().resolve() for c in given]
        for c in ckpts:
            if not (c / "adapter_config.json").is_file():
                raise InputError("is not a LoRA checkpoint (no adapter_config.json)", path=c,
                                 fix="pass directories written by finetune(save_every_epoch=True)")
            if not (c / "optimizer.safetensors").is_file():
                _adam_state(c, {})  # raises the explanatory error
        warm = {"given": True}
    else:
        ckpts, warm = warmup_checkpoints(ctx, opts, seed)
    weights, wsource = _checkpoint_weights(ckpts, opts.checkpoint_weights)

    dim = opts.proj_dim
    tasks = [p.task for p in ctx.inputs.pairs]
    partial = ctx.out_dir / ".partial" / "less"
    N, M = len(ctx.inputs.encoded), len(ctx.inputs.pairs)
    sim = torch.zeros(N, M, dtype=torch.float64)
    kw = dict(pad_id=ctx.pad_id, batch_size=ctx.settings.batch_size, dim=dim, proj_seed=proj_seed,
              chunk=opts.proj_chunk, progress=ctx.settings.progress, projection=projection)
    log.info("LESS: %s projection to %d dimensions (%s)", projection, dim, why)
    t = time.perf_counter()
    n_params = None
    # the candidates' projected gradients depend on the pool, not on the targets: kept
    # beside the cached warm-up's checkpoints for the next target set (given checkpoints
    # are the user's directories and stay untouched)
    feat_key = None if warm.get("given") else candidate_features_key(ctx, projection, dim, proj_seed)
    reused_features: list = []
    skipped = [i for i, w in enumerate(weights) if w == 0]
    if skipped:  # a checkpoint of weight 0 adds nothing to the scores
        log.info("LESS: checkpoint(s) %s have weight 0 (their epoch's mean learning rate): not computed",
                 ", ".join(str(i + 1) for i in skipped))
    for i, (ckpt, w) in enumerate(zip(ckpts, weights)):
        if w == 0:
            continue
        feats_path = partial / f"ckpt-{i}.safetensors"
        reuse = feats_path.is_file() and _saved_projection(feats_path) == projection
        if feats_path.is_file() and not reuse:  # e.g. `auto` on CUDA, resumed on the CPU
            log.warning("LESS: %s holds features of another projection; computing them again", feats_path)
        shared = None if feat_key is None else ckpt / "features" / f"{feat_key}.safetensors"
        if reuse:
            f = load_file(str(feats_path))
            cand, targ = f["candidates"], f["targets"]
        else:
            with _with_adapter(ctx, ckpt) as pm:
                modules = tracked_linear_modules(pm, ctx.settings.modules)
                n_params = sum(m.weight.numel() for m in modules.values())
                if shared is not None and shared.is_file():  # the pool's side, from an earlier target set
                    cand = load_file(str(shared))["candidates"]
                    reused_features.append(i)
                else:
                    adam = _adam_state(ckpt, modules)
                    cand = projected_gradients(pm, modules, ctx.inputs.encoded, adam=adam,
                                               desc=f"LESS candidates (checkpoint {i + 1}/{len(ckpts)})", **kw)
                    if shared is not None:
                        _save_shared(shared, cand, projection)
                if side == "rejected":
                    targ = projected_gradients(pm, modules, ctx.inputs.rejected, desc="LESS targets", **kw)
                else:
                    targ = projected_gradients(pm, modules, ctx.inputs.chosen, desc="LESS targets", **kw)
                    if side == "contrast":
                        targ = targ - projected_gradients(pm, modules, ctx.inputs.rejected, desc="LESS targets", **kw)
            _save_features(feats_path, {"candidates": cand, "targets": targ}, projection)
        sim += w * (_normalise(cand) @ _normalise(targ).T)
        del cand, targ
        release_host_memory(ctx.lm.device)  # the checkpoint's adapter, Adam state and features are freed
    ctx.end_stage("less_gradients", t)
    scores, task_names = task_max_of_means(sim, tasks)
    record(ctx, "less", opts, seed=seed, proj_seed=proj_seed, checkpoints=[str(c) for c in ckpts],
           warnings=list(warm.get("warnings", [])),
           checkpoint_weights=weights, checkpoint_weight_source=wsource, skipped_checkpoints=skipped, warmup=warm,
           tasks=task_names, lora_params=n_params,
           tile_rows=TILE_ROWS, projection=projection, projection_reason=why,
           candidate_features={"key": feat_key, "reused_checkpoints": reused_features},
           **({"sjlt_nnz": SJLT_NNZ} if projection == "sjlt" else {}))
    mean_cos = sim.mean(0)
    rows = [{"id": p.id, **({"task": p.task} if p.task else {}), "mean_similarity": float(mean_cos[j])}
            for j, p in enumerate(ctx.inputs.pairs)]
    return scores, rows
