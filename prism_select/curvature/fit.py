"""Fitting the curvature on (a sample of) the pool.

Normalisation (per tracked layer, ``N`` fit examples, ``T`` = all non-padding
tokens of them, prompt tokens included):

    A = (1/T) sum_tokens a a^T        S = (1/N) sum_n sum_t b_t b_t^T

so that ``A (x) S`` approximates ``F = (1/N) sum_n vec(G_n) vec(G_n)^T`` when the
tokens are independent (exact for one token per example and a shared input).
EK-FAC then replaces the Kronecker eigenvalues by
``Lambda = (1/N) sum_n (Q_S^T G_n Q_A)**2`` (a second pass), which is the exact
diagonal of ``F`` in that eigenbasis. ``diagonal`` uses ``(1/N) sum_n G_n**2``.
"""

from __future__ import annotations

import logging
import random

import torch
from tqdm.auto import tqdm

from ..data.tokenize import collate, token_losses
from ..gradients import Taps, activation_grad_mode, check_finite, layer_shape
from ..io import sha256_json
from .base import Curvature, CurvatureSettings, settings_dict

log = logging.getLogger(__name__)


def length_batches(encoded: list, indices: list, batch_size: int) -> list:
    """Group ``indices`` into batches of similar length (less padding), in a
    deterministic order."""
    order = sorted(indices, key=lambda i: (len(encoded[i].input_ids), i))
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


def fit_indices(n: int, settings: CurvatureSettings) -> list:
    if settings.fit_examples is None or settings.fit_examples >= n:
        return list(range(n))
    rng = random.Random(settings.seed)
    return sorted(rng.sample(range(n), settings.fit_examples))


def _sampled_labels(logits: torch.Tensor, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Replace response labels by tokens drawn from the model's own predictions."""
    with torch.no_grad():
        probs = torch.softmax(logits[:, :-1].float(), dim=-1)
        flat = probs.reshape(-1, probs.size(-1)).cpu()
        draw = torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1]).to(labels.device)
    new = labels.clone()
    mask = labels[:, 1:] != -100
    new[:, 1:][mask] = draw[mask]
    return new


def _passes(model, modules, encoded, batches, fisher, seed, device, pad_id, desc, on_batch):
    gen = torch.Generator().manual_seed(seed)
    compute = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    with activation_grad_mode(model), Taps(modules, compute) as taps:
        for batch in tqdm(batches, desc=desc, unit="batch", leave=False):
            enc = [encoded[i] for i in batch]
            b = collate(enc, pad_id, device)
            taps.mask = b["attention_mask"]
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
            labels = b["labels"] if fisher == "empirical" else _sampled_labels(out.logits, b["labels"], gen)
            losses, _ = token_losses(out.logits, labels)
            check_finite(losses, "the training loss", record=batch)
            losses.sum().backward()
            on_batch(taps, b["attention_mask"], batch)
            taps.clear()


def fit_curvature(model, modules: dict, encoded: list, settings: CurvatureSettings,
                  *, pad_id: int, device=None, row_ids=None) -> Curvature:
    """Fit ``settings.kind`` curvature for ``modules`` on ``encoded`` examples."""
    device = device or next(model.parameters()).device
    layers = list(modules)
    if settings.kind == "identity":
        return Curvature("identity", layers, {}, {n: 0.0 for n in layers})
    idx = fit_indices(len(encoded), settings)
    batches = length_batches(encoded, idx, settings.batch_size)
    compute = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    n_examples = len(idx)
    tensors: dict = {}

    def zeros(*shape):
        return torch.zeros(*shape, dtype=compute, device=device)

    if settings.kind == "diagonal":
        D = {n: zeros(*layer_shape(m)) for n, m in modules.items()}

        def acc_diag(taps, mask, batch):
            for n in layers:
                D[n] += (taps.per_example_grads(n) ** 2).sum(0)

        _passes(model, modules, encoded, batches, settings.fisher, settings.seed, device, pad_id,
                "curvature (diagonal)", acc_diag)
        for n in layers:
            tensors[f"{n}::D"] = D[n] / n_examples
            check_finite(tensors[f"{n}::D"], "the diagonal curvature", layer=n)
        damping = {n: _damping(settings, tensors[f"{n}::D"]) for n in layers}
        return Curvature("diagonal", layers, tensors, damping)

    # Pass 1: Kronecker factors.
    A = {n: zeros(layer_shape(m)[1], layer_shape(m)[1]) for n, m in modules.items()}
    S = {n: zeros(layer_shape(m)[0], layer_shape(m)[0]) for n, m in modules.items()}
    n_tokens = [0]

    def acc_cov(taps, mask, batch):
        n_tokens[0] += int(mask.sum())
        for n in layers:
            a = taps.a[n].reshape(-1, taps.a[n].shape[-1])
            b = taps.b[n].reshape(-1, taps.b[n].shape[-1])
            A[n] += a.T @ a
            S[n] += b.T @ b

    _passes(model, modules, encoded, batches, settings.fisher, settings.seed, device, pad_id,
            "curvature factors", acc_cov)
    for n in layers:
        A[n] /= max(n_tokens[0], 1)
        S[n] /= n_examples
        check_finite(A[n], "the activation covariance", layer=n)
        check_finite(S[n], "the gradient covariance", layer=n)
        lamA, QA = torch.linalg.eigh(A[n].double())
        lamS, QS = torch.linalg.eigh(S[n].double())
        tensors[f"{n}::QA"] = QA.to(compute)
        tensors[f"{n}::QS"] = QS.to(compute)
        tensors[f"{n}::lamA"] = lamA.clamp(min=0).to(compute)
        tensors[f"{n}::lamS"] = lamS.clamp(min=0).to(compute)
    del A, S

    if settings.kind == "kfac":
        cur = Curvature("kfac", layers, tensors, {})
        cur.damping = {n: _damping(settings, cur.eigenvalues(n)) for n in layers}
        return cur

    # Pass 2 (EK-FAC): eigenvalues corrected with per-example gradients in the eigenbasis.
    Lam = {n: zeros(*layer_shape(m)) for n, m in modules.items()}

    def acc_lambda(taps, mask, batch):
        for n in layers:
            a = taps.a[n] @ tensors[f"{n}::QA"]
            b = taps.b[n] @ tensors[f"{n}::QS"]
            rot = torch.einsum("bto,bti->boi", b, a)
            Lam[n] += (rot ** 2).sum(0)

    _passes(model, modules, encoded, batches, settings.fisher, settings.seed, device, pad_id,
            "curvature eigenvalues", acc_lambda)
    for n in layers:
        tensors[f"{n}::Lambda"] = Lam[n] / n_examples
        check_finite(tensors[f"{n}::Lambda"], "the EK-FAC eigenvalues", layer=n)
        del tensors[f"{n}::lamA"], tensors[f"{n}::lamS"]
    cur = Curvature("ekfac", layers, tensors, {})
    cur.damping = {n: _damping(settings, cur.eigenvalues(n)) for n in layers}
    return cur


def _damping(settings: CurvatureSettings, eig: torch.Tensor) -> float:
    if settings.damping is not None:
        return float(settings.damping)
    lam = settings.damping_factor * float(eig.double().mean())
    # A layer with all-zero curvature (e.g. unused) still needs an invertible H.
    return lam if lam > 0 else 1e-12


def curvature_key(settings: CurvatureSettings, model_fingerprint: str, pool_fingerprint: str,
                  layers: list, max_length: int) -> dict:
    """What a saved curvature must match to be reused."""
    s = settings_dict(settings)
    s.pop("batch_size")  # does not change the result
    return {
        "settings": s,
        "model_fingerprint": model_fingerprint,
        "pool_fingerprint": pool_fingerprint,
        "layers_key": sha256_json(layers),
        "max_length": max_length,
    }


def load_or_fit_curvature(model, modules, encoded, settings, *, pad_id, cache_root,
                          model_fingerprint, pool_fingerprint, max_length, device=None):
    """Reuse a saved curvature whose settings and fingerprints match, else fit and save.

    Returns ``(curvature, directory, reused)``.
    """
    from pathlib import Path

    from ..errors import CacheError

    key = curvature_key(settings, model_fingerprint, pool_fingerprint, list(modules), max_length)
    directory = Path(cache_root) / sha256_json(key)[:24]
    if settings.kind != "identity" and (directory / "curvature.json").exists():
        try:
            cur = Curvature.load(directory, expect=key)
            log.info("reusing curvature from %s", directory)
            return cur, directory, True
        except CacheError as exc:
            log.warning("%s; fitting again", exc)
    cur = fit_curvature(model, modules, encoded, settings, pad_id=pad_id, device=device)
    if settings.kind != "identity":
        cur.save(directory, key)
    return cur, directory, False
