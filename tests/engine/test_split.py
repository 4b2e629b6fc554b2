"""The engine's split-precision arithmetic (engine/arith.py, engine/kernels.py) and its
linear layer (``SplitPrecisionLinear``) against float64 products on the same bf16 weights."""

import pytest
import torch

#: hi + lo of a bf16 split keeps 16 significant bits: |x - (hi + lo)| <= 2^-16 |x|
#: (the bound is 2^-17 from the two roundings; the constant leaves a factor 2)
SPLIT_RECONSTRUCTION = 2.0 ** -16
#: split_linear against float64 on the same bf16 weights: float32-level error
#: (measured 3-4e-7 relative on 64 x 48 x 40 products); plain bf16 F.linear: ~2e-3
SPLIT_LINEAR_TOL = 1e-5
#: gradients through split_linear: the cotangent (and, for W, the input) rounded to bf16
BF16_GRAD_TOL = 1e-2

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_split_half_reconstructs_float32():
    from prism_select.engine import split_half
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 1000)
    hi, lo = split_half(x, torch.bfloat16)
    assert hi.dtype == lo.dtype == torch.bfloat16
    err = (x.double() - hi.double() - lo.double()).abs()
    assert (err <= SPLIT_RECONSTRUCTION * x.double().abs()).all()
    assert (x.double() - hi.double()).abs().max() > 0  # the split does carry information


def test_split_linear_and_its_gradients_match_float64():
    from prism_select.engine import SplitPrecisionLinear, split_linear
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, 48, generator=g, dtype=torch.float32) * 3
    W = torch.randn(40, 48, generator=g).to(torch.bfloat16)
    b = torch.randn(40, generator=g).to(torch.bfloat16)
    ref = x.double() @ W.double().t() + b.double()
    y = split_linear(x, W, b)
    assert y.dtype == torch.float32 and y.shape == (4, 16, 40)
    assert float((y.double() - ref).norm() / ref.norm()) < SPLIT_LINEAR_TOL
    plain = torch.nn.functional.linear(x.to(torch.bfloat16), W, b)
    assert float((plain.double() - ref).norm() / ref.norm()) > 10 * SPLIT_LINEAR_TOL
    # backward: the cotangent is rounded to bf16, so gradients carry bf16-level error
    xr = x.clone().requires_grad_(True)
    Wr = W.clone().requires_grad_(True)
    br = b.clone().requires_grad_(True)
    cot = torch.randn(4, 16, 40, generator=g)
    SplitPrecisionLinear.apply(xr, Wr, br).backward(cot)
    c64 = cot.double()
    for got, want in ((xr.grad, c64 @ W.double()),
                      (Wr.grad, c64.reshape(-1, 40).t() @ x.double().reshape(-1, 48)),
                      (br.grad, c64.sum((0, 1)))):
        assert float((got.double() - want).norm() / want.norm()) < BF16_GRAD_TOL


def test_split_backward_gives_float32_accurate_gradients():
    from prism_select import engine
    from prism_select.runtime.execution import Kernels
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 48, generator=g, requires_grad=True)
    W = torch.randn(40, 48, generator=g).to(torch.bfloat16)
    cot = torch.randn(8, 40, generator=g)
    want = cot.double() @ W.double()
    errs = {}
    for split in (False, True):
        x.grad = None
        engine.SplitPrecisionLinear.apply(x, W, None, Kernels(split_backward=split)).backward(cot)
        errs[split] = float((x.grad.double() - want).norm() / want.norm())
    assert errs[True] < SPLIT_LINEAR_TOL < errs[False] < BF16_GRAD_TOL, errs


@needs_cuda
def test_split_kernel_matches_the_torch_split_bit_for_bit():
    from prism_select.engine import split_cat
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in [(7, 5), (300, 576), (33, 1536)]:
        x = torch.randn(*shape, device="cuda", generator=g) * 10
        buf = split_cat(x, torch.bfloat16)
        hi = x.to(torch.bfloat16)
        lo = (x - hi.float()).to(torch.bfloat16)
        assert torch.equal(buf[:, :shape[1]], hi) and torch.equal(buf[:, shape[1]:], lo)
