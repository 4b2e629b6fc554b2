"""Precision policy for half-precision models: the residual stream in float32.

A bf16 model adds every layer's output into a bf16 residual stream, which keeps 8 bits
of each hidden value; a layer's update, often a few hundredths of the stream's size,
loses most of its own bits in that sum. PRISM's scores are directional derivatives along
a preconditioned ``v`` of large curvature, and they are sensitive to exactly that
rounding: on the embedded SmolLM2-135M with PRISM's ``v`` (128 GSM8K records, CPU), bf16
exact scores correlate with float32 exact scores at Spearman 0.971, and emulating bf16
everywhere *except* the residual stream gives 0.994 (docs/performance.md, session 3).

:func:`residual_fp32` keeps the weights and every matmul in the model's dtype (tensor
cores, no extra weight memory) but carries the residual stream in float32: the token
embeddings are upcast, every ``nn.Linear`` receives its input cast to its weight's
dtype, and the rotary tables stay in the model's dtype so attention runs in half
precision as before. Residual additions and norms then run in float32; gradients flow
back through the same casts. Used by ``ScoreSettings.residual_dtype`` ("float32").
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .errors import ConfigError

RESIDUAL_DTYPES = ("model", "float32")
HALF = (torch.bfloat16, torch.float16)


def check_residual_dtype(value: str) -> None:
    if value not in RESIDUAL_DTYPES:
        raise ConfigError("residual_dtype", f"unknown value {value!r}",
                          f"use one of {', '.join(RESIDUAL_DTYPES)}")


def _to_weight_dtype(module, args):
    x = args[0]
    if torch.is_tensor(x) and x.dtype != module.weight.dtype and x.is_floating_point():
        return (x.to(module.weight.dtype),) + tuple(args[1:])
    return None


@contextmanager
def residual_fp32(model, enabled: bool = True):
    """Within the block, ``model`` (a half-precision transformers causal LM) computes
    with a float32 residual stream (see the module docstring). A no-op for float32 and
    float64 models or with ``enabled=False``."""
    dtype = next(model.parameters()).dtype
    if not enabled or dtype not in HALF:
        yield model
        return
    embed = model.get_input_embeddings()
    if embed is None:
        raise ConfigError("residual_dtype", f"{type(model).__name__} has no input embeddings to upcast",
                          "use --residual-dtype model")
    hooks = [embed.register_forward_hook(lambda m, i, out: out.float())]
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            hooks.append(m.register_forward_pre_hook(_to_weight_dtype))
        elif name.split(".")[-1] == "rotary_emb":  # cos/sin in the model dtype: attention stays half
            hooks.append(m.register_forward_hook(
                lambda m, i, out: tuple(t.to(dtype) if torch.is_tensor(t) and t.is_floating_point() else t
                                        for t in out)))
    try:
        yield model
    finally:
        for h in hooks:
            h.remove()
