"""VecFilter, ProjDiff and ConceptInf (Kowal et al. 2026, "Concept Influence"; ProjDiff
is also the data filter of Persona Vectors, Chen et al. 2025).

Concept vector at layer ``l`` (see :mod:`.common` for the layer convention and
``h_l``): ``v = mean_q h_l(q, y+) - mean_q h_l(q, y-)``, ``vhat = v / ||v||``.

VecFilter   ``h_l(x, y) . vhat`` (option ``similarity="cosine"``: ``cos(h_l(x, y), v)``).
ProjDiff    ``(h_l(x, y) - h_l(x, y')) . vhat`` with ``y'`` the model's own sampled
            response to ``x`` (:mod:`.generation`: temperature 1, cached).
ConceptInf  influence on ``f(theta) = mean_q h_l(q, y+) . vhat`` with ``vhat`` held
            fixed: ``score = g_z . H^-1 (-grad f)``. Upweighting ``z`` moves the
            parameters by ``-H^-1 g_z``, so ``f`` changes by ``g_z . H^-1 (-grad f)``:
            a higher score means training on ``z`` *raises* the target concept's
            projection. Same shared curvature and score loop as PRISM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..data.tokenize import encode
from ..errors import ConfigError, InputError, NumericalError
from ..gradients import check_finite, tracked_param_grad_mode, weight_grad
from .common import batch_hidden, record, require_pairs, resolve_layer, resolve_options, response_means
from .generation import own_responses
from .registry import options_dict, register

SIMILARITIES = ("projection", "cosine")


@dataclass(frozen=True)
class VecFilterOptions:
    """VecFilter's options: ``layer`` the hidden-state index (None: ``round(2/3 * num_layers)``,
    :mod:`prism_select.methods.common`); ``similarity`` one of :data:`SIMILARITIES`."""

    layer: int | None = None
    similarity: str = "projection"


@dataclass(frozen=True)
class ProjDiffOptions:
    """ProjDiff's options: ``layer`` as VecFilter's; ``max_new_tokens`` the length bound of
    the sampled ``y'``; ``responses`` the ``y'`` given instead of sampled (a list in pool
    order or a mapping pool id -> text)."""

    layer: int | None = None
    max_new_tokens: int = 128
    responses: list | dict | None = None


@dataclass(frozen=True)
class ConceptInfOptions:
    """ConceptInf's options: ``layer`` as VecFilter's."""

    layer: int | None = None


def concept_vector(ctx, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v, h_l of chosen, h_l of rejected)``, float64 on the CPU."""
    m, bs = ctx.lm.model, ctx.settings.batch_size
    hc = response_means(m, ctx.inputs.chosen, layer, ctx.pad_id, bs)
    hr = response_means(m, ctx.inputs.rejected, layer, ctx.pad_id, bs)
    v = hc.mean(0) - hr.mean(0)
    check_finite(v, "the concept vector")
    if float(v.norm()) == 0.0:
        raise NumericalError(f"the concept vector at layer {layer} is zero: chosen and rejected responses have "
                             "the same mean hidden state; use another layer or more distinct target pairs")
    return v, hc, hr


def _pair_rows(ctx, hc, hr, vhat):
    return [{"id": p.id, "proj_chosen": float(hc[i] @ vhat), "proj_rejected": float(hr[i] @ vhat),
             **({"task": p.task} if p.task else {})} for i, p in enumerate(ctx.inputs.pairs)]


def _common(ctx, name: str, opts):
    require_pairs(ctx, name)
    layer = resolve_layer(ctx.lm.model, opts.layer)
    t = time.perf_counter()
    v, hc, hr = concept_vector(ctx, layer)
    ctx.end_stage("concept_vector", t)
    return opts, layer, v, hc, hr


@register("vecfilter", options=VecFilterOptions,
          description="VecFilter: response-averaged hidden state projected on the concept vector "
                      "mean h(q,y+) - mean h(q,y-)")
def vecfilter_method(ctx) -> tuple[torch.Tensor, list]:
    """VecFilter scores. Needs target pairs.

    Options:
      layer: hidden-state index (default ``round(2/3 * num_layers)``; see
        :mod:`prism_select.methods.common`).
      similarity: "projection" (default, ``h . v / ||v||``) or "cosine"
        (``h . v / (||h|| ||v||)``, 0 where ``h = 0``).

    Pair rows: ``id``, ``proj_chosen``, ``proj_rejected`` (``h_l . vhat`` of each side).
    """
    opts = resolve_options(ctx, "vecfilter")
    if opts.similarity not in SIMILARITIES:
        raise ConfigError("similarity", f"unknown value {opts.similarity!r}", f"use one of {', '.join(SIMILARITIES)}")
    opts, layer, v, hc, hr = _common(ctx, "vecfilter", opts)
    vhat = v / v.norm()
    h = response_means(ctx.lm.model, ctx.inputs.encoded, layer, ctx.pad_id, ctx.settings.batch_size)
    scores = h @ vhat
    if opts.similarity == "cosine":
        norms = h.norm(dim=1)
        scores = torch.where(norms > 0, scores / torch.where(norms > 0, norms, torch.ones_like(norms)),
                             torch.zeros_like(scores))
    check_finite(scores, "VecFilter scores")
    record(ctx, "vecfilter", {**options_dict(opts), "layer": layer}, concept_norm=float(v.norm()))
    return scores, _pair_rows(ctx, hc, hr, vhat)


def _given_responses(ctx, given) -> list:
    pool = ctx.inputs.pool
    if isinstance(given, list):
        if len(given) != len(pool):
            raise ConfigError("responses", f"has {len(given)} entries for a pool of {len(pool)}",
                              "give one response per pool example, in pool order, or a mapping id -> text")
        out = given
    elif isinstance(given, dict):
        by = {str(k): t for k, t in given.items()}
        missing = [ex.id for ex in pool if str(ex.id) not in by]
        if missing:
            raise ConfigError("responses", f"no response for pool id(s) {missing[:5]}"
                              + (" ..." if len(missing) > 5 else ""), "give a response for every pool id")
        out = [by[str(ex.id)] for ex in pool]
    else:
        raise ConfigError("responses", f"must be a list or a mapping id -> text, got {type(given).__name__}")
    bad = [i for i, t in enumerate(out) if not isinstance(t, str)]
    if bad:
        raise ConfigError("responses", f"entry {bad[0]} is not text")
    return list(out)


@register("projdiff", options=ProjDiffOptions,
          description="ProjDiff: (h(x,y) - h(x,y')) . concept vector, y' the model's own sampled response (cached)")
def projdiff_method(ctx) -> tuple[torch.Tensor, list]:
    """ProjDiff scores. Needs target pairs.

    Options:
      layer: hidden-state index (default ``round(2/3 * num_layers)``).
      max_new_tokens: length bound of the sampled ``y'`` (default 128).
      responses: ``y'`` given instead of sampled: a list in pool order or a mapping
        pool id -> text (default None: sample, temperature 1, seeded by ``seed``, cached
        under ``<cache_dir>/generations/``; see :mod:`prism_select.methods.generation`).

    ``y'`` is encoded like ``y`` (same chat template and prompt truncation), so both
    hidden states average the same kind of positions.
    Pair rows: ``id``, ``proj_chosen``, ``proj_rejected``.
    """
    opts = resolve_options(ctx, "projdiff")
    n_new = opts.max_new_tokens
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
        raise ConfigError("max_new_tokens", f"must be a positive integer, got {n_new!r}")
    opts, layer, v, hc, hr = _common(ctx, "projdiff", opts)
    vhat = v / v.norm()
    lm, st = ctx.lm, ctx.settings
    t = time.perf_counter()
    if opts.responses is not None:
        own = _given_responses(ctx, opts.responses)
        gen_info = {"source": "given"}
    else:
        own, gen_info = own_responses(lm, ctx.inputs.encoded, max_new_tokens=n_new, seed=st.seed,
                                      cache_dir=lm.settings.resolved_cache_dir(), progress=st.progress)
        gen_info["source"] = "sampled"
    ctx.end_stage("own_responses", t)
    enc_own = []
    for ex, text in zip(ctx.inputs.pool, own):
        try:
            enc_own.append(encode(lm.tokenizer, ex.prompt, text, st.max_length, row=ex.row, field="y'"))
        except InputError as e:
            raise ConfigError("max_new_tokens", f"the model's own response to pool id {ex.id} cannot be "
                              f"encoded: {e.reason}", "lower max_new_tokens or raise max_length") from e
    h = response_means(lm.model, ctx.inputs.encoded, layer, ctx.pad_id, st.batch_size)
    h_own = response_means(lm.model, enc_own, layer, ctx.pad_id, st.batch_size)
    scores = (h - h_own) @ vhat
    check_finite(scores, "ProjDiff scores")
    used = {**options_dict(opts), "layer": layer, "responses": None if opts.responses is None else "given"}
    record(ctx, "projdiff", used, concept_norm=float(v.norm()), own_responses=gen_info)
    return scores, _pair_rows(ctx, hc, hr, vhat)


def concept_gradient(model, modules: dict, chosen: list, layer: int, vhat: torch.Tensor, *, pad_id: int,
                     batch_size: int = 8) -> dict:
    """``grad f`` for ``f = mean_q h_l(q, y+) . vhat`` (``vhat`` fixed), over the tracked
    layers' weights, as ``out x in'`` matrices."""
    device = next(model.parameters()).device
    Q = len(chosen)
    with tracked_param_grad_mode(model, modules):
        for s in range(0, Q, batch_size):
            h = batch_hidden(model, chosen[s:s + batch_size], layer, pad_id, device)
            f = (h @ vhat.to(device=device, dtype=h.dtype)).sum() / Q
            f.backward()
        grad = {n: weight_grad(m).detach().clone() for n, m in modules.items()}
    for n, g in grad.items():
        check_finite(g, "the concept gradient", layer=n)
    return grad


@register("conceptinf", options=ConceptInfOptions,
          description="ConceptInf: influence g_z . H^-1 (-grad f) on the target responses' concept projection f")
def conceptinf_method(ctx) -> tuple[torch.Tensor, list]:
    """ConceptInf scores ``g_z . H^-1 (-grad f)`` (higher = training on ``z`` raises
    ``f``, the target-positive concept projection). Needs target pairs.

    Options:
      layer: hidden-state index (default ``round(2/3 * num_layers)``).

    Tracked layers after ``layer`` get a zero direction (``f`` does not depend on them).
    Pair rows: ``id``, ``proj_chosen``, ``proj_rejected``.
    """
    opts, layer, v, hc, hr = _common(ctx, "conceptinf", resolve_options(ctx, "conceptinf"))
    vhat = v / v.norm()
    t = time.perf_counter()
    grad_f = concept_gradient(ctx.lm.model, ctx.modules, ctx.inputs.chosen, layer, vhat, pad_id=ctx.pad_id,
                              batch_size=ctx.settings.batch_size)
    ctx.end_stage("concept_gradient", t)
    direction = {n: -g for n, g in grad_f.items()}
    del grad_f
    scores = ctx.score_direction(direction, tag="conceptinf", last=True)
    record(ctx, "conceptinf", {**options_dict(opts), "layer": layer}, concept_norm=float(v.norm()),
           f=float((hc @ vhat).mean()))
    return scores, _pair_rows(ctx, hc, hr, vhat)
