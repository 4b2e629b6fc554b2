"""Random: uniform scores from a seeded generator (the chance baseline)."""

from __future__ import annotations

import torch

from .common import record, resolve_options
from .registry import register


@register("random", description="uniform random scores from a generator seeded with --seed", needs_pairs=False)
def random_method(ctx) -> tuple[torch.Tensor, list]:
    """Uniform ``[0, 1)`` scores, float64, from ``torch.Generator().manual_seed(seed)``
    with ``seed = ctx.settings.seed``: the same seed gives the same scores.

    Options: none. Target pairs are not needed (and not used).
    """
    opts = resolve_options(ctx, "random")
    gen = torch.Generator().manual_seed(ctx.settings.seed)
    scores = torch.rand(len(ctx.inputs.pool), generator=gen, dtype=torch.float64)
    record(ctx, "random", opts, seed=ctx.settings.seed)
    return scores, []
