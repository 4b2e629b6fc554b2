"""The linear layers PRISM tracks: every ``nn.Linear`` of the decoder blocks (a PEFT
model's LoRA matrices), or those matching ``--modules`` patterns.
"""

from __future__ import annotations

import re
from collections import OrderedDict

import torch

from ..errors import ConfigError


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "active_adapter")


def _block_prefixes(model) -> list:
    """Names of the ModuleList(s) of decoder blocks (length = num_hidden_layers)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        try:
            cfg = cfg.get_text_config()
        except Exception:
            pass
    n = getattr(cfg, "num_hidden_layers", None)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and name and (n is None or len(m) == n):
            out.append(name + ".")
    return out


_BLOCK_RE = re.compile(r"(^|\.)(layers|h|blocks|block)\.\d+\.")


def _candidates(model) -> tuple[OrderedDict, str]:
    if _is_peft(model):
        active = model.active_adapter
        active = active if isinstance(active, str) else (list(active)[0] if active else "default")
        rx = re.compile(r"\.lora_[AB]\." + re.escape(active) + r"$")
        # PEFT's LoRA on raw parameters (target_parameters: ParamWrapper, e.g. on fused
        # experts) forms a weight delta from its lora_A/lora_B; they never see the tokens
        wrappers = tuple(n + "." for n, m in model.named_modules() if type(m).__name__ == "ParamWrapper")
        found = OrderedDict((n, m) for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and rx.search(n)
                            and not (wrappers and n.startswith(wrappers)))
        return found, f"the LoRA modules of adapter {active!r}"
    prefixes = _block_prefixes(model)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    if prefixes:
        found = OrderedDict((n, m) for n, m in linears if any(n.startswith(p) for p in prefixes))
    else:
        found = OrderedDict()
    if not found:
        found = OrderedDict((n, m) for n, m in linears if _BLOCK_RE.search(n))
    return found, "the nn.Linear modules of the decoder blocks"


def tracked_linear_modules(model: torch.nn.Module, patterns: list | None = None) -> "OrderedDict[str, torch.nn.Linear]":
    """The linear modules whose weights PRISM tracks, in module order.

    Default: every ``nn.Linear`` inside the decoder blocks (not ``lm_head``, not the
    embeddings; a model loaded by :func:`load_model` has its fused experts and ``Conv1D``
    modules rewritten as ``nn.Linear`` ones first, :func:`prism_select.model.moe.linearize_model`); with a PEFT model, the active adapter's ``lora_A``/``lora_B`` Linear
    modules (``...lora_A.default``). ``patterns``: regexes, a module is kept if any
    matches its name (``re.search``); they select among all ``nn.Linear`` modules of a
    plain model (so ``lm_head`` can be asked for) and among the LoRA modules of a PEFT
    model. No match -> :class:`ConfigError`.
    """
    default, what = _candidates(model)
    if patterns is None:
        if not default:
            raise ConfigError("tracked_modules", f"the model has no {what}",
                              "pass patterns (regexes over module names) that select nn.Linear modules")
        return default
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, (list, tuple)) or not patterns or not all(isinstance(p, str) for p in patterns):
        raise ConfigError("tracked_modules", f"must be a non-empty list of regexes, got {patterns!r}",
                          "e.g. ['mlp\\.down_proj', 'self_attn\\.o_proj'], or leave it out for the default")
    compiled = []
    for p in patterns:
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ConfigError("tracked_modules", f"{p!r} is not a valid regular expression: {e}") from e
    if _is_peft(model):
        pool = default
    else:
        pool = OrderedDict((n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    chosen = OrderedDict((n, m) for n, m in pool.items() if any(c.search(n) for c in compiled))
    if not chosen:
        names = list(pool)
        sample = names[:6] + (["..."] + names[-2:] if len(names) > 8 else names[6:])
        raise ConfigError("tracked_modules", f"no module matches {patterns!r}; available names include: "
                          f"{', '.join(sample) or '(none)'}",
                          "use regexes that match these names (re.search), e.g. 'mlp' or 'q_proj'")
    return chosen
