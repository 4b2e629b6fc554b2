"""How a run computes, resolved once and passed down: the execution context.

:class:`Kernels` are the kernel choices of the arithmetic (which GEMMs a split32 linear
layer runs, whether a backward splits its cotangent, how token dot products are reduced).
They are explicit arguments of the functions that use them (:func:`prism_select.engine.policy.split32`,
:func:`prism_select.engine.arith.split_linear`, :class:`prism_select.engine.ExactScorer`,
:func:`prism_select.engine.arith.rowdot`, ...), with :data:`DEFAULT_KERNELS` as the default;
benchmarks pass others to compare them.

:class:`ExecutionContext` is what a run (:mod:`prism_select.run`) resolves once, after the model is loaded
and the memory plan made: the device, the precision policy, the CUDA-graph mode, the
process group (rank and world size), the memory plan and the kernels. The stages read
it from :attr:`prism_select.run.RunContext.execution` instead of re-deriving it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from ..errors import ConfigError
from ..settings import SHARDS, check_graph_mode, check_precision
from . import distributed, sharding

SPLIT_GEMMS = ("two", "kcat")
ROWDOT_BACKENDS = ("auto", "mulsum", "triton", "bmm")


@dataclass(frozen=True)
class Kernels:
    """Kernel choices; the defaults are the measured best (docs/performance.md).

    split_gemm: how :func:`~prism_select.engine.arith.split_linear` runs its products on CUDA:
        ``two`` (two GEMMs, the second accumulating into the float32 result of the first) |
        ``kcat`` (one GEMM of ``[hi | lo]`` against ``[W | W]``, the doubled weight built
        once per layer by :func:`~prism_select.engine.policy.split32`).
    split_backward: whether a split32 backward's products split the cotangent too
        (float32-accurate gradients, one more GEMM per product) or round it to the weights'
        dtype. The target direction always splits it
        (:func:`~prism_select.engine.policy.direction_policy`). On the embedded model with
        PRISM's ``v`` (CPU, 96 GSM8K records) rounding it leaves a relative error of 6.3e-3
        in the scores against float32 exact (Spearman 0.9998), splitting it 5e-5; plain
        bf16 exact: 0.105.
    rowdot: how half-precision token dot products are reduced on CUDA
        (:func:`~prism_select.engine.arith.rowdot`): mulsum (bf16 products summed in float32) |
        triton (one fused kernel) | bmm (cuBLAS batched dot, float32 result) | auto
        (mulsum: on an H200 it ties the Triton kernel where the GPU is the bottleneck, 1B:
        110.1 vs 111.0 ex/s, and wins where kernel-launch overhead is, SmolLM2-135M: 324
        vs 291 ex/s).
    """

    split_gemm: str = "two"
    split_backward: bool = False
    rowdot: str = "auto"

    def __post_init__(self):
        for name, allowed in (("split_gemm", SPLIT_GEMMS), ("rowdot", ROWDOT_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"unknown value {getattr(self, name)!r}", f"use one of {', '.join(allowed)}")
        if not isinstance(self.split_backward, bool):
            raise ConfigError("split_backward", f"must be true or false, got {self.split_backward!r}")

    @property
    def rowdot_backend(self) -> str:
        """The reduction ``rowdot`` runs (``auto`` resolved)."""
        return "mulsum" if self.rowdot == "auto" else self.rowdot


DEFAULT_KERNELS = Kernels()


def direction_kernels(kernels: Kernels = DEFAULT_KERNELS) -> Kernels:
    """``kernels`` as the target direction uses them: its backwards split the cotangent too
    (a few target pairs: the extra GEMM costs little, and ``g_KL`` stays float32-accurate)."""
    return replace(kernels, split_backward=True)


@dataclass
class ExecutionContext:
    """How this process runs the job, resolved once (:func:`resolve`).

    device: where the model is. precision, cuda_graphs, shard: from
    :class:`~prism_select.settings.ExecutionSettings`, checked here once for callers
    below the run that build a context themselves (:meth:`of`). rank, world: this
    process's place in the process group (0 and 1 without torchrun). sharded: the model
    is sharded with FSDP2. plan: the memory plan (:class:`prism_select.plan.MemoryPlan`),
    None until made. kernels: the kernel choices. progress: progress bars and console lines.
    """

    device: torch.device
    precision: str = "model"
    cuda_graphs: str = "auto"
    shard: str = "none"
    rank: int = 0
    world: int = 1
    sharded: bool = False
    plan: object | None = None
    kernels: Kernels = field(default_factory=Kernels)
    progress: bool = True

    def __post_init__(self):
        self.device = torch.device(self.device)
        check_precision(self.precision)
        check_graph_mode(self.cuda_graphs)
        if self.shard not in SHARDS:
            raise ConfigError("shard", f"unknown value {self.shard!r}", f"use one of {', '.join(SHARDS)}")

    @classmethod
    def of(cls, model, device=None, **fields) -> "ExecutionContext":
        """The context of one process running ``model`` on ``device`` (default: where its
        parameters are); ``fields`` set the others (precision, cuda_graphs, kernels,
        progress, ...). What a caller outside a run passes to the scoring functions."""
        return cls(device=device if device is not None else next(model.parameters()).device, **fields)

    @property
    def main(self) -> bool:
        """Whether this is the process that writes the run's files."""
        return self.rank == 0


#: cuBLAS's workspace setting for reproducible results (NVIDIA's cuBLAS documentation,
#: "Results reproducibility"); read when the first cuBLAS handle is made
CUBLAS_DETERMINISTIC_WORKSPACE = ":4096:8"


@contextmanager
def deterministic(on: bool = True):
    """Deterministic kernels while the block runs (``--deterministic``), the previous
    settings restored after it; nothing changes when ``on`` is false.

    ``torch.use_deterministic_algorithms(True)``: operations with a deterministic variant
    use it (e.g. attention backwards that otherwise add with atomics, in an order that
    varies between runs), and an operation without one raises
    a ``RuntimeError`` that names it. cuBLAS gets a fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``, unless already set) and cuDNN its deterministic
    algorithms. Without it, two runs of the same bf16 job on a GPU rank the pool alike
    only up to that rounding (docs/scale.md: Spearman 0.998 at the 8B shape)."""
    if not on:
        yield
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC_WORKSPACE)
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def resolve(settings, model, device, plan=None, kernels: Kernels = DEFAULT_KERNELS) -> ExecutionContext:
    """The execution context of a run: ``settings`` (an
    :class:`~prism_select.settings.ExecutionSettings`, or a settings object that holds
    one and a ``progress`` flag), the loaded ``model`` on ``device`` and its memory ``plan``."""
    return ExecutionContext(device=torch.device(device), precision=settings.precision,
                            cuda_graphs=settings.cuda_graphs, shard=settings.shard, rank=distributed.rank(),
                            world=distributed.world(), sharded=sharding.is_sharded(model), plan=plan,
                            kernels=kernels, progress=getattr(settings, "progress", True))
