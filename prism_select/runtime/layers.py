"""A tracked linear layer's shape and where its gradient lives: this rank's part of a
sharded tensor (:func:`local`) and the attribute of a float32 accumulator (:data:`GRAD32`).
"""

from __future__ import annotations

import torch


#: the attribute holding the float32 gradient accumulator of a half-precision weight under
#: :func:`prism_select.runtime.precision.float32_grads` (read by :func:`prism_select.gradients.weight_grad`)
GRAD32 = "_prism_grad32"


def has_bias(module: torch.nn.Linear) -> bool:
    return getattr(module, "bias", None) is not None


def layer_shape(module: torch.nn.Linear) -> tuple[int, int]:
    return module.out_features, module.in_features + int(has_bias(module))


def local(t):
    """This rank's rows of an FSDP2-sharded parameter or gradient (a DTensor,
    :mod:`prism_select.runtime.sharding`); any other tensor (or None) as it is."""
    return t.to_local() if hasattr(t, "to_local") else t
