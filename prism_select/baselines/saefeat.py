"""SAE-Feat (after Wang et al. 2025, persona features): the activation of one sparse
autoencoder latent on the example's response tokens.

The SAE is a user-supplied **safetensors** file (never a pickle) with tensors:

``W_enc``      ``(d_model, d_sae)`` encoder weight (``d_model`` = the model's hidden size)
``b_enc``      ``(d_sae,)`` encoder bias
``threshold``  optional ``(d_sae,)``: JumpReLU thresholds
``b_dec``      optional ``(d_model,)``: subtracted from the input before encoding

and optionally the metadata entry ``layer`` (an integer, the hidden-state index as in
:mod:`prism_select.baselines.common`: ``l`` = residual stream after decoder block ``l``,
SAELens' ``blocks.{l-1}.hook_resid_post``); the option ``layer`` overrides it.

Per token: ``pre = (h - b_dec) W_enc + b_enc``; ``act = ReLU(pre)``, and with a
threshold ``act = ReLU(pre) * [pre > threshold]`` (JumpReLU as in Gemma Scope).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import ConfigError, InputError
from ..gradients import check_finite
from .common import batch_hidden, compute_dtype, method, num_layers, record, resolve_layer, resolve_options

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
    from safetensors import safe_open

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


@method("saefeat", "SAE-Feat: one SAE latent's activation on the response tokens (by default the latent "
        "separating chosen from rejected most)", {"sae": None, "layer": None, "latent": None, "reduce": "mean"})
def saefeat_method(ctx) -> tuple[torch.Tensor, list]:
    """SAE-Feat scores. Needs target pairs unless ``latent`` is given.

    Options:
      sae: path of the SAE safetensors file (required; keys in the module docstring).
      layer: hidden-state index the SAE reads (default: the file's ``layer`` metadata;
        one of the two is required).
      latent: the latent to score (default: chosen from the target pairs, below).
      reduce: "mean" (default) or "max" over the example's response tokens.

    Latent choice: ``k = argmax_j mean_q a_j(q, y+) - mean_q a_j(q, y-)`` with
    ``a_j(x, y)`` the example's reduced activation of latent ``j`` (the same
    ``reduce`` as the scores, so with the default it is the mean over response tokens):
    the latent whose score separates ``y+`` from ``y-`` most; ties -> lowest index.
    Pair rows: ``id``, ``act_chosen``, ``act_rejected`` (latent ``k``).
    """
    opts = resolve_options(ctx, saefeat_method)
    if opts["sae"] is None:
        raise ConfigError("sae", "method 'saefeat' needs an SAE file", "pass --option sae=PATH.safetensors")
    if opts["reduce"] not in REDUCES:
        raise ConfigError("reduce", f"unknown value {opts['reduce']!r}", f"use one of {', '.join(REDUCES)}")
    model = ctx.lm.model
    tensors, meta = load_sae(opts["sae"], _hidden_size(model))
    layer = opts["layer"]
    layer_from = "option"
    if layer is None:
        if "layer" not in meta:
            raise ConfigError("layer", f"the SAE file {opts['sae']} has no 'layer' metadata",
                              f"pass --option layer=N (0 .. {num_layers(model)})")
        try:
            layer = int(meta["layer"])
        except ValueError:
            raise InputError(f"metadata 'layer' is {meta['layer']!r}, not an integer", path=opts["sae"],
                             field="layer", fix="pass --option layer=N") from None
        layer_from = "metadata"
    layer = resolve_layer(model, layer)
    sae = SAE(tensors, next(model.parameters()).device, compute_dtype(model))
    st, how = ctx.settings, opts["reduce"]
    latent, pairs, extra, col = opts["latent"], [], {}, 0
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
    record(ctx, "saefeat", {**opts, "sae": str(Path(opts["sae"]).expanduser().resolve()), "layer": layer,
                            "latent": latent}, layer_from=layer_from, d_sae=sae.d_sae,
           jumprelu=sae.threshold is not None, **extra)
    return scores, pairs
