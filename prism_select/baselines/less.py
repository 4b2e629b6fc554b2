"""LESS (Xia et al. 2024; princeton-nlp/LESS): Adam-preconditioned LoRA gradient
similarity to the target examples, summed over warm-up checkpoints.

1. **Warm-up.** LoRA training (:func:`prism_select.evaluation.finetune`) on a seeded
   random ``warmup_fraction`` (5%) of the pool: r 128, alpha 512, dropout 0.1 on
   q/k/v/o, lr 2e-5, 4 epochs, linear decay, warm-up ratio 0.03 (``transformers``'
   schedule: ``ceil(0.03 x steps)`` steps rising from lr 0, the first at 0); a
   checkpoint (adapter + Adam state as safetensors) at the end of each epoch. LESS's
   own warm-up (5% of 270,679 records, batch 1 x accumulation 128) takes
   :data:`LESS_WARMUP_STEPS` (424) optimizer steps; here the **steps** are kept at any
   pool size and the accumulation is scaled down to reach them (``grad_accum`` None;
   at most 128, at least 1), so the checkpoints sample the same schedule: on a
   600-record pool a 5% sample would give 4 steps at accumulation 128 (the first at
   lr 0, the first checkpoint of weight 0, the adapters all but at their
   initialisation). A sample too small for 424 steps even at accumulation 1 takes
   ``warmup_floor`` (:func:`warmup_plan`): ``examples`` (default) grows the sample to
   the fewest records that give the steps (106 at 4 epochs, at most the whole pool),
   keeping LESS's steps, schedule and 4 passes (what shapes the adapters and the Adam
   moments the scores read) at the price of a larger share of the pool;
   ``batch1`` keeps the 5% sample at accumulation 1 and fewer steps. A warm-up of fewer
   than :data:`MIN_WARMUP_STEPS` steps is warned of (logged, and in run.json's
   ``warnings`` and ``method_info.warnings``). ``method_info.warmup`` records the
   planned and the run steps, the effective batch, the floor applied, every step's
   learning rate (per epoch, ``epoch_lrs``), the steps at lr 0 and the training loss of
   each step (``losses``).
   The run is cached under ``<cache_dir>/less/<key>/`` (``cache_dir`` = the model
   settings' cache, ``$PRISM_SELECT_CACHE`` or ``~/.cache/prism-select``), ``key`` =
   sha256 over the model fingerprint, the tokenised pool's fingerprint, the warm-up
   fraction, the sample's size, the seed and every training setting (the resolved
   accumulation included); it is reused only when the key matches
   (``ctx.info["method"]["warmup"]["reused"]``). Option ``checkpoints``: use
   these existing checkpoint directories instead (each an adapter directory with
   ``optimizer.safetensors``, see :mod:`prism_select.evaluation.finetune`).
   The candidates' projected gradients at each cached checkpoint are kept beside it
   (``<checkpoint>/features/<key>.safetensors``, :func:`candidate_features_key`), so a
   second target set on the same pool (another target task) computes only its targets'
   side (``ctx.info["method"]["candidate_features"]``).
2. **Gradients** over the LoRA matrices only, with the checkpoint's adapter loaded on
   the run's base model (eval mode: dropout off), of the **mean** response-token loss
   of one example (batch-size-1 semantics; computed in batches through per-example
   activation/output-gradient hooks, which is exact for right-padded batches).
   Candidate side: ``Gamma = m' / sqrt(v' + 1e-8)``, ``m' = 0.9 m + 0.1 g``,
   ``v' = 0.999 v + 0.001 g^2`` with ``m, v`` Adam's moments stored with the
   checkpoint (LESS's ``prepare_optimizer_state`` / ``obtain_gradients_with_adam``).
   Target side: plain gradients ``g``; option ``target_side``: ``chosen`` (default,
   the target-positive responses ``(q, y+)`` as LESS's target examples), ``rejected``,
   or ``contrast`` (``g(q, y+) - g(q, y-)``).
3. **Projection** to ``proj_dim`` (8192) dimensions, then L2 normalisation of every
   projected vector. Option ``projection``: ``rademacher`` (LESS's own: a dense +-1
   matrix, as TRAK's CUDA projector), ``sjlt`` (a sparse Johnson-Lindenstrauss
   projection) or ``auto`` (default): ``rademacher`` on CUDA, ``sjlt`` on any other
   device (CPU, MPS), where the dense one is infeasible (below). The choice and its
   reason are logged and recorded (``ctx.info["method"]["projection"]``,
   ``["projection_reason"]``). Neither matrix is ever stored: parameter ``key`` (its name
   in ``adapter_model.safetensors``) is flattened row-major and cut into tiles of
   :data:`TILE_ROWS` entries, and tile ``i`` of ``key`` is generated from a
   ``torch.Generator`` seeded with sha256 of ``"{proj_seed}|{key}|{i}"`` (``rademacher``)
   or ``"{proj_seed}|{key}|{i}|sjlt"`` (first 8 bytes, 63 bits) when needed and dropped
   after use. The matrix thus depends only on ``(proj_seed, key, proj_dim)`` (and, for
   ``rademacher``, the device type) -- not on batching or chunking -- so every
   checkpoint, candidates and targets, uses the same projection.

   * ``rademacher``: tile ``i`` is a ``TILE_ROWS x proj_dim`` (fewer rows for the last
     tile) +-1 matrix drawn by ``bernoulli_(0.5)`` on the compute device (CPU and CUDA
     generators give different, equally valid matrices), multiplied in. The whole
     matrix (``n_lora_params x proj_dim`` draws) is generated once per chunk of
     ``proj_chunk`` examples, so larger chunks amortise it, at ``proj_chunk x
     n_lora_params`` floats of gradient memory (bounded by :func:`chunk_bytes`:
     :data:`GRAD_CHUNK_BYTES`, on a GPU a quarter of what the process can still
     allocate there, within its ``max_gpu_memory`` cap).
     For the default adapter of the embedded 135M model (14.7M parameters) that is
     3,600 tiles of 4096 x 8192 per chunk: about 2 hours per chunk of 18 examples on a
     2-core CPU.
   * ``sjlt``: every coordinate is sent to :data:`SJLT_NNZ` (4) of the ``proj_dim``
     outputs with random signs, scaled ``1/sqrt(SJLT_NNZ)`` (so ``E[P P^T] = I``); tile
     ``i`` is ``SJLT_NNZ x rows`` draws of ``randint(0, 2 proj_dim)`` from a CPU
     generator (bucket = draw // 2, sign from its low bit: the same matrix on every
     device), applied by ``index_add_`` over the buckets. Cost: ``SJLT_NNZ x
     n_lora_params`` draws per chunk and as many additions per example, no dense
     matrix; regeneration is cheap, so chunks are small (:data:`SJLT_CHUNK_BYTES`: 4
     examples of the default adapter).

   Neither is scaled by ``1/sqrt(proj_dim)``: cosines ignore it.
4. **Score.** ``s(z) = sum_ckpt w_ckpt cos(Gamma_z, g_q)``, ``w`` = the mean learning
   rate of each checkpoint's epoch (``checkpoint.json``'s ``mean_lr``; option
   ``checkpoint_weights`` overrides; equal weights when neither is known or all are 0;
   a checkpoint of weight 0 is not computed, ``skipped_checkpoints`` in the info),
   normalised to sum 1; then per task (``TargetPair.task``; one task when ``None``) the
   **mean** over the task's targets, and the **max** over tasks (LESS's ``matching.py``).

Per-checkpoint projected features are kept in the run's ``.partial/less/`` (with their
projection in the file's metadata) so an interrupted run resumes after the last finished
checkpoint; features of another projection (``auto`` resumed on another device) are
computed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .. import cache
from ..data.tokenize import collate, encoded_fingerprint, token_losses
from ..errors import CacheError, ConfigError, InputError
from ..gradients import Taps, activation_grad_mode, check_finite, release_host_memory
from ..io import atomic_write_json, sha256_json
from ..runtime.memory import allocatable_bytes
from ..settings import key_of
from .common import compute_dtype, method, record, require_pairs, resolve_options

log = logging.getLogger(__name__)

TILE_ROWS = 4096
#: the chunk's flattened per-example gradients (``proj_chunk`` x LoRA parameters) are
#: held at most this large: ``proj_chunk`` is lowered to fit. The default r=128 q/k/v/o
#: adapter of the embedded 135M model has 14.7M parameters: 64 examples were 3.8 GB of
#: host memory on the CPU; 1 GiB holds 18 (computed from the sizes). A smaller chunk regenerates the
#: projection more often (more time, same features).
GRAD_CHUNK_BYTES = 1 << 30
#: on a CUDA device the chunk may take this share of the memory the process can still
#: allocate there instead (within its ``max_gpu_memory`` cap), when more
CUDA_FREE_SHARE = 0.25
#: the same bound for the sparse (``sjlt``) projection, which costs little to regenerate
#: (4 draws per parameter, about 0.5 s for the 14.7M-parameter adapter on one CPU core):
#: 256 MiB holds 4 of those examples.
SJLT_CHUNK_BYTES = 1 << 28
#: output coordinates per input coordinate of the sparse projection (``s``)
SJLT_NNZ = 4
PROJECTIONS = ("auto", "rademacher", "sjlt")
CACHE_FORMAT = 2
WARMUP_FILE = "less_warmup.json"
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.999, 1e-8
TARGET_SIDES = ("chosen", "rejected", "contrast")
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

OPTIONS = {
    "warmup_fraction": 0.05,
    "lr": 2e-5,
    "epochs": 4,
    "lora_r": 128,
    "lora_alpha": 512,
    "lora_dropout": 0.1,
    "train_batch_size": 1,
    "grad_accum": None,
    "warmup_steps": LESS_WARMUP_STEPS,
    "warmup_floor": "examples",
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "lr_scheduler": "linear",
    "warmup_ratio": 0.03,
    "weight_decay": 0.0,
    "seed": None,
    "checkpoints": None,
    "checkpoint_weights": None,
    "target_side": "chosen",
    "proj_dim": 8192,
    "proj_seed": None,
    "proj_chunk": 64,
    "projection": "auto",
}


# --------------------------------------------------------------------------- projection

def tile_seed(proj_seed: int, key: str, tile: int, kind: str = "rademacher") -> int:
    text = f"{proj_seed}|{key}|{tile}" if kind == "rademacher" else f"{proj_seed}|{key}|{tile}|{kind}"
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def rademacher_tile(proj_seed: int, key: str, tile: int, rows: int, dim: int, device, dtype) -> torch.Tensor:
    """Tile ``tile`` (rows ``tile*TILE_ROWS ..``) of ``key``'s projection, ``rows x dim``, +-1
    (``rows`` < TILE_ROWS only for a parameter's last tile, always the same for a given size)."""
    g = torch.Generator(device=device).manual_seed(tile_seed(proj_seed, key, tile))
    return torch.empty(rows, dim, device=device, dtype=dtype).bernoulli_(0.5, generator=g).mul_(2).sub_(1)


def sjlt_tile(proj_seed: int, key: str, tile: int, rows: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile ``tile`` of ``key``'s sparse projection: ``(buckets, signs)``, each ``SJLT_NNZ x rows``
    on the CPU. Row ``r`` of the tile has ``signs[j, r]`` (+-1) added at column ``buckets[j, r]``
    for every ``j``, scaled by ``1/sqrt(SJLT_NNZ)`` by the caller; the ``SJLT_NNZ`` buckets are
    drawn independently (a repeat, probability about ``SJLT_NNZ/dim``, leaves the expectation
    ``E[P P^T] = I`` intact). One draw in ``[0, 2 dim)`` gives a bucket and a sign."""
    g = torch.Generator().manual_seed(tile_seed(proj_seed, key, tile, "sjlt"))
    r = torch.randint(0, 2 * dim, (SJLT_NNZ, rows), generator=g)
    return r >> 1, 1 - 2 * (r & 1)


def _tiles(n: int):
    for t in range((n + TILE_ROWS - 1) // TILE_ROWS):
        lo = t * TILE_ROWS
        yield t, lo, min(n, lo + TILE_ROWS)


def projection_matrix(shapes: dict, dim: int, proj_seed: int, device="cpu", dtype=torch.float64,
                      kind: str = "rademacher") -> torch.Tensor:
    """The full projection ``kind`` (``rademacher`` or ``sjlt``) for parameters ``shapes``
    (key -> numel or shape), stacked in the given key order: ``(sum numel) x dim``. For
    tests and small models only."""
    blocks = []
    for key, shape in shapes.items():
        n = shape if isinstance(shape, int) else int(torch.Size(shape).numel())
        for t, lo, hi in _tiles(n):
            if kind == "rademacher":
                blocks.append(rademacher_tile(proj_seed, key, t, hi - lo, dim, torch.device(device), dtype))
                continue
            buckets, signs = sjlt_tile(proj_seed, key, t, hi - lo, dim)
            P = torch.zeros(hi - lo, dim, dtype=dtype)
            rows = torch.arange(hi - lo)
            for j in range(SJLT_NNZ):
                P.index_put_((rows, buckets[j]), signs[j].to(dtype) / SJLT_NNZ ** 0.5, accumulate=True)
            blocks.append(P.to(device))
    return torch.cat(blocks)


def project(flat: torch.Tensor, key: str, dim: int, proj_seed: int, kind: str = "rademacher") -> torch.Tensor:
    """``flat (C, n) @ P_key (n, dim)``, tile by tile; ``kind`` is ``rademacher`` (a dense
    ``TILE_ROWS x dim`` matrix multiplied per tile: ``n x dim`` draws and ``C n dim``
    multiply-adds) or ``sjlt`` (``SJLT_NNZ`` scatter-adds per tile: ``SJLT_NNZ n`` draws and
    ``SJLT_NNZ C n`` adds)."""
    C, n = flat.shape
    out = torch.zeros(C, dim, device=flat.device, dtype=flat.dtype)
    scale = SJLT_NNZ ** -0.5
    for t, lo, hi in _tiles(n):
        if kind == "rademacher":
            P = rademacher_tile(proj_seed, key, t, hi - lo, dim, flat.device, flat.dtype)
            out.addmm_(flat[:, lo:hi], P)
            del P
            continue
        buckets, signs = sjlt_tile(proj_seed, key, t, hi - lo, dim)
        buckets = buckets.to(flat.device)
        signs = signs.to(flat.device, flat.dtype).mul_(scale)
        src = flat[:, lo:hi]
        for j in range(SJLT_NNZ):
            # index_add_ along the columns: fast on the CPU for the few rows of a chunk
            out.index_add_(1, buckets[j], src * signs[j])
    return out


def resolve_projection(value, device: torch.device) -> tuple[str, str]:
    """The projection to use (``rademacher`` or ``sjlt``) and why, for option ``projection``."""
    if value not in PROJECTIONS:
        raise ConfigError("projection", f"unknown projection {value!r}",
                          f"use one of {', '.join(PROJECTIONS)} (auto: rademacher on CUDA, sjlt elsewhere)")
    if value != "auto":
        return value, "option projection"
    if device.type == "cuda":
        return "rademacher", "auto: CUDA device, LESS's dense Rademacher projection (TRAK's semantics)"
    return "sjlt", (f"auto: {device.type} device, where the dense projection's {TILE_ROWS}-row tiles cost "
                    "hours per chunk; a sparse JL projection instead")


# --------------------------------------------------------------------------- gradients

def param_key(module_name: str) -> str:
    """``...q_proj.lora_A.less`` -> ``...q_proj.lora_A.weight`` (adapter_model.safetensors key)."""
    return module_name.rsplit(".", 1)[0] + ".weight"


def adam_precondition(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """LESS's ``Gamma = m' / sqrt(v' + eps)``, ``m' = b1 m + (1-b1) g``, ``v' = b2 v + (1-b2) g^2``."""
    m2 = ADAM_BETA1 * m + (1 - ADAM_BETA1) * g
    v2 = ADAM_BETA2 * v + (1 - ADAM_BETA2) * g * g
    return m2 / torch.sqrt(v2 + ADAM_EPS)


def chunk_bytes(device: torch.device, projection: str) -> tuple[int, str]:
    """The bound on one chunk's per-example gradients and its name: ``SJLT_CHUNK_BYTES``
    for ``sjlt``; for ``rademacher`` ``GRAD_CHUNK_BYTES``, or on a CUDA device a quarter
    of the memory this process can still allocate there (:func:`prism_select.runtime.memory.allocatable_bytes`:
    within its ``max_gpu_memory`` cap, so that processes sharing a GPU under caps do not
    size their chunks by the whole device) when that is more (:data:`CUDA_FREE_SHARE`). Each chunk
    regenerates the dense matrix, so on a GPU a larger chunk is the difference between a
    launch-bound and a compute-bound projection (with 18-example chunks about half of
    LESS's gradient time on one H200 went to drawing tiles, 2026-11-28)."""
    if projection != "rademacher":
        return SJLT_CHUNK_BYTES, "SJLT_CHUNK_BYTES"
    if device.type == "cuda":
        free = allocatable_bytes(device)
        if int(free * CUDA_FREE_SHARE) > GRAD_CHUNK_BYTES:
            return int(free * CUDA_FREE_SHARE), f"{CUDA_FREE_SHARE:g} of the device memory this process can allocate"
    return GRAD_CHUNK_BYTES, "GRAD_CHUNK_BYTES"


def projected_gradients(model, modules: dict, encoded: list, *, pad_id: int, batch_size: int, dim: int,
                        proj_seed: int, adam: dict | None = None, chunk: int = 64, progress: bool = False,
                        desc: str = "LESS gradients", projection: str = "rademacher") -> torch.Tensor:
    """Projected (not yet normalised) per-example gradients of the mean response loss
    over ``modules`` (LoRA Linear layers), Adam-preconditioned when ``adam`` maps
    ``param_key -> (m, v)``, with :func:`project` ``projection``. Returns ``(N, dim)``
    float64 on the CPU, filled chunk by chunk. On the CPU the heap is handed back to the
    system after each chunk (:func:`prism_select.gradients.release_host_memory`): each
    chunk's per-example gradients (up to ``SJLT_CHUNK_BYTES``) are freed between the
    pages of the next chunk's activations, which would otherwise keep them resident
    (measured on the CPU, 2026-11-27)."""
    device = next(model.parameters()).device
    dt = compute_dtype(model)
    keys = {name: param_key(name) for name in modules}
    n_params = sum(m.weight.numel() for m in modules.values())
    cap, cap_name = chunk_bytes(device, projection)
    fit = max(1, cap // max(1, n_params * torch.empty(0, dtype=dt).element_size()))
    if fit < chunk:
        log.info("LESS: projecting %d examples at a time, not %d (%d LoRA parameters; %s)",
                 fit, chunk, n_params, cap_name)
        chunk = fit
    state = None
    if adam is not None:
        state = {name: (adam[k][0].to(device, dt), adam[k][1].to(device, dt)) for name, k in keys.items()}
    out = torch.empty(len(encoded), dim, dtype=torch.float64)
    bar = tqdm(total=len(encoded), desc=desc, disable=not progress, leave=False)
    with activation_grad_mode(model), Taps(modules, compute_dtype=dt) as taps:
        for c0 in range(0, len(encoded), chunk):
            part = encoded[c0:c0 + chunk]
            flats = {name: [] for name in modules}
            for b0 in range(0, len(part), batch_size):
                batch = part[b0:b0 + batch_size]
                b = collate(batch, pad_id, device)
                taps.mask = b["attention_mask"]
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
                total, count = token_losses(logits, b["labels"])
                loss = (total / count.clamp(min=1)).sum()  # each example's mean loss; examples independent
                check_finite(loss.detach(), "the LESS loss", record=f"{c0 + b0}..{c0 + b0 + len(batch) - 1}")
                loss.backward()
                for name in modules:
                    G = taps.per_example_grads(name)
                    if state is not None:
                        G = adam_precondition(G, *state[name])
                    flats[name].append(G.reshape(G.shape[0], -1))
                taps.clear()
                bar.update(len(batch))
            feats = None
            for name in modules:
                flat = torch.cat(flats[name])
                flats[name] = None
                p = project(flat, keys[name], dim, proj_seed, projection)
                feats = p if feats is None else feats + p
            check_finite(feats, "the projected LESS gradients")
            out[c0:c0 + len(part)] = feats
            del feats, flats
            release_host_memory(device)
    bar.close()
    return out


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=1)


def task_max_of_means(sim: torch.Tensor, tasks: list) -> tuple[torch.Tensor, list]:
    """``sim (N, M)`` -> per task (in order of first appearance) the mean over its
    columns, then the max over tasks. Returns the scores and the task names."""
    names = list(dict.fromkeys(tasks))
    per_task = torch.stack([sim[:, [j for j, t in enumerate(tasks) if t == name]].mean(1) for name in names], 1)
    return per_task.max(1).values, names


# --------------------------------------------------------------------------- checkpoints

def _warmup_settings(opts: dict, max_length: int, seed: int, progress: bool, grad_accum: int):
    from ..evaluation.finetune import FinetuneSettings
    try:
        return FinetuneSettings(
            learning_rate=opts["lr"], epochs=opts["epochs"], batch_size=opts["train_batch_size"],
            grad_accum=grad_accum, lora_r=opts["lora_r"], lora_alpha=opts["lora_alpha"],
            lora_dropout=opts["lora_dropout"], target_modules=opts["target_modules"],
            lr_scheduler=opts["lr_scheduler"], warmup_ratio=opts["warmup_ratio"],
            weight_decay=opts["weight_decay"], max_length=max_length, seed=seed, progress=progress)
    except ConfigError as e:
        raise ConfigError("method_options", f"LESS warm-up: {e}") from e


def optimizer_steps(n_examples: int, batch_size: int, grad_accum: int, epochs: float) -> int:
    """Optimizer steps of a ``transformers.Trainer`` run: ``ceil(n / batch)`` micro-batches
    an epoch, ``ceil(micro / accum)`` steps an epoch (the last one partial), ``ceil(epochs x
    steps)`` in all."""
    micro = math.ceil(n_examples / batch_size)
    return math.ceil(epochs * max(1, math.ceil(micro / grad_accum)))


def warmup_plan(n_pool: int, opts: dict) -> dict:
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
    frac, epochs, b = opts["warmup_fraction"], opts["epochs"], opts["train_batch_size"]
    target, accum, floor = opts["warmup_steps"], opts["grad_accum"], opts["warmup_floor"]
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


def warmup_checkpoints(ctx, opts: dict, seed: int) -> tuple[list, dict]:
    """Train (or reuse from the cache) the warm-up LoRA; returns checkpoint dirs and info."""
    frac = opts["warmup_fraction"]
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
    from ..evaluation.finetune import finetune

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
    from ..evaluation.finetune import load_optimizer_state

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
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return (f.metadata() or {}).get("projection", "rademacher")


def _with_adapter(ctx, ckpt: Path):
    """Context manager: the run's base model with the checkpoint's adapter, restored after."""
    from contextlib import contextmanager

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


@method("less", "LESS: Adam-preconditioned LoRA gradient cosine to the targets over warm-up checkpoints", OPTIONS)
def less_method(ctx) -> tuple[torch.Tensor, list]:
    """LESS scores (see the module docstring); float64, higher = more aligned."""
    from ..model.tracking import _is_peft
    from ..model import tracked_linear_modules

    require_pairs(ctx, "less")
    opts = resolve_options(ctx, less_method)
    if _is_peft(ctx.lm.model):
        raise ConfigError("model", "LESS trains and loads its own LoRA adapters on the base model, but the run's "
                          "model already carries an adapter", "pass the base model (without --adapter)")
    seed = ctx.settings.seed if opts["seed"] is None else opts["seed"]
    proj_seed = seed if opts["proj_seed"] is None else opts["proj_seed"]
    projection, why = resolve_projection(opts["projection"], next(ctx.lm.model.parameters()).device)
    for name in ("proj_dim", "proj_chunk"):
        v = opts[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(name, f"must be a positive integer, got {v!r}")
    if not isinstance(seed, int) or not isinstance(proj_seed, int):
        raise ConfigError("seed", f"seeds must be integers, got {seed!r} / {proj_seed!r}")
    side = opts["target_side"]
    if side not in TARGET_SIDES:
        raise ConfigError("target_side", f"unknown target side {side!r}", f"use one of {', '.join(TARGET_SIDES)}")

    if opts["checkpoints"] is not None:
        given = opts["checkpoints"]
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
    weights, wsource = _checkpoint_weights(ckpts, opts["checkpoint_weights"])

    dim = opts["proj_dim"]
    tasks = [p.task for p in ctx.inputs.pairs]
    partial = ctx.out_dir / ".partial" / "less"
    N, M = len(ctx.inputs.encoded), len(ctx.inputs.pairs)
    sim = torch.zeros(N, M, dtype=torch.float64)
    kw = dict(pad_id=ctx.pad_id, batch_size=ctx.settings.batch_size, dim=dim, proj_seed=proj_seed,
              chunk=opts["proj_chunk"], progress=ctx.settings.progress, projection=projection)
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


METHODS = {"less": less_method}
