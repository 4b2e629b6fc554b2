"""Spearman's rank correlation, the one every part of prism-select uses (the split-half
check of :mod:`prism_select.curvature.support`, the benchmarks' agreement columns, the
evaluation's tables): on the ground floor, so that curvature and evaluation both import it.

The rule, for two equally long score lists (Python numbers or tensors of any dtype, read
as float64):

* **ties** take the mean of the ranks they span (average ranks, as
  ``scipy.stats.spearmanr`` and the textbook definition): the correlation is then the
  Pearson correlation of the two rank vectors, independent of the order the records came
  in, so two scorings that tie the same records agree exactly;
* **a constant input** (every score equal, or fewer than two scores) gives NaN: its ranks
  are all equal, so there is no ranking to correlate, and 0 or 1 would each claim an
  agreement that was not measured. A caller that must decide on it says what NaN means
  there (the split-half check counts it as no disagreement).
"""

from __future__ import annotations

import torch


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """0-based ranks of the 1-D ``x`` (float64), each tie the mean of the ranks it spans."""
    n = x.numel()
    order = torch.argsort(x, stable=True)
    xs = x[order]
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = xs[1:] != xs[:-1]
    group = torch.cumsum(new.long(), 0) - 1  # the tie group of each sorted position
    counts = torch.bincount(group).to(torch.float64)
    starts = torch.cumsum(counts, 0) - counts
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = (starts + (counts - 1) / 2)[group]
    return ranks


def spearman(a, b) -> float:
    """Spearman's rank correlation of the score lists ``a`` and ``b``: the Pearson
    correlation of their average ranks; NaN when either is constant (module docstring)."""
    x = torch.as_tensor(a).detach().to("cpu", torch.float64).reshape(-1)
    y = torch.as_tensor(b).detach().to("cpu", torch.float64).reshape(-1)
    if x.numel() != y.numel():
        raise ValueError(f"spearman of score lists of different lengths ({x.numel()} and {y.numel()})")
    if x.numel() < 2:
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    if den == 0.0:  # a constant list: every rank equal
        return float("nan")
    return float(rx @ ry) / den
