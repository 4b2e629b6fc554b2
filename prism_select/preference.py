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

Controls of the weights (is it ``pi``'s assignment to the pairs that matters, or its spread?):

``prism_shuffled``  ``g_KL`` with ``pi`` permuted across the pairs: pair ``q`` gets
                    ``pi_{perm(q)}`` (:func:`shuffled_weights`, a seeded permutation), the
                    same weights as PRISM's, another assignment.
``equal_top_half``  ``g_0`` over the pairs whose ``pi`` is above the median (weight 1, the
                    rest 0; :func:`top_half_weights`).
Their weights need every pair's ``pi`` before the first backward: :func:`pair_margins`
(forward passes) gives them, and :func:`compute_preference` takes them as ``weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .data.tokenize import collate, token_losses
from .engine import batch_losses, cpu_response_split
from .errors import ConfigError
from .gradients import check_finite, release_host_memory, tracked_param_grad_mode, weight_grad
from .runtime import distributed, profiling
from .runtime.execution import ExecutionContext, Kernels, direction_kernels
from .runtime.layers import has_bias

#: the direction's default kernels (:func:`prism_select.runtime.execution.direction_kernels`: under
#: split32 its backwards split the cotangent too)
DIRECTION_KERNELS = direction_kernels()


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


def _mean_losses(model, encoded: list, pad_id: int, device, modules: dict | None = None,
                 kernels: Kernels = DIRECTION_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    b = collate(encoded, pad_id, device)
    split = cpu_response_split(model, modules)
    if split is not None:
        total, count = batch_losses(model, b, split=split, kernels=kernels)
    else:
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
        total, count = token_losses(out.logits, b["labels"])
    return total / count.clamp(min=1), count


#: the directions whose weights are given (:func:`compute_preference`'s ``weights``)
GIVEN_WEIGHTS = ("prism_shuffled", "equal_top_half")
#: the weightings :func:`compute_preference` forms the direction with (each a method of
#: :mod:`prism_select.methods.prism`, which names their facts; those of
#: :data:`GIVEN_WEIGHTS` take one weight per pair)
METHODS = ("prism", "equal", "unpaired") + GIVEN_WEIGHTS


def shuffled_weights(pi: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, perm)``: ``weights[q] = pi[perm[q]]`` for a permutation ``perm`` of the
    pairs drawn from ``seed`` (CPU generator: the same on every device)."""
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(len(pi), generator=g)
    return pi.detach().double().cpu()[perm], perm


def top_half_weights(pi: torch.Tensor) -> torch.Tensor:
    """1.0 for the pairs whose ``pi`` is above the median (``torch.quantile(pi, 0.5)``: the
    mean of the two middle values for an even count), else 0.0."""
    pi = pi.detach().double().cpu()
    w = (pi > torch.quantile(pi, 0.5)).double()
    if not w.any():
        raise ConfigError("targets", f"equal_top_half needs pairs whose pi differ: all {len(pi)} pairs have pi "
                          f"{float(pi[0]):.6g}", "use more target pairs, or another method")
    return w


def compute_preference(model, modules: dict, chosen: list, rejected: list, *, method: str = "prism",
                       pad_id: int, batch_size: int = 8, ids=None, accumulate: str = "device", store: str = "device",
                       one_graph: bool = False, execution: ExecutionContext | None = None,
                       weights: torch.Tensor | None = None) -> Preference:
    """Margins, ``pi`` and the target direction for encoded pairs.

    ``weights``: one weight per pair (float64), used in place of the method's own
    (required, and only accepted, for the methods of :data:`GIVEN_WEIGHTS`).

    ``chosen[i]`` / ``rejected[i]`` are the :class:`~prism_select.data.tokenize.Encoded`
    ``(q, y+)`` and ``(q, y-)`` of pair ``i``; memory is bounded by ``batch_size``. A batch
    of pairs is differentiated in one backward through both halves' forwards, or, with
    ``one_graph`` (the run sets it on a GPU with a memory plan and on the CPU), half by half: the rejected losses
    first without a graph (for the weights), then the chosen and the rejected half each
    with its own forward and backward, so one forward's activations are alive at a time
    (one more forward per batch).

    ``accumulate`` (the memory plan, :mod:`prism_select.plan`): ``device`` sums the
    gradients in the tracked layers' ``.grad``; ``host`` moves each layer's gradient into a
    float32 host accumulator as soon as autograd has formed it (one layer's gradient on
    the device at a time). ``store``: where the finished direction is kept (``device``:
    the model's device, ``host``), float32 for half-precision models, one layer at a time
    taken out of ``.grad`` (no full copy next to the gradients).

    ``execution`` (default: :meth:`ExecutionContext.of` the model with
    :data:`DIRECTION_KERNELS`): the device, progress, ``kernels`` (those of the fused
    loss's head product on the CPU; under split32, with the cotangent split) and
    ``sharded`` (a model sharded with FSDP over the ranks, :mod:`prism_select.runtime.sharding`):
    the batches of pairs are dealt to the ranks in turn, each rank's losses scaled by the
    number of ranks (FSDP averages the ranks' gradients as it reduce-scatters them), and a
    rank with fewer batches repeats its last with zero weights so that every rank runs as
    many steps; the margins, ``pi`` and weights are then gathered in pair order.
    """
    if method not in METHODS:
        raise ConfigError("method", f"unknown target direction {method!r}", f"use one of {', '.join(METHODS)}")
    if len(chosen) != len(rejected) or not chosen:
        raise ConfigError("targets", "need at least one target pair")
    if (weights is not None) != (method in GIVEN_WEIGHTS) or (weights is not None and len(weights) != len(chosen)):
        raise ConfigError("weights", f"method {method!r} takes {'one weight per pair' if method in GIVEN_WEIGHTS else 'no weights'}"
                          f", got {'none' if weights is None else len(weights)} for {len(chosen)} pairs")
    execution = execution or ExecutionContext.of(model, kernels=DIRECTION_KERNELS)
    device, progress, kernels = execution.device, execution.progress, execution.kernels
    Q = len(chosen)
    margins, pis, lcs, lrs, ws, done = [], [], [], [], [], []
    starts = list(range(0, Q, batch_size))
    share = execution.sharded and distributed.active()
    scale = distributed.world() if share else 1
    mine = distributed.round_robin(starts) if share else starts
    steps = distributed.lockstep(mine, starts[0]) if share else ((s, True) for s in starts)
    with tracked_param_grad_mode(model, modules), _HostAccumulator(modules, accumulate == "host") as host:
        bar = tqdm(total=len(mine),
                   desc=f"target direction ({method})", unit="batch", leave=False,
                   disable=not progress or not distributed.is_main())
        for s, real in profiling.steps(f"target direction ({method})", steps):
            ch, rj = chosen[s:s + batch_size], rejected[s:s + batch_size]
            batch_ids = None if ids is None else ids[s:s + batch_size]
            joint = not one_graph and method != "unpaired"  # both halves' graphs alive at once
            with torch.set_grad_enabled(joint):
                lr, _ = _mean_losses(model, rj, pad_id, device, modules, kernels)
            check_finite(lr.detach(), "the target loss (rejected)", record=batch_ids)
            lc, _ = _mean_losses(model, ch, pad_id, device, modules, kernels)
            check_finite(lc.detach(), "the target loss (chosen)", record=batch_ids)
            with torch.no_grad():
                margin = (lr - lc).double()
                pi = torch.sigmoid(margin)
                if weights is not None:
                    w = weights[s:s + len(ch)].to(device=pi.device, dtype=pi.dtype)
                elif method == "prism":
                    w = pi
                elif method == "equal":
                    w = torch.ones_like(pi)
                else:
                    w = torch.exp(-lc.double())
                # (share) a stand-in step adds nothing; a real one counts for every rank's
                # average that FSDP forms
                wq = w * scale if real else torch.zeros_like(w)
            # The direction is the gradient of sum_q w_q (lbar+ - lbar-) / |Q| with the
            # weights held constant (for unpaired, of sum_q w_q lbar+ / |Q|): jointly, or the
            # chosen half and then the rejected half with a forward of its own (one_graph).
            if joint:
                (wq.to(lc.dtype) * (lc - lr)).sum().div(Q).backward()
            else:
                (wq.to(lc.dtype) * lc).sum().div(Q).backward()
                if method != "unpaired":  # y- is only reported (pi, margin), not differentiated
                    lr_g, _ = _mean_losses(model, rj, pad_id, device, modules, kernels)
                    (wq.to(lr_g.dtype) * lr_g).sum().div(-Q).backward()
                    del lr_g
            lc, lr = lc.detach(), lr.detach()
            if not real:
                continue
            bar.update()
            done.append(s)
            margins.append(margin)
            pis.append(pi)
            lcs.append(lc.double())
            lrs.append(lr.double())
            ws.append(w)
        bar.close()
        direction = host.result() if host.active else _take_grads(modules, store)
    if share:  # every rank's pairs, in pair order
        rows = [(s, *(x.cpu() for x in xs)) for s, *xs in zip(done, margins, pis, lcs, lrs, ws)]
        every = sorted((t for part in distributed.gather_values(rows) for t in part), key=lambda t: t[0])
        margins, pis, lcs, lrs, ws = (list(col) for col in zip(*[t[1:] for t in every]))
    release_host_memory()  # the batches' graphs are gone: their heap goes back to the system
    if host.active:  # (_take_grads checks each gradient where autograd left it)
        for n, g in direction.items():
            check_finite(g, "the target direction", layer=n)
    cat = lambda xs: torch.cat([x.cpu() for x in xs])
    return Preference(cat(margins), cat(pis), cat(lcs), cat(lrs), cat(ws), direction, method)


@torch.no_grad()
def pair_margins(model, chosen: list, rejected: list, *, pad_id: int, batch_size: int = 32, device=None,
                 modules: dict | None = None, kernels: Kernels = DIRECTION_KERNELS) -> tuple[torch.Tensor, torch.Tensor]:
    """``(margin, pi)`` of encoded pairs, float64, from forward passes alone (no gradient):
    what :func:`compute_preference` reports for them, without the direction (``modules``
    and ``kernels``: the loss route it takes, :func:`_mean_losses`)."""
    if len(chosen) != len(rejected) or not chosen:
        raise ConfigError("targets", "need at least one target pair")
    device = device if device is not None else next(model.parameters()).device
    margins = []
    for s in range(0, len(chosen), batch_size):
        lc, _ = _mean_losses(model, chosen[s:s + batch_size], pad_id, device, modules, kernels)
        lr, _ = _mean_losses(model, rejected[s:s + batch_size], pad_id, device, modules, kernels)
        margins.append((lr - lc).double().cpu())
    margin = torch.cat(margins)
    return margin, torch.sigmoid(margin)


def _store_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _take_grads(modules: dict, store: str) -> dict:
    """Each layer's gradient as one float32 (float64) matrix on the direction's store, taken
    out of ``.grad`` layer by layer (the ``.grad`` is released as it is taken; a gradient
    already in that dtype and place is taken as it is, not copied). Each is checked for
    NaN/inf where autograd left it (on a GPU: not on the host, where the check of an 8B
    model's float32 direction takes seconds per layer group)."""
    out = {}
    for n, m in modules.items():
        g = weight_grad(m).detach()
        check_finite(g, "the target direction", layer=n)
        dev = "cpu" if store == "host" else g.device
        # converted where it is, then copied: a conversion on the way to the host would run
        # on the CPU (one thread under torchrun), seconds per GB
        out[n] = g.to(dtype=_store_dtype(g)).to(device=dev)
        del g
        m.weight.grad = None
        if has_bias(m):
            m.bias.grad = None
    return out


class _HostAccumulator:
    """Moves each tracked weight's (and bias's) gradient into a float32 host accumulator as
    soon as autograd has accumulated it (``register_post_accumulate_grad_hook``), then
    releases the device copy: one layer's gradient on the device at a time."""

    def __init__(self, modules: dict, active: bool):
        self.modules, self.active = modules, active
        self.acc: dict = {}
        self.handles: list = []

    def __enter__(self):
        if not self.active:
            return self
        for n, m in self.modules.items():
            for p in (m.weight, m.bias) if has_bias(m) else (m.weight,):
                self.acc[id(p)] = torch.zeros(p.shape, dtype=_store_dtype(p), device="cpu")
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook))
        return self

    def _hook(self, p):
        self.acc[id(p)] += p.grad.to(self.acc[id(p)].dtype).to("cpu")
        p.grad = None

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def result(self) -> dict:
        out = {}
        for n, m in self.modules.items():
            g = self.acc.pop(id(m.weight))
            if has_bias(m):
                g = torch.cat([g, self.acc.pop(id(m.bias))[:, None]], dim=1)
            out[n] = g
        return out
