"""Fitting the curvature on (a sample of) the pool.

Normalisation (per tracked layer, ``N`` fit examples, ``T`` = all non-padding
tokens of them, prompt tokens included):

    A = (1/T) sum_tokens a a^T        S = (1/N) sum_n sum_t b_t b_t^T

so that ``A (x) S`` approximates ``F = (1/N) sum_n vec(G_n) vec(G_n)^T`` when the
tokens are independent (exact for one token per example and a shared input).
EK-FAC then replaces the Kronecker eigenvalues by
``Lambda = (1/N) sum_n (Q_S^T G_n Q_A)**2`` (a second pass), which is the exact
diagonal of ``F`` in that eigenbasis. The same pass sums the fourth powers, so that
``LambdaVar = ((1/N) sum_n sum_ij R_nij**4 - sum_ij Lambda_ij**2) / (N - 1)`` (with
``R_n = Q_S^T G_n Q_A``) estimates the sampling variance of ``Lambda``, summed over its
entries; with the K-FAC eigenvalues ``lamA``, ``lamS``, which EK-FAC keeps, it sets the
shrinkage weight and the noise damping (:class:`CurvatureSettings`).
``diagonal`` uses ``(1/N) sum_n G_n**2``.

This module runs the passes and puts a fit together; the pieces live beside it:

    factors.py      the factor pass's Gram products and taps, layers sharing one input
    eigh.py         the factors' eigendecompositions and their thread schedule
    eigenvalues.py  EK-FAC's eigenvalue pass (Lambda, LambdaVar)
    stats.py        the passes' sums and their reduction across ranks
    sharded.py      the taps of a sharded (FSDP2) fit
    spill.py        the CPU fit's host spill, and scores formed from it
    base.py         Curvature, the settings, damping and shrinkage
    store.py        the cache key and load-or-fit
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from tqdm.auto import tqdm

from ..data.tokenize import token_losses
from ..engine import batch_losses, causal_only, collate_to, split_causal_lm, tap_linears
from ..engine.policy import fit_policy
from ..gradients import check_finite, release_host_memory
from ..model.moe import is_routed
from ..runtime import distributed, profiling, sharding
from ..runtime.execution import ExecutionContext
from ..runtime.graphs import GraphedScorer, bucket_length, graphs_wanted
from ..runtime.layers import layer_shape
from .base import Curvature, CurvatureSettings, FitSettings, apply_damping
from .eigenvalues import _finish_lambda, _lambda_steps, _LambdaTap
from .eigh import _eigh_many
from .factors import (_CovTap, _DiagTap, _identical, _identical_across_ranks, _LowerBlocks, _mirror,
                      _shared_inputs, _unshare_inputs)
from .sharded import _ShardedCovTap, _ShardedLambdaTap
from .spill import FitScores, _Spill, _spill_wanted, _spilled_groups, _SpillTap
from .stats import _Stats


log = logging.getLogger(__name__)


def length_batches(encoded: list, indices: list, batch_size: int) -> list:
    """Group ``indices`` into batches of similar length (less padding), in a
    deterministic order."""
    order = sorted(indices, key=lambda i: (len(encoded[i].input_ids), i))
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


def fit_indices(n: int, settings: FitSettings) -> list:
    if settings.fit_examples is None or settings.fit_examples >= n:
        return list(range(n))
    rng = random.Random(settings.seed)
    return sorted(rng.sample(range(n), settings.fit_examples))


def _sampled_labels(logits: torch.Tensor, labels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Replace response labels by tokens drawn from the model's own predictions."""
    with torch.no_grad():
        probs = torch.softmax(logits[:, :-1].float(), dim=-1)
        flat = probs.reshape(-1, probs.size(-1)).cpu()
        draw = torch.multinomial(flat, 1, generator=gen).view(probs.shape[:-1]).to(labels.device)
    new = labels.clone()
    mask = labels[:, 1:] != -100
    new[:, 1:][mask] = draw[mask]
    return new


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A fitted tensor moved to host memory (one place, so that a test can follow it)."""
    return t.to("cpu")


class _FitStep:
    """One fit batch: forward, the loss, the backward through the taps (which add to the
    statistics). Returns the per-example finite-loss flags. Under CUDA graphs
    (:class:`prism_select.runtime.graphs.GraphedScorer`) the batch comes padded, without an
    attention mask (``token_mask`` marks the real tokens) and with the plain loss."""

    def __init__(self, model, stats, fisher, seed, split):
        self.model, self.stats, self.fisher, self.split = model, stats, fisher, split
        self.gen = torch.Generator().manual_seed(seed)

    def score(self, b):
        self.stats.start(b)
        with torch.enable_grad():
            if self.fisher == "empirical":
                losses, _ = batch_losses(self.model, causal_only(b), split=self.split)
            else:
                out = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
                losses, _ = token_losses(out.logits, _sampled_labels(out.logits, b["labels"], self.gen))
            ok = torch.isfinite(losses.detach())
            losses.sum().backward()
        self.stats.drain()
        self.stats.cache.clear()
        return ok

    @staticmethod
    def neutral(b):
        """Same shapes, adds nothing: no loss, no real token (graph warm-up)."""
        return {**b, "labels": torch.full_like(b["labels"], -100), "token_mask": torch.zeros_like(b["token_mask"])}


#: under ``cuda_graphs="auto"`` a fit pass is captured only when it replays each padded
#: shape at least this often on average: a capture costs a few steps, and a short or
#: very varied fit never earns it back (docs/performance.md)
FIT_GRAPH_MIN_REPLAYS = 8


def fit_graphs_pay_off(encoded: list, batches: list) -> bool:
    """Whether ``batches`` (lists of indices into ``encoded``) hold at least
    FIT_GRAPH_MIN_REPLAYS batches per distinct padded shape."""
    shapes = {bucket_length(max(len(encoded[i].input_ids) for i in b)) for b in batches}
    return len(batches) >= FIT_GRAPH_MIN_REPLAYS * max(len(shapes), 1)


def _passes(model, taps, stats, encoded, batches, settings: FitSettings, pad_id: int, desc: str,
            execution: ExecutionContext):
    """One pass over ``batches`` (this rank's share) with ``taps`` routing the tracked layers,
    in batches of ``settings.batch_size`` drawn as ``settings.fisher`` says.
    ``execution.cuda_graphs`` (empirical Fisher only): capture each padded batch shape once."""
    fisher, seed, batch_size = settings.fisher, settings.seed, settings.batch_size
    device, progress, cuda_graphs = execution.device, execution.progress, execution.cuda_graphs
    together = sharding.is_sharded(model)  # FSDP2: every rank runs as many steps
    # FSDP2: the length-sorted batches dealt in turn, so the ranks' batches in each step are
    # about as long; otherwise contiguous shares (each rank captures ~1/world of the shapes)
    mine = (distributed.round_robin(batches) if together else
            distributed.shard(batches, [len(b) * max(len(encoded[i].input_ids) for i in b) for b in batches]))
    graphed = (fisher == "empirical" and batch_size is not None and not sharding.is_sharded(model)
               and graphs_wanted(cuda_graphs, device or "cpu", model)
               and (cuda_graphs == "on" or fit_graphs_pay_off(encoded, mine)))
    split = split_causal_lm(model) if fisher == "empirical" and not graphed else None
    step = _FitStep(model, stats, fisher, seed, split)
    runner = GraphedScorer(step, batch_size, pad_id) if graphed else step
    with tap_linears(model, taps):
        bar = tqdm(total=len(mine), desc=desc, unit="batch", leave=False,
                   disable=not progress or not distributed.is_main())
        for batch, real in profiling.steps(desc, distributed.lockstep(mine, batches[0] if batches else None,
                                                                      together)):
            b = collate_to([encoded[i] for i in batch], pad_id, device)
            if fisher == "empirical":  # the mask is only for counting tokens (see causal_only)
                b["token_mask"] = b["attention_mask"]
            if real:
                stats.bad.append((batch, runner.score(b).all()))
                bar.update()
            else:  # a stand-in step: the same collectives, no statistics
                for tap in taps.values():
                    tap.paused = True
                stats.paused = True
                runner.score(b)
                for tap in taps.values():
                    tap.paused = False
                stats.paused = False
        bar.close()
        if graphed:
            runner.graphs.clear()
    for batch, ok in stats.bad:  # one device sync per pass, not per batch
        if not bool(ok):
            check_finite(torch.tensor([float("nan")]), "the training loss", record=batch)
    stats.bad.clear()


@dataclass(frozen=True)
class FitLayout:
    """How the memory plan (:mod:`prism_select.plan`) lays a fit out.

    groups: lists of layer names covering the tracked layers (None: one group); the fit
    runs group by group, each with its own passes over the fit batches, so only one
    group's factors are on the device at a time; the result is the same as one group's
    (every factor of a layer depends only on that layer's inputs and output gradients).
    store: where each finished group's tensors go: ``device`` (kept where they were
    computed), ``host`` (moved to host memory), or ``transient`` (dropped after
    ``on_group``: the returned curvature holds only the damping). offload (EK-FAC; None:
    ``store != "device"``): a group's float32 eigenbases wait in host memory during its
    eigenvalue pass (the memory plan turns it off when the host cannot hold a group's;
    the numbers are the same). sums (K-FAC / EK-FAC with factors sharded over FSDP ranks):
    when each rank's statistics of a layer reach its owner: ``step`` (every step: each
    rank holds only its share) or ``pass`` (each rank sums its batches of every layer of
    the group through a pass, and the sums travel once at its end: the memory plan picks
    it where a whole group's sums fit every rank).
    """

    groups: list | None = None
    store: str = "device"
    offload: bool | None = None
    sums: str = "step"

    def __post_init__(self):
        if self.store not in ("device", "host", "transient"):
            raise ValueError(f"unknown curvature store {self.store!r}")

    @property
    def offloads(self) -> bool:
        """Whether the float32 eigenbases wait in host memory (``offload`` resolved)."""
        return self.store != "device" if self.offload is None else self.offload


@dataclass(frozen=True)
class FitSpill:
    """The CPU EK-FAC fit's spill of the factor pass's layer inputs and gradients, kept for
    the eigenvalue pass (:mod:`.spill`; an unnamed temporary file, SPILL_MAX_BYTES).

    dir: where (None: the system's temporary directory). on_spill(spill): with one group
    of layers, the spill (:class:`_Spill`, which can score the fit examples,
    :meth:`_Spill.scores`) is handed to it once the fit is done instead of being closed;
    the callee closes it. scores (:class:`FitScores`; one group of layers): the fit also
    scores the fit examples along ``scores.direction``; the spill is then closed, not
    handed to ``on_spill``.
    """

    dir: str | None = None
    on_spill: Callable | None = None
    scores: FitScores | None = None


def fit_curvature(model, modules: dict, encoded: list, settings: CurvatureSettings, *, pad_id: int,
                  execution: ExecutionContext | None = None, timings: dict | None = None,
                  layout: FitLayout = FitLayout(), on_group=None, spill: FitSpill = FitSpill()) -> Curvature:
    """Fit ``settings.kind`` curvature for ``modules`` on ``encoded`` examples.

    ``layout`` (:class:`FitLayout`, from the memory plan): the fit groups, where their
    tensors go, and how sharded sums travel. ``on_group(layers, part)`` is called with
    each finished group as a :class:`Curvature` of its layers (e.g. to precondition a
    direction with it). ``spill``: the CPU fit's spill and what is done with it
    (:class:`FitSpill`). ``execution`` (default: :meth:`ExecutionContext.of` the model):
    the device; ``precision`` (under ``split32`` the fit computes as the scores do,
    :func:`prism_select.engine.policy.fit_policy`, with ``kernels``); ``cuda_graphs``
    (empirical Fisher only; ``auto``: CUDA devices, models below
    ``graphs.AUTO_MAX_PARAMS``, and passes that replay each shape FIT_GRAPH_MIN_REPLAYS
    times) captures each padded fit-batch shape once and replays it
    (:mod:`prism_select.runtime.graphs`; the statistics are the same sums); ``progress``.
    ``timings``, if given, receives ``factors_s``, ``eigh_s`` and ``lambda_s`` (summed
    over groups).

    Under ``torchrun`` (an initialised process group), each rank runs its share of the
    fit batches. Data-parallel ranks sum the statistics (all-reduce) before each
    eigendecomposition, so every rank ends with the same curvature. With the model sharded
    by FSDP (:func:`factors_sharded`) each rank's statistics of a layer are summed onto its
    owner rank as the passes run (when: ``layout.sums``), and each rank ends with its own
    layers' curvature (``meta["owners"]``; the damping and shrinkage of every layer).
    """
    layers = list(modules)
    groups = [list(g) for g in layout.groups] if layout.groups else [layers]
    if sorted(n for g in groups for n in g) != sorted(layers):
        raise ValueError("the fit groups must cover the tracked layers exactly once")
    timings = timings if timings is not None else {}
    for k in ("factors_s", "eigh_s", "lambda_s"):
        timings.setdefault(k, 0.0)
    if settings.kind == "identity":
        cur = Curvature("identity", layers, {}, {n: 0.0 for n in layers})
        if on_group is not None:
            on_group(layers, cur)
        return cur
    execution = execution or ExecutionContext.of(model)
    batches = length_batches(encoded, fit_indices(len(encoded), settings), settings.batch_size)
    tensors, damping, shrinkage, owned_by = {}, {}, {}, {}
    sharded = factors_sharded(model, settings.kind)
    with fit_policy(model, execution):
        for k, group in enumerate(groups):
            tag = f" (group {k + 1}/{len(groups)})" if len(groups) > 1 else ""
            sub = {n: modules[n] for n in group}
            owners = sharding.factor_owners(group, sub) if sharded else None
            before = dict(timings)
            t = _fit_group(model, sub, encoded, batches, settings, pad_id=pad_id, execution=execution,
                           timings=timings, layout=layout, owners=owners,
                           spill=spill if len(groups) == 1 else FitSpill(spill.dir), tag=tag)
            log.info("curvature%s: %d layers, factors %.1f s, eigendecompositions %.1f s, eigenvalues %.1f s",
                     tag, len(group), *(timings[k] - before[k] for k in ("factors_s", "eigh_s", "lambda_s")))
            if layout.store == "host":
                t = {name: _to_host(x) for name, x in t.items()}
            part = _damped_group(settings, group, t, owners)
            if owners is not None:
                owned_by.update(owners)
            if on_group is not None:
                on_group(group, part)
            damping.update(part.damping)
            shrinkage.update(part.shrinkage)
            if layout.store != "transient":
                tensors.update(t)
            del t, part
    meta = {"store": layout.store, "groups": len(groups)}
    if sharded:
        meta["owners"] = owned_by
    return Curvature(settings.kind, layers, tensors, damping, meta=meta, shrinkage=shrinkage)


def _damped_group(settings: CurvatureSettings, group: list, t: dict, owners: dict | None) -> Curvature:
    """One fitted group as a :class:`Curvature` with its damping and shrinkage. With
    sharded factors (``owners``) this rank damps its own layers, and every rank learns
    every layer's damping and shrinkage."""
    if owners is None:
        return apply_damping(Curvature(settings.kind, group, t, {}), settings)
    mine = apply_damping(Curvature(settings.kind, [n for n in group if owners[n] == distributed.rank()], t, {}),
                         settings)
    return Curvature(settings.kind, group, t, distributed.merge_dicts(mine.damping),
                     meta={"owners": owners}, shrinkage=distributed.merge_dicts(mine.shrinkage))


def factors_sharded(model, kind: str) -> bool:
    """Whether a fit of ``kind`` shards its factors over the ranks: K-FAC and EK-FAC of a
    model sharded with FSDP (:mod:`prism_select.runtime.sharding`). Each layer's factors then live
    on one rank (:func:`prism_select.runtime.sharding.factor_owners`), which receives the other
    ranks' layer inputs and output gradients in every step, so per-rank factor memory
    falls as ``1/K``; data-parallel ranks (a whole model each) sum full factors instead."""
    return kind in ("ekfac", "kfac") and distributed.active() and sharding.is_sharded(model)


def _decompose(A: dict, S: dict, reps: list, own: list, owners, compute, desc: str, progress: bool):
    """Eigendecompose each distinct ``A`` (one per representative in ``reps``) and each
    owned layer's ``S``, freeing each factor (its entry set to None) once it is decomposed.
    Returns ``(results, tasks, where)``: ``(kind, layer) -> (eigenvalues, eigenbasis)``, the
    tasks in order, and the rank that decomposes each (the others' results are empty
    tensors until :func:`prism_select.runtime.distributed.share_from_owners`)."""
    me = distributed.rank()
    # Tasks: one eigh per distinct A and one per layer's S. Under torchrun they are
    # spread over the ranks by cost (~size^3, largest first), and each result is then
    # broadcast by the rank that computed it; sharded factors are decomposed by their owner.
    # Each factor is freed once decomposed.
    tasks = [("A", r) for r in reps] + [("S", n) for n in own]
    where = distributed.balance([(A[n] if k == "A" else S[n]).shape[0] ** 3 for k, n in tasks]) \
        if owners is None else [me] * len(tasks)
    results = {}

    def factor(i):
        k, n = tasks[i]
        return A[n] if k == "A" else S[n]

    mine = [i for i, r in enumerate(where) if r == distributed.rank()]
    with tqdm(total=len(tasks), desc=desc, unit="factor", leave=False,
              disable=not progress or not distributed.is_main()) as bar:
        for i in (i for i, r in enumerate(where) if r != distributed.rank()):
            M = factor(i)
            results[tasks[i]] = (M.new_empty(M.shape[0]), torch.empty_like(M))
            k, n = tasks[i]
            (A if k == "A" else S)[n] = None  # another rank decomposes it
            del M
        for i, (lam, Q) in _eigh_many(factor, mine):
            k, n = tasks[i]
            # row-major: LAPACK's column-major Q would be copied whole when the curvature is
            # saved (+0.8 GB of host memory for the embedded model)
            results[(k, n)] = (lam.clamp(min=0).to(compute), Q.to(compute).contiguous())
            on_host = Q.device.type == "cpu"
            del lam, Q
            (A if k == "A" else S)[n] = None  # each factor is freed once decomposed
            if on_host:
                # the freed factor, LAPACK's column-major Q and the workers' scratch are
                # holes in the heap arenas that the next factor's sizes do not fill:
                # untrimmed, the phase rose ~560 MiB above the decomposed curvature on the
                # embedded model (dropped at its end), the highest plateau of the CPU fit
                release_host_memory()
            bar.update()
        bar.update(len(tasks) - len(mine))
    return results, tasks, where


def _fit_group(model, modules: dict, encoded: list, batches: list, settings: CurvatureSettings, *, pad_id: int,
               execution: ExecutionContext, timings: dict, layout: FitLayout = FitLayout(),
               owners: dict | None = None, spill: FitSpill = FitSpill(), tag: str = "") -> dict:
    """The fit of one group of layers: the tensors :class:`Curvature` holds
    (:class:`_GroupFit`; ``layout.offloads`` and ``layout.sums`` as there)."""
    return _GroupFit(model, modules, encoded, batches, settings, pad_id, execution, timings, owners=owners,
                     local_sums=layout.sums == "pass", offload=layout.offloads, spill=spill, tag=tag).run()


@dataclass
class _GroupFit:
    """One group's fit, phase by phase (:meth:`run`): the factor pass, the factors'
    eigendecompositions, and (EK-FAC) the eigenvalue pass; the diagonal in one pass.

    ``offload``: the finished tensors go to host memory as soon as the device copies that
    the eigenvalue pass needs are made (the pass then holds only those). ``owners``
    (K-FAC / EK-FAC under FSDP, :func:`prism_select.runtime.sharding.factor_owners`): each layer's
    statistics are accumulated, decomposed and kept by its owner rank alone, and this
    rank returns the tensors of the layers it owns. ``local_sums`` (with ``owners``): each
    rank sums its own batches' statistics of every layer of the group through a pass and
    they reach the owners once, at its end (and every rank receives every layer's
    eigenbases once, before the eigenvalue pass), instead of at every step: the same sums,
    far fewer transfers, the whole group's sums on every rank. ``spill``
    (:class:`FitSpill`): where the CPU's EK-FAC fit spills, and who receives the spill.
    """

    model: torch.nn.Module
    modules: dict
    encoded: list
    batches: list
    settings: CurvatureSettings
    pad_id: int
    execution: ExecutionContext
    timings: dict
    owners: dict | None = None
    local_sums: bool = False
    offload: bool = False
    spill: FitSpill = field(default_factory=FitSpill)
    tag: str = ""

    def __post_init__(self):
        self.layers = list(self.modules)
        self.n_examples = sum(len(b) for b in self.batches)
        self.device = self.execution.device
        self.me = distributed.rank()
        self.own = [n for n in self.layers if self.owners is None or self.owners[n] == self.me]
        self.local = self.owners is not None and self.local_sums
        self.step_sums = self.owners is not None and not self.local  # summed onto their owners every step
        self.summing = self.layers if self.local else self.own  # the layers this rank sums in the passes
        self.compute = torch.float64 if next(self.model.parameters()).dtype == torch.float64 else torch.float32
        self.stats = _Stats(self.compute)
        self.tensors: dict = {}

    def zeros(self, *shape):
        return torch.zeros(*shape, dtype=self.compute, device=self.device)

    def sync(self):
        """Wait for the device, so that a phase's time is its own."""
        if self.device is not None and torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def _pass(self, taps: dict, desc: str, batches: list | None = None):
        _passes(self.model, taps, self.stats, self.encoded, self.batches if batches is None else batches,
                self.settings, self.pad_id, desc + self.tag, self.execution)

    def run(self) -> dict:
        if self.settings.kind == "diagonal":
            return self._diagonal()
        # Pass 1: Kronecker factors. On the CPU (EK-FAC, one process) the layers' inputs and
        # output gradients only, spilled to a file, from which _spilled_groups forms them;
        # otherwise summed in the pass, where layers reading one input (unsharded) sum their A
        # in one accumulator (q/k/v, gate/up: 0.11 GiB of the embedded model's 1.02 GiB).
        t0 = time.perf_counter()
        spill = self._open_spill()
        taps = {n: _SpillTap(m, n, spill, self.stats) for n, m in self.modules.items()} if spill is not None \
            else self._factor_taps()
        try:
            self._pass(taps, "curvature factors")
        except BaseException:
            if spill is not None:
                spill.close()
            raise
        self.stats.spill = None
        del taps
        release_host_memory()
        n_tok = self.stats.n_tokens if self.stats.n_tokens is not None else torch.zeros((), device=self.device)
        n_tok = n_tok.to(self.compute).reshape(1)
        if spill is not None:
            return self._from_spill(spill, n_tok, t0)
        n_tokens = self._reduce_factors(n_tok)
        self.sync()
        self.timings["factors_s"] += time.perf_counter() - t0
        group_of = self._eigendecompose(n_tokens)
        if self.settings.kind == "kfac":
            _unshare_inputs(self.tensors, self.own)
            return self.tensors
        self._eigenvalue_pass(group_of)
        return self.tensors

    def _diagonal(self) -> dict:
        """The diagonal curvature ``(1/N) sum_n G_n**2`` of every layer, in one pass."""
        t0 = time.perf_counter()
        D = {n: self.zeros(*layer_shape(m)) for n, m in self.modules.items()}
        taps = {n: _DiagTap(m, self.stats, D[n]) for n, m in self.modules.items()}
        self._pass(taps, "curvature (diagonal)")
        distributed.all_reduce_sum(list(D.values()))
        tensors = {}
        for n in self.modules:
            tensors[f"{n}::D"] = D[n] / self.n_examples
            check_finite(tensors[f"{n}::D"], "the diagonal curvature", layer=n)
        self.sync()
        self.timings["factors_s"] += time.perf_counter() - t0
        return tensors

    def _open_spill(self):
        """The spill of the factor pass where the fit wants one (:func:`_spill_wanted`),
        else None; the statistics write to it."""
        spill = None
        if _spill_wanted(self.model, self.modules, self.encoded, self.batches, self.device, self.settings,
                         self.spill.dir):
            try:
                spill = _Spill(self.spill.dir)
            except OSError as exc:  # an unwritable directory: the factors are summed in the pass
                log.info("no spill file for the fit (%s); the eigenvalue pass runs the model again", exc)
        self.stats.spill = spill
        return spill

    def _factor_taps(self) -> dict:
        """The factor pass's taps and the accumulators they sum into: ``A`` (one per
        distinct input, ``roots``; ``first[n]`` the layer whose accumulator ``n`` reads)
        and ``S`` of every layer this rank sums."""
        modules, summing = self.modules, self.summing
        # (sharded factors: no probe forward outside the lockstep passes; with local sums it
        # left the ranks' FSDP collectives out of step in the two-process test. A layer that
        # finds its input's product in the batch's cache adds it to its own A instead.)
        self.first = {n: n for n in self.layers} if self.owners is not None else \
            _shared_inputs(self.model, modules, self.encoded, self.batches, self.pad_id, self.device)
        # on the CPU (unsharded) a wide factor is summed as its lower block triangle alone
        # (_LowerBlocks)
        packed = self.owners is None and distributed.world() == 1

        def factor_zeros(D, d):
            if packed and _LowerBlocks.wanted(d, self.device):
                return _LowerBlocks(D, d, self.compute)
            return self.zeros(D, D)

        first = self.first
        self.roots = [n for n in summing if first[n] == n]  # one per accumulator of A
        A = {n: factor_zeros(layer_shape(modules[n])[1], modules[n].in_features) for n in self.roots}
        A.update({n: A[first[n]] for n in summing})
        readers = {r: sum(first[n] == r for n in summing) for r in self.roots}
        shared = {n for n in summing if readers[first[n]] > 1}
        S = {n: factor_zeros(layer_shape(modules[n])[0], layer_shape(modules[n])[0]) for n in summing}
        self.A, self.S = A, S
        if self.step_sums:
            return {n: _ShardedCovTap(m, self.stats, A.get(n), S.get(n), self.owners[n], n)
                    for n, m in modules.items()}
        return {n: _CovTap(m, self.stats, A[n], S[n], n, n in shared) for n, m in modules.items()}

    def _from_spill(self, spill, n_tok, t0) -> dict:
        """EK-FAC, one process, the CPU (:func:`_spill_wanted`): factors,
        eigendecompositions and eigenvalues together, group by group, from the spill."""
        scores = self.spill.scores
        spill.finish()
        spill.examples = self.batches
        n_tokens = int(round(float(n_tok)))
        self.timings["factors_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            routed = {n: int(round(float(c))) for n, c in self._routed_counts().items()}
            tensors, Lam, M4, secs = _spilled_groups(self.modules, spill, self.compute, n_tokens, self.n_examples,
                                                     "curvature" + self.tag, self.execution.progress, scores,
                                                     routed)
            if scores is not None:
                scores.finish(self.layers)
        except BaseException:
            spill.close()
            raise
        if self.spill.on_spill is None or scores is not None and scores.scores is not None:
            spill.close(background=True)
        else:
            self.spill.on_spill(spill)
        _finish_lambda(tensors, Lam, M4, self.own, self.n_examples)
        # the wall time, split between the phases as the workers' time was
        dt = time.perf_counter() - t0
        share = secs["eigh"] / max(secs["eigh"] + secs["lambda"], 1e-9)
        self.timings["eigh_s"] += dt * share
        self.timings["lambda_s"] += dt * (1 - share)
        return tensors

    def _routed_counts(self) -> dict:
        """Each expert layer's count of routed real tokens (this rank's), in the layers'
        order (the same on every rank: a layer no batch reached counts zero)."""
        counts = self.stats.layer_tokens
        return {n: counts[n].reshape(1) if n in counts else
                torch.zeros(1, dtype=self.compute, device=self.device)
                for n in self.layers if is_routed(self.modules[n])}

    def _reduce_factors(self, n_tok) -> int:
        """The factor sums as full matrices, summed across ranks (each rank keeping what it
        decomposes); returns the token count."""
        A, S, first, summing = self.A, self.S, self.first, self.summing
        for n in self.roots:  # one factor at a time: a packed one is freed as its full matrix is made
            A[n] = _mirror(A[n])
        A.update({n: A[first[n]] for n in summing})
        for n in summing:
            S[n] = _mirror(S[n])
        if self.local:
            # Layers reading one input (q/k/v, gate/up) hold bitwise-identical sums here (one
            # product per input in the pass): each input's sum is sent once. Summed apart over
            # more than two ranks, copies at other offsets of the reduction buffer would be
            # added in other orders, differ in their last bits and be decomposed once each.
            first = self.first = _identical_across_ranks(self.roots, A)
            self.roots = [n for n in self.roots if first[n] == n]
            A = {n: A[first[n]] for n in summing}
        # sharded factors summed every step were summed on their owners as the pass went
        routed = self._routed_counts()
        distributed.all_reduce_sum(([] if self.step_sums else [A[n] for n in self.roots] + list(S.values()))
                                   + [n_tok] + list(routed.values()))
        self.routed = {n: int(round(float(c))) for n, c in routed.items()}
        if self.local:  # this rank keeps its own layers' sums and the accumulators they read
            self.roots = list(dict.fromkeys(first[n] for n in self.own))
            A, S = {n: A[n] for n in [*self.roots, *self.own]}, {n: S[n] for n in self.own}
        self.A, self.S = A, S
        return int(round(float(n_tok)))

    def _eigendecompose(self, n_tokens: int) -> dict:
        """Normalise the factors and eigendecompose each distinct one; the eigenbases and
        eigenvalues go to ``tensors``. Returns each layer's input group (the index of the
        distinct ``A`` it reads)."""
        t0 = time.perf_counter()
        A, S, roots, own = self.A, self.S, self.roots, self.own
        # Layers reading the same input have bitwise-identical A (one product per input in
        # the pass): group them by a fingerprint (one host sync), confirm with torch.equal,
        # and decompose each distinct A once.
        # (sums once per pass: grouped before they were sent, roots are distinct already)
        rep = {n: n for n in roots} if self.local else _identical(roots, A)
        reps = [n for n in roots if rep[n] == n]  # group id -> representative layer
        group_of = {n: reps.index(rep[n]) for n in roots}  # layer -> group id
        for n in own:  # summed in the accumulator of the first layer reading their input
            group_of[n] = group_of[self.first[n]]
        for n in roots:  # an expert's layer: over the tokens routed to it (prism_select.model.moe)
            A[n] /= max(self.routed.get(n, n_tokens), 1)
            check_finite(A[n], "the activation covariance", layer=n)
        for n in own:
            S[n] /= self.n_examples
            check_finite(S[n], "the gradient covariance", layer=n)
        for n in own:  # the duplicates' accumulators are not needed any more
            if n != reps[group_of[n]]:
                A[n] = None
        results, tasks, where = _decompose(A, S, reps, own, self.owners, self.compute,
                                           "eigendecompositions" + self.tag, self.execution.progress)
        if self.owners is None:
            distributed.share_from_owners([t for kn in tasks for t in results[kn]],
                                          [r for r in where for _ in range(2)])
        for n in own:  # layers reading one input share its eigenbasis until _unshare_inputs
            self.tensors[f"{n}::lamA"], self.tensors[f"{n}::QA"] = results[("A", reps[group_of[n]])]
            self.tensors[f"{n}::lamS"], self.tensors[f"{n}::QS"] = results[("S", n)]
        del A, S, results
        self.A = self.S = None
        # the decomposed factors and LAPACK's outputs were freed in the workers' heaps
        release_host_memory()
        self.sync()
        self.timings["eigh_s"] += time.perf_counter() - t0
        return group_of

    def _lambda_taps(self, group_of: dict, Lam: dict, M4: dict) -> dict:
        """The eigenvalue pass's taps, each with its layer's eigenbases and sums."""
        tensors, owners, taps = self.tensors, self.owners, {}
        # (local sums) a layer's inputs are rotated once per owner and eigenbasis, as the owner
        # does with sums every step
        qa_key = distributed.merge_dicts({n: (self.me, group_of[n]) for n in self.own}) if self.local else None
        for n, m in self.modules.items():
            if self.local:  # every layer's eigenbases in the model's dtype, from its owner, for the pass
                out, inp = layer_shape(m)
                dt = m.weight.dtype
                QA = distributed.broadcast_from(tensors.get(f"{n}::QA"), owners[n], (inp, inp), dt, self.device)
                QS = distributed.broadcast_from(tensors.get(f"{n}::QS"), owners[n], (out, out), dt, self.device)
                tap = taps[n] = _LambdaTap(m, self.stats, QA, QS, qa_key[n])
                del QA, QS
            elif owners is not None:
                tap = taps[n] = _ShardedLambdaTap(m, self.stats, tensors.get(f"{n}::QA"), tensors.get(f"{n}::QS"),
                                                  group_of.get(n), owners[n])
                if owners[n] != self.me:
                    continue
            else:
                tap = taps[n] = _LambdaTap(m, self.stats, tensors[f"{n}::QA"], tensors[f"{n}::QS"], group_of[n])
            if self.offload and n in self.own:  # the taps hold the eigenbases in the model's dtype; the float32
                # ones wait on the host, moved there layer by layer: the group's float32 and half copies
                # never coexist
                for k in ("QA", "lamA", "lamS", "QS"):
                    tensors[f"{n}::{k}"] = _to_host(tensors[f"{n}::{k}"])
            # a layer's sums are allocated once its float32 eigenbases have left: allocated for
            # the whole group first, they stood next to all of its float32 eigenbases (the
            # pass-1 factors' size) and exceeded the plan's figure for the fit (tests/integration/test_scale.py)
            Lam[n] = tap.Lam = self.zeros(*layer_shape(m))
            M4[n] = tap.M4 = self.zeros(1)
        return taps

    def _eigenvalue_pass(self, group_of: dict):
        """Pass 2 (EK-FAC): eigenvalues corrected with per-example gradients in the eigenbasis."""
        t0 = time.perf_counter()
        Lam, M4 = {}, {}
        taps = self._lambda_taps(group_of, Lam, M4)
        steps = _lambda_steps(self.modules, self.encoded, self.batches, self.settings.fisher, self.device,
                              self.owners)
        self._pass(taps, "curvature eigenvalues", steps)
        del taps
        if not self.step_sums:
            distributed.all_reduce_sum(list(Lam.values()) + list(M4.values()))
        if self.local:  # this rank keeps its own layers' sums
            for n in set(self.layers) - set(self.own):
                del Lam[n], M4[n]
        _finish_lambda(self.tensors, Lam, M4, self.own, self.n_examples)
        _unshare_inputs(self.tensors, self.own)
        self.sync()
        self.timings["lambda_s"] += time.perf_counter() - t0
