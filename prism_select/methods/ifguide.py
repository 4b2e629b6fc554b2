"""IF-Guide (Coalson et al., NeurIPS 2025; ztcoalson/IF-Guide): token-level influence
of a contrastive target, aggregated into a document ranking.

Target: ``g = mean_q grad l(q, y+) - mean_q grad l(q, y-)`` with ``l`` the *summed*
response loss (prompt masked): IF-Guide's ``gbar_bad - gbar_good`` where the traced
("bad") behaviour is the target-positive ``chosen`` and ``rejected`` is the "good"
side. Preconditioned once by the run's shared curvature: ``V = H^-1 g``.

Token scores (option ``token_attribution``):

``position`` (default; what IF-Guide computes, through kronfluence's
    ``compute_per_token_scores``, after Grosse et al. 2023): the summed-loss gradient
    ``G_z = sum_l sum_t b_t a_t^T`` is split by position ``t``; token ``t``'s score is
    ``sum_l b_t^T V_l a_t`` with ``b_t = dl(z)/do_t`` the gradient of the example's
    whole summed loss. Every non-padding position counts (prompt positions included:
    their activations shape the response losses). Cost: one forward + one backward per
    batch, like the document score.
``loss``: token ``t``'s score is the influence of its own loss term,
    ``grad l_t(z) . V = sum_l sum_s b^{(t)}_s^T V_l a_s`` (``b^{(t)} = dl_t/do``), one
    per response token. The ``b^{(t)}`` of ``token_chunk`` tokens come from one batched
    backward (``torch.autograd.grad(..., is_grads_batched=True)``, a vmap over the
    backward); cost: one forward per batch plus about one backward *per response token*
    (so ~n_response times the document score's backward), and ``token_chunk x`` the
    activation-gradient memory of one backward.

Both decompositions sum to the document score ``g_z . V`` (the summed-loss influence).

Document rules (option ``ranking``): ``sum`` (default), the document score itself, and
``harmonic``, IF-Guide's count-and-sum of the tokens above the 0.99 quantile ``tau``,
taken over the **response tokens** (option ``threshold_tokens``: IF-Guide's code
thresholds every token of its pretraining documents, all of which its loss trains; here
the prompt and chat-template positions, which no SFT loss trains, are left out of
``tau``, the counts and the sums). Either rule records how many records tie
(:func:`ties`) and warns above :data:`TIE_WARN_SHARE` of the pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..data.tokenize import collate
from ..engine import batch_losses, cpu_response_split
from ..errors import ConfigError
from ..gradients import (activation_grad_mode, check_finite, release_host_memory, tracked_param_grad_mode,
                         weight_grad)
from ..runtime.layers import has_bias
from .common import compute_dtype, record, require_pairs, resolve_options
from .registry import register

log = logging.getLogger(__name__)

RANKINGS = ("harmonic", "sum")
ATTRIBUTIONS = ("position", "loss")
#: which token scores the harmonic rule thresholds, counts and sums (option ``threshold_tokens``)
THRESHOLD_TOKENS = ("response", "all")
#: a ranking tying more than this share of the pool is warned of (printed and in run.json)
TIE_WARN_SHARE = 0.10


# --------------------------------------------------------------------------- ranking

def ifguide_threshold(token_scores: list, quantile: float) -> float:
    """``tau``: the ``quantile`` of the given token scores of the pool, all documents'
    together (linear interpolation, ``numpy.quantile``'s default, as IF-Guide's code; the
    method passes the response tokens', :func:`response_token_scores`)."""
    flat = np.concatenate([t.detach().double().cpu().numpy().reshape(-1) for t in token_scores])
    return float(np.quantile(flat, quantile))


def response_token_scores(token_scores: list, encoded: list, attribution: str) -> list:
    """Each document's scores at its response tokens: under ``position`` the positions
    ``response_start - 1 .. len - 2``, whose outputs predict the response tokens (the
    positions an SFT loss trains; a pretraining document, IF-Guide's setting, trains every
    position); under ``loss`` every score already belongs to a response token."""
    if attribution == "loss":
        return list(token_scores)
    out = []
    for t, e in zip(token_scores, encoded, strict=True):
        out.append(t.reshape(-1)[max(0, e.response_start - 1): len(e.input_ids) - 1])
    return out


def ties(scores: torch.Tensor) -> dict:
    """How many records share their exact score with another record (ties fall back to
    the pool's order in a ranking): ``tied`` records, their ``share`` of the pool, the
    ``largest`` group of one score and that score (``largest_value``)."""
    x = scores.detach().double().cpu().reshape(-1)
    if x.numel() == 0:
        return {"tied": 0, "share": 0.0, "largest": 0, "largest_value": None}
    values, counts = torch.unique(x, return_counts=True)
    tied = int(counts[counts > 1].sum())
    k = int(counts.argmax())
    return {"tied": tied, "share": tied / x.numel(), "largest": int(counts[k]) if counts[k] > 1 else 0,
            "largest_value": float(values[k]) if counts[k] > 1 else None}


def _min_max(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.min(), x.max()
    if hi == lo:
        return torch.zeros_like(x)
    return (x - lo) / (hi - lo)


def ifguide_rank(token_scores: list, quantile: float = 0.99, mode: str = "harmonic") -> torch.Tensor:
    """Document scores from per-token scores (one 1-D tensor per document).

    ``harmonic`` (IF-Guide): ``tau`` = :func:`ifguide_threshold`; ``s_i`` = number of
    the document's tokens with score ``> tau``, ``f_i`` = their sum; both min-max
    normalised over the pool (all-equal -> 0); ``R_i = 2 s f / (s + f)``, 0 where
    ``s + f = 0``. (IF-Guide's code adds ``eps = 1e-6`` to both denominators; this is
    the exact form.)
    ``sum``: the plain sum of the document's token scores.
    Returns float64 scores, higher = more influential towards the target.
    """
    if mode not in RANKINGS:
        raise ConfigError("ranking", f"unknown ranking {mode!r}", f"use one of {', '.join(RANKINGS)}")
    ts = [t.detach().double().cpu().reshape(-1) for t in token_scores]
    if mode == "sum":
        return torch.stack([t.sum() for t in ts])
    if not 0 < quantile < 1:
        raise ConfigError("quantile", f"must be in (0, 1), got {quantile}")
    tau = ifguide_threshold(ts, quantile)
    s = torch.stack([(t > tau).sum().double() for t in ts])
    f = torch.stack([t[t > tau].sum() for t in ts])
    s, f = _min_max(s), _min_max(f)
    den = s + f
    return torch.where(den > 0, 2 * s * f / torch.where(den > 0, den, torch.ones_like(den)),
                       torch.zeros_like(den))


# --------------------------------------------------------------------------- target

def contrastive_target(model, modules: dict, chosen: list, rejected: list, *, pad_id: int,
                       batch_size: int = 8, progress: bool = False):
    """``g = mean_q grad l(q, y+) - mean_q grad l(q, y-)`` (summed response losses).

    Returns ``(g as layer matrices, summed losses of chosen, of rejected)``.
    """
    device = next(model.parameters()).device
    Q = len(chosen)
    losses = {"chosen": [], "rejected": []}
    with tracked_param_grad_mode(model, modules):
        for side, encs, sign in (("chosen", chosen, 1.0), ("rejected", rejected, -1.0)):
            for s in tqdm(range(0, Q, batch_size), desc=f"IF-Guide target ({side})", unit="batch",
                          leave=False, disable=not progress):
                b = collate(encs[s:s + batch_size], pad_id, device)
                # on the CPU, logits at the response positions only (as in _position_scores)
                total, _ = batch_losses(model, b, split=cpu_response_split(model, modules))
                check_finite(total.detach(), f"the target loss ({side})")
                (sign * total.sum() / Q).backward()
                losses[side].append(total.detach().double().cpu())
        g = {}
        for n, m in modules.items():  # taken out of .grad, not copied next to it
            g[n] = weight_grad(m).detach()
            m.weight.grad = None
            if has_bias(m):
                m.bias.grad = None
    for n, t in g.items():
        check_finite(t, "the IF-Guide target", layer=n)
    return g, torch.cat(losses["chosen"]), torch.cat(losses["rejected"])


# --------------------------------------------------------------------------- token scores

def _u(a: torch.Tensor, V: torch.Tensor, bias: bool) -> torch.Tensor:
    u = a @ V[:, : a.shape[-1]].T
    return u + V[:, -1] if bias else u


def _position_scores(model, modules, V, batch, pad_id, device, dt) -> list:
    """Per-position scores ``sum_l b_t^T V_l a_t`` (b of the summed loss), all positions,
    formed in each layer's backward as ``(b_t^T V_l) . a_t``: the forward keeps a reference
    to the layer's input ``a`` (one tensor for the layers reading it, q/k/v, gate/up), not
    ``V_l a_t`` of every layer's width (about half the memory of the batch's activations
    more at the embedded model; the 1,000-record CPU run peaked over 3 GB with it).
    On the CPU the logits are formed at the response positions only
    (:func:`prism_select.engine.cpu_response_split`): every position's logits, their
    softmax and gradient were about 0.4 GB of a batch of 8 at the embedded model's vocabulary."""
    b = collate(batch, pad_id, device)
    mask = b["attention_mask"]
    acc = torch.zeros(mask.shape, dtype=dt, device=device)
    handles = []

    def hook(name, module):
        Vl, bias = V[name], has_bias(module)

        def fwd(mod, inputs, output):
            a = inputs[0].detach()

            def on_grad(g):
                nonlocal acc
                g = g.detach().to(dt)
                s = ((g @ Vl[:, : a.shape[-1]]) * a.to(dt)).sum(-1)
                acc = acc + (s + g @ Vl[:, -1] if bias else s)
            if output.requires_grad:
                output.register_hook(on_grad)
        return fwd

    for n, m in modules.items():
        handles.append(m.register_forward_hook(hook(n, m)))
    try:
        total, _ = batch_losses(model, b, split=cpu_response_split(model, modules))
        total.sum().backward()
    finally:
        for h in handles:
            h.remove()
    acc = acc * mask.to(dt)  # padding positions score nothing
    return [acc[i, : len(e.input_ids)].double().cpu() for i, e in enumerate(batch)]


def _loss_term_scores(model, modules, V, batch, pad_id, device, dt, token_chunk) -> list:
    """Per-response-token scores ``grad l_t . V`` via batched backward passes."""
    b = collate(batch, pad_id, device)
    mask = b["attention_mask"]
    outs, us, handles = [], [], []

    def hook(name, module):
        Vl, bias = V[name], has_bias(module)

        def fwd(mod, inputs, output):
            outs.append(output)
            us.append(_u(inputs[0].detach().to(dt), Vl, bias) * mask[..., None].to(dt))
        return fwd

    for n, m in modules.items():
        handles.append(m.register_forward_hook(hook(n, m)))
    try:
        out = model(input_ids=b["input_ids"], attention_mask=mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    logits = out.logits[:, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    target = b["labels"][:, 1:]
    keep = target != -100
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.clamp(min=0).reshape(-1),
                                           reduction="none").view(target.shape)
    terms = ce[keep]  # example 0's response tokens in order, then example 1's, ...
    n = terms.numel()
    scores = torch.zeros(n, dtype=dt, device=device)
    for k0 in range(0, n, token_chunk):
        rows = torch.arange(k0, min(k0 + token_chunk, n), device=device)
        E = torch.zeros(len(rows), n, dtype=terms.dtype, device=device)
        E[torch.arange(len(rows), device=device), rows] = 1
        grads = torch.autograd.grad(terms, outs, grad_outputs=E, is_grads_batched=True,
                                    retain_graph=k0 + token_chunk < n, allow_unused=True)
        for g, u in zip(grads, us):
            if g is not None:
                scores[rows] += torch.einsum("kbto,bto->k", g.to(dt), u)
    counts = keep.sum(1).tolist()
    return [t.double().cpu() for t in torch.split(scores, counts)]


def token_scores(model, modules: dict, encoded: list, V: dict, *, pad_id: int, attribution: str = "position",
                 batch_size: int = 8, token_chunk: int = 32, progress: bool = False, ids=None) -> list:
    """Per-token scores of every encoded example (one float64 tensor each; see the
    module docstring for the two ``attribution`` modes)."""
    if attribution not in ATTRIBUTIONS:
        raise ConfigError("token_attribution", f"unknown value {attribution!r}", f"use one of {', '.join(ATTRIBUTIONS)}")
    device = next(model.parameters()).device
    dt = compute_dtype(model)
    Vd = {n: V[n].to(device=device, dtype=dt) for n in modules}
    out = []
    with activation_grad_mode(model):
        for s in tqdm(range(0, len(encoded), batch_size), desc=f"IF-Guide token scores ({attribution})",
                      unit="batch", leave=False, disable=not progress):
            batch = encoded[s:s + batch_size]
            if attribution == "position":
                res = _position_scores(model, modules, Vd, batch, pad_id, device, dt)
            else:
                res = _loss_term_scores(model, modules, Vd, batch, pad_id, device, dt, token_chunk)
            for k, t in enumerate(res):
                check_finite(t, "IF-Guide token scores", record=None if ids is None else ids[s + k])
            out.extend(res)
            # each batch leaves its examples' small score tensors between the pages its
            # activations were freed from: untrimmed, the heap crept ~150 MiB over the
            # 1,000-record pool's batches inside a `compare` (CPU, measured 2026-11-27)
            release_host_memory(device)
    return out


# --------------------------------------------------------------------------- method

@dataclass(frozen=True)
class IFGuideOptions:
    """IF-Guide's options (:func:`ifguide_method`): ``ranking`` one of :data:`RANKINGS`,
    ``quantile`` the token-score quantile ``tau`` in (0, 1), ``threshold_tokens`` one of
    :data:`THRESHOLD_TOKENS`, ``token_attribution`` one of :data:`ATTRIBUTIONS`,
    ``token_chunk`` token-loss gradients per batched backward (``loss`` attribution)."""

    ranking: str = "sum"
    quantile: float = 0.99
    threshold_tokens: str = "response"
    token_attribution: str = "position"
    token_chunk: int = 32


@dataclass(frozen=True)
class IFGuideHarmonicOptions(IFGuideOptions):
    """:class:`IFGuideOptions` with the harmonic rule by default."""

    ranking: str = "harmonic"


@register("ifguide", options=IFGuideOptions,
          description="IF-Guide: token-level influence of mean grad l(y+) - mean grad l(y-) (summed losses), "
                      "documents ranked by their summed influence or by count and sum of top response tokens")
def ifguide_method(ctx) -> tuple[torch.Tensor, list]:
    """IF-Guide scores (see the module docstring). Needs target pairs.

    Options (``ctx.settings.method_options``):
      ranking: "sum" (default: the document sum of token scores = the summed-loss
        influence ``g_z . H^-1 g``, computed without token scores and resumable) or
        "harmonic" (IF-Guide's ``R = 2 s f / (s + f)`` over tokens above the quantile).
        "harmonic" is built for long documents: on short records few hold a token above
        the 0.99 quantile, every other record scores exactly 0 and ties (the tie count
        is recorded, ``ties``, and warned of above :data:`TIE_WARN_SHARE` of the pool);
        the ties of both rules on a dropped-carry pool are in docs/methods.md, and why
        "sum" is the default.
      quantile: the token-score quantile ``tau`` (default 0.99).
      threshold_tokens: "response" (default: ``tau``, the counts and the sums over each
        record's response tokens, :func:`response_token_scores`: IF-Guide thresholds
        the tokens its pretraining loss trains, which in SFT are the response's) or
        "all" (every non-padding position, prompt and chat template included).
      token_attribution: "position" (default, IF-Guide/kronfluence) or "loss" (each
        response token's own loss term; about one backward per response token).
      token_chunk: token-loss gradients per batched backward in "loss" mode (default 32).

    Pair rows: ``id``, ``loss_chosen`` and ``loss_rejected`` (summed response losses).
    Under "harmonic", each ``scores.jsonl`` row also holds ``token_sum``: the record's token
    scores summed (every position), the score "sum" would give it (up to rounding), so one
    run ranks both ways; the method's record holds the ties of both (``ties``,
    ``token_sum_ties``).
    """
    return _ifguide(ctx, "ifguide")


@register("ifguide_harmonic", options=IFGuideHarmonicOptions,
          description="IF-Guide with its harmonic rule: documents ranked by count and sum of their "
                      "response tokens above the 0.99 quantile (ifguide with ranking=harmonic)")
def ifguide_harmonic_method(ctx) -> tuple[torch.Tensor, list]:
    """:func:`ifguide_method` with ``ranking`` "harmonic" by default: its own name, so that
    one experiment scores, ranks and retrains both document rules side by side."""
    return _ifguide(ctx, "ifguide_harmonic")


def _ifguide(ctx, name: str) -> tuple[torch.Tensor, list]:
    opts = resolve_options(ctx, name)
    require_pairs(ctx, name)
    if opts.ranking not in RANKINGS:
        raise ConfigError("ranking", f"unknown ranking {opts.ranking!r}", f"use one of {', '.join(RANKINGS)}")
    if opts.threshold_tokens not in THRESHOLD_TOKENS:
        raise ConfigError("threshold_tokens", f"unknown value {opts.threshold_tokens!r}",
                          f"use one of {', '.join(THRESHOLD_TOKENS)}")
    if opts.token_attribution not in ATTRIBUTIONS:
        raise ConfigError("token_attribution", f"unknown value {opts.token_attribution!r}",
                          f"use one of {', '.join(ATTRIBUTIONS)}")
    q = opts.quantile
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q < 1:
        raise ConfigError("quantile", f"must be a number in (0, 1), got {q!r}", "e.g. quantile=0.99")
    tc = opts.token_chunk
    if isinstance(tc, bool) or not isinstance(tc, int) or tc < 1:
        raise ConfigError("token_chunk", f"must be a positive integer, got {tc!r}")
    lm, st = ctx.lm, ctx.settings
    t = time.perf_counter()
    g, lc, lr = contrastive_target(lm.model, ctx.modules, ctx.inputs.chosen, ctx.inputs.rejected,
                                   pad_id=ctx.pad_id, batch_size=ctx.direction_batch(), progress=st.progress)
    ctx.end_stage("target", t)
    pairs = [{"id": p.id, "loss_chosen": float(lc[i]), "loss_rejected": float(lr[i]),
              **({"task": p.task} if p.task else {})} for i, p in enumerate(ctx.inputs.pairs)]
    if opts.ranking == "sum":
        scores = ctx.score_direction(g, tag="ifguide", last=True)
        tied = ties(scores)
        record(ctx, name, opts, ties=tied, warnings=_tie_warnings(tied, "sum"))
        return scores, pairs
    # the target and the curvature are not needed once V is formed: neither is held through
    # the token scores (at 60 records this run peaked at 5158 MiB holding both, 2026-11-26),
    # and the target waits on disk while the curvature is fitted
    V = ctx.last_use(g)
    del g
    release_host_memory()
    t = time.perf_counter()
    ts = token_scores(lm.model, ctx.modules, ctx.inputs.encoded, V, pad_id=ctx.pad_id,
                      attribution=opts.token_attribution, batch_size=ctx.scoring_batch(), token_chunk=tc,
                      progress=st.progress, ids=[e.id for e in ctx.inputs.pool])
    ctx.end_stage("token_scores", t)
    ranked = ts if opts.threshold_tokens == "all" else response_token_scores(
        ts, ctx.inputs.encoded, opts.token_attribution)
    tau = ifguide_threshold(ranked, q)
    scores = ifguide_rank(ranked, q, "harmonic")
    ctx.columns["token_sum"] = ifguide_rank(ts, q, "sum")
    tied = ties(scores)
    record(ctx, name, opts, tau=tau, tokens=sum(len(x) for x in ranked),
           tokens_above_tau=int(sum(int((x > tau).sum()) for x in ranked)),
           records_above_tau=int(sum(bool((x > tau).any()) for x in ranked)), ties=tied,
           token_sum_ties=ties(ctx.columns["token_sum"]), warnings=_tie_warnings(tied, "harmonic"))
    return scores, pairs


def _tie_warnings(tied: dict, ranking: str) -> list:
    """The warning (logged, and for run.json) of a ranking that ties more than
    :data:`TIE_WARN_SHARE` of the pool."""
    if tied["share"] <= TIE_WARN_SHARE:
        return []
    text = (f"IF-Guide ({ranking}) ties {tied['tied']} records ({100 * tied['share']:.0f}% of the pool; "
            f"{tied['largest']} score exactly {tied['largest_value']!r}): their order is the pool's own, so a "
            "removal reaching into them is at random there" +
            (". Fix: --option ranking=sum (the document's summed influence)" if ranking == "harmonic" else ""))
    log.warning("%s", text)
    return [text]
