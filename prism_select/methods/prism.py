"""PRISM, its ablations and the controls of its weights: the target directions of
:mod:`prism_select.preference`, scored along ``H^-1 g_KL`` by the run's one curvature.

prism           g_z . H^-1 g_KL, target pairs weighted by the model's preference
                pi_q = sigmoid(margin_q), margin_q = lbar(y-) - lbar(y+)
equal           the ablation with equal aggregation g_0 (every pi_q = 1)
unpaired        the ablation with positive responses only, weighted by their
                length-normalised likelihood exp(-lbar(y+))
prism_shuffled  control: PRISM with pi permuted across the pairs (option shuffle_seed)
equal_top_half  control: equal aggregation over the pairs whose pi is above the median

All five are one function, :func:`prism_method` (the weighting is
``ctx.settings.method``); :func:`run_tasks` and :func:`_check_task_method` decide the
run's target sets, :func:`_method_fn` the function a run calls for its method.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from ..runtime import distributed
from ..errors import ConfigError
from ..runtime.execution import direction_kernels
from ..engine.policy import direction_policy
from ..preference import GIVEN_WEIGHTS, compute_preference, pair_margins, shuffled_weights, top_half_weights
from ..tasks import task_groups
from .registry import get, names, parse_options, register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShuffleOptions:
    """``prism_shuffled``'s option: ``shuffle_seed``, the permutation's seed beside the
    run's ``--seed`` (the permutation is seeded by ``seed * 1000 + shuffle_seed``)."""

    shuffle_seed: int = 0

    def __post_init__(self):
        if self.shuffle_seed < 0:
            raise ConfigError("method_options", f"prism_shuffled's shuffle_seed must be an integer >= 0, got "
                              f"{self.shuffle_seed!r}", "e.g. --option shuffle_seed=1")


def _summary(xs: list) -> dict:
    if not xs:
        return {}
    return {"min": min(xs), "max": max(xs), "mean": sum(xs) / len(xs)}


def prism_method(ctx) -> tuple[torch.Tensor, list]:
    """PRISM and its ablations: scores and per-pair rows for pairs.jsonl. With several
    target sets (``ctx.tasks``) each set gets its own direction and the scores are
    ``(N, tasks)``: :func:`_prism_tasks`."""
    if not ctx.inputs.pairs:
        raise ConfigError("targets", f"method {ctx.settings.method!r} needs target pairs", "pass --targets FILE")
    if len(ctx.tasks) > 1:
        return _prism_tasks(ctx)
    t = time.perf_counter()
    d = ctx.plan.direction if ctx.plan is not None and ctx.plan.direction else {}
    # split32 accumulates its float32 gradients itself (precision.float32_grads)
    ex = ctx.execution
    accumulate = d.get("accumulate", "device") if ex.precision != "split32" else "device"
    # one half's graph alive at a time: under a bounded plan (GPU) and on the CPU (host
    # memory: with both halves' activations at once the direction stage reached 2.7-2.9 GB
    # at 60 records, model and gradients included), for one more forward of the
    # rejected half without a graph
    one_graph = ctx.plan is not None and ctx.plan.bounded or ctx.lm.device.type == "cpu"
    kernels = direction_kernels(ex.kernels)
    with direction_policy(ctx.lm.model, ex):
        weights, given = _given_weights(ctx, kernels)
        pref = compute_preference(ctx.lm.model, ctx.modules, ctx.inputs.chosen, ctx.inputs.rejected,
                                  method=ctx.settings.method, pad_id=ctx.pad_id,
                                  batch_size=ctx.direction_batch(),
                                  ids=[p.id for p in ctx.inputs.pairs], accumulate=accumulate,
                                  store=d.get("store", "device"), one_graph=one_graph,
                                  execution=replace(ex, kernels=kernels), weights=weights)
    ctx.timings["preference_s"] = time.perf_counter() - t
    ctx.stage_peak("direction")
    log.info("target direction (%s, %d pairs): %.1f s", ctx.settings.method, len(ctx.inputs.pairs),
             ctx.timings["preference_s"])
    distributed.say(f"target direction ({ctx.settings.method}, {len(ctx.inputs.pairs)} pairs): "
                    f"{ctx.timings['preference_s']:.1f} s", ctx.settings.progress)
    ctx.info["pi"] = _summary(pref.pi.tolist())
    pairs = [{"id": p.id, "pi": float(pref.pi[i]), "margin": float(pref.margin[i]),
              "weight": float(pref.weights[i]), "loss_chosen": float(pref.loss_chosen[i]),
              "loss_rejected": float(pref.loss_rejected[i]), **({"task": p.task} if p.task else {}),
              **{k: v[i] for k, v in given.items()}}
             for i, p in enumerate(ctx.inputs.pairs)]
    return ctx.score_direction(_take_direction(pref), last=True), pairs


#: the methods :func:`prism_method` scores, in order: (name, facts, description)
DIRECTIONS = (
    ("prism", dict(sharded=True, multi_task=True),
     "PRISM: g_z . H^-1 g_KL, target pairs weighted by the model's preference pi_q = sigmoid(margin)"),
    ("equal", dict(sharded=True, multi_task=True), "PRISM ablation: equal aggregation g_0 (every pi_q = 1)"),
    ("unpaired", dict(sharded=True, multi_task=True),
     "PRISM ablation: positive responses only, weighted by their length-normalised likelihood"),
    ("prism_shuffled", dict(control=True, given_weights=True, options=ShuffleOptions),
     "control of PRISM's weights: PRISM with pi permuted across the pairs (seeded; option shuffle_seed)"),
    ("equal_top_half", dict(control=True, given_weights=True),
     "control of PRISM's weights: equal aggregation over the pairs whose pi is above the median"),
)
for _name, _facts, _text in DIRECTIONS:
    register(_name, kind="direction", description=_text, **_facts)(prism_method)


def _prism_tasks(ctx) -> tuple[torch.Tensor, list]:
    """Several target sets in one pass: each task's pairs give their own ``pi``, margins and
    direction (:func:`compute_preference` on that task's pairs alone, so each direction is
    what a run on that task alone forms), each direction is preconditioned by the run's
    one curvature, and the pool is scored along all of them from one forward and backward
    per batch (:meth:`RunContext.score_tasks`). Returns ``(N, tasks)`` scores (None under
    stream) and the pairs' rows, each with its task."""
    ex = ctx.execution
    d = ctx.plan.direction if ctx.plan is not None and ctx.plan.direction else {}
    accumulate = d.get("accumulate", "device") if ex.precision != "split32" else "device"
    one_graph = ctx.plan is not None and ctx.plan.bounded or ctx.lm.device.type == "cpu"
    kernels = direction_kernels(ex.kernels)
    method, inputs = ctx.settings.method, ctx.inputs
    rows: dict = {}
    pis: dict = {}

    def directions():
        for task, idx in ctx.tasks:
            t = time.perf_counter()
            with direction_policy(ctx.lm.model, ex):
                pref = compute_preference(ctx.lm.model, ctx.modules, [inputs.chosen[i] for i in idx],
                                          [inputs.rejected[i] for i in idx], method=method, pad_id=ctx.pad_id,
                                          batch_size=ctx.direction_batch(), ids=[inputs.pairs[i].id for i in idx],
                                          accumulate=accumulate, store=d.get("store", "device"),
                                          one_graph=one_graph, execution=replace(ex, kernels=kernels))
            dt = time.perf_counter() - t
            ctx.timings["preference_s"] = ctx.timings.get("preference_s", 0) + dt
            ctx.stage_peak("direction")
            distributed.say(f"target direction ({method}, task {task}, {len(idx)} pairs): {dt:.1f} s",
                            ctx.settings.progress)
            pis[task] = _summary(pref.pi.tolist())
            for j, i in enumerate(idx):
                p = inputs.pairs[i]
                rows[i] = {"id": p.id, "pi": float(pref.pi[j]), "margin": float(pref.margin[j]),
                           "weight": float(pref.weights[j]), "loss_chosen": float(pref.loss_chosen[j]),
                           "loss_rejected": float(pref.loss_rejected[j]), "task": p.task}
            yield _take_direction(pref)

    scores = ctx.score_tasks(directions())
    ctx.info["pi"] = _summary([rows[i]["pi"] for i in sorted(rows)])
    ctx.info["target_sets"] = [{"task": task, "pairs": len(idx), "pi": pis[task]} for task, idx in ctx.tasks]
    return scores, [rows[i] for i in sorted(rows)]


def _given_weights(ctx, kernels) -> tuple:
    """``(weights, per-pair columns for pairs.jsonl)`` of a control of PRISM's weights
    (``preference.GIVEN_WEIGHTS``), from every pair's ``pi`` by forward passes first;
    ``(None, {})`` for the other directions. ``prism_shuffled``'s permutation is seeded by
    the run's seed and its option ``shuffle_seed`` (``seed * 1000 + shuffle_seed``); each
    pair's row names the pair whose ``pi`` it got (``weight_from``)."""
    method = ctx.settings.method
    if method not in GIVEN_WEIGHTS:
        return None, {}
    _, pi = pair_margins(ctx.lm.model, ctx.inputs.chosen, ctx.inputs.rejected, pad_id=ctx.pad_id,
                         batch_size=ctx.direction_batch(), modules=ctx.modules, kernels=kernels)
    ids = [p.id for p in ctx.inputs.pairs]
    if method == "equal_top_half":
        w = top_half_weights(pi)
        ctx.info["weights"] = {"rule": "1 above the median pi, else 0", "median_pi": float(torch.quantile(pi, 0.5)),
                               "n_weighted": int(w.sum())}
        return w, {"pi_before": [float(x) for x in pi]}
    shuffle_seed = parse_options(method, ctx.settings.method_options).shuffle_seed
    seed = ctx.settings.seed * 1000 + shuffle_seed
    w, perm = shuffled_weights(pi, seed)
    ctx.info["weights"] = {"rule": "pi permuted across the pairs", "shuffle_seed": shuffle_seed,
                           "permutation_seed": seed, "fixed_points": int((perm == torch.arange(len(perm))).sum())}
    return w, {"pi_before": [float(x) for x in pi], "weight_from": [ids[j] for j in perm.tolist()]}


def _take_direction(pref) -> dict:
    """``pref.direction``, no longer referenced by ``pref`` (so scoring can release it)."""
    direction, pref.direction = pref.direction, None
    return direction


def run_tasks(inputs, settings) -> list:
    """The run's target sets: ``[(task, [pair indices])]`` (:func:`prism_select.tasks.task_groups`),
    or one group ``(None, every pair)`` for a method that reads the pairs' tasks itself
    (the baselines, e.g. LESS), under ``combine_tasks``, and for one unnamed set. The
    controls of PRISM's weights (``preference.GIVEN_WEIGHTS``) take one set only."""
    groups = task_groups(inputs.pairs)
    every = [(None, list(range(len(inputs.pairs))))]
    if get(settings.method).kind != "direction" or settings.combine_tasks or not groups:
        return every
    _check_task_method(groups, settings)
    return groups


def _check_task_method(groups: list, settings) -> None:
    """A control of PRISM's weights with several target sets is refused (it weighs
    every pair at once): :func:`run_tasks`, and before the model loads."""
    method = get(settings.method)
    multi = names(multi_task=True)
    if len(groups) > 1 and method.kind == "direction" and not method.multi_task and not settings.combine_tasks:
        raise ConfigError("targets", f"method {settings.method!r} weighs every target pair at once and scores one "
                          f"target set, but the targets hold {len(groups)} tasks "
                          f"({', '.join(str(t) for t, _ in groups[:4])}{', ...' if len(groups) > 4 else ''})",
                          "pass --combine-tasks (one direction from every pair), or use --method "
                          + " / ".join(multi))
    several = len(groups) > 1 and method.multi_task and not settings.combine_tasks
    for name, flag, value in (("shard", "--shard", "fsdp"), ("precision", "--precision", "split32")):
        if several and getattr(settings, name) == value:
            raise ConfigError(name, f"{len(groups)} target sets are not scored in one pass under {flag} {value}",
                              f"drop {flag}, score one task per run, or pass --combine-tasks")


def _method_fn(name: str):
    """The function that scores a run of method ``name`` (the registry's)."""
    return get(name).fn
