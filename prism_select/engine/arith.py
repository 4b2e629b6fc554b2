"""Arithmetic of the engine: GEMMs with float32 results, the split-precision products and
per-row dot products.

Split precision: a float32 matrix ``x`` is split into two half-precision matrices,
``hi = round(x)`` and ``lo = round(x - hi)``, so that ``x @ W = hi @ W + lo @ W`` up to the
rounding of ``lo``: float32-accurate products of float32 activations with half-precision
weights on tensor cores (:func:`split_linear`, :func:`split_mm`, :func:`cotangent_mm`).
How they run is a :class:`~prism_select.runtime.execution.Kernels` argument.
"""

from __future__ import annotations

import torch

from ..runtime.execution import DEFAULT_KERNELS, Kernels
from ..runtime.layers import GRAD32
from .kernels import rowdot_kernel, split_kernel, triton_cdiv


def accumulate32(p: torch.Tensor, g: torch.Tensor) -> None:
    acc = getattr(p, GRAD32)
    setattr(p, GRAD32, g if acc is None else acc.add_(g))


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


def split_half(x: torch.Tensor, dtype: torch.dtype):
    """``x`` (float32) as ``hi + lo`` with both terms in ``dtype`` (bf16/fp16): ``hi`` is
    ``x`` rounded, ``lo`` the rounding error rounded. ``hi + lo`` carries 16 of float32's
    24 mantissa bits (bf16), against bf16's 8: a 256x smaller rounding error. The GEMMs
    take both as the two halves of one ``(N, 2K)`` buffer (:func:`split_cat`)."""
    hi = x.to(dtype)
    return hi, (x - hi.to(x.dtype)).to(dtype)


def split_cat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[hi | lo]`` of :func:`split_half` for a float32 ``(N, K)`` matrix, as one
    ``(N, 2K)`` tensor in ``dtype``: one Triton kernel on CUDA (reads ``x`` once)."""
    N, K = x.shape
    out = torch.empty(N, 2 * K, dtype=dtype, device=x.device)
    if x.is_cuda:
        try:
            BLOCK = 1024
            split_kernel()[(triton_cdiv(N * K, BLOCK),)](x.contiguous(), out, N * K, K, BLOCK=BLOCK)
            return out
        except ImportError:  # no Triton: the same split in PyTorch kernels
            pass
    hi, lo = split_half(x, dtype)
    out[:, :K], out[:, K:] = hi, lo
    return out


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


def forget_split(*_):
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


def rowdot(g: torch.Tensor, u: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``sum`` of ``g * u`` over every dim but the first: (B,), float32 (float64 for
    float64 inputs); half-precision products accumulate in float32, on CUDA reduced as
    ``backend`` says (:attr:`prism_select.runtime.execution.Kernels.rowdot`)."""
    B = g.shape[0]
    if g.is_cuda and g.dtype == torch.float32:  # einsum would be a batched GEMV: slow on CUDA
        return (g * u).reshape(B, -1).sum(1)
    if not g.is_cuda or g.dtype in (torch.float32, torch.float64):
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        if g.dtype == acc:
            return torch.einsum("bk,bk->b", g.reshape(B, -1), u.reshape(B, -1))
        return (g * u).reshape(B, -1).sum(1, dtype=acc)
    K = g.shape[-1]
    g2, u2 = g.reshape(-1, K).contiguous(), u.reshape(-1, K).contiguous()
    N = g2.shape[0]
    backend = "mulsum" if backend == "auto" else backend
    if backend == "triton":
        out = torch.empty(N, dtype=torch.float32, device=g.device)
        ROWS = 16
        BLOCK_K = min(1024, max(16, 1 << (K - 1).bit_length()))
        rowdot_kernel()[(triton_cdiv(N, ROWS),)](g2, u2, out, N, K, BLOCK_K=BLOCK_K, ROWS=ROWS)
        return out.view(B, -1).sum(1)
    if backend == "bmm":
        try:
            out = torch.bmm(g2.view(N, 1, K), u2.view(N, K, 1), out_dtype=torch.float32)
            return out.view(B, -1).sum(1)
        except (RuntimeError, TypeError):
            pass
    return (g2 * u2).view(B, -1).sum(1, dtype=torch.float32)
