"""The memory plan: where each stage of a run keeps what, decided before any work.

A run holds on its device, besides the model's weights ``W``:

=============  ==========================================================================
stage          what it adds
=============  ==========================================================================
direction      the tracked layers' gradients (model dtype), one batch of target pairs'
               activations and logits; the finished direction (float32) goes layer by
               layer to the *direction store* (the device, or host memory)
fit, pass 1    the float32 factors ``A`` (in' x in') and ``S`` (out x out) of one *group*
               of layers, one fit batch's activations (counted per layer: an upper
               bound, as layers reading one input share their ``A``)
eigh           the largest factor's eigendecomposition workspace
fit, pass 2    (EK-FAC) ``Q_A``, ``Q_S`` in the model's dtype and ``Lambda`` (float32,
               out x in') of the group, and one batch of rotated per-example gradients;
               layer by layer, the float32 eigenbases leave (to the host, unless the
               curvature stays on the device) before that layer's ``Lambda`` is allocated
scoring        ``V`` (the preconditioned direction, model dtype) and one batch; with
               ``k`` target sets, ``k`` directions and each example's gradient of the
               largest tracked layer (:meth:`_Planner.scoring`)
=============  ==========================================================================

Activations are *measured*: one forward and activation backward of the longest example
(batch of one), scaled by the batch size. The plan then

- splits the tracked layers into contiguous groups (whole decoder blocks where they fit)
  whose pass-1 factors fit next to the weights: the fit runs group by group, two passes
  over the fit sample per group (:func:`prism_select.curvature.fit.fit_curvature`);
- chooses where the fitted curvature lives (``curvature_store``): ``device`` when every
  group's factors fit there at once and the fit holding them still fits (one group, as
  without a plan), ``host`` when they fit in ``HOST_FRACTION`` of the host's available
  memory and in host memory next to the direction and ``v`` (moved there group by group
  and brought back a layer at a time to precondition), else ``transient``: each group's
  factors precondition the run's direction as soon as they are fitted and are dropped
  (``v`` is kept; nothing is cached, and a second direction means a second fit);
- budgets host memory too (``HOST_USABLE`` of what the host has available when planning):
  the float32 direction where it is kept there, ``v`` (formed there, and under
  ``transient`` collected there group by group), a host-kept curvature, and under
  ``transient`` EK-FAC a group's float32 eigenbases, which wait there during the group's
  eigenvalue pass (``fit["offload"]``): groups are made small enough for that too, or the
  eigenbases stay on the device (more, smaller groups), and :class:`PlanError` names host
  memory when neither fits. ``host`` records the figures (available, usable, and the most
  the direction, the fit and the scoring keep there);
- chooses where the target direction accumulates (``device`` ``.grad``, or ``host``:
  each layer's gradient is moved to a float32 host accumulator as soon as autograd
  finishes it) and where the finished direction is kept;
- lowers a stage's batch size when one batch does not fit, and records it;
- raises :class:`PlanError` in seconds, before the first pass, when even one layer per
  group or one example per batch does not fit, saying what would.

On the CPU nothing is bounded (one group, everything in host memory); the plan still
records the estimates. ``max_gpu_memory`` caps the usable device memory below what the
device has free (for a GPU shared with other work).
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass, field

import torch

from .curvature.stats import RECENT_INPUTS, REDUCE_WINDOW
from .engine import batch_losses, causal_only, collate_to, split_causal_lm
from .errors import PrismError
from .gradients import activation_grad_mode
from .runtime.layers import layer_shape
from .runtime.memory import gib, host_share_bytes
from .settings import GiB, parse_bytes  # noqa: F401 (parse_bytes: part of the plan's interface)

log = logging.getLogger(__name__)

#: device memory kept free for the CUDA context, allocator fragmentation and library
#: workspaces (cuBLAS, cuSOLVER) that the estimates do not count
HEADROOM_BYTES = 3 * GiB
#: measured activation bytes are scaled by this before planning (length-bucketed
#: padding and allocator rounding make real batches a little larger than the probe)
ACTIVATION_SAFETY = 1.25
#: float32 ``n x n`` buffers alive during one eigendecomposition (input, eigenvectors,
#: solver workspace)
EIGH_BUFFERS = 4
#: share of the host's available memory the fitted curvature may take under ``host``
#: (besides the budget of everything the run keeps there, HOST_USABLE)
HOST_FRACTION = 0.6
#: share of the host's available memory (when planning, after the model is loaded) that
#: what the run keeps there may take: the float32 target direction, a fit group's float32
#: eigenbases waiting there during the eigenvalue pass, a host-kept curvature, and ``v``
#: (the rest is for the process's own heap, the tokenised inputs and the page cache)
HOST_USABLE = 0.9
#: the finished target direction stays on the device only below this share of the usable
#: memory (it is alive through the fit and the scoring)
DIRECTION_ON_DEVICE = 0.05
STORES = ("device", "host", "transient")
_BLOCK = re.compile(r"^(.*?\.\d+)\.")


class PlanError(PrismError):
    """The run cannot fit the device's memory as configured; the message says what would."""


# ----------------------------------------------------------------------------- sizes

def pass1_bytes(out: int, inp: int, acc: int = 4) -> int:
    """Float32 (or float64) factors ``A`` and ``S`` of one layer."""
    return acc * (out * out + inp * inp)


def pass2_bytes(out: int, inp: int, half: int, acc: int = 4) -> int:
    """Pass 2 (EK-FAC): ``Q_A``, ``Q_S`` in the model's dtype and ``Lambda``."""
    return half * (out * out + inp * inp) + acc * out * inp


def stored_bytes(kind: str, out: int, inp: int, acc: int = 4) -> int:
    """The fitted tensors of one layer as kept after the fit."""
    if kind == "ekfac":
        return acc * (out * out + inp * inp + out * inp)
    if kind == "kfac":
        return acc * (out * out + inp * inp + out + inp)
    if kind == "diagonal":
        return acc * out * inp
    return 0


def units(names: list) -> list:
    """Consecutive tracked layers of one decoder block (``...layers.7.``) as one unit, so a
    group boundary falls between blocks and layers reading one input stay together."""
    out, key = [], None
    for n in names:
        m = _BLOCK.match(n)
        k = m.group(1) if m else n
        if out and k == key:
            out[-1].append(n)
        else:
            out.append([n])
            key = k
    return out


def make_groups(names: list, cost: dict, budget: int, cost2: dict | None = None,
                budget2: int | None = None, carry2: dict | None = None) -> list | None:
    """Contiguous groups of ``names`` whose summed ``cost`` stays within ``budget`` (and
    ``cost2`` within ``budget2``, e.g. host memory, where given): whole units where one
    fits, single layers otherwise; None if one layer alone does not fit. ``carry2``: bytes
    of ``budget2`` that a finished group's layers keep for the rest of the run (e.g. their
    part of ``v``), so that later groups have less of it."""
    limits = [(cost, budget, {})] + ([(cost2, budget2, carry2 or {})] if cost2 is not None else [])
    base = [0] * len(limits)  # carried by the finished groups

    def over(piece, used):
        return any(b0 + u + sum(c[n] for n in piece) > b for (c, b, _), u, b0 in zip(limits, used, base))

    groups, cur, used = [], [], [0] * len(limits)
    for unit in units(names):
        pieces = [unit] if not over(unit, [0] * len(limits)) else [[n] for n in unit]
        for piece in pieces:
            if cur and over(piece, used):
                groups.append(cur)
                base = [b0 + sum(k.get(n, 0) for n in cur) for (_, _, k), b0 in zip(limits, base)]
                cur, used = [], [0] * len(limits)
            if over(piece, used):
                return None
            cur = cur + piece
            used = [u + sum(c[n] for n in piece) for (c, _, _), u in zip(limits, used)]
    if cur:
        groups.append(cur)
    return groups


# ----------------------------------------------------------------------------- probe

def measure_example_bytes(model, example, pad_id: int, device, copies: int = 1) -> int:
    """Peak device memory of one forward + activation backward of ``example`` (a batch of
    ``copies`` of it) above what was allocated before, as the fit and the scores run it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    example_step(model, example, pad_id, dev, copies)
    torch.cuda.synchronize(dev)
    return max(torch.cuda.max_memory_allocated(dev) - base, 0)


def example_step(model, example, pad_id: int, device, copies: int = 1) -> None:
    """The step :func:`measure_example_bytes` measures: one forward and activation backward
    of ``copies`` of ``example`` (tests measure it on the CPU with their own tracker)."""

    b = collate_to([example] * copies, pad_id, torch.device(device))
    with activation_grad_mode(model), torch.enable_grad():
        losses, _ = batch_losses(model, causal_only(b), split=split_causal_lm(model))
        losses.sum().backward()
    del losses, b


# ----------------------------------------------------------------------------- plan

@dataclass
class MemoryPlan:
    """Where a run keeps what (see the module docstring). Sizes in bytes."""

    device: str
    bounded: bool  # False on the CPU: nothing is limited, the sizes are estimates
    usable: int | None  # device bytes the run may use (after HEADROOM_BYTES)
    weights: int  # device bytes allocated when planning (the model)
    example_activations: int  # measured: one example of the longest length
    direction: dict = field(default_factory=dict)  # accumulate, store, batch_size, peak
    fit: dict = field(default_factory=dict)  # groups, batch_size, peak, factor bytes
    curvature_store: str = "device"
    scoring: dict = field(default_factory=dict)  # batch_size, peak
    #: FSDP: decoder blocks keep their gathered weights from forward to backward
    #: (:func:`prism_select.runtime.sharding.weights_gathered`); ``peak`` includes the whole model then
    keep_gathered: bool = False
    #: host memory (bounded plans): available, usable, and what the direction, the fit and
    #: the scoring keep there at most
    host: dict = field(default_factory=dict)
    peak: int = 0
    notes: list = field(default_factory=list)

    @property
    def fit_groups(self) -> list:
        return self.fit.get("groups") or []

    def to_json(self) -> dict:
        d = asdict(self)
        d["fit"] = {k: v for k, v in d["fit"].items() if k != "groups"}
        d["fit"]["group_sizes"] = [len(g) for g in self.fit_groups]
        d["fit"]["groups"] = [[g[0], g[-1]] for g in self.fit_groups]  # first and last layer
        return d

    def describe(self) -> str:
        """A few lines for the console."""
        cap = gib(self.usable) if self.usable is not None else "unbounded"
        lines = [f"memory plan on {self.device} (usable {cap}; weights {gib(self.weights)}; "
                 f"expected peak {gib(self.peak)})"]
        d, f, s = self.direction, self.fit, self.scoring
        if d:
            lines.append(f"  direction: gradients accumulate on the {d['accumulate']}, kept on the "
                         f"{d['store']}, batch {d['batch_size']}, peak {gib(d['peak'])}")
        if f.get("groups"):
            kept = (f"kept on the {self.curvature_store}" if self.curvature_store != "transient"
                    else "not kept: each group preconditions the direction")
            sharded = ""
            if f.get("factor_shards", 1) > 1:
                when = "once per pass" if f.get("sums") == "pass" else "every step"
                sharded = f" over {f['factor_shards']} ranks, statistics sent to their owners {when}"
            lines.append(f"  fit: {len(f['groups'])} group(s) of layers, batch {f['batch_size']}, "
                         f"peak {gib(f['peak'])}; curvature ({gib(f['stored_bytes'])}{sharded}) {kept}")
        if s:
            lines.append(f"  scoring: batch {s['batch_size']}, peak {gib(s['peak'])}")
        h = self.host
        if h:
            lines.append(f"  host memory: {gib(h['peak'])} of {gib(h['usable'])} usable "
                         f"({HOST_USABLE:.0%} of {gib(h['available'])} available): direction "
                         f"{gib(h['direction'])}, fit {gib(h['fit'])}, scoring {gib(h['scoring'])}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _suggestions(n_layers: int, what: str) -> str:
    return ("what would fit: a PEFT adapter (--adapter; its LoRA matrices are then the tracked layers), "
            f"fewer tracked layers (--modules REGEX ...; now {n_layers}), a smaller --batch-size or "
            f"--max-length, or a GPU with more memory ({what})")


@dataclass(frozen=True)
class ExampleSize:
    """The longest example, as the plan counts it: ``activation_bytes`` measured for one
    example of ``tokens`` tokens (:func:`measure_example_bytes`), and ``vocab``, the width
    of its logits."""

    activation_bytes: int
    tokens: int
    vocab: int


@dataclass(frozen=True)
class Shards:
    """The ranks a model is sharded over (FSDP2, :mod:`prism_select.runtime.sharding`) and the
    sharded run's memory choices.

    count: the ranks; each holds ``1/count`` of the gradients and the direction, and ``v``
    inside the weights' shards; K-FAC and EK-FAC factors are sharded too (each layer's on
    one rank, :func:`prism_select.curvature.fit.factors_sharded`), so a fit group may be
    about ``count`` times larger, while every rank holds, for one layer at a time, its own
    product of the factor pass and the owner's eigenbases and its own sums in the
    eigenvalue pass. sums (``--fsdp-sums``, sharded factors): ``step`` keeps that;
    ``pass`` has every rank sum a whole group through each pass (the statistics reach their
    owners once per pass, :class:`prism_select.curvature.fit.FitLayout`), which needs a
    whole group's sums on every rank; ``auto`` takes ``pass`` where that fits.
    keep_gathered (``--fsdp-keep-gathered``): ``auto`` keeps each block's gathered weights
    from its forward to its backward where every stage's peak leaves room for the rest of
    the model, ``on`` always (refused where it cannot fit), ``off`` never. full_weights:
    bytes of the whole unsharded model (default: the weights times ``count``).
    """

    count: int = 1
    sums: str = "auto"
    keep_gathered: str = "auto"
    full_weights: int | None = None


def make_plan(model, modules: dict, *, kind: str, device, batch_size: int, fit_batch_size: int,
              example: ExampleSize, max_gpu_memory: int | None = None, gpu_total: int | None = None,
              host_available: int | None = None, weights: int | None = None,
              shards: Shards = Shards(), directions: int = 1) -> MemoryPlan:
    """The plan for one run; :class:`PlanError` if it cannot fit.

    ``example``: the longest example's measured activations and logits
    (:class:`ExampleSize`); ``gpu_total``: the device's memory (default: asked from CUDA);
    ``max_gpu_memory``: a cap below it; ``host_available``: host bytes free for this
    process (default: /proc/meminfo's MemAvailable shared among the ranks on this host,
    :func:`host_share_bytes`); ``weights``: device bytes already taken (default: what CUDA
    has allocated, i.e. the model). ``shards``: the FSDP sharding and its choices
    (:class:`Shards`); the choices made are ``fit["sums"]`` and ``keep_gathered``.
    ``directions``: the target sets scored together (:mod:`prism_select.tasks`): each has
    its own ``v``, and the scoring holds them all (:meth:`_Planner.scoring`).
    """
    planner = _Planner(model, modules, kind, torch.device(device), example, shards,
                       _host_figure(host_available), _device_figures(model, device, max_gpu_memory, gpu_total, weights))
    planner.k = max(1, int(directions))
    planner.direction(batch_size)
    planner.scoring(batch_size)
    planner.fit(fit_batch_size)
    _keep_gathered(planner)
    planner.host()
    return planner.plan


def _host_figure(host_available: int | None) -> int:
    return host_available if host_available is not None else host_share_bytes()


def _device_figures(model, device, max_gpu_memory, gpu_total, weights) -> tuple:
    """``(weights, usable)``: the device bytes taken before the run, and those it may use
    (None on the CPU, where nothing is bounded)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        weights = weights if weights is not None else torch.cuda.memory_allocated(dev)
        total = gpu_total if gpu_total is not None else torch.cuda.get_device_properties(dev).total_memory
        cap = min(total, max_gpu_memory) if max_gpu_memory else total
        return weights, cap - HEADROOM_BYTES
    weights = weights if weights is not None else sum(p.numel() * p.element_size() for p in model.parameters())
    return weights, None


class _Planner:
    """The figures of one plan and its stages, each deciding its part of :attr:`plan` in
    turn (direction, scoring, fit, FSDP's kept weights, host memory)."""

    #: the target sets scored together (:func:`make_plan`'s ``directions``)
    k = 1

    def __init__(self, model, modules: dict, kind: str, dev: torch.device, example: ExampleSize, shards: Shards,
                 host_available: int, device_figures: tuple):
        self.kind, self.dev, self.shards, self.sharding = kind, dev, shards.count, shards
        self.longest, self.vocab = example.tokens, example.vocab
        self.names = list(modules)
        self.shapes = shapes = {n: layer_shape(m) for n, m in modules.items()}
        p0 = next(model.parameters())
        self.half = half = p0.element_size()
        self.acc = acc = 8 if p0.dtype == torch.float64 else 4
        self.tracked = sum(o * i for o, i in shapes.values())
        self.largest = max(o * i for o, i in shapes.values())
        self.p1 = {n: pass1_bytes(o, i, acc) for n, (o, i) in shapes.items()}
        self.p2 = {n: pass2_bytes(o, i, half, acc) for n, (o, i) in shapes.items()}
        self.stored = {n: stored_bytes(kind, o, i, acc) for n, (o, i) in shapes.items()}
        self.max_dim = max(max(o, i) for o, i in shapes.values())
        self.host_available = host_available
        self.host_usable = int(HOST_USABLE * host_available)
        self.bounded = dev.type == "cuda"
        self.weights, self.usable = device_figures
        self.act1 = int(example.activation_bytes * ACTIVATION_SAFETY)
        self.plan = MemoryPlan(device=str(dev), bounded=self.bounded, usable=self.usable, weights=self.weights,
                               example_activations=example.activation_bytes)

    def fits(self, b: int) -> bool:
        return self.usable is None or b <= self.usable

    def act(self, bs: int) -> int:
        return self.act1 * bs

    def largest_batch(self, need, start: int) -> int | None:
        bs = start
        while bs >= 1:
            if self.fits(need(bs)):
                return bs
            bs //= 2
        return None

    def direction(self, batch_size: int):
        """The target direction: the gradients of the tracked layers, one batch of pairs
        (activations + full logits in the model's dtype and float32), then one layer
        converted to float32; where it accumulates and where the finished one is kept."""
        weights, largest, acc, usable, dev = self.weights, self.largest, self.acc, self.usable, self.dev
        logits = lambda bs: bs * self.longest * self.vocab * (self.half + 2 * acc)  # noqa: E731
        grads_dev = self.tracked * self.half // self.shards
        ways = (("device", grads_dev), ("host", 2 * largest * acc))
        for accumulate, grads in ways[:1] if self.shards > 1 else ways:  # FSDP reduce-scatters into .grad
            need = lambda bs, g=grads: weights + g + self.act(bs) + logits(bs) + largest * acc  # noqa: E731
            bs = self.largest_batch(need, batch_size)
            if bs is not None:
                break
        else:
            raise PlanError(f"the target direction does not fit on {dev}: the weights take {gib(weights)} of "
                            f"{gib(usable)} usable and one pair of {self.longest} tokens needs "
                            f"{gib(need(1) - weights)} more; "
                            + _suggestions(len(self.names), "or --max-gpu-memory if it caps below the device"))
        # the finished direction (float32) stays alive through the fit and the scoring: on the
        # device only while it is small next to what those stages need
        dir_bytes = self.tracked * acc // self.shards
        dir_store = "device" if not self.bounded or (accumulate == "device"
                                                     and dir_bytes <= DIRECTION_ON_DEVICE * usable) else "host"
        if self.bounded and dir_store == "host" and dir_bytes + largest * acc > self.host_usable:
            # the host cannot hold it: on the device, if it fits there next to v and a batch
            if accumulate == "device" and self.fits(weights + dir_bytes + self.tracked * self.half // self.shards
                                                    + self.act(1)):
                dir_store = "device"
            else:
                raise PlanError(f"the target direction ({gib(dir_bytes)} in float32) fits neither host memory "
                                f"({gib(self.host_usable)} usable of {gib(self.host_available)} available) nor "
                                f"{dev} next to the weights; "
                                + _suggestions(len(self.names), "or a host with more memory"))
        self.held = dir_bytes if dir_store == "device" and self.bounded else 0
        self.dir_host = dir_bytes if dir_store == "host" and self.bounded else 0
        self.plan.direction = {"accumulate": accumulate, "store": dir_store, "batch_size": bs, "peak": need(bs)}
        if bs < batch_size:
            self.plan.notes.append(f"target pairs in batches of {bs} (not {batch_size}) to fit the device")

    def scoring(self, batch_size: int):
        """Scoring: V in the model's dtype next to the weights, and one batch. With ``k``
        target sets: ``k`` directions' V, at most twice (the stacked V and the scorer's
        ``k x (out in)`` layout of it, a copy where the layers have a bias), and in the
        backward of the largest layer each example's gradient of it, in the
        accumulation dtype and in the model's (:class:`~prism_select.engine.linear.ScoringLinear`)."""
        k = self.k
        one = self.tracked * self.half if self.shards == 1 else 0
        self.v_bytes = v_bytes = one if k == 1 else 2 * k * one
        per_example = 0 if k == 1 else self.largest * (self.half + self.acc)
        need_s = lambda bs: (self.weights + self.held + v_bytes + self.act(bs)  # noqa: E731
                             + bs * per_example)
        sbs = self.sbs = self.largest_batch(need_s, batch_size)
        if sbs is None:
            raise PlanError(f"scoring does not fit on {self.dev}: the weights ({gib(self.weights)}) and the "
                            f"preconditioned direction ({gib(v_bytes)}) leave no room for one example of "
                            f"{self.longest} tokens within {gib(self.usable)}; "
                            + _suggestions(len(self.names), "the preconditioned direction is as large as the "
                                                            "tracked weights"))
        self.plan.scoring = {"batch_size": sbs, "peak": need_s(sbs), "v_bytes": v_bytes, "directions": k}
        if sbs < batch_size:
            self.plan.notes.append(f"scoring in batches of {sbs} (not {batch_size}) to fit the device")

    # -- the curvature fit

    def fit(self, fit_batch_size: int):
        """The curvature fit: its batch size and groups, where the fitted curvature is
        kept, and (sharded factors) when the statistics reach their owners."""
        plan = self.plan
        if self.kind == "identity":
            plan.curvature_store = "device"
            plan.fit = {"groups": [], "batch_size": fit_batch_size, "peak": 0, "stored_bytes": 0}
            return
        self._fit_costs()
        fbs, groups = self._fit_groups(fit_batch_size)
        store, offload, group_host, groups, base_peak = self._fit_store(fbs, groups)
        plan.curvature_store = store
        kept_on_device = self.total_stored / self.fsh if store == "device" else 0
        sums_mode, fit_peak = _fit_sums(self, fbs, groups, int(base_peak + kept_on_device), kept_on_device)
        kept = group_host if store == "transient" else self.v_host(False) + group_host
        fit_host = int(self.dir_host + self.largest * self.acc + kept) if self.bounded else 0
        plan.fit = {"groups": groups, "batch_size": fbs, "peak": fit_peak, "stored_bytes": self.total_stored,
                    "largest_factor": self.max_dim, "factor_shards": self.fsh, "offload": offload,
                    "host_peak": fit_host, "sums": sums_mode}
        if fbs < fit_batch_size:
            plan.notes.append(f"curvature fit in batches of {fbs} (not {fit_batch_size}) to fit the device")
        if len(groups) > 1:
            plan.notes.append(f"the fit runs in {len(groups)} groups of layers: two passes over the fit "
                              "sample per group")

    def _fit_costs(self):
        """What a fit group costs on the device per layer (``cost``), the per-batch work
        beside it, and what is kept."""
        kind, acc, half, names = self.kind, self.acc, self.half, self.names
        self.total_stored = sum(self.stored.values())
        self.fsh = self.shards if kind in ("ekfac", "kfac") else 1  # ranks the factors are sharded over
        self.eigh = EIGH_BUFFERS * acc * self.max_dim * self.max_dim if kind in ("ekfac", "kfac") else 0
        self.max_in = max(i for _, i in self.shapes.values())
        self.cost = {n: max(self.p1[n], self.p2[n]) if kind == "ekfac" else
                     (self.stored[n] if kind == "diagonal" else self.p1[n]) for n in names}
        # per rank, a group's factors are 1/fsh of it, plus at most one layer (the owners
        # cut the group into contiguous runs, sharding.factor_owners)
        self.one = max(self.cost.values())
        # host memory besides the direction: v in the model's dtype (formed on the host where
        # the direction is, and under ``transient`` collected there group by group) and one
        # layer's float32 v while it is preconditioned
        self.v_parts = {n: half * o * i // self.shards for n, (o, i) in self.shapes.items()}
        self.spare_fit = self.host_usable - self.dir_host - self.largest * acc  # a transient fit: v grows

    def rot(self, bs: int) -> int:
        """Each rank rotates the examples of its own batch."""
        return bs * self.largest * (self.half + self.acc) if self.kind in ("ekfac", "diagonal") else 0

    def taps(self, bs: int) -> int:
        """Pass 1's per-batch products: RECENT_INPUTS in' x in' products kept for the layers
        sharing an input, and one float32 copy of a batch's inputs."""
        return self.acc * (RECENT_INPUTS * self.max_in * self.max_in + bs * self.longest * self.max_in)

    def shared(self, bs: int) -> int:
        """Sharded factors, one layer at a time: pass 1's products of this rank's batch being
        summed onto their owners (REDUCE_WINDOW in flight and one formed; RECENT_INPUTS kept
        are in ``taps``), pass 2's eigenbases from the owner and this rank's sums of as many layers."""
        return 0 if self.fsh == 1 else (2 * self.half + (1 + REDUCE_WINDOW) * self.acc) * self.max_dim * self.max_dim

    def work(self, bs: int) -> int:
        return max(self.eigh, self.rot(bs), self.taps(bs)) + self.shared(bs)

    def share(self, c):
        return c if self.fsh == 1 else min(c, c / self.fsh + self.one)

    def budget(self, room):
        return room if self.fsh == 1 or room <= self.one else self.fsh * (room - self.one)

    def v_host(self, transient: bool) -> int:
        return sum(self.v_parts.values()) if self.dir_host or transient else 0

    def spare(self, transient: bool) -> int:
        return self.host_usable - self.dir_host - self.v_host(transient) - self.largest * self.acc

    def _room(self, b: int):
        return None if self.usable is None else self.usable - self.weights - self.held - self.act(b) - self.work(b)

    def _all_kept_on_device_fits(self) -> bool:
        return self.fits(self.weights + self.total_stored / self.fsh + self.v_bytes + self.act(self.sbs))

    def _fit_groups(self, fit_batch_size: int) -> tuple:
        """``(batch size, groups)``. Each group costs two passes over the fit sample, while
        a smaller batch costs little on a large model: the batch size that needs the fewest
        groups (the largest such batch size on a tie)."""
        names, cost = self.names, self.cost
        fbs, groups = fit_batch_size, None
        b = fit_batch_size
        while b >= 1:
            room = self._room(b)
            if room is None:
                fbs, groups = b, [names]
                break
            if room > 0:
                # everything at once (and kept there), as without a plan
                if self.share(sum(cost.values())) + self.total_stored / self.fsh <= room \
                        and self._all_kept_on_device_fits():
                    fbs, groups = b, [names]
                    break
                g = make_groups(names, cost, self.budget(room))
                if g is not None and (groups is None or len(g) < len(groups)):
                    fbs, groups = b, g
            b //= 2
        if groups is None:
            worst = max(names, key=lambda n: cost[n])
            raise PlanError(f"the curvature fit does not fit on {self.dev}: layer {worst!r} alone needs "
                            f"{gib(cost[worst])} of factors next to the weights ({gib(self.weights)}) within "
                            f"{gib(self.usable)}; "
                            + _suggestions(len(names), "or --curvature diagonal / identity"))
        return fbs, groups

    def _base_peak(self, fbs: int, groups: list) -> int:
        gpeak = max(self.share(sum(self.cost[n] for n in g)) for g in groups)
        return int(self.weights + self.held + self.act(fbs) + gpeak + self.work(fbs))

    def _fit_store(self, fbs: int, groups: list) -> tuple:
        """Where the fitted curvature lives: ``(store, offload, group_host, groups,
        base_peak)``; ``offload`` None is the fit's default (off where the curvature stays
        on the device), ``group_host`` the host bytes the fit's groups keep there."""
        base_peak = self._base_peak(fbs, groups)
        # kept on the device only where the fit holding it as well still fits (the figure
        # recorded), not only the scoring next to it
        if not self.bounded or (len(groups) == 1 and self._all_kept_on_device_fits()
                                and self.fits(base_peak + self.total_stored / self.fsh)):
            return "device", None, 0, groups, base_peak
        if self.total_stored <= min(self.spare(False), HOST_FRACTION * self.host_available):
            # every group's tensors end up there (a group's float32 eigenbases wait there
            # during its eigenvalue pass)
            return "host", self.kind == "ekfac", self.total_stored, groups, base_peak
        groups, offload, group_host = self._transient_groups(fbs, groups)
        self.plan.notes.append(f"the fitted curvature ({gib(self.total_stored)}) fits neither the device nor host "
                               f"memory ({HOST_FRACTION:.0%} of the host's {gib(self.host_available)} available, "
                               f"and {gib(self.host_usable)} usable next to the direction and v): each group "
                               "preconditions the direction and is dropped (not cached)")
        return "transient", offload, group_host, groups, self._base_peak(fbs, groups)

    def _transient_groups(self, fbs: int, groups: list) -> tuple:
        """A transient fit's ``(groups, offload, group_host)``: a group's float32
        eigenbases wait in host memory during its eigenvalue pass (EK-FAC), and its part of
        v is saved from there: groups small enough for the host too; else the eigenbases
        stay on the device (beside their half-precision copies and Lambda: more, smaller
        groups)."""
        names, acc, kind, v_parts = self.names, self.acc, self.kind, self.v_parts
        room = self.usable - self.weights - self.held - self.act(fbs) - self.work(fbs)
        waits = {n: acc * (o * o + i * i + o + i) if kind == "ekfac" else 0 for n, (o, i) in self.shapes.items()}
        # (with sharded factors each rank's share of a group, as for the device: budget)
        g = make_groups(names, self.cost, self.budget(room), {n: waits[n] / self.fsh + v_parts[n] for n in names},
                        self.spare_fit - (max(waits.values()) if self.fsh > 1 else 0), v_parts)
        offload = kind == "ekfac" and g is not None
        if g is None and kind == "ekfac":
            self.cost = {n: self.p1[n] + self.p2[n] for n in names}
            g = make_groups(names, self.cost, self.budget(room), v_parts, self.spare_fit, v_parts)
            if g is not None:
                self.plan.notes.append("the float32 eigenbases stay on the device during the eigenvalue pass: "
                                       "host memory does not hold a group's")
        if g is None:
            raise PlanError(f"the curvature fit does not fit host memory: the target direction "
                            f"({gib(self.dir_host)}) leaves {gib(max(self.spare_fit, 0))} of "
                            f"{gib(self.host_usable)} usable ({HOST_USABLE:.0%} of {gib(self.host_available)} "
                            f"available) for v ({gib(self.v_host(True))}, collected group by group) and a "
                            f"group's eigenbases; " + _suggestions(len(names), "or a host with more memory"))
        if len(g) > len(groups):
            self.plan.notes.append(f"{len(g)} fit groups (not {len(groups)}) to fit host memory")
        # the largest of: the groups before this one's v, and this one's eigenbases and v
        done, group_host = 0, 0
        for grp in g:
            held_back = self.share(sum(waits[n] for n in grp)) if offload else 0
            group_host = max(group_host, done + held_back + sum(v_parts[n] for n in grp))
            done += sum(v_parts[n] for n in grp)
        return g, offload, group_host

    # -- after the stages

    def host(self):
        """Host memory (bounded plans): what the direction, the fit and the scoring keep there."""
        if not self.bounded:
            return
        plan, dir_host = self.plan, self.dir_host
        v_host_s = self.tracked * self.half // self.shards if dir_host or plan.curvature_store == "transient" else 0
        plan.host = {"available": self.host_available, "usable": self.host_usable,
                     "direction": dir_host + (self.largest * self.acc if dir_host else 0),
                     "fit": plan.fit.get("host_peak", dir_host), "scoring": v_host_s}
        plan.host["peak"] = max(plan.host["direction"], plan.host["fit"], plan.host["scoring"])


# ----------------------------------------------------------------------------- the sharded run's choices

def _fit_sums(planner: _Planner, fbs: int, groups: list, fit_peak: int, kept_on_device) -> tuple:
    """``(sums, fit peak)``: with sharded factors, ``pass`` where every rank can sum
    each pass's statistics of a whole group (as one unsharded rank does) beside its own
    share of the kept curvature, as ``shards.sums`` asks."""
    sums = planner.sharding.sums
    if planner.fsh == 1:
        return "step", fit_peak
    group_sums = max(sum(planner.cost[n] for n in g) for g in groups)
    work = max(planner.eigh, planner.rot(fbs), planner.taps(fbs))
    local_peak = int(planner.weights + planner.held + planner.act(fbs) + work + group_sums + kept_on_device)
    if sums == "pass" and not planner.fits(local_peak):
        raise PlanError(f"--fsdp-sums pass does not fit on {planner.dev}: every rank would hold a whole fit "
                        f"group's sums ({gib(group_sums)}), a peak of {gib(local_peak)} of "
                        f"{gib(planner.usable)} usable; use --fsdp-sums step (or auto)")
    if sums == "pass" or sums == "auto" and planner.fits(local_peak):
        return "pass", max(fit_peak, local_peak)
    return "step", fit_peak

def _keep_gathered(planner: _Planner):
    """The run's peak (after the stages), and (FSDP) whether decoder blocks keep their gathered weights:
    the rest of the model, gathered by every block at the end of a forward."""
    plan, shards, keep = planner.plan, planner.shards, planner.sharding.keep_gathered
    plan.peak = max(plan.direction["peak"], plan.scoring["peak"], plan.fit.get("peak", 0))
    if shards > 1 and keep != "off":
        rest = (planner.sharding.full_weights or planner.weights * shards) * (shards - 1) // shards
        room = planner.fits(plan.peak + rest)
        if keep == "on" and not room:
            raise PlanError(f"--fsdp-keep-gathered on does not fit on {planner.dev}: the whole model "
                            f"({gib(rest)} more per rank) beside a peak of {gib(plan.peak)} exceeds "
                            f"{gib(planner.usable)} usable; use --fsdp-keep-gathered off (or auto)")
        if room:
            plan.keep_gathered, plan.peak = True, plan.peak + rest
            plan.notes.append(f"each decoder block keeps its gathered weights from forward to backward "
                              f"(one all-gather a step instead of two; +{gib(rest)} per rank)")
