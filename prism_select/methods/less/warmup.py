"""LESS's warm-up: the LoRA fine-tune on a seeded sample of the pool, its size
(:func:`warmup_plan`), its cache entry, and the checkpoints it leaves (their weights,
Adam state and adapters) (:mod:`prism_select.methods.less`)."""

from __future__ import annotations

import json
from contextlib import contextmanager
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from ... import cache
from ...data.tokenize import encoded_fingerprint
from ...errors import CacheError, ConfigError, InputError
from ...finetune import FinetuneSettings, finetune, load_optimizer_state
from ...io import atomic_write_json, sha256_json
from ...settings import key_of

log = logging.getLogger(__name__)
from .projection import param_key

log = logging.getLogger(__name__)

CACHE_FORMAT = 2
WARMUP_FILE = "less_warmup.json"
ADAPTER_NAME = "less"
#: LESS's warm-up in optimizer steps: 5% of its 270,679-record pool (13,534 records) for 4
#: epochs at batch 128 is ceil(13,534 / 128) = 106 steps an epoch, 424 in all
LESS_WARMUP_STEPS = 424
#: LESS's accumulated batch (batch 1 x gradient accumulation 128)
LESS_BATCH = 128
#: a warm-up of fewer optimizer steps than this is warned of (printed and in run.json)
MIN_WARMUP_STEPS = 50
#: what a warm-up sample too small for ``warmup_steps`` at batch 1 does (option ``warmup_floor``)
WARMUP_FLOORS = ("examples", "batch1")


# --------------------------------------------------------------------------- checkpoints

def _warmup_settings(opts, max_length: int, seed: int, progress: bool, grad_accum: int):
    try:
        return FinetuneSettings(
            learning_rate=opts.lr, epochs=opts.epochs, batch_size=opts.train_batch_size,
            grad_accum=grad_accum, lora_r=opts.lora_r, lora_alpha=opts.lora_alpha,
            lora_dropout=opts.lora_dropout, target_modules=opts.target_modules,
            lr_scheduler=opts.lr_scheduler, warmup_ratio=opts.warmup_ratio,
            weight_decay=opts.weight_decay, max_length=max_length, seed=seed, progress=progress)
    except ConfigError as e:
        raise ConfigError("method_options", f"LESS warm-up: {e}") from e


def optimizer_steps(n_examples: int, batch_size: int, grad_accum: int, epochs: float) -> int:
    """Optimizer steps of a ``transformers.Trainer`` run: ``ceil(n / batch)`` micro-batches
    an epoch, ``ceil(micro / accum)`` steps an epoch (the last one partial), ``ceil(epochs x
    steps)`` in all."""
    micro = math.ceil(n_examples / batch_size)
    return math.ceil(epochs * max(1, math.ceil(micro / grad_accum)))


def warmup_plan(n_pool: int, opts) -> dict:
    """The warm-up's size: how many examples, at which accumulation, for how many steps.

    LESS warms up on 5% of its pool for 4 epochs at an accumulated batch of 128, about
    :data:`LESS_WARMUP_STEPS` optimizer steps. The steps (and so the learning-rate schedule
    the per-epoch checkpoints sample: linear decay, ``warmup_ratio`` of the steps of linear
    warm-up, the first step at lr 0) are what is kept at any pool size: with
    ``grad_accum`` None the accumulation is the one whose run comes nearest
    ``warmup_steps`` (at most :data:`LESS_BATCH`, at least 1). A ``warmup_fraction`` sample
    too small for ``warmup_steps`` even at accumulation 1 takes option ``warmup_floor``:

    ``examples`` (default): the sample grows to the fewest examples that give
        ``warmup_steps`` at accumulation 1 (at most the whole pool), so the run keeps LESS's
        steps, schedule and number of passes over its sample (4 epochs); what changes is
        the share of the pool it is trained on (on a 600-record pool 106 records, 18%).
    ``batch1``: the sample stays ``warmup_fraction`` of the pool, at accumulation 1, for
        fewer steps (on a 600-record pool 30 records, 120 steps).

    An explicit ``grad_accum`` (or ``warmup_steps`` None) is used as given.
    Returns ``n_examples``, ``grad_accum``, ``effective_batch``, ``steps``, ``floor``
    (the floor applied, or None) and ``warnings`` (a run of fewer than
    :data:`MIN_WARMUP_STEPS` steps).
    """
    frac, epochs, b = opts.warmup_fraction, opts.epochs, opts.train_batch_size
    target, accum, floor = opts.warmup_steps, opts.grad_accum, opts.warmup_floor
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
        raise ConfigError("warmup_fraction", f"must be in (0, 1], got {frac!r}")
    for name, v in (("train_batch_size", b), ("grad_accum", accum), ("warmup_steps", target)):
        if v is None and name != "train_batch_size":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, f"must be a positive integer{'' if name == 'train_batch_size' else ' or null'}, "
                              f"got {v!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise ConfigError("epochs", f"must be a positive number, got {epochs!r}")
    if floor not in WARMUP_FLOORS:
        raise ConfigError("warmup_floor", f"unknown floor {floor!r}", f"use one of {', '.join(WARMUP_FLOORS)}")
    n = max(1, int(round(frac * n_pool)))
    applied = None
    if accum is None and target is None:
        accum = LESS_BATCH
    elif accum is None:
        micro = math.ceil(n / b)
        if optimizer_steps(n, b, 1, epochs) < target:  # too small even at accumulation 1
            accum = 1
            if floor == "examples":
                # the fewest examples giving `target` steps at accumulation 1
                need = min(n_pool, math.ceil(math.ceil(target / epochs) * b))
                while need > n and optimizer_steps(need - b, b, 1, epochs) >= target:
                    need -= b
                applied = "examples" if need > n else None
                n = max(n, need)
            else:
                applied = "batch1"
        else:
            accum = min(LESS_BATCH, max(1, round(micro * epochs / target)))
    steps = optimizer_steps(n, b, accum, epochs)
    warnings = []
    if steps < MIN_WARMUP_STEPS:
        warnings.append(f"the LESS warm-up takes {steps} optimizer steps ({n} examples, batch {b} x accumulation "
                        f"{accum}, {epochs:g} epochs), fewer than {MIN_WARMUP_STEPS}: its checkpoints' adapters stay "
                        f"near their initialisation (LESS's own warm-up takes about {LESS_WARMUP_STEPS}). Fix: "
                        "leave grad_accum unset (null) and warmup_floor at 'examples', or raise warmup_fraction")
    return {"n_examples": n, "grad_accum": accum, "effective_batch": b * accum, "steps": steps,
            "target_steps": target, "floor": applied, "warnings": warnings}


def warmup_subset(n: int, fraction: float, seed: int, k: int | None = None) -> list:
    """Sorted indices of the seeded random ``fraction`` of ``n`` examples (at least one),
    or of ``k`` examples when given (the first ``k`` of the same permutation)."""
    k = max(1, int(round(fraction * n))) if k is None else min(n, k)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return sorted(perm[:k].tolist())


def warmup_checkpoints(ctx, opts, seed: int) -> tuple[list, dict]:
    """Train (or reuse from the cache) the warm-up LoRA; returns checkpoint dirs and info."""
    frac = opts.warmup_fraction
    size = warmup_plan(len(ctx.inputs.encoded), opts)
    for w in size["warnings"]:
        log.warning("%s", w)
    fs = _warmup_settings(opts, ctx.settings.max_length, seed, ctx.settings.progress, size["grad_accum"])
    idx = warmup_subset(len(ctx.inputs.encoded), frac, seed, size["n_examples"])
    train = key_of(fs)  # the fields that change the trained adapter (the accumulation included)
    key = sha256_json({"format": CACHE_FORMAT, "model": ctx.lm.fingerprint,
                       "pool": encoded_fingerprint(ctx.inputs.encoded), "warmup_fraction": frac,
                       "n_examples": len(idx), "seed": seed, "train": train})
    root = Path(ctx.lm.settings.resolved_cache_dir()) / "less"
    target = root / key
    info = {"key": key, "path": str(target), "n_examples": len(idx), "settings": train,
            "planned_steps": size["steps"], "target_steps": size["target_steps"], "floor": size["floor"],
            "effective_batch": size["effective_batch"], "warnings": size["warnings"]}
    try:  # one process trains a warm-up at a time; another one waits, then reuses it
        lock = cache.writing(target)
        lock.__enter__()
    except OSError as e:
        raise CacheError(f"cannot write the LESS warm-up cache under {root}: {e.strerror or e}; set cache_dir "
                         "(or $PRISM_SELECT_CACHE) to a writable directory") from e
    try:
        return _warmup_locked(ctx, fs, idx, key, train, target, info)
    finally:
        lock.__exit__(None, None, None)


def _warmup_locked(ctx, fs, idx, key, train, target, info) -> tuple[list, dict]:
    """:func:`warmup_checkpoints` once it holds the entry's write lock."""

    root = target.parent
    marker = target / WARMUP_FILE
    if marker.is_file():
        try:
            meta = json.loads(marker.read_text())
            ckpts = [target / c for c in meta["checkpoints"]]
            if meta.get("key") == key and ckpts and all((c / "adapter_config.json").is_file() for c in ckpts):
                log.info("LESS: reusing the warm-up checkpoints in %s", target)
                return ckpts, {**info, **_trajectory(meta), "reused": True}
        except (ValueError, KeyError, TypeError):
            pass
        log.warning("LESS: the cached warm-up %s is incomplete; training it again", target)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key[:16]}-", dir=root))
        cache.claim(tmp)  # the entry marker first: a killed warm-up leaves an entry prune may remove
    except OSError as e:
        raise CacheError(f"cannot write the LESS warm-up cache under {root}: {e}; set cache_dir "
                         "(or $PRISM_SELECT_CACHE) to a writable directory") from e
    t = time.perf_counter()
    try:
        res = finetune(ctx.lm, [ctx.inputs.encoded[i] for i in idx], tmp, fs, save_every_epoch=True, overwrite=True)
        if not res.checkpoints:
            raise ConfigError("epochs", "the LESS warm-up produced no checkpoint", "use epochs >= 1")
        names = [str(c.relative_to(tmp)) for c in res.checkpoints]
        losses = [{"step": int(h["step"]), "loss": float(h["loss"])} for h in res.log_history
                  if "loss" in h and "step" in h]
        atomic_write_json(tmp / WARMUP_FILE, {"key": key, "checkpoints": names, "indices": idx,
                                              "epoch_lrs": res.epoch_lrs, "losses": losses, "settings": train})
        if (target / WARMUP_FILE).is_file():  # another process finished the same warm-up meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(target, ignore_errors=True)  # an incomplete leftover
            try:
                os.rename(tmp, target)
            except OSError:
                if not (target / WARMUP_FILE).is_file():
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    ctx.end_stage("less_warmup", t)
    return [target / n for n in names], {**info, **_trajectory({"epoch_lrs": res.epoch_lrs, "losses": losses}),
                                         "reused": False}


def _trajectory(meta: dict) -> dict:
    """What run.json keeps of a warm-up's run: its optimizer steps, the learning rate of
    each (per epoch, as the checkpoints' weights take them), the first step of nonzero
    learning rate, and the logged training loss of each step."""
    epoch_lrs = meta.get("epoch_lrs") or []
    flat = [lr for lrs in epoch_lrs for lr in lrs]
    return {"steps": len(flat), "epoch_lrs": epoch_lrs,
            "zero_lr_steps": sum(1 for lr in flat if lr == 0), "losses": meta.get("losses", [])}


def _checkpoint_weights(ckpts: list, given) -> tuple[list, str]:
    if given is not None:
        if not isinstance(given, (list, tuple)) or len(given) != len(ckpts) or \
                not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in given):
            raise ConfigError("checkpoint_weights", f"must be {len(ckpts)} non-negative numbers, got {given!r}")
        raw, source = [float(w) for w in given], "option"
    else:
        raw, source = [], "mean_lr"
        for c in ckpts:
            f = Path(c) / "checkpoint.json"
            try:
                raw.append(float(json.loads(f.read_text())["mean_lr"]))
            except (OSError, ValueError, KeyError, TypeError):
                raw, source = [], "equal"
                break
    total = sum(raw)
    if not raw or total <= 0:
        if source != "equal":
            log.warning("LESS: checkpoint weights sum to 0; using equal weights")
        return [1.0 / len(ckpts)] * len(ckpts), "equal"
    return [w / total for w in raw], source


def _adam_state(ckpt: Path, modules: dict) -> dict:

    m, v, _ = load_optimizer_state(ckpt)
    out, missing = {}, []
    for name, mod in modules.items():
        k = param_key(name)
        if k not in m or k not in v:
            missing.append(k)
            continue
        if tuple(m[k].shape) != tuple(mod.weight.shape) or tuple(v[k].shape) != tuple(mod.weight.shape):
            raise InputError(f"the Adam state of {k} has shape {tuple(m[k].shape)}, the parameter "
                             f"{tuple(mod.weight.shape)}", path=ckpt / "optimizer.safetensors")
        out[k] = (m[k], v[k])
    if missing:
        raise InputError(f"no Adam state for {len(missing)} LoRA parameter(s) (e.g. {missing[0]})",
                         path=ckpt / "optimizer.safetensors",
                         fix="the optimizer state must hold exp_avg.<key> and exp_avg_sq.<key> for every "
                             "LoRA parameter of the adapter")
    return out


def _saved_projection(path: Path) -> str:
    """The projection of a checkpoint's saved features (files without the entry predate
    option ``projection``: always ``rademacher``)."""
    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("projection", "rademacher")


def _with_adapter(ctx, ckpt: Path):
    """Context manager: the run's base model with the checkpoint's adapter, restored after."""
    from peft import PeftModel

    @contextmanager
    def cm():
        base = ctx.lm.model
        flags = [(p, p.requires_grad) for p in base.parameters()]
        try:
            pm = PeftModel.from_pretrained(base, str(ckpt), adapter_name=ADAPTER_NAME, is_trainable=False,
                                           local_files_only=True)
        except Exception as e:
            raise InputError(f"cannot load this LoRA checkpoint on the run's model: {type(e).__name__}: "
                             f"{str(e)[:500]}", path=ckpt) from e
        pm.eval()
        try:
            yield pm
        finally:
            pm.unload()
            for p, f in flags:
                p.requires_grad_(f)
                p.grad = None
            base.eval()
    return cm()
