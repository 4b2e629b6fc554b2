"""The engine: how a tracked linear layer computes, the loss of a batch, and the kernels.

``linear``   the tracked-linear modes: :class:`~.linear.SplitPrecisionLinear` (split32),
             :class:`~.linear.ScoringLinear` with :class:`~.linear.ExactScorer` (exact
             ``g_z . v``), :class:`~.linear.FitTapLinear` with :class:`~.linear.Tap` and
             :func:`~.linear.tap_linears` (the curvature fit's statistics)
``loss``     per-example training loss, fused chunked cross-entropy, collation to a device
``arith``    GEMMs with float32 results, split-precision products, per-row dot products
``kernels``  the Triton kernels

What is explicit here and not a module setting: the kernel choices
(:class:`prism_select.runtime.execution.Kernels`), passed as arguments.
"""

from .arith import GRAD32, cotangent_mm, mm_acc, mm_acc_into, rowdot, split_cat, split_half, split_linear, split_mm
from .linear import ExactScorer, FitTapLinear, ScoringLinear, SplitPrecisionLinear, Tap, frozen, tap_linears
from .loss import batch_losses, causal_only, collate_to, cpu_response_split, loss_index, split_causal_lm

__all__ = ["GRAD32", "ExactScorer", "FitTapLinear", "ScoringLinear", "SplitPrecisionLinear", "Tap", "batch_losses",
           "causal_only", "collate_to", "cotangent_mm", "cpu_response_split", "frozen", "loss_index", "mm_acc", "mm_acc_into", "rowdot",
           "split_cat", "split_causal_lm", "split_half", "split_linear", "split_mm", "tap_linears"]
