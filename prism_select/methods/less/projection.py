"""LESS's random projection of LoRA gradients (Rademacher or sparse, regenerated tile by
tile from seeds) and the projected, Adam-preconditioned per-example gradients
(:mod:`prism_select.methods.less`)."""

from __future__ import annotations

import hashlib
import logging

import torch
from tqdm.auto import tqdm

from ...data.tokenize import collate, token_losses
from ...errors import ConfigError
from ...gradients import Taps, activation_grad_mode, check_finite, release_host_memory
from ...runtime.memory import allocatable_bytes
from ..common import compute_dtype

log = logging.getLogger(__name__)
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
ADAM_BETA1, ADAM_BETA2, ADAM_EPS = 0.9, 0.999, 1e-8


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
