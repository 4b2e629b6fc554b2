"""The precision policies that run the engine's split-precision linear layer: ``split32``
(float32 activations everywhere, every ``nn.Linear`` as
:class:`~prism_select.engine.linear.SplitPrecisionLinear`) and what ``--precision`` means for
each stage (:func:`precision_policy` for the scores, :func:`direction_policy`,
:func:`fit_policy`). ``residual32`` and the float32 weights and gradients are
:mod:`prism_select.runtime.precision`'s (its docstring says what each policy measures).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.execution import DEFAULT_KERNELS, ExecutionContext, Kernels, direction_kernels
from ..runtime.precision import HALF, float32_grads, residual_fp32, upcast_embeddings
from .arith import forget_split
from .linear import SplitPrecisionLinear


def precision_policy(model, execution: ExecutionContext):
    """The context manager that applies ``execution.precision`` (one of :data:`PRECISIONS`,
    checked where the context was made) to ``model`` (``execution.kernels``: those of
    split32's products)."""
    if execution.precision == "split32":
        return split32(model, kernels=execution.kernels)
    return residual_fp32(model, execution.precision == "residual32")


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


def fit_policy(model, execution: ExecutionContext):
    """What ``execution.precision`` means for the curvature fit: under ``split32`` the fit's
    forwards and backwards run as the scores' do (:func:`split32`: float32 activations
    and cotangents, split GEMMs), and its statistics are formed from them rounded to the
    weights' dtype, on tensor cores (:class:`~prism_select.engine.linear.FitTapLinear`). Fitting on float32 weights
    instead cost 5.5x the bf16 fit at 0.3B (docs/performance.md)."""
    return split32(model, execution.precision == "split32", execution.kernels)


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
    hooks = [upcast_embeddings(model),
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
