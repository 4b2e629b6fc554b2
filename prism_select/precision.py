"""Precision policies for half-precision models, and float32-accurate GEMMs from
half-precision ones.

A bf16 model rounds every activation to 8 significant bits. PRISM's scores are
directional derivatives along a preconditioned ``v`` of large curvature, and they are
sensitive to where the model is linearised: on the embedded SmolLM2-135M with PRISM's
``v`` the bf16 exact scores correlate with the float32 exact scores of the same weights
at Spearman 0.992 only (top-5% overlap 0.90; docs/performance.md, run 10). Which
roundings matter was measured one site at a time: the residual stream most, then the
inputs of the linear layers and the attention products; the precision of the cotangent
(or tangent) much less.

Policies (``ScoreSettings.precision``; a no-op on float32/float64 models):

* ``model``: everything in the model's dtype (the default).
* ``residual32`` (:func:`residual_fp32`): the residual stream, token embeddings and norms
  in float32; every matmul and the attention in the model's dtype, on tensor cores.
* ``split32`` (:func:`split32`): float32 activations everywhere (attention and loss
  included); every ``nn.Linear`` runs as :func:`split_linear`, two half-precision GEMMs
  on the float32 input split into ``hi + lo`` against the weights, which are exact in
  their own dtype, with float32 results: float32-accurate forwards on tensor cores. The
  target direction and the curvature fit run in the same arithmetic: the direction with
  split cotangents and float32 weight gradients (:func:`direction_policy`), the fit with
  its statistics formed on tensor cores (:func:`fit_policy`).

The half-precision GEMMs with float32 accumulation and result (:func:`mm_acc`,
:func:`mm_acc_into`) are shared with the curvature fit.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError
from .execution import DEFAULT_KERNELS, Kernels

PRECISIONS = ("model", "residual32", "split32")
HALF = (torch.bfloat16, torch.float16)


def check_precision(value: str) -> None:
    if value not in PRECISIONS:
        raise ConfigError("precision", f"unknown value {value!r}", f"use one of {', '.join(PRECISIONS)}")


def check_precision_scoring(precision: str, scoring: str) -> None:
    """split32 is built into the exact route's layers; the finite-difference routes
    perturb half-precision weights of their own (``fd32`` is float32 already)."""
    if precision == "split32" and scoring != "exact":
        raise ConfigError("precision", f"split32 applies to exact scoring, not {scoring!r}",
                          "use --scoring exact with --precision split32, or --scoring fd32 alone")


def precision_policy(model, precision: str, kernels: Kernels = DEFAULT_KERNELS):
    """The context manager that applies ``precision`` (one of :data:`PRECISIONS`) to ``model``
    (``kernels``: those of split32's products)."""
    check_precision(precision)
    if precision == "split32":
        return split32(model, kernels=kernels)
    return residual_fp32(model, precision == "residual32")


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
    the float32 copy does not fit beside a 1.1B model's fit (docs/performance.md, run 12)."""
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
def direction_policy(model, precision: str, kernels: Kernels = DEFAULT_KERNELS):
    """What ``precision`` means for the target direction: under ``split32`` the direction's
    forwards run as the scores' do (:func:`split32`), its backwards with the cotangent
    split too (``kernels`` with ``split_backward``: a few target pairs, the split cotangent
    costs little here), and the weight gradients of the half-precision linear
    layers are formed from split products and accumulated in float32
    (:func:`float32_grads`): a float32-accurate ``g_KL`` (1.5e-5 from a float32 copy's,
    tests/test_precision.py) without a float32 copy of the weights. Elsewhere the model
    as loaded."""
    check_precision(precision)
    on = precision == "split32"
    with split32(model, on, replace(kernels, split_backward=True)), float32_grads(model, on):
        yield model


#: the float32 gradient accumulator of a half-precision weight under float32_grads
GRAD32 = "_prism_grad32"


@contextmanager
def float32_grads(model, enabled: bool = True):
    """Within the block, the weight (and bias) gradients of ``model``'s half-precision
    ``nn.Linear`` layers running as :func:`split_linear` are accumulated in float32, in an
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


def _accumulate32(p: torch.Tensor, g: torch.Tensor) -> None:
    acc = getattr(p, GRAD32)
    setattr(p, GRAD32, g if acc is None else acc.add_(g))


def fit_policy(model, precision: str, kernels: Kernels = DEFAULT_KERNELS):
    """What ``precision`` means for the curvature fit: under ``split32`` the fit's
    forwards and backwards run as the scores' do (:func:`split32`: float32 activations
    and cotangents, split GEMMs), and its statistics are formed from them rounded to the
    weights' dtype, on tensor cores (``fast._TapLinear``). Fitting on float32 weights
    instead cost 5.5x the bf16 fit at 0.3B (docs/performance.md, run 12)."""
    check_precision(precision)
    return split32(model, precision == "split32", kernels)


def fit_arithmetic(model, precision: str) -> str:
    """The arithmetic a fit under ``precision`` uses, for the curvature cache key: the
    weights' dtype, and ``+split32`` where that policy is active."""
    check_precision(precision)
    dtype = next(model.parameters()).dtype
    return str(dtype) + ("+split32" if precision == "split32" and dtype in HALF else "")


# ----------------------------------------------------------------------------- GEMMs with float32 results

def mm_acc(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result (and accumulation) in ``acc``; half-precision operands
    stay in half precision on CUDA (tensor cores, float32 accumulate)."""
    if a.dtype == acc and b.dtype == acc:
        return a @ b
    if a.dim() == 3 and b.dim() == 2:
        return mm_acc(a.reshape(-1, a.shape[-1]), b, acc).view(*a.shape[:-1], b.shape[-1])
    if a.device.type == "cuda" and a.dtype == b.dtype:
        try:
            f = torch.bmm if a.dim() == 3 else torch.mm
            return f(a, b, out_dtype=acc)
        except (RuntimeError, TypeError):
            pass
    return a.to(acc) @ b.to(acc)


def mm_acc_into(M: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``M += a @ b`` with ``M``'s dtype for the result and accumulation. Half-precision
    operands on CUDA: one in-place GEMM (``beta = 1``), no temporary the size of ``M``."""
    if a.device.type == "cuda" and a.dtype == b.dtype and a.dtype != M.dtype:
        try:
            return torch.addmm(M, a, b, out_dtype=M.dtype, out=M)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    return M.add_(mm_acc(a, b, M.dtype))


# ----------------------------------------------------------------------------- split32

def split_half(x: torch.Tensor, dtype: torch.dtype):
    """``x`` (float32) as ``hi + lo`` with both terms in ``dtype`` (bf16/fp16): ``hi`` is
    ``x`` rounded, ``lo`` the rounding error rounded. ``hi + lo`` carries 16 of float32's
    24 mantissa bits (bf16), against bf16's 8: a 256x smaller rounding error. The GEMMs
    take both as the two halves of one ``(N, 2K)`` buffer (:func:`split_cat`)."""
    hi = x.to(dtype)
    return hi, (x - hi.to(x.dtype)).to(dtype)


_split_kernel = None


def _get_split_kernel():
    global _split_kernel
    if _split_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _split(X, OUT, total, K, BLOCK: tl.constexpr):
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < total
            x = tl.load(X + offs, mask=m)
            hi = x.to(OUT.dtype.element_ty)
            lo = (x - hi.to(tl.float32)).to(OUT.dtype.element_ty)
            at = (offs // K) * (2 * K) + offs % K
            tl.store(OUT + at, hi, mask=m)
            tl.store(OUT + at + K, lo, mask=m)

        _split_kernel = _split
    return _split_kernel


def split_cat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[hi | lo]`` of :func:`split_half` for a float32 ``(N, K)`` matrix, as one
    ``(N, 2K)`` tensor in ``dtype``: one Triton kernel on CUDA (reads ``x`` once)."""
    N, K = x.shape
    out = torch.empty(N, 2 * K, dtype=dtype, device=x.device)
    if x.is_cuda:
        try:
            BLOCK = 1024
            _get_split_kernel()[(triton_cdiv(N * K, BLOCK),)](x.contiguous(), out, N * K, K, BLOCK=BLOCK)
            return out
        except ImportError:  # no Triton: the same split in PyTorch kernels
            pass
    hi, lo = split_half(x, dtype)
    out[:, :K], out[:, K:] = hi, lo
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def split_mm(a: torch.Tensor, B: torch.Tensor, split: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ B`` for a float32 matrix ``a`` and a half-precision ``B``: two
    half-precision GEMMs on ``split_half(a)``, float32 accumulation and result.
    ``split``: ``split_cat(a, B.dtype)`` when the caller has it already."""
    K = a.shape[1]
    split = split_cat(a, B.dtype) if split is None else split
    return mm_acc_into(mm_acc(split[:, :K], B, a.dtype), split[:, K:], B)


def split_linear(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None,
                 kernels: Kernels = DEFAULT_KERNELS) -> torch.Tensor:
    """``x @ W.T + b`` for float32 ``x`` and half-precision ``W`` (exact in its own
    dtype), float32-accurate: :func:`split_mm` on tensor cores (``kernels.split_gemm``). The
    split of the latest input is reused by the next layer reading the same tensor
    (q/k/v, gate/up, and the scorer's ``V`` products)."""
    shape = x.shape
    split = split_of(x, W.dtype)
    W2 = getattr(W, "_split_w2", None)
    if W2 is not None and kernels.split_gemm == "kcat":
        y = mm_acc(split, W2.t(), x.dtype)
    else:
        y = split_mm(x.reshape(-1, shape[-1]), W.t(), split)
    if b is not None:
        y = y.add_(b)
    return y.view(*shape[:-1], W.shape[0])


#: (input tensor, its version, its split) of the latest split within one forward. Held,
#: so never a recycled address; cleared when a forward starts and ends (split32's hooks),
#: so nothing allocated in one forward is freed in another: a CUDA graph captured after an
#: eager warm-up fails otherwise ("dependency created on uncaptured work in another stream")
_last_split: list = [None, -1, None]


def _forget_split(*_):
    _last_split[:] = [None, -1, None]


def split_of(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``split_cat`` of ``x`` as a matrix, reused while ``x`` is the latest input split."""
    try:
        version = x._version
    except RuntimeError:  # inference-mode tensors keep no version counter: no reuse
        return split_cat(x.reshape(-1, x.shape[-1]), dtype)
    t, seen, buf = _last_split
    if t is x and seen == version and buf.dtype == dtype:
        return buf
    buf = split_cat(x.reshape(-1, x.shape[-1]), dtype)
    _last_split[:] = [x, version, buf]
    return buf


def cotangent_mm(g: torch.Tensor, B: torch.Tensor, kernels: Kernels = DEFAULT_KERNELS) -> torch.Tensor:
    """``g @ B`` in a backward under split32: float32 ``g`` against half-precision ``B``,
    with ``g`` split (``kernels.split_backward``) or rounded to ``B``'s dtype; float32 result."""
    g2 = g.reshape(-1, g.shape[-1])
    y = split_mm(g2, B) if kernels.split_backward else mm_acc(g2.to(B.dtype), B, g.dtype)
    return y.view(*g.shape[:-1], B.shape[1])


class _SplitLinear(torch.autograd.Function):
    """:func:`split_linear`, and a backward through :func:`cotangent_mm`, with ``kernels``."""

    @staticmethod
    def forward(ctx, x, W, b, kernels: Kernels = DEFAULT_KERNELS):
        ctx.save_for_backward(x if W.requires_grad else None, W)
        ctx.bias, ctx.kernels = b, kernels
        return split_linear(x, W, b, kernels)

    @staticmethod
    def backward(ctx, g):
        x, W = ctx.saved_tensors
        gx = cotangent_mm(g, W, ctx.kernels) if ctx.needs_input_grad[0] else None
        gW = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if hasattr(W, GRAD32):  # float32_grads: g^T (x_hi + x_lo), g split too
                K = x2.shape[1]
                both = split_mm(g2.t(), split_of(x, W.dtype))
                _accumulate32(W, both[:, :K].add_(both[:, K:]))
            else:  # half-precision weight gradients, float32 accumulation
                gW = mm_acc(g2.t().to(W.dtype), x2.to(W.dtype), torch.float32).to(W.dtype)
        b = ctx.bias
        if b is not None and ctx.needs_input_grad[2]:
            if hasattr(b, GRAD32):
                _accumulate32(b, g2.sum(0))
            else:
                gb = g2.sum(0).to(W.dtype)
        return gx, gW, gb, None


def _float32_sdpa(original):
    """transformers' SDPA attention for float32 activations of a grouped-query model: the
    key/value heads repeated, so that PyTorch can pick its fused memory-efficient float32
    kernel. With ``enable_gqa``, which transformers passes when there is no mask, only
    the unfused math kernel takes float32 (docs/performance.md, run 11's profile).
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
    as :func:`split_linear` with ``kernels``: float32-accurate scores at tensor-core speed for the
    matmuls. A no-op for float32/float64 models or with ``enabled=False``. Layers whose
    ``forward`` is replaced later (the exact scorer's tracked layers) handle float32
    inputs themselves."""
    if not enabled or next(model.parameters()).dtype not in HALF:
        yield model
        return
    hooks = [_upcast_embeddings(model),
             model.register_forward_pre_hook(_forget_split), model.register_forward_hook(_forget_split)]
    patched, doubled = [], []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            if "forward" not in m.__dict__:
                m.forward = (lambda x, m=m: _SplitLinear.apply(x, m.weight, m.bias, kernels))
                patched.append(m)
            if kernels.split_gemm == "kcat" and m.weight.is_cuda and not hasattr(m.weight, "_split_w2"):
                m.weight._split_w2 = torch.cat([m.weight.detach(), m.weight.detach()], 1)
                doubled.append(m.weight)
    try:
        with _float32_attention(model):
            yield model
    finally:
        _forget_split()
        for h in hooks:
            h.remove()
        for m in patched:
            m.__dict__.pop("forward", None)
        for W in doubled:
            del W._split_w2
