"""SAE-Feat (after Wang et al. 2025, persona features): the activation of one sparse
autoencoder latent on the example's response tokens.

The SAE is a user-supplied **safetensors** file (never a pickle) with tensors:

``W_enc``      ``(d_model, d_sae)`` encoder weight (``d_model`` = the model's hidden size)
``b_enc``      ``(d_sae,)`` encoder bias
``threshold``  optional ``(d_sae,)``: JumpReLU thresholds
``b_dec``      optional ``(d_model,)``: subtracted from the input before encoding

and optionally the metadata entry ``layer`` (an integer, the hidden-state index as in
:mod:`prism_select.methods.common`: ``l`` = residual stream after decoder block ``l``,
SAELens' ``blocks.{l-1}.hook_resid_post``); the option ``layer`` overrides it.

Without an SAE for the model, ``sae="pool"`` fits one on the pool's own hidden states
(:func:`fit_sae`: a ReLU SAE with an L1 penalty weighted by the decoder norms, on every
real token of the pool) and scores with it; its reconstruction quality is recorded.

Per token: ``pre = (h - b_dec) W_enc + b_enc``; ``act = ReLU(pre)``, and with a
threshold ``act = ReLU(pre) * [pre > threshold]`` (JumpReLU as in Gemma Scope).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ConfigError, InputError
from ..gradients import check_finite
from .common import batch_hidden, compute_dtype, num_layers, record, resolve_layer, resolve_options
from .registry import options_dict, register

REDUCES = ("mean", "max")
_LATENT_BLOCK = 4096  # latents per block when all of them are needed (bounds memory)


def _hidden_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config()
        except Exception:  # configs without a text sub-config
            pass
    return getattr(cfg, "hidden_size", None)


def load_sae(path, d_model: int | None = None) -> tuple[dict, dict]:
    """Read and check an SAE file; returns ``(tensors, metadata)``.

    :class:`InputError` (naming the file and key) for a missing or unreadable file,
    a missing key, or a shape that does not fit (``d_model`` = the model's hidden size).
    """
    p = Path(str(path)).expanduser()
    fix_keys = "an SAE file holds W_enc (d_model x d_sae), b_enc (d_sae) [, threshold (d_sae), b_dec (d_model)]"
    if not p.is_file():
        raise InputError("SAE file not found", path=p, field="sae", fix="pass the path of a .safetensors SAE file")
    try:
        with safe_open(str(p), framework="pt") as f:
            keys = set(f.keys())
            meta = dict(f.metadata() or {})
            missing = [k for k in ("W_enc", "b_enc") if k not in keys]
            if missing:
                raise InputError(f"missing tensor(s) {', '.join(missing)} (found: {', '.join(sorted(keys)) or 'none'})",
                                 path=p, field="sae", fix=fix_keys)
            t = {k: f.get_tensor(k) for k in ("W_enc", "b_enc", "threshold", "b_dec") if k in keys}
    except InputError:
        raise
    except Exception as e:  # safetensors raises its own error types for a bad header / non-safetensors file
        raise InputError(f"cannot read it as safetensors: {type(e).__name__}: {e}", path=p, field="sae",
                         fix="save the SAE with safetensors.torch.save_file") from e
    W = t["W_enc"]
    if W.dim() != 2:
        raise InputError(f"W_enc must be 2-D (d_model x d_sae), got shape {tuple(W.shape)}", path=p, field="W_enc",
                         fix=fix_keys)
    dm, ds = W.shape
    if d_model is not None and dm != d_model:
        fix = ("W_enc looks transposed: store it as d_model x d_sae" if ds == d_model
               else f"use an SAE trained on this model (hidden size {d_model})")
        raise InputError(f"W_enc has shape {tuple(W.shape)}; its first dimension must be the model's hidden size "
                         f"{d_model}", path=p, field="W_enc", fix=fix)
    want = {"b_enc": (ds,), "threshold": (ds,), "b_dec": (dm,)}
    for k, shape in want.items():
        if k in t and tuple(t[k].shape) != shape:
            raise InputError(f"{k} has shape {tuple(t[k].shape)}, expected {shape} (W_enc is {dm} x {ds})",
                             path=p, field=k, fix=fix_keys)
    for k, v in t.items():
        if not v.is_floating_point():
            raise InputError(f"{k} must be a floating-point tensor, got {v.dtype}", path=p, field=k)
    return t, meta


class SAE:
    """The encoder of a loaded SAE, on a device and in a compute dtype."""

    def __init__(self, tensors: dict, device, dtype):
        self.W = tensors["W_enc"].to(device=device, dtype=dtype)
        self.b = tensors["b_enc"].to(device=device, dtype=dtype)
        self.threshold = tensors["threshold"].to(device=device, dtype=dtype) if "threshold" in tensors else None
        self.b_dec = tensors["b_dec"].to(device=device, dtype=dtype) if "b_dec" in tensors else None

    @property
    def d_sae(self) -> int:
        return self.W.shape[1]

    def encode(self, h: torch.Tensor, latents=None) -> torch.Tensor:
        """Latent activations of ``h (..., d_model)``; ``latents`` (a slice or index
        tensor) restricts them to those columns."""
        if self.b_dec is not None:
            h = h - self.b_dec
        W, b, th = self.W, self.b, self.threshold
        if latents is not None:
            W, b = W[:, latents], b[latents]
            th = None if th is None else th[latents]
        pre = h @ W + b
        act = torch.relu(pre)
        if th is not None:
            act = act * (pre > th).to(act.dtype)
        return act


#: fit_sae's defaults: latents per hidden dimension, L1 weight (on inputs scaled so that
#: E||x||^2 = d_model), Adam steps, tokens per step, learning rate
SAE_EXPANSION = 4
SAE_L1 = 5.0
SAE_STEPS = 2000
SAE_BATCH_TOKENS = 4096
SAE_LR = 1e-3
#: rows whose norm exceeds this multiple of the median norm are left out of the fit: the
#: "massive activations" of a sequence's first token (SmolLM2-135M, layer 20: norm about
#: 25,000 against a median of 217, 99% of the squared norm of a pool), which would
#: otherwise set the input scale and leave the ordinary tokens under the L1 penalty
SAE_OUTLIER_NORM = 10.0


def pool_hidden_tokens(model, encoded: list, layer: int, pad_id: int, batch_size: int) -> torch.Tensor:
    """Hidden state ``layer`` at every real token (prompt and response) of ``encoded``:
    ``(tokens, d_model)`` on the model's device, in :func:`compute_dtype`."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for s in range(0, len(encoded), batch_size):
            h, mask = batch_hidden(model, encoded[s:s + batch_size], layer, pad_id, device, per_token=True,
                                   all_tokens=True)
            out.append(h[mask])
    return torch.cat(out)


def fit_sae(X: torch.Tensor, *, d_sae: int, l1: float = SAE_L1, steps: int = SAE_STEPS,
            batch_tokens: int = SAE_BATCH_TOKENS, lr: float = SAE_LR, seed: int = 0,
            outlier_norm: float | None = SAE_OUTLIER_NORM) -> tuple[dict, dict]:
    """A sparse autoencoder of the rows of ``X (tokens, d)``; returns ``(tensors, stats)``.

    Rows with a norm above ``outlier_norm`` times the median norm are left out (None: none
    are); ``stats["outliers"]`` counts them. Training (after Bricken et al. 2023 and
    Anthropic's 2024 update): the inputs scaled by
    one number ``c`` so that ``E||x||^2 = d``; ``f = ReLU((x - b_dec) W_enc + b_enc)``,
    ``x_hat = f W_dec + b_dec``; loss ``mean ||x - x_hat||^2 + l1 * mean sum_j f_j
    ||W_dec[j]||``; Adam on batches of ``batch_tokens`` rows drawn with replacement;
    ``b_dec`` starts at the mean input, ``W_dec`` at ``W_enc^T`` with rows of norm 0.1.
    The tensors are those of :class:`SAE` in the input's units (``W_enc / c``,
    ``b_dec * c``, plus ``W_dec`` scaled back), so that ``SAE(tensors).encode(h)`` gives
    the trained latents of ``h / c``. ``stats``: the scale, the final fraction of variance
    unexplained (``fvu``) and the mean number of active latents per token (``l0``), both
    on up to 16,384 rows."""
    if X.dim() != 2 or len(X) < 2:
        raise ConfigError("sae", f"fitting an SAE needs at least 2 hidden-state rows, got shape {tuple(X.shape)}",
                          "score a larger pool, or pass an SAE file")
    outliers = 0
    if outlier_norm is not None:
        norms = X.norm(dim=1)
        keep = norms <= outlier_norm * norms.median()
        outliers = int((~keep).sum())
        X = X[keep]
    n, d = X.shape
    g = torch.Generator(device="cpu").manual_seed(seed)
    c = float(X.double().pow(2).sum(1).mean().div(d).sqrt())
    x = X / c
    W_enc = torch.randn(d, d_sae, generator=g, dtype=X.dtype).to(X.device)
    W_enc *= 0.1 / W_enc.norm(dim=0, keepdim=True)
    params = {"W_enc": W_enc, "b_enc": torch.zeros(d_sae, dtype=X.dtype, device=X.device),
              "W_dec": W_enc.T.clone(), "b_dec": x.mean(0)}
    for p in params.values():
        p.requires_grad_(True)
    opt = torch.optim.Adam(params.values(), lr=lr)

    def forward(xb):
        f = torch.relu((xb - params["b_dec"]) @ params["W_enc"] + params["b_enc"])
        return f, f @ params["W_dec"] + params["b_dec"]

    for _ in range(steps):
        idx = torch.randint(n, (min(batch_tokens, n),), generator=g).to(X.device)
        xb = x[idx]
        f, xh = forward(xb)
        loss = (xb - xh).pow(2).sum(1).mean() + l1 * (f * params["W_dec"].norm(dim=1)).sum(1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        xe = x[torch.randperm(n, generator=g)[:16384].to(X.device)]
        f, xh = forward(xe)
        fvu = float((xe - xh).pow(2).sum() / (xe - xe.mean(0)).pow(2).sum())
        l0 = float((f > 0).sum(1).double().mean())
        tensors = {"W_enc": params["W_enc"] / c, "b_enc": params["b_enc"].clone(),
                   "W_dec": params["W_dec"] * c, "b_dec": params["b_dec"] * c}
    return ({k: v.detach() for k, v in tensors.items()},
            {"scale": c, "fvu": fvu, "l0": l0, "d_sae": d_sae, "tokens": n, "outliers": outliers, "steps": steps,
             "l1": l1})


def save_sae(path, tensors: dict, layer: int | None = None):
    """Write ``tensors`` (at least ``W_enc`` and ``b_enc``) as an SAE file :func:`load_sae`
    reads, with ``layer`` as metadata."""
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path),
              metadata=None if layer is None else {"layer": str(int(layer))})


def _reduce(act: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """``act (B, T, k)`` over the response positions ``mask (B, T)`` -> ``(B, k)``."""
    m = mask[..., None]
    if how == "mean":
        return (act * m.to(act.dtype)).sum(1) / m.sum(1).clamp(min=1).to(act.dtype)
    return act.masked_fill(~m, float("-inf")).amax(1)


def latent_stats(model, sae: SAE, encoded: list, layer: int, pad_id: int, batch_size: int, how: str,
                 latents=None) -> torch.Tensor:
    """Per-example reduced activations ``(N, k)`` (float64, CPU) of ``latents`` (None = all)."""
    device = next(model.parameters()).device
    out = []
    blocks = ([slice(s, min(s + _LATENT_BLOCK, sae.d_sae)) for s in range(0, sae.d_sae, _LATENT_BLOCK)]
              if latents is None else [latents])
    with torch.no_grad():
        for s in range(0, len(encoded), batch_size):
            h, mask = batch_hidden(model, encoded[s:s + batch_size], layer, pad_id, device, per_token=True)
            out.append(torch.cat([_reduce(sae.encode(h, blk), mask, how) for blk in blocks], dim=1).double().cpu())
    return torch.cat(out)


@dataclass(frozen=True)
class SAEFeatOptions:
    """SAE-Feat's options (:func:`saefeat_method`): ``sae`` the SAE file or "pool" (required),
    ``layer`` the hidden-state index, ``latent`` the latent scored, ``reduce`` one of
    :data:`REDUCES`; with ``sae="pool"``: ``sae_width`` latents, ``sae_l1``, ``sae_steps``."""

    sae: str | Path | None = None
    layer: int | None = None
    latent: int | None = None
    reduce: str = "mean"
    sae_width: int | None = None
    sae_l1: float = SAE_L1
    sae_steps: int = SAE_STEPS


@register("saefeat", options=SAEFeatOptions, needs_pairs=False,
          description="SAE-Feat: one SAE latent's activation on the response tokens (by default the latent "
                      "separating chosen from rejected most)")
def saefeat_method(ctx) -> tuple[torch.Tensor, list]:
    """SAE-Feat scores. Needs target pairs unless ``latent`` is given.

    Options:
      sae: path of the SAE safetensors file (keys in the module docstring), or "pool":
        fit one on the pool's hidden states (:func:`fit_sae`; ``sae_width`` latents,
        default 4 x the hidden size; ``sae_l1``; ``sae_steps``). Required.
      layer: hidden-state index the SAE reads (default: the file's ``layer`` metadata,
        one of the two being required; with ``sae="pool"`` the default layer, 2/3 depth).
      latent: the latent to score (default: chosen from the target pairs, below).
      reduce: "mean" (default) or "max" over the example's response tokens.

    Latent choice: ``k = argmax_j mean_q a_j(q, y+) - mean_q a_j(q, y-)`` with
    ``a_j(x, y)`` the example's reduced activation of latent ``j`` (the same
    ``reduce`` as the scores, so with the default it is the mean over response tokens):
    the latent whose score separates ``y+`` from ``y-`` most; ties -> lowest index.
    Pair rows: ``id``, ``act_chosen``, ``act_rejected`` (latent ``k``).
    """
    opts = resolve_options(ctx, "saefeat")
    if opts.sae is None:
        raise ConfigError("sae", "method 'saefeat' needs an SAE file", "pass --option sae=PATH.safetensors")
    if opts.reduce not in REDUCES:
        raise ConfigError("reduce", f"unknown value {opts.reduce!r}", f"use one of {', '.join(REDUCES)}")
    model = ctx.lm.model
    fitted = opts.sae == "pool"
    extra = {}
    if fitted:
        tensors, meta = _fit_on_pool(ctx, model, opts)
        extra["sae_fit"] = meta
    else:
        tensors, meta = load_sae(opts.sae, _hidden_size(model))
    layer = opts.layer
    layer_from = "option"
    if fitted:
        layer, layer_from = meta["layer"], "fit on the pool"
    elif layer is None:
        if "layer" not in meta:
            raise ConfigError("layer", f"the SAE file {opts.sae} has no 'layer' metadata",
                              f"pass --option layer=N (0 .. {num_layers(model)})")
        try:
            layer = int(meta["layer"])
        except ValueError:
            raise InputError(f"metadata 'layer' is {meta['layer']!r}, not an integer", path=opts.sae,
                             field="layer", fix="pass --option layer=N") from None
        layer_from = "metadata"
    layer = resolve_layer(model, layer)
    sae = SAE(tensors, next(model.parameters()).device, compute_dtype(model))
    st, how = ctx.settings, opts.reduce
    latent, pairs, col = opts.latent, [], 0
    if latent is not None and (isinstance(latent, bool) or not isinstance(latent, int)
                               or not 0 <= latent < sae.d_sae):
        raise ConfigError("latent", f"must be an integer in 0 .. {sae.d_sae - 1}, got {latent!r}")
    t = time.perf_counter()
    if latent is None:
        if not ctx.inputs.pairs:
            raise ConfigError("targets", "method 'saefeat' needs target pairs to choose the latent",
                              "pass --targets FILE, or --option latent=K")
        ac = latent_stats(model, sae, ctx.inputs.chosen, layer, ctx.pad_id, st.batch_size, how)
        ar = latent_stats(model, sae, ctx.inputs.rejected, layer, ctx.pad_id, st.batch_size, how)
        diff = ac.mean(0) - ar.mean(0)
        latent = col = int(torch.argmax(diff))
        top = torch.topk(diff, min(5, len(diff)))
        extra["latent_choice"] = {"from": "target pairs", "difference": float(diff[latent]),
                                  "top": [[int(i), float(d)] for d, i in zip(top.values, top.indices)]}
        ctx.timings["latent_choice_s"] = time.perf_counter() - t
    else:
        extra["latent_choice"] = {"from": "option"}
        if ctx.inputs.pairs:
            ac = latent_stats(model, sae, ctx.inputs.chosen, layer, ctx.pad_id, st.batch_size, how, [latent])
            ar = latent_stats(model, sae, ctx.inputs.rejected, layer, ctx.pad_id, st.batch_size, how, [latent])
    if ctx.inputs.pairs:
        ck, rk = ac[:, col], ar[:, col]
        pairs = [{"id": p.id, "act_chosen": float(ck[i]), "act_rejected": float(rk[i]),
                  **({"task": p.task} if p.task else {})} for i, p in enumerate(ctx.inputs.pairs)]
    t = time.perf_counter()
    scores = latent_stats(model, sae, ctx.inputs.encoded, layer, ctx.pad_id, st.batch_size, how, [latent])[:, 0]
    ctx.timings["sae_scores_s"] = time.perf_counter() - t
    check_finite(scores, "SAE-Feat scores")
    sae_used = "pool" if fitted else str(Path(opts.sae).expanduser().resolve())
    record(ctx, "saefeat", {**options_dict(opts), "sae": sae_used, "layer": layer, "latent": latent},
           layer_from=layer_from, d_sae=sae.d_sae, jumprelu=sae.threshold is not None, **extra)
    return scores, pairs


def _fit_on_pool(ctx, model, opts) -> tuple[dict, dict]:
    """``sae="pool"``: an SAE fitted on every real token of the pool at the option's
    layer (default 2/3 depth); returns its tensors and the fit's record (the layer and
    :func:`fit_sae`'s statistics)."""
    layer = resolve_layer(model, opts.layer)
    d = _hidden_size(model)
    width = opts.sae_width if opts.sae_width is not None else SAE_EXPANSION * d
    for key, v, ok in (("sae_width", width, isinstance(width, int) and not isinstance(width, bool) and width > 0),
                       ("sae_steps", opts.sae_steps, isinstance(opts.sae_steps, int) and opts.sae_steps > 0),
                       ("sae_l1", opts.sae_l1, isinstance(opts.sae_l1, (int, float)) and opts.sae_l1 >= 0)):
        if not ok:
            raise ConfigError(key, f"must be a positive number, got {v!r}")
    t = time.perf_counter()
    X = pool_hidden_tokens(model, ctx.inputs.encoded, layer, ctx.pad_id, ctx.settings.batch_size)
    tensors, stats = fit_sae(X, d_sae=width, l1=float(opts.sae_l1), steps=opts.sae_steps,
                             seed=ctx.settings.seed or 0)
    ctx.timings["sae_fit_s"] = time.perf_counter() - t
    return tensors, {"layer": layer, **stats}
