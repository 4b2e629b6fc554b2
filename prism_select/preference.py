"""Model preference and the target direction (paper Sec. 2.2).

For a target pair ``(q, y+, y-)``:

``margin``  ``m_q = mean log p(y+|q) - mean log p(y-|q)``: the difference of the
            length-normalised log-likelihoods (``-lbar(q, y+) + lbar(q, y-)``).
``pi``      ``pi_q = sigmoid(m_q)``: the model's preference for ``y+`` within the pair.
``g_kl``    ``g_KL = (1/|Q|) sum_q pi_q (gbar_{q,y+} - gbar_{q,y-})`` with ``gbar`` the
            gradient of the token-average loss and ``pi_q`` held constant. It equals
            ``-grad K`` for the reward ``K = (1/|Q|) sum_q log(1 + exp(m_q))``.

Ablations (paper Sec. 4.4):

``equal``     ``g_0``: the same with every ``pi_q = 1`` (equal aggregation).
``unpaired``  positive responses only: ``g_U = (1/|Q|) sum_q pbar(y+|q) gbar_{q,y+}``
              with ``pbar(y+|q) = exp(-lbar(q, y+))`` the length-normalised likelihood.
              It is ``-grad U`` for ``U = (1/|Q|) sum_q pbar(y+|q)``, the unpaired
              counterpart of ``K``: the weight comes from the positive likelihood alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .data.tokenize import collate, token_losses
from .errors import ConfigError
from .gradients import check_finite, tracked_param_grad_mode, weight_grad

METHODS = ("prism", "equal", "unpaired")


@dataclass
class Preference:
    """Per-pair results and the target direction (one ``out x in'`` matrix per layer)."""

    margin: torch.Tensor  # (|Q|,) float64
    pi: torch.Tensor  # (|Q|,) float64
    loss_chosen: torch.Tensor  # token-average loss lbar(q, y+)
    loss_rejected: torch.Tensor  # token-average loss lbar(q, y-)
    weights: torch.Tensor  # the weight each pair received in the direction
    direction: dict  # layer name -> gradient matrix (g_KL, g_0 or g_U)
    method: str


def _mean_losses(model, encoded: list, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    b = collate(encoded, pad_id, device)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    total, count = token_losses(out.logits, b["labels"])
    return total / count.clamp(min=1), count


def compute_preference(model, modules: dict, chosen: list, rejected: list, *, method: str = "prism",
                       pad_id: int, batch_size: int = 8, device=None, progress: bool = True,
                       ids=None) -> Preference:
    """Margins, ``pi`` and the target direction for encoded pairs.

    ``chosen[i]`` / ``rejected[i]`` are the :class:`~prism_select.data.tokenize.Encoded`
    ``(q, y+)`` and ``(q, y-)`` of pair ``i``. Gradients are accumulated over batches
    of pairs, so memory is bounded by ``batch_size``.
    """
    if method not in METHODS:
        raise ConfigError("method", f"unknown target direction {method!r}", f"use one of {', '.join(METHODS)}")
    if len(chosen) != len(rejected) or not chosen:
        raise ConfigError("targets", "need at least one target pair")
    device = device or next(model.parameters()).device
    Q = len(chosen)
    margins, pis, lcs, lrs, ws = [], [], [], [], []
    with tracked_param_grad_mode(model, modules):
        starts = range(0, Q, batch_size)
        for s in tqdm(starts, desc=f"target direction ({method})", unit="batch", leave=False,
                      disable=not progress):
            lc, _ = _mean_losses(model, chosen[s:s + batch_size], pad_id, device)
            if method == "unpaired":  # y- is only reported (pi, margin), not differentiated
                with torch.no_grad():
                    lr, _ = _mean_losses(model, rejected[s:s + batch_size], pad_id, device)
            else:
                lr, _ = _mean_losses(model, rejected[s:s + batch_size], pad_id, device)
            batch_ids = None if ids is None else ids[s:s + batch_size]
            check_finite(lc.detach(), "the target loss (chosen)", record=batch_ids)
            check_finite(lr.detach(), "the target loss (rejected)", record=batch_ids)
            with torch.no_grad():
                margin = (lr - lc).double()
                pi = torch.sigmoid(margin)
                if method == "prism":
                    w = pi
                elif method == "equal":
                    w = torch.ones_like(pi)
                else:
                    w = torch.exp(-lc.double())
            # The direction is the gradient of sum_q w_q (lbar+ - lbar-) / |Q| with the
            # weights held constant (for unpaired, of sum_q w_q lbar+ / |Q|).
            diff = lc if method == "unpaired" else lc - lr
            obj = (w.to(lc.dtype) * diff).sum() / Q
            obj.backward()
            margins.append(margin)
            pis.append(pi)
            lcs.append(lc.detach().double())
            lrs.append(lr.detach().double())
            ws.append(w)
        direction = {n: weight_grad(m).detach().clone() for n, m in modules.items()}
    for n, g in direction.items():
        check_finite(g, "the target direction", layer=n)
    cat = lambda xs: torch.cat([x.cpu() for x in xs])
    return Preference(cat(margins), cat(pis), cat(lcs), cat(lrs), cat(ws), direction, method)
