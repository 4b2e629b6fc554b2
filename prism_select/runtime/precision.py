"""Precision policies for half-precision models, and float32-accurate GEMMs from
half-precision ones.

A bf16 model rounds every activation to 8 significant bits. PRISM's scores are
directional derivatives along a preconditioned ``v`` of large curvature, and they are
sensitive to where the model is linearised: on the embedded SmolLM2-135M with PRISM's
``v`` the bf16 exact scores correlate with the float32 exact scores of the same weights
at Spearman 0.992 only (top-5% overlap 0.90; docs/performance.md). Which
roundings matter was measured one site at a time: the residual stream most, then the
inputs of the linear layers and the attention products; the precision of the cotangent
(or tangent) much less.

Policies (``ScoreSettings.precision``; a no-op on float32/float64 models):

* ``model``: everything in the model's dtype (the default).
* ``residual32`` (:func:`residual_fp32`): the residual stream, token embeddings and norms
  in float32; every matmul and the attention in the model's dtype, on tensor cores.
* ``split32`` (:func:`prism_select.engine.policy.split32`): float32 activations everywhere (attention and loss
  included); every ``nn.Linear`` runs as :func:`~prism_select.engine.arith.split_linear`, two half-precision GEMMs
  on the float32 input split into ``hi + lo`` against the weights, which are exact in
  their own dtype, with float32 results: float32-accurate forwards on tensor cores. The
  target direction and the curvature fit run in the same arithmetic: the direction with
  split cotangents and float32 weight gradients
  (:func:`~prism_select.engine.policy.direction_policy`), the fit with its statistics
  formed on tensor cores (:func:`~prism_select.engine.policy.fit_policy`).

This module holds what needs no engine: ``residual32``, the float32 weights and gradient
accumulators, the fit's arithmetic as the curvature cache key names it. ``split32`` and
the policies of the stages (:func:`~prism_select.engine.policy.precision_policy`,
:func:`~prism_select.engine.policy.direction_policy`,
:func:`~prism_select.engine.policy.fit_policy`) run the engine's split-precision linear
layer and live beside it (:mod:`prism_select.engine.policy`); the arithmetic is
:mod:`prism_select.engine.arith`.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..errors import ConfigError
from ..settings import PRECISIONS, check_precision  # noqa: F401 (re-exported)
from .execution import ExecutionContext
from .layers import GRAD32

HALF = (torch.bfloat16, torch.float16)


def upcast_embeddings(model):
    """A hook handle: the token embeddings come out in float32, starting a float32 residual stream."""
    embed = model.get_input_embeddings()
    if embed is None:
        raise ConfigError("precision", f"{type(model).__name__} has no input embeddings to upcast",
                          "use --precision model")
    return embed.register_forward_hook(lambda m, i, out: out.float())


def _to_weight_dtype(module, args):
    x = args[0]
    if torch.is_tensor(x) and x.dtype != module.weight.dtype and x.is_floating_point():
        return (x.to(module.weight.dtype),) + tuple(args[1:])
    return None


@contextmanager
def residual_fp32(model, enabled: bool = True):
    """Within the block, ``model`` (a half-precision transformers causal LM) computes
    with a float32 residual stream: the token embeddings are upcast, every ``nn.Linear``
    receives its input cast to its weight's dtype, and the rotary tables stay in the
    model's dtype so attention runs in half precision as before. Residual additions and
    norms then run in float32; gradients flow back through the same casts. A no-op for
    float32 and float64 models or with ``enabled=False``."""
    dtype = next(model.parameters()).dtype
    if not enabled or dtype not in HALF:
        yield model
        return
    hooks = [upcast_embeddings(model)]
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


@contextmanager
def float32_weights(model, enabled: bool = True):
    """Within the block, the half-precision parameters of ``model`` are float32 (the same
    values: bf16/fp16 -> float32 -> back is exact), so everything computed from them runs
    in float32; afterwards each is its original dtype again, bit for bit. Buffers (e.g.
    rotary tables) are left alone. Peak memory: the weights in float32 (twice their bf16
    size) while the block runs. A reference for ``split32``'s direction and fit (the
    benchmarks' ``*_f32w`` routes), which run in split arithmetic instead
    (:func:`~prism_select.engine.policy.direction_policy`,
    :func:`~prism_select.engine.policy.fit_policy`): float32 GEMMs have no tensor cores,
    and the float32 copy does not fit beside a 1.1B model's fit (docs/performance.md)."""
    params = [p for p in model.parameters() if p.dtype in HALF] if enabled else []
    dtypes = [p.dtype for p in params]
    for p in params:
        p.data = p.data.float()
    try:
        yield model
    finally:
        for p, dt in zip(params, dtypes):
            p.data = p.data.to(dt)


@contextmanager
def float32_grads(model, enabled: bool = True):
    """Within the block, the weight (and bias) gradients of ``model``'s half-precision
    ``nn.Linear`` layers running as :class:`~prism_select.engine.linear.SplitPrecisionLinear` are accumulated in float32, in an
    attribute ``GRAD32`` of each parameter, instead of its half-precision ``.grad``
    (:func:`prism_select.gradients.weight_grad` reads it). Removed on exit."""
    params = [p for m in model.modules() if isinstance(m, nn.Linear)
              for p in (m.weight, m.bias) if p is not None and p.dtype in HALF] if enabled else []
    for p in params:
        setattr(p, GRAD32, None)
    try:
        yield model
    finally:
        for p in params:
            delattr(p, GRAD32)


def fit_arithmetic(model, execution: ExecutionContext) -> str:
    """The arithmetic a fit under ``execution.precision`` uses, for the curvature cache key:
    the weights' dtype, and ``+split32`` where that policy is active."""
    dtype = next(model.parameters()).dtype
    return str(dtype) + ("+split32" if execution.precision == "split32" and dtype in HALF else "")
