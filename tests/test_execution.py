"""The execution context: kernel choices are checked values passed as arguments, and a
run's context is resolved once from its settings and model."""

import pytest
import torch

from prism_select.errors import ConfigError
from prism_select.runtime.execution import DEFAULT_KERNELS, Kernels, resolve
from prism_select.settings import ScoreSettings


@pytest.mark.parametrize("field,value", [("split_gemm", "three"), ("rowdot", "einsum"), ("split_backward", 1)])
def test_kernels_are_checked(field, value):
    with pytest.raises(ConfigError, match=field):
        Kernels(**{field: value})


def test_default_kernels_and_rowdot_backend():
    assert DEFAULT_KERNELS == Kernels() and DEFAULT_KERNELS.rowdot_backend == "mulsum"
    assert Kernels(rowdot="triton").rowdot_backend == "triton"


def test_split_backward_is_an_argument_not_a_global():
    """The same layer, two kernel choices side by side: each product follows its own."""
    from prism_select.engine import SplitPrecisionLinear
    g = torch.Generator().manual_seed(0)
    W = torch.randn(24, 32, generator=g).to(torch.bfloat16)
    cot = torch.randn(5, 24, generator=g)
    grads = []
    for split in (True, False, True):
        x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        SplitPrecisionLinear.apply(x, W, None, Kernels(split_backward=split)).backward(cot)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[2]) and not torch.equal(grads[0], grads[1])


def test_resolve_takes_the_execution_settings_and_the_process(model):
    s = ScoreSettings(precision="residual32", cuda_graphs="off")
    ex = resolve(s, model, "cpu")
    assert (ex.device, ex.precision, ex.cuda_graphs, ex.shard) == (torch.device("cpu"), "residual32", "off", "none")
    assert (ex.rank, ex.world, ex.sharded, ex.main, ex.plan) == (0, 1, False, True, None)
    assert ex.kernels == DEFAULT_KERNELS


def test_deterministic_kernels_are_on_inside_and_restored_after(monkeypatch):
    """``--deterministic``: PyTorch's deterministic algorithms, cuDNN's and cuBLAS's fixed
    workspace while the run lasts; the process's own settings come back after it (also
    after an error), and ``on=False`` changes nothing."""
    from prism_select.runtime.execution import CUBLAS_DETERMINISTIC_WORKSPACE, deterministic
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic(False):
        assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ValueError), deterministic():
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        import os
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_DETERMINISTIC_WORKSPACE
        raise ValueError
    assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
