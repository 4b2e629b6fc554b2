"""The host spill of the CPU fit: the first pass writes every tracked layer's inputs and
output gradients to a file, and the eigendecompositions, the eigenvalue pass and (when
asked) the scores are then formed from it group by group, without a second pass over the
model. Bounded by SPILL_MAX_BYTES."""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import threading
import time

import torch
from tqdm.auto import tqdm

from ..engine import Tap, rowdot
from ..gradients import check_finite, release_host_memory, side_by_side as _side_by_side
from ..model.moe import is_routed
from ..runtime import distributed, sharding
from ..runtime.layers import has_bias, layer_shape
from .base import Curvature, PreconditionSettings, apply_damping
from .eigenvalues import _lambda_from_sums, _LambdaTap
from .eigh import _eigh
from .factors import _gram_into, _input_product, _key
from .stats import _Recent, _Stats

log = logging.getLogger(__name__)


#: on the CPU, EK-FAC's factor pass writes every layer's inputs and output gradients to a
#: temporary file, from which the factors and the eigenvalues are formed layer group by
#: layer group (:func:`_spilled_groups`; the eigenvalue pass does not run the model again),
#: when they take at most this many bytes (and at most a quarter of the free disk space
#: where the file goes). The demo: about 3 GB for 40 records (1 MB a token at 135M). 0
#: turns it off: the factors are summed in the pass and the eigenvalue pass reruns the model.
SPILL_MAX_BYTES = 8 << 30


class _Spill:
    """Layer inputs and output gradients of the factor pass in an unnamed temporary file
    (removed when closed), read back batch by batch by the eigenvalue pass. Each batch
    is a list of ``(layer, input entry, gradient entry)``; an input shared by several
    layers (q/k/v, gate/up) is written once."""

    def __init__(self, directory=None):
        self.f = tempfile.TemporaryFile(dir=directory)
        self.batches: list = []
        # this batch's recent inputs: key -> (input, entry); the input is held so that its
        # address is not reused by another tensor while the key is known (see _key)
        self._inputs = _Recent()
        self._pending: dict = {}  # this batch: layer -> input entry (until its gradient arrives)
        self.examples: list = []  # each batch's example indices (set by the fit)
        self.masks: list = []  # each batch's (B, T) bool mask of the real tokens

    def start(self, mask: torch.Tensor):
        """A new batch, with ``mask`` (``B x T``) marking its real tokens."""
        self._inputs.clear()
        self._pending = {}
        self.batches.append([])
        self.masks.append(mask.to(torch.bool))

    def _write(self, t: torch.Tensor):
        t = t.detach().contiguous()
        off = self.f.seek(0, 2)
        self.f.write(memoryview(t.numpy()).cast("B"))
        return off, tuple(t.shape), t.dtype

    def read(self, entry) -> torch.Tensor:
        """One written tensor (a positioned read: threads may read side by side)."""
        off, shape, dtype = entry
        t = torch.empty(shape, dtype=dtype)
        buf = memoryview(t.numpy()).cast("B")
        done = 0
        while done < len(buf):
            n = os.preadv(self.f.fileno(), [buf[done:]], off + done)
            if n <= 0:
                raise OSError(f"the spill file ended at byte {off + done}")
            done += n
        return t

    def input(self, name, x):
        k = _key(x)
        if k not in self._inputs:
            # detached: an input with its graph, held by the taps' spill, would be a
            # reference cycle through autograd's C++ graph that Python's gc cannot free
            # (it kept the factor accumulators alive to the end of the fit)
            self._inputs[k] = (x.detach(), self._write(x))
        self._pending[name] = self._inputs[k][1]

    def gradient(self, name, g):
        self.batches[-1].append((name, self._pending.pop(name), self._write(g)))

    def finish(self):
        """The factor pass is over: nothing of its last batch is held, everything written
        is in the file (for :meth:`read`)."""
        self._inputs.clear()
        self._pending = {}
        self.f.flush()

    def close(self, background: bool = False):
        """Close (and so remove) the file. ``background``: on a thread of its own, while the
        caller goes on: the demo's 3 GB spill took 2.7 s of wall time to close (0.25 CPU-s,
        the kernel freeing the file's pages and blocks) on the run's path."""
        self.finish()
        if background:
            threading.Thread(target=self.f.close, name="spill-close").start()
        else:
            self.f.close()

    def scores(self, modules: dict, V: dict, n_examples: int) -> torch.Tensor | None:
        """``g_z . V`` of every fit example from the spilled inputs ``a_t`` and output
        gradients ``b_t``: ``sum_layers sum_t b_t^T V a_t`` (``+ (sum_t b_t)^T V_bias`` for a
        layer with a bias), float64, in the order of ``encoded`` (``examples``: the fit
        batches' indices into it). Padded positions have ``b_t = 0`` (right padding under
        causal attention) and add nothing. These are the exact scores only when the
        spilled gradients are those of the scoring loss (the caller checks: the empirical
        Fisher, the whole pool, the model's own arithmetic). None when a tracked layer has
        nothing spilled. Each input's layers are one task (its inputs read once per
        batch) on one-thread workers (:func:`_side_by_side`)."""
        if not self.batches or any(n not in {e[0] for e in self.batches[0]} for n in modules):
            return None
        by_input: dict = {}  # the first batch's input entry -> layers reading it
        for name, xe, _ in self.batches[0]:
            if name in modules:
                by_input.setdefault(xe, []).append(name)
        groups = list(by_input.values())
        p = next(iter(modules.values())).weight
        acc = torch.float64 if p.dtype == torch.float64 else torch.float32

        def task(layers):
            part = torch.zeros(n_examples, dtype=torch.float64)
            Vs = {}
            for n in layers:
                m = modules[n]
                Vd = V[n].to(dtype=m.weight.dtype)
                Vs[n] = (Vd[:, :m.in_features].contiguous(), Vd[:, -1].to(acc) if has_bias(m) else None)
            for rec, idx in zip(self.batches, self.examples):
                inputs: dict = {}
                for name, xe, ge in rec:
                    if name not in Vs:
                        continue
                    x = inputs.get(xe)
                    if x is None:
                        x = inputs[xe] = self.read(xe)
                    g = self.read(ge)
                    Vw, Vb = Vs[name]
                    if Vw.shape[0] <= Vw.shape[1]:  # the product in the narrower width
                        s = rowdot(g, x @ Vw.T)
                    else:
                        s = rowdot(g @ Vw, x)
                    if Vb is not None:
                        s = s + g.sum(1, dtype=acc) @ Vb
                    part[idx] += s.double()
            return part

        return torch.stack(list(_side_by_side(task, groups))).sum(0)


#: the rotated per-example gradients that :class:`FitScores` keeps, summed over the tasks
#: that run at once (the largest), at most this many bytes; above it the fit does not
#: score and the run scores from the spill after the fit. The demo: 566 MB (40 examples,
#: the gate/up task 283 MB beside another).
FIT_SCORES_MAX_BYTES = 1 << 30


class FitScores:
    """Exact scores ``g_n . H^-1 d`` of the fit examples, formed inside the spilled EK-FAC
    fit (:func:`_spilled_groups`) when the direction ``d`` is known before the fit and the
    fit examples' spilled gradients are the scoring loss's (the caller checks, as for
    :meth:`_Spill.scores`). Each task keeps its layers' rotated per-example gradients
    ``R_n = Q_S^T G_n Q_A`` (the products whose squares it sums into ``Lambda``); once its
    ``Lambda``, and so each layer's damping and shrinkage (:func:`apply_damping`, as the
    fit's result gets them), are known, it rotates the layer's direction the way
    :meth:`Curvature.precondition` does and scores
    ``<R_n, (Q_S^T D Q_A) / (eig + lambda)>``: no scoring pass over the spill and no
    rotation back to ``v = H^-1 d``.

    ``direction``: layer -> ``out x in'`` matrix, a mapping with ``pop`` (a dict or
    :class:`prism_select.gradients.SpilledLayers`); the layers are taken out of it as they
    are scored, and left in it when the fit does not score (no spill, or the kept products
    would exceed ``max_bytes``). ``n_examples``: the length of the encoded list the fit
    batches index. After the fit, :attr:`scores` is the float64 scores (the layers summed
    in the order of ``modules``), or None when the fit did not score."""

    def __init__(self, direction, settings: PreconditionSettings, n_examples: int,
                 max_bytes: int | None = None):
        self.direction, self.settings, self.n_examples = direction, settings, n_examples
        self.max_bytes = FIT_SCORES_MAX_BYTES if max_bytes is None else max_bytes
        self.per_layer: dict = {}  # layer -> float64 (n_examples,)
        self.scores: torch.Tensor | None = None

    def score_layer(self, name: str, tensors: dict, R: torch.Tensor, lock) -> None:
        """Layer ``name``'s scores from its kept products ``R`` (``n_examples x out x in'``)
        and its fitted ``tensors`` (``QA``, ``QS``, ``lamA``, ``lamS``, ``Lambda``,
        ``LambdaVar``, unprefixed)."""
        part = apply_damping(Curvature("ekfac", [name], {f"{name}::{k}": t for k, t in tensors.items()}, {}),
                             self.settings)
        with lock:  # the direction may be a file read by position of its own
            g = self.direction.pop(name)
        dt = torch.float64 if g.dtype == torch.float64 else torch.float32
        QA, QS = tensors["QA"].to(dt), tensors["QS"].to(dt)
        # as Curvature.precondition, less the rotation back
        W = (QS.T @ g.to(dt) @ QA) / (part.eigenvalues(name, dtype=dt) + part.damping[name])
        s = R.reshape(R.shape[0], -1) @ W.to(R.dtype).reshape(-1)
        self.per_layer[name] = s.double()

    def finish(self, layers: list) -> None:
        """Sum the layers' scores (in ``layers``' order: the same sum in every run)."""
        if all(n in self.per_layer for n in layers):
            self.scores = torch.stack([self.per_layer.pop(n) for n in layers]).sum(0)
        self.per_layer.clear()


def _spill_bytes(modules: dict, encoded: list, batches: list, itemsize: int) -> int:
    """An upper bound of what the factor pass spills: every padded token's input and
    output of every tracked layer (shared inputs counted once per layer)."""
    per_token = sum(sum(layer_shape(m)) for m in modules.values()) * itemsize
    return per_token * sum(len(b) * max(len(encoded[i].input_ids) for i in b) for b in batches)


def _spill_wanted(model, modules, encoded, batches, device, settings, directory) -> bool:
    p = next(model.parameters())
    if (settings.kind != "ekfac" or SPILL_MAX_BYTES <= 0 or torch.device(device or p.device).type != "cpu"
            or p.dtype not in (torch.float32, torch.float64) or distributed.world() > 1
            or sharding.is_sharded(model)):
        return False
    need = _spill_bytes(modules, encoded, batches, p.element_size())
    try:
        free = shutil.disk_usage(directory or tempfile.gettempdir()).free
    except OSError:
        return False
    return need <= min(SPILL_MAX_BYTES, free // 4)


def _spilled_groups(modules: dict, spill: _Spill, compute, n_tokens: int, n_examples: int, desc: str,
                    progress: bool = True, scores: FitScores | None = None,
                    routed: dict | None = None) -> tuple[dict, dict, dict, dict]:
    """EK-FAC from the factor pass's spill, as one task per distinct layer input (the layers
    that read it: q/k/v, gate/up, ...): form the input's ``A`` and each layer's ``S`` from
    the spilled batches (the sums :class:`_CovTap` forms, in the same order), decompose
    them, then add every spilled batch of those layers to their ``Lambda`` and ``M4`` (each
    input read and rotated once per batch). The tasks, largest first, run side by side on
    one-thread workers (as many as torch's threads, :func:`_side_by_side`): a task needs no
    other task's results, so the cores stay busy with independent work instead of
    synchronising a team of threads over one small eigendecomposition or GEMM at a time.
    A task's factors are freed once decomposed.

    ``scores`` (:class:`FitScores`): each task also scores the fit examples with its
    layers, if the products it keeps for that fit ``scores.max_bytes`` (else the fit does
    not score; ``scores.scores`` stays None). ``routed``: the token count of each expert
    layer (:mod:`prism_select.model.moe`), which normalises its ``A`` instead of ``n_tokens``.

    Returns ``(tensors, Lam, M4, seconds)``: each layer's ``QA``, ``lamA``, ``QS``, ``lamS``
    (eigenvalues clamped at 0, row-major eigenvectors), the unnormalised sums per layer,
    and the summed task seconds of the two kinds of work (``eigh``: factors and
    eigendecompositions; ``lambda``, scores included)."""
    fit = _SpilledFit(modules, spill, compute, n_tokens, n_examples, scores)
    fit.routed = routed or {}
    order = sorted(range(len(fit.groups)), key=fit.cost, reverse=True)
    with tqdm(total=len(order), desc=desc, unit="group", leave=False,
              disable=not progress or not distributed.is_main()) as bar:
        for _ in _side_by_side(fit.task, order):
            bar.update()
    fit.kept_bufs.clear()
    return fit.tensors, fit.Lam, fit.M4, fit.seconds


class _SpilledFit:
    """The tasks of :func:`_spilled_groups` and what they share: the spilled entries of
    each layer, the groups of layers reading one input, and the results, which the
    workers add under one lock."""

    def __init__(self, modules: dict, spill: _Spill, compute, n_tokens: int, n_examples: int,
                 scores: FitScores | None):
        self.modules, self.spill, self.compute = modules, spill, compute
        self.n_tokens, self.n_examples = n_tokens, n_examples
        self.routed: dict = {}  # expert layer -> its routed token count (normalises its A)
        self.entries: dict = {}  # layer -> [(batch number, input entry, gradient entry)]
        for k, rec in enumerate(spill.batches):
            for name, xe, ge in rec:
                self.entries.setdefault(name, []).append((k, xe, ge))
        by_input: dict = {}  # layers reading one input (with the same bias column) share A
        for n in modules:
            first = self.entries.get(n, [(None, ("none", n), None)])[0][1]
            by_input.setdefault((first, has_bias(modules[n])), []).append(n)
        self.groups = list(by_input.values())
        self.tokens = sum(math.prod(m.shape) for m in spill.masks)
        self.tensors, self.Lam, self.M4 = {}, {}, {}
        self.seconds = {"eigh": 0.0, "lambda": 0.0}
        self.lock = threading.Lock()
        self.kept_bufs: dict = {}  # worker thread -> the buffer its tasks' kept products reuse
        self.scores = self._scoring(scores)

    def cost(self, gid: int) -> int:
        """A task's work: eigendecompositions ~ 27 d^3; products 2 T (2 in^2 + 2 out^2 + out in),
        A and S included."""
        modules, group = self.modules, self.groups[gid]
        inp = layer_shape(modules[group[0]])[1]
        outs = [layer_shape(modules[n])[0] for n in group]
        return 27 * (inp ** 3 + sum(o ** 3 for o in outs)) + 2 * self.tokens * (
            2 * inp ** 2 + sum(2 * o * o + o * inp for o in outs))

    def _scoring(self, scores: FitScores | None) -> FitScores | None:
        """``scores`` where the products the largest tasks keep at once (one per worker) fit
        ``scores.max_bytes``, else None."""
        if scores is None:
            return None
        itemsize = torch.empty((), dtype=self.compute).element_size()
        kept = sorted((scores.n_examples * itemsize * sum(math.prod(layer_shape(self.modules[n])) for n in g)
                       for g in self.groups), reverse=True)
        at_once = sum(kept[:max(torch.get_num_threads(), 1)])  # the largest tasks, one per worker
        rows = sorted(i for b in self.spill.examples for i in b)
        if rows != list(range(scores.n_examples)):
            raise ValueError("FitScores: the fit examples must be the encoded list's, each once")
        if at_once > scores.max_bytes:
            log.info("the fit does not score: its rotated gradients would take %.2f GiB at once (at most %.2f)",
                     at_once / 2**30, scores.max_bytes / 2**30)
            return None
        return scores

    def kept_products(self, layers) -> dict:
        """Each layer's ``R`` (``n_examples x out x in'``), views of one buffer per worker
        thread: fresh pages for every task (17 GB over the demo's tasks) were ~13 s of
        kernel time in page faults. The buffer is replaced by a smaller one when a task
        needs at most half of it (the tasks come largest first, and the finished
        curvature grows as they go: the demo's peak RSS was ~400 MB higher with the
        largest buffers kept to the end)."""
        shapes = {n: (self.scores.n_examples, *layer_shape(self.modules[n])) for n in layers}
        need = sum(math.prod(sh) for sh in shapes.values())
        tid = threading.get_ident()
        buf = self.kept_bufs.get(tid)
        if buf is None or buf.numel() < need or 2 * need <= buf.numel():
            del buf
            self.kept_bufs.pop(tid, None)  # the old buffer is freed before the new one is allocated
            buf = self.kept_bufs[tid] = torch.empty(need, dtype=self.compute)
        out, at = {}, 0
        for n, sh in shapes.items():
            out[n] = buf[at:at + math.prod(sh)].view(sh)
            at += math.prod(sh)
        return out

    def per_batch(self, layers) -> list:
        """batch -> [(layer, input entry, gradient entry)] of these layers, in batch order."""
        out: dict = {}
        for n in layers:
            for k, xe, ge in self.entries.get(n, []):
                out.setdefault(k, []).append((n, xe, ge))
        return [(k, out[k]) for k in sorted(out)]

    def task(self, gid: int) -> int:
        """One group of layers reading one input: factors, eigendecompositions, eigenvalues
        (and scores), added to the results."""
        t0 = time.perf_counter()
        layers = self.groups[gid]
        batches = self.per_batch(layers)
        out, QA = self._decompose(layers, batches)
        t1 = time.perf_counter()
        taps = self._eigenvalues(gid, layers, batches, out, QA)
        with self.lock:
            for n in layers:
                for key, t in out[n].items():
                    self.tensors[f"{n}::{key}"] = t
                self.Lam[n], self.M4[n] = taps[n].Lam, taps[n].M4
            self.seconds["eigh"] += t1 - t0
            self.seconds["lambda"] += time.perf_counter() - t1
        # this worker's freed batches and products, in its own heap arena, go back to the
        # system (untrimmed, the demo's stage ended 1.2 GB above where it began)
        release_host_memory()
        return gid

    def _factors(self, layers: list, batches: list) -> tuple:
        """The group's ``A`` and each layer's ``S``, as _CovTap sums them (A from the first
        layer's input); lower triangles only."""
        compute, spill, modules = self.compute, self.spill, self.modules
        bias = has_bias(modules[layers[0]])
        d_in = layer_shape(modules[layers[0]])[1]
        A = torch.zeros(d_in, d_in, dtype=compute)
        S = {n: torch.zeros(layer_shape(modules[n])[0], layer_shape(modules[n])[0], dtype=compute) for n in layers}
        routed = is_routed(modules[layers[0]])
        for k, rec in batches:
            sel = spill.masks[k]
            x = spill.read(rec[0][1])
            # an expert's inputs were masked at its slots when spilled
            a = (x if routed else x * sel.to(x.dtype)[..., None]).reshape(-1, x.shape[-1])
            C = _input_product(a, compute, sel.sum().to(compute) if bias else None)
            A += C
            del x, a, C
            for n, _, ge in rec:
                g = spill.read(ge)
                _gram_into(S[n], g.reshape(-1, g.shape[-1]))
                del g
        return A, S

    def _decompose(self, layers: list, batches: list) -> tuple:
        """``(out, QA)``: each layer's ``QA``, ``lamA``, ``lamS``, ``QS`` (the first layer
        holds the input's own, the others copies), and the input's eigenbasis. Each
        factor is freed once decomposed."""
        compute = self.compute
        A, S = self._factors(layers, batches)
        # not mirrored: the eigensolver reads the lower triangle alone (_eigh), which is
        # what _gram_into sums (the upper block triangle stays zero)
        A = A.div_(max(self.routed.get(layers[0], self.n_tokens), 1))
        check_finite(A, "the activation covariance", layer=layers[0])
        out = {}
        lam, Q = _eigh(A)
        del A
        # row-major: LAPACK's column-major Q would be copied whole when the curvature is
        # saved (+0.8 GB of host memory for the embedded model)
        lamA, QA = lam.clamp(min=0).to(compute), Q.to(compute).contiguous()
        for n in layers:
            Sn = S.pop(n).div_(self.n_examples)  # lower triangle, as A
            check_finite(Sn, "the gradient covariance", layer=n)
            lam, Q = _eigh(Sn)
            del Sn
            out[n] = {"QA": QA if n == layers[0] else QA.clone(), "lamA": lamA if n == layers[0] else lamA.clone(),
                      "lamS": lam.clamp(min=0).to(compute), "QS": Q.to(compute).contiguous()}
            del lam, Q
        return out, QA

    def _eigenvalues(self, gid: int, layers: list, batches: list, out: dict, QA) -> dict:
        """Every spilled batch of the group's layers added to their ``Lambda`` and ``M4``
        (each input read and rotated once per batch); with :class:`FitScores`, the
        layers' scores. Returns the taps, which hold the sums."""
        compute, spill, modules = self.compute, self.spill, self.modules
        stats = _Stats(compute)
        taps = {}
        # FitScores: each layer's R_n, one row per example of the encoded list
        R = self.kept_products(layers) if self.scores is not None else {}
        for n in layers:
            tap = taps[n] = _LambdaTap(modules[n], stats, QA, out[n]["QS"], gid)
            tap.Lam, tap.M4 = torch.zeros(*layer_shape(modules[n]), dtype=compute), torch.zeros(1, dtype=compute)
        for k, rec in batches:
            stats.cache.clear()
            inputs: dict = {}
            for n, xe, ge in rec:
                if xe not in inputs:
                    inputs[xe] = spill.read(xe)
                if n in R:
                    taps[n].rows = [R[n][i] for i in spill.examples[k]]
                taps[n].on_backward(inputs[xe], spill.read(ge))
            del inputs
        stats.cache.clear()
        del stats
        for n in list(R):  # Lambda as _finish_lambda forms it (the sums stay), then the layer's scores
            lam, var = _lambda_from_sums(taps[n].Lam, taps[n].M4, self.n_examples, in_place=False)
            self.scores.score_layer(n, {**out[n], "Lambda": lam, "LambdaVar": var}, R.pop(n), self.lock)
            del lam, var
        return taps


class _SpillTap(Tap):
    """Pass 1 when the factors are formed from the spill (:func:`_spilled_groups`): the
    layer's input and output gradient go to the spill file, nothing else."""

    def __init__(self, module, name, spill, stats=None):
        super().__init__(module)
        self.name, self.spill, self.stats = name, spill, stats

    def on_forward(self, x):
        if self.stats is not None:
            self.stats.count_routed(self.name, self.module)
        if is_routed(self.module):  # an expert's slots: masked here (the batch's mask is per position)
            x = x * self.stats.mask_of(self.module, x.dtype)
        self.spill.input(self.name, x)

    def on_backward(self, x, g):
        self.spill.gradient(self.name, g)
