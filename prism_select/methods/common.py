"""Pieces shared by the methods: options, layer choice, response-averaged hidden states.

Layer convention (VecFilter, ProjDiff, ConceptInf, SAE-Feat): ``layer = l`` is
``hidden_states[l]`` of a Hugging Face forward with ``output_hidden_states=True``:
``0`` is the embedding output, ``l`` (1..L-1) the residual stream after decoder block
``l`` (block ``l - 1`` when blocks are counted from 0, i.e. SAELens'
``blocks.{l-1}.hook_resid_post``), and ``L`` (the last) is the *final-normed* output in
most HF models. The default is ``round(2/3 * L)``.

``h_l(x, y)`` is that hidden state averaged over the response tokens only (the
positions whose label is not -100 in :func:`~prism_select.data.tokenize.collate`:
the response tokens as inputs, end-of-turn included).
"""

from __future__ import annotations

import torch

from ..data.tokenize import collate
from ..errors import ConfigError
from .registry import options_dict, parse_options


def resolve_options(ctx, name: str):
    """Method ``name``'s options dataclass from ``ctx.settings.method_options``
    (:func:`~prism_select.methods.registry.parse_options`): an unknown key or a wrong type
    is a :class:`ConfigError` (a typo must not silently fall back to a default)."""
    return parse_options(name, ctx.settings.method_options)


def record(ctx, name: str, options, **extra):
    """What the method used, for run.json (``ctx.info['method']``); ``options`` an options
    dataclass or a dict."""
    if not isinstance(options, dict):
        options = options_dict(options)
    ctx.info["method"] = {"name": name, "options": options, **extra}


def require_pairs(ctx, name: str):
    if not ctx.inputs.pairs:
        raise ConfigError("targets", f"method {name!r} needs target pairs", "pass --targets FILE")


def num_layers(model) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config()
        except Exception:  # some configs raise when they have no text sub-config
            pass
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ConfigError("layer", "cannot tell the model's number of layers (config.num_hidden_layers)",
                          "pass the option layer=N explicitly")
    return n


def resolve_layer(model, value) -> int:
    """``value`` (None = round(2/3 * L)) checked against ``0 .. L``."""
    n = num_layers(model)
    if value is None:
        return round(2 * n / 3)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError("layer", f"must be an integer, got {value!r}", f"use 0 .. {n}")
    if not 0 <= value <= n:
        raise ConfigError("layer", f"{value} is outside 0 .. {n} (the model has {n} layers)",
                          f"use 0 .. {n}; the default is {round(2 * n / 3)}")
    return value


def compute_dtype(model) -> torch.dtype:
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def batch_hidden(model, batch: list, layer: int, pad_id: int, device, per_token: bool = False,
                 all_tokens: bool = False):
    """Hidden states of ``layer`` for a batch of encoded examples, with the autograd
    graph (call under ``torch.no_grad()`` when not needed).

    Returns the response-averaged ``(B, d)`` tensor, or with ``per_token`` the pair
    ``(h (B, T, d), response mask (B, T) bool)`` (with ``all_tokens`` the mask of every
    real token, prompt included); in float32 at least.
    """
    b = collate(batch, pad_id, device)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_hidden_states=True,
                use_cache=False)
    hs = out.hidden_states
    if hs is None or len(hs) <= layer:
        raise ConfigError("layer", f"the model returned {0 if hs is None else len(hs)} hidden states; "
                          f"layer {layer} does not exist", "choose a smaller layer")
    dt = compute_dtype(model)
    h = hs[layer].to(dt)
    mask = b["attention_mask"].bool() if all_tokens else b["labels"] != -100
    if per_token:
        return h, mask
    m = mask.to(dt)[..., None]
    return (h * m).sum(1) / m.sum(1).clamp(min=1)


def response_means(model, encoded: list, layer: int, pad_id: int, batch_size: int) -> torch.Tensor:
    """``h_l(x, y)`` for every encoded example: ``(N, d)`` float64 on the CPU."""
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for s in range(0, len(encoded), batch_size):
            out.append(batch_hidden(model, encoded[s:s + batch_size], layer, pad_id, device).double().cpu())
    return torch.cat(out)
