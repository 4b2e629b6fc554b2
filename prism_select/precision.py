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
* ``split32`` (:func:`split32`): float32 activations everywhere (attention and loss
  included); every ``nn.Linear`` runs as :func:`~prism_select.engine.arith.split_linear`, two half-precision GEMMs
  on the float32 input split into ``hi + lo`` against the weights, which are exact in
  their own dtype, with float32 results: float32-accurate forwards on tensor cores. The
  target direction and the curvature fit run in the same arithmetic: the direction with
  split cotangents and float32 weight gradients (:func:`direction_policy`), the fit with
  its statistics formed on tensor cores (:func:`fit_policy`).

The arithmetic (split products, GEMMs with float32 results) and the split-precision
linear layer are the engine's (:mod:`prism_select.engine.arith`,
:class:`prism_select.engine.linear.SplitPrecisionLinear`); this module holds the policies
that put a model into one precision or another.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .engine.arith import forget_split
from .engine.linear import SplitPrecisionLinear
from .errors import ConfigError
from .execution import DEFAULT_KERNELS, ExecutionContext, Kernels, direction_kernels
from .gradients import GRAD32
from .settings import PRECISIONS, check_precision  # noqa: F401 (re-exported)

HALF = (torch.bfloat16, torch.float16)


def precision_policy(model, execution: ExecutionContext):
    """The context manager that applies ``execution.precision`` (one of :data:`PRECISIONS`,
    checked where the context was made) to ``model`` (``execution.kernels``: those of
    split32's products)."""
    if execution.precision == "split32":
        return split32(model, kernels=execution.kernels)
    return residual_fp32(model, execution.precision == "residual32")


def _upcast_embeddings(model):
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
    hooks = [_upcast_embeddings(model)]
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
    (:func:`direction_policy`, :func:`fit_policy`): float32 GEMMs have no tensor cores, and
    the float32 copy does not fit beside a 1.1B model's fit (docs/performance.md)."""
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
def direction_policy(model, execution: ExecutionContext):
    """What ``execution.precision`` means for the target direction: under ``split32`` the direction's
    forwards run as the scores' do (:func:`split32`), its backwards with the cotangent
    split too (``kernels`` with ``split_backward``: a few target pairs, the split cotangent
    costs little here), and the weight gradients of the half-precision linear
    layers are formed from split products and accumulated in float32
    (:func:`float32_grads`): a float32-accurate ``g_KL`` (1.5e-5 from a float32 copy's,
    tests/test_precision.py) without a float32 copy of the weights. Elsewhere the model
    as loaded."""
    on = execution.precision == "split32"
    with split32(model, on, direction_kernels(execution.kernels)), float32_grads(model, on):
        yield model


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


def fit_policy(model, execution: ExecutionContext):
    """What ``execution.precision`` means for the curvature fit: under ``split32`` the fit's
    forwards and backwards run as the scores' do (:func:`split32`: float32 activations
    and cotangents, split GEMMs), and its statistics are formed from them rounded to the
    weights' dtype, on tensor cores (:class:`~prism_select.engine.linear.FitTapLinear`). Fitting on float32 weights
    instead cost 5.5x the bf16 fit at 0.3B (docs/performance.md)."""
    return split32(model, execution.precision == "split32", execution.kernels)


def fit_arithmetic(model, execution: ExecutionContext) -> str:
    """The arithmetic a fit under ``execution.precision`` uses, for the curvature cache key:
    the weights' dtype, and ``+split32`` where that policy is active."""
    dtype = next(model.parameters()).dtype
    return str(dtype) + ("+split32" if execution.precision == "split32" and dtype in HALF else "")


# ----------------------------------------------------------------------------- split32


def _float32_sdpa(original):
    """transformers' SDPA attention for float32 activations of a grouped-query model: the
    key/value heads repeated, so that PyTorch can pick its fused memory-efficient float32
    kernel. With ``enable_gqa``, which transformers passes when there is no mask, only
    the unfused math kernel takes float32 (docs/performance.md).
    Anything else goes to ``original``."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  **kwargs):
        groups = getattr(module, "num_key_value_groups", 1)
        plain = (query.dtype == torch.float32 and attention_mask is None and groups > 1
                 and query.shape[2] == key.shape[2] and kwargs.get("position_bias") is None
                 and kwargs.get("softcap") is None)
        if not plain:
            return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                            is_causal=is_causal, **kwargs)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        causal = query.shape[2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=causal)
        return out.transpose(1, 2).contiguous(), None

    return attention


@contextmanager
def _float32_attention(model):
    """Within the block, a grouped-query SDPA model runs attention through
    :func:`_float32_sdpa`. A no-op for other attention implementations."""
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # pragma: no cover - transformers without the attention registry
        yield
        return
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa" or "sdpa" not in ALL_ATTENTION_FUNCTIONS:
        yield
        return
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had, before = "sdpa" in local, local.get("sdpa")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = _float32_sdpa(ALL_ATTENTION_FUNCTIONS["sdpa"])
    try:
        yield
    finally:
        if had:
            local["sdpa"] = before
        else:
            local.pop("sdpa", None)


@contextmanager
def split32(model, enabled: bool = True, kernels: Kernels = DEFAULT_KERNELS):
    """Within the block, ``model`` (half precision) computes with float32 activations
    everywhere (residual stream, norms, attention, loss) while every ``nn.Linear`` runs
    as :class:`~prism_select.engine.linear.SplitPrecisionLinear` with ``kernels``: float32-accurate scores at tensor-core speed for the
    matmuls. A no-op for float32/float64 models or with ``enabled=False``. Layers whose
    ``forward`` is replaced later (the exact scorer's tracked layers) handle float32
    inputs themselves."""
    if not enabled or next(model.parameters()).dtype not in HALF:
        yield model
        return
    hooks = [_upcast_embeddings(model),
             model.register_forward_pre_hook(forget_split), model.register_forward_hook(forget_split)]
    patched, doubled = [], []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if "forward" not in m.__dict__:
                m.forward = (lambda x, m=m: SplitPrecisionLinear.apply(x, m.weight, m.bias, kernels))
                patched.append(m)
            if kernels.split_gemm == "kcat" and m.weight.is_cuda and not hasattr(m.weight, "_split_w2"):
                m.weight._split_w2 = torch.cat([m.weight.detach(), m.weight.detach()], 1)
                doubled.append(m.weight)
    try:
        with _float32_attention(model):
            yield model
    finally:
        forget_split()
        for h in hooks:
            h.remove()
        for m in patched:
            m.__dict__.pop("forward", None)
        for W in doubled:
            del W._split_w2
