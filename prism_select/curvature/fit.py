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
"""

from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict, deque

import torch
from tqdm.auto import tqdm

from .. import distributed, profiling, sharding
from ..data.tokenize import token_losses
from ..execution import DEFAULT_KERNELS, Kernels
from ..engine import (Tap, batch_losses, causal_only, collate_to, mm_acc, mm_acc_into, rowdot, split_causal_lm,
                      tap_linears)
from ..precision import fit_policy
from ..graphs import GraphedScorer, bucket_length, graphs_wanted
from ..gradients import check_finite, has_bias, layer_shape, release_host_memory
from ..gradients import side_by_side as _side_by_side
from .base import Curvature, CurvatureSettings, FitSettings, PreconditionSettings, apply_damping
from .eigh import _eigh, _eigh_many


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


class _Recent(OrderedDict):
    """The last few per-input products of a batch (layers reading one input, e.g. q/k/v or
    gate/up, run one after the other and share them); older entries are dropped, so the
    cache holds at most ``RECENT_INPUTS`` products however many layers are tapped."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        while len(self) > RECENT_INPUTS:
            self.popitem(last=False)


#: per-input products a fit tap keeps for the next layers reading the same input
RECENT_INPUTS = 4


#: sharded factors: collectives summing a layer's products onto its owner that may be in
#: flight at once while the pass computes on (each holds its product until it is waited
#: for; memory.plan counts them); the rest are waited for at the end of the step
REDUCE_WINDOW = 2


class _Sum:
    """A tensor being summed onto its owner rank (:func:`distributed.reduce_sum_to_async`);
    :meth:`then` runs a function on the sum, on the owner, once it is there."""

    def __init__(self, t: torch.Tensor, owner: int):
        self._finish = distributed.reduce_sum_to_async(t, owner)
        self.result, self.done, self._then = None, False, []

    def then(self, fn):
        if not self.done:
            self._then.append(fn)
        elif self.result is not None:
            fn(self.result)

    def wait(self):
        if self.done:
            return
        self.result, self.done = self._finish(), True
        if self.result is not None:
            for fn in self._then:
                fn(self.result)
        self._then = []


class _Stats:
    """Per-batch bookkeeping shared by the fit taps."""

    def __init__(self, acc):
        self.acc = acc
        self.sel = None  # (B, T) bool: real tokens of the batch
        self.cache: dict = _Recent()
        self.added: list = []  # shared input accumulators added to in this batch (_CovTap)
        self.n_tokens = None
        self.bad: list = []
        self.paused = False  # a stand-in step (see _passes): nothing is counted
        self._scratch = None
        self.spill = None  # a _Spill the factor pass writes
        self.pending: deque = deque()  # _Sum in flight (sharded factors)

    def summed(self, t: torch.Tensor, owner: int) -> _Sum:
        """``t`` summed onto rank ``owner`` in the background: at most REDUCE_WINDOW sums
        stay in flight (the oldest are waited for first, in the order every rank started
        them); :meth:`drain` waits for the rest."""
        s = _Sum(t, owner)
        self.pending.append(s)
        while len(self.pending) > REDUCE_WINDOW:
            self.pending.popleft().wait()
        return s

    def drain(self):
        while self.pending:
            self.pending.popleft().wait()

    def start(self, b):
        self.drain()
        if self.paused:
            return
        sel = b.get("token_mask")
        self.sel = b["attention_mask"] if sel is None else sel
        self._masks = {}
        self.cache.clear()
        self.added = []
        if self.spill is not None:
            self.spill.start(self.sel)
        self.n_batch = self.sel.sum().to(self.acc)
        if self.n_tokens is None:
            self.n_tokens = torch.zeros((), dtype=self.acc, device=self.sel.device)
        self.n_tokens += self.n_batch  # in place: a CUDA graph replays it

    def scratch(self, *shape):
        """A reused ``acc`` buffer of ``shape`` (its contents are the caller's)."""
        n = math.prod(shape)
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=self.acc)
        return self._scratch[:n].view(*shape)

    def mask(self, dtype):
        m = self._masks.get(dtype)
        if m is None:
            m = self._masks[dtype] = self.sel.to(dtype)[..., None]
        return m


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
        import tempfile
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
        import os
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
            import threading
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
    import shutil
    import tempfile
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
                    progress: bool = True, scores: FitScores | None = None) -> tuple[dict, dict, dict, dict]:
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
    not score; ``scores.scores`` stays None).

    Returns ``(tensors, Lam, M4, seconds)``: each layer's ``QA``, ``lamA``, ``QS``, ``lamS``
    (eigenvalues clamped at 0, row-major eigenvectors), the unnormalised sums per layer,
    and the summed task seconds of the two kinds of work (``eigh``: factors and
    eigendecompositions; ``lambda``, scores included)."""
    import threading
    import time

    entries: dict = {}  # layer -> [(batch number, input entry, gradient entry)]
    for k, rec in enumerate(spill.batches):
        for name, xe, ge in rec:
            entries.setdefault(name, []).append((k, xe, ge))
    by_input: dict = {}  # layers reading one input (with the same bias column) share A
    for n in modules:
        first = entries.get(n, [(None, ("none", n), None)])[0][1]
        by_input.setdefault((first, has_bias(modules[n])), []).append(n)
    groups = list(by_input.values())
    tokens = sum(math.prod(m.shape) for m in spill.masks)

    def cost(gid):  # eigendecompositions ~ 27 d^3; products 2 T (2 in^2 + 2 out^2 + out in), A and S included
        inp = layer_shape(modules[groups[gid][0]])[1]
        outs = [layer_shape(modules[n])[0] for n in groups[gid]]
        return 27 * (inp ** 3 + sum(o ** 3 for o in outs)) + 2 * tokens * (
            2 * inp ** 2 + sum(2 * o * o + o * inp for o in outs))

    tensors, Lam, M4 = {}, {}, {}
    seconds = {"eigh": 0.0, "lambda": 0.0}
    lock = threading.Lock()
    if scores is not None:
        itemsize = torch.empty((), dtype=compute).element_size()
        kept = sorted((scores.n_examples * itemsize * sum(math.prod(layer_shape(modules[n])) for n in g)
                       for g in groups), reverse=True)
        at_once = sum(kept[:max(torch.get_num_threads(), 1)])  # the largest tasks, one per worker
        rows = sorted(i for b in spill.examples for i in b)
        if rows != list(range(scores.n_examples)):
            raise ValueError("FitScores: the fit examples must be the encoded list's, each once")
        if at_once > scores.max_bytes:
            log.info("the fit does not score: its rotated gradients would take %.2f GiB at once (at most %.2f)",
                     at_once / 2**30, scores.max_bytes / 2**30)
            scores = None
    kept_bufs: dict = {}  # worker thread -> the buffer its tasks' kept products reuse

    def kept_products(layers) -> dict:
        """Each layer's ``R`` (``n_examples x out x in'``), views of one buffer per worker
        thread: fresh pages for every task (17 GB over the demo's tasks) were ~13 s of
        kernel time in page faults. The buffer is replaced by a smaller one when a task
        needs at most half of it (the tasks come largest first, and the finished
        curvature grows as they go: the demo's peak RSS was ~400 MB higher with the
        largest buffers kept to the end)."""
        shapes = {n: (scores.n_examples, *layer_shape(modules[n])) for n in layers}
        need = sum(math.prod(sh) for sh in shapes.values())
        tid = threading.get_ident()
        buf = kept_bufs.get(tid)
        if buf is None or buf.numel() < need or 2 * need <= buf.numel():
            del buf
            kept_bufs.pop(tid, None)  # the old buffer is freed before the new one is allocated
            buf = kept_bufs[tid] = torch.empty(need, dtype=compute)
        out, at = {}, 0
        for n, sh in shapes.items():
            out[n] = buf[at:at + math.prod(sh)].view(sh)
            at += math.prod(sh)
        return out

    def per_batch(layers):  # batch -> [(layer, input entry, gradient entry)] of these layers
        out: dict = {}
        for n in layers:
            for k, xe, ge in entries.get(n, []):
                out.setdefault(k, []).append((n, xe, ge))
        return [(k, out[k]) for k in sorted(out)]

    def task(gid):
        t0 = time.perf_counter()
        layers = groups[gid]
        bias = has_bias(modules[layers[0]])
        d_in = layer_shape(modules[layers[0]])[1]
        A = torch.zeros(d_in, d_in, dtype=compute)
        S = {n: torch.zeros(layer_shape(modules[n])[0], layer_shape(modules[n])[0], dtype=compute) for n in layers}
        stats = _Stats(compute)
        batches = per_batch(layers)
        for k, rec in batches:  # the factors, as _CovTap sums them (A from the first layer's input)
            sel = spill.masks[k]
            x = spill.read(rec[0][1])
            a = (x * sel.to(x.dtype)[..., None]).reshape(-1, x.shape[-1])
            C = _input_product(a, compute, sel.sum().to(compute) if bias else None)
            A += C
            del x, a, C
            for n, _, ge in rec:
                g = spill.read(ge)
                _gram_into(S[n], g.reshape(-1, g.shape[-1]))
                del g
        # not mirrored: the eigensolver reads the lower triangle alone (_eigh), which is
        # what _gram_into sums (the upper block triangle stays zero)
        A = A.div_(max(n_tokens, 1))
        check_finite(A, "the activation covariance", layer=layers[0])
        out = {}
        lam, Q = _eigh(A)
        del A
        # row-major: LAPACK's column-major Q would be copied whole when the curvature is
        # saved (+0.8 GB of host memory for the embedded model, session 8)
        lamA, QA = lam.clamp(min=0).to(compute), Q.to(compute).contiguous()
        for n in layers:
            Sn = S.pop(n).div_(n_examples)  # lower triangle, as A
            check_finite(Sn, "the gradient covariance", layer=n)
            lam, Q = _eigh(Sn)
            del Sn
            out[n] = {"QA": QA if n == layers[0] else QA.clone(), "lamA": lamA if n == layers[0] else lamA.clone(),
                      "lamS": lam.clamp(min=0).to(compute), "QS": Q.to(compute).contiguous()}
            del lam, Q
        t1 = time.perf_counter()
        taps = {}
        # FitScores: each layer's R_n, one row per example of the encoded list
        R = kept_products(layers) if scores is not None else {}
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
            lam, var = _lambda_from_sums(taps[n].Lam, taps[n].M4, n_examples, in_place=False)
            scores.score_layer(n, {**out[n], "Lambda": lam, "LambdaVar": var}, R.pop(n), lock)
            del lam, var
        with lock:
            for n in layers:
                for key, t in out[n].items():
                    tensors[f"{n}::{key}"] = t
                Lam[n], M4[n] = taps[n].Lam, taps[n].M4
            seconds["eigh"] += t1 - t0
            seconds["lambda"] += time.perf_counter() - t1
        # this worker's freed batches and products, in its own heap arena, go back to the
        # system (untrimmed, the demo's stage ended 1.2 GB above where it began)
        release_host_memory()
        return gid

    order = sorted(range(len(groups)), key=cost, reverse=True)
    with tqdm(total=len(order), desc=desc, unit="group", leave=False,
              disable=not progress or not distributed.is_main()) as bar:
        for _ in _side_by_side(task, order):
            bar.update()
    kept_bufs.clear()
    return tensors, Lam, M4, seconds


class _SpillTap(Tap):
    """Pass 1 when the factors are formed from the spill (:func:`_spilled_groups`): the
    layer's input and output gradient go to the spill file, nothing else."""

    def __init__(self, module, name, spill):
        super().__init__(module)
        self.name, self.spill = name, spill

    def on_forward(self, x):
        self.spill.input(self.name, x)

    def on_backward(self, x, g):
        self.spill.gradient(self.name, g)


def _key(x, *extra):
    """Identifies one input tensor within a batch. The cache entry also holds ``x``, so
    its memory cannot be reused by another tensor (with the same address) meanwhile."""
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x._version) + extra


#: on the CPU a factor ``a^T a`` wider than this is formed block by block, the lower block
#: triangle only (``_gram_into``), and mirrored once after the pass (``_mirror``): about
#: 0.65 of the full product's time at 576 and 1536 wide (measured on a 2-core EPYC,
#: benchmarks/results/INDEX.md, session 8). GPUs keep the one full product.
GRAM_BLOCK = 384


class _LowerBlocks:
    """A ``D x D`` factor summed on the CPU as the lower block triangle that
    :func:`_gram_into` adds to, and no more: row block ``i`` of the first ``d`` rows
    (blocks as :func:`_gram_into` cuts a ``d``-wide input) keeps its columns up to the end
    of its diagonal block, and rows ``d..D`` (a bias's) are kept whole. For a 1536-wide
    factor 0.62 of the square (0.75 at 576): the upper blocks are never summed, so they
    take no memory during the pass. :func:`_mirror` returns the full matrix, equal to the
    one a full ``D x D`` accumulator would give. ``+=`` takes such a factor or a full
    matrix (its upper block triangle ignored)."""

    def __init__(self, D: int, d: int, dtype: torch.dtype):
        k = -(-d // GRAM_BLOCK)
        bs = -(-d // k)
        self.spans = [(i * bs, min(d, (i + 1) * bs)) for i in range(k)]
        self.blocks = [torch.zeros(r1 - r0, r1, dtype=dtype) for r0, r1 in self.spans]
        self.edge = torch.zeros(D - d, D, dtype=dtype) if D > d else None
        self.d, self.shape, self.dtype, self.device = d, (D, D), dtype, torch.device("cpu")

    @staticmethod
    def wanted(d: int, device) -> bool:
        """Whether a factor of a ``d``-wide input (or output) is summed so: on the CPU,
        wider than GRAM_BLOCK."""
        return torch.device(device).type == "cpu" and d > GRAM_BLOCK

    def gram_(self, a: torch.Tensor) -> "_LowerBlocks":
        a = a.to(self.dtype)
        for (r0, r1), B in zip(self.spans, self.blocks):
            B.addmm_(a[:, r0:r1].T, a[:, :r1])
        return self

    def __iadd__(self, C):
        if isinstance(C, _LowerBlocks):
            for B, B2 in zip(self.blocks, C.blocks):
                B += B2
            if self.edge is not None:
                self.edge += C.edge
            return self
        for (r0, r1), B in zip(self.spans, self.blocks):
            B += C[r0:r1, :r1]
        if self.edge is not None:
            self.edge += C[self.d:]
        return self

    def full(self) -> torch.Tensor:
        """The ``D x D`` matrix with the upper block triangle zero (and forgets the blocks)."""
        M = torch.zeros(self.shape, dtype=self.dtype)
        for (r0, r1), B in zip(self.spans, self.blocks):
            M[r0:r1, :r1] = B
        if self.edge is not None:
            M[self.d:] = self.edge
        self.blocks, self.edge = [], None
        return M


def _gram_into(M, a: torch.Tensor):
    """``M += a^T a`` in ``M``'s dtype. On the CPU, for a factor wider than GRAM_BLOCK,
    only the lower block triangle of ``M`` (diagonal blocks whole) is added to, in place;
    :func:`_mirror` completes the matrix once the sums are done. ``M`` may be a
    :class:`_LowerBlocks`, which holds that triangle only."""
    if isinstance(M, _LowerBlocks):
        return M.gram_(a)
    d = a.shape[-1]
    k = -(-d // GRAM_BLOCK)
    if M.device.type != "cpu" or k < 2:
        return mm_acc_into(M, a.T, a)
    a = a.to(M.dtype)
    bs = -(-d // k)
    for i in range(k):
        r0, r1 = i * bs, min(d, (i + 1) * bs)
        M[r0:r1, :r1].addmm_(a[:, r0:r1].T, a[:, :r1])
    return M


def _gram(a: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``a^T a`` as :func:`_gram_into` forms it (lower block triangle on the CPU)."""
    if a.device.type != "cpu" or a.shape[-1] <= GRAM_BLOCK:
        return mm_acc(a.T, a, acc)
    return _gram_into(torch.zeros(a.shape[-1], a.shape[-1], dtype=acc), a)


def _mirror(M) -> torch.Tensor:
    """Complete a factor summed by :func:`_gram_into`: its upper triangle becomes the
    transposed lower one (in place, or into the full matrix of a :class:`_LowerBlocks`,
    which is returned; on other devices nothing is done). The result is exactly
    symmetric."""
    if isinstance(M, _LowerBlocks):
        M = M.full()
    if M.device.type == "cpu" and M.shape[-1] > GRAM_BLOCK:
        M.copy_(M.tril() + M.tril(-1).mT)
    return M


def _input_product(a: torch.Tensor, acc: torch.dtype, n_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A batch's ``A`` term from its masked inputs ``a`` (tokens x in): ``a^T a`` as
    :func:`_gram` forms it, bordered, for a layer with a bias, by the inputs' sums and the
    batch's real token count ``n_tokens`` (the bias's input is a column of ones)."""
    C = _gram(a, acc)
    if n_tokens is None:
        return C
    s = a.sum(0, dtype=acc)
    return torch.cat([torch.cat([C, s[:, None]], 1), torch.cat([s[None, :], n_tokens.reshape(1, 1)], 1)], 0)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A fitted tensor moved to host memory (one place, so that a test can follow it)."""
    return t.to("cpu")


def _with_ones(x):
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)], dim=-1)


class _CovTap(Tap):
    """Pass 1: ``A += a a^T`` over real tokens (once per distinct input), ``S += b b^T``.

    ``shared``: ``A`` is one accumulator of several layers that read one input (q/k/v,
    gate/up; :func:`_shared_inputs`): the first of them to see the batch's input adds its
    product, the others find it in the batch's cache, added to their accumulator already.
    Otherwise a layer that finds its input's product in the cache adds it to its own ``A``."""

    def __init__(self, module, stats, A, S, name=None, shared=False):
        super().__init__(module)
        self.stats, self.A, self.S, self.bias = stats, A, S, has_bias(module)
        self.name, self.shared = name, shared

    def on_forward(self, x):
        st = self.stats
        k = _key(x, self.bias)
        hit = st.cache.get(k)
        if hit is None:
            a = (x * st.mask(x.dtype)).reshape(-1, x.shape[-1])  # padding rows zeroed
            C = _input_product(a, st.acc, st.n_batch if self.bias else None)
            st.cache[k] = (x.detach(), C, self.A)  # detached: see _Spill.input
        else:
            C, into = hit[1], hit[2]
            if self.shared and into is self.A:
                return  # added to the accumulator this layer shares
            if self.shared:
                raise RuntimeError(f"layer {self.name} shares its input accumulator with other layers, "
                                   "but read another input in this fit batch")
        if self.shared:
            if any(t is self.A for t in st.added):
                raise RuntimeError(f"the layers sharing {self.name}'s input accumulator read different "
                                   "inputs in this fit batch")
            st.added.append(self.A)
        self.A += C

    def on_backward(self, x, g):
        _gram_into(self.S, g.reshape(-1, g.shape[-1]))


class _Probe(Tap):
    """Records which input each layer reads in one forward (see :func:`_shared_inputs`)."""

    def __init__(self, module, name, seen):
        super().__init__(module)
        self.name, self.seen, self.bias = name, seen, has_bias(module)

    def on_forward(self, x):
        self.seen.append((self.name, _key(x, self.bias), x))  # x held: its address is not reused


def _shared_inputs(model, modules: dict, encoded: list, batches: list, pad_id, device) -> dict:
    """``{layer: the first layer reading the same input}`` (itself for the first or only
    one), from a forward of the shortest fit example without a graph: layers that read one
    tensor (q/k/v, gate/up) have the same ``A`` and can sum it in one accumulator. The
    fit checks in every batch that they still read one input (:class:`_CovTap`)."""
    first = {n: n for n in modules}
    if not batches:
        return first
    i = min((i for b in batches for i in b), key=lambda i: len(encoded[i].input_ids))
    b = collate_to([encoded[i]], pad_id, device)
    seen: list = []
    with tap_linears(model, {n: _Probe(m, n, seen) for n, m in modules.items()}), torch.no_grad():
        model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    owner, done = {}, set()
    for n, k, _ in seen:  # the input of each layer's first call
        if n not in done:
            done.add(n)
            first[n] = owner.setdefault(k, n)
    del seen
    return first


def _rotate(x: torch.Tensor, Q: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``x @ Q`` in ``x``'s dtype. Half precision: one tensor-core matmul (float32
    accumulation, rounded once to half), no float32 intermediate to write and cast."""
    if x.dtype == acc or x.dtype != Q.dtype:
        return mm_acc(x, Q, acc).to(x.dtype)
    return x @ Q


class _LambdaTap(Tap):
    """Pass 2 (EK-FAC): ``Lambda += sum_n (Q_S^T G_n Q_A)**2`` (padding has ``b = 0``),
    ``M4 += sum_n sum_ij (Q_S^T G_n Q_A)_ij**4`` (a one-element tensor)."""

    keep_input = True

    def __init__(self, module, stats, QA, QS, qa_group):
        super().__init__(module)
        self.stats, self.bias = stats, has_bias(module)
        self.Lam = self.M4 = None  # the sums, set by the fit (zeros of out x in', and of one element)
        self.dtype = dt = module.weight.dtype  # the eigenbases' dtype in the pass
        # None: another rank owns the layer (sharded factors, _ShardedLambdaTap)
        self.QA = None if QA is None else QA.to(dt)
        self.QS = None if QS is None else QS.to(dt)
        self.qa_id = qa_group
        self.rows = None  # the next batch's kept products (_spilled_groups with FitScores), else None

    def on_backward(self, x, g):
        st = self.stats
        k = _key(x, self.bias, self.qa_id)
        aq = st.cache.get(k, (None, None))[1]
        if aq is None:
            xa = _with_ones(x) if self.bias else x
            aq = _rotate(xa, self.QA, st.acc)
            st.cache[k] = (x.detach(), aq)
        keep, self.rows = self.rows, None
        self.add(aq, _rotate(g, self.QS, st.acc), keep=keep)

    def add(self, aq: torch.Tensor, bq: torch.Tensor, Lam=None, M4=None, keep=None):
        """Add the examples of rotated inputs ``aq`` (``B x T x in'``) and output gradients
        ``bq`` (``B x T x out``) to ``Lambda`` and ``M4`` (or to the given ``Lam``, ``M4``).
        ``keep`` (the CPU, the accumulation dtype; :class:`FitScores`): one ``out x in'``
        tensor per example, into which its product ``R_n`` is written before it is squared."""
        st = self.stats
        Lam = self.Lam if Lam is None else Lam
        M4 = self.M4 if M4 is None else M4
        if bq.device.type == "cpu" and bq.dtype == st.acc:
            # example by example into one reused buffer: a (B, out, in) product, squared
            # into a second one, cost three times the GEMMs on the CPU (memory traffic
            # and page faults; session 8)
            R = st.scratch(bq.shape[-1], aq.shape[-1])
            flat = R.view(-1)
            for n in range(bq.shape[0]):
                if keep is None:
                    torch.mm(bq[n].T, aq[n], out=R)
                    R.square_()
                else:
                    torch.mm(bq[n].T, aq[n], out=keep[n])
                    torch.square(keep[n], out=R)
                Lam += R
                M4 += torch.dot(flat, flat)
            return
        if keep is not None:
            raise ValueError("the kept products are formed on the CPU in the accumulation dtype only")
        if bq.dtype == st.acc:
            rot = bq.transpose(1, 2) @ aq
            sq = rot * rot
            Lam += sq.sum(0)
        else:  # half precision: bf16 products (float32 accumulate), squares summed in float32
            sq = torch.bmm(bq.transpose(1, 2), aq).square_()
            Lam += sq.sum(0, dtype=st.acc)
        flat = sq.reshape(-1)
        M4 += torch.dot(flat, flat).to(st.acc)  # no copy of the batch's squares


class _ShardedCovTap(_CovTap):
    """Pass 1 with the factors sharded over the ranks (FSDP, ``owner`` from
    :func:`prism_select.sharding.factor_owners`): every rank forms the products of its own
    batch (masked inputs with the bias's ones column, masked too; output gradients), and
    they are summed onto the layer's owner, which alone accumulates ``A`` and ``S`` (None
    elsewhere), with the same sums as one process. Each rank multiplies only its own
    examples, so the products divide over the ranks (the ranks meet at every layer's
    collective: a product formed by the owner alone over every rank's examples would put
    ``world`` times its cost on every rank's path). An input read by several layers of one
    owner is summed once. A stand-in step adds zeros, and the owner still adds the other
    ranks' sums."""

    collective = True

    def __init__(self, module, stats, A, S, owner: int):
        super().__init__(module, stats, A, S)
        self.owner = owner

    def on_forward(self, x):
        st = self.stats
        k = _key(x, self.bias, "owner", self.owner)
        if k in st.cache:
            total = st.cache[k][1]
        else:
            w = x.shape[-1] + int(self.bias)
            if self.paused:
                C = torch.zeros(w, w, dtype=st.acc, device=x.device)
            else:
                m = st.mask(x.dtype)
                a = torch.cat([x * m, m], -1) if self.bias else x * m
                C = _gram(a.reshape(-1, w), st.acc)
            total = st.summed(C, self.owner)
            st.cache[k] = (x.detach(), total)
        if self.A is not None:
            total.then(self.A.add_)

    def on_backward(self, x, g):
        w = g.shape[-1]
        if self.paused:
            C = torch.zeros(w, w, dtype=self.stats.acc, device=g.device)
        else:
            C = _gram(g.reshape(-1, w), self.stats.acc)
        total = self.stats.summed(C, self.owner)
        if self.S is not None:
            total.then(self.S.add_)


class _ShardedLambdaTap(_LambdaTap):
    """Pass 2 with sharded factors: the layer's owner sends its eigenbases (in the model's
    dtype) to every rank for the step; each rank rotates its own batch's inputs and output
    gradients and adds its examples into a sum of its own, and the sums are added onto
    the owner's ``Lambda`` and ``M4`` (padding examples and tokens have ``b = 0`` and add
    nothing). Each rank rotates only its own examples, so the work divides over the ranks
    (see :class:`_ShardedCovTap`). An input read by several layers of one owner is rotated
    once. A stand-in step adds zeros."""

    collective = True

    def __init__(self, module, stats, QA, QS, qa_group, owner: int):
        super().__init__(module, stats, QA, QS, qa_group)
        self.owner = owner

    def _from_owner(self, Q, width: int, device) -> torch.Tensor:
        return distributed.broadcast_from(Q, self.owner, (width, width), self.dtype, device)

    def on_backward(self, x, g):
        st = self.stats
        k = _key(x, self.bias, self.qa_id, "owner", self.owner)
        if k in st.cache:
            aq = st.cache[k][1]
        else:
            QA = self._from_owner(self.QA, x.shape[-1] + int(self.bias), x.device)
            aq = None if self.paused else _rotate(_with_ones(x) if self.bias else x, QA, st.acc)
            del QA
            st.cache[k] = (x.detach(), aq)
        QS = self._from_owner(self.QS, g.shape[-1], g.device)
        out, inp = g.shape[-1], x.shape[-1] + int(self.bias)
        sums = torch.zeros(out * inp + 1, dtype=st.acc, device=g.device)  # this rank's Lambda and M4
        if not self.paused:
            self.add(aq, _rotate(g, QS, st.acc), sums[:-1].view(out, inp), sums[-1:])
        del QS
        total = st.summed(sums, self.owner)
        if self.Lam is not None:
            total.then(self._add_sums)

    def _add_sums(self, sums: torch.Tensor):
        self.Lam += sums[:-1].view(self.Lam.shape)
        self.M4 += sums[-1:]


class _DiagTap(Tap):
    keep_input = True

    def __init__(self, module, stats, D):
        super().__init__(module)
        self.stats, self.D, self.bias = stats, D, has_bias(module)

    def on_backward(self, x, g):
        xa = _with_ones(x) if self.bias else x
        G = mm_acc(g.transpose(1, 2), xa, self.stats.acc)
        self.D += (G * G).sum(0)


class _FitStep:
    """One fit batch: forward, the loss, the backward through the taps (which add to the
    statistics). Returns the per-example finite-loss flags. Under CUDA graphs
    (:class:`prism_select.graphs.GraphedScorer`) the batch comes padded, without an
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
#: very varied fit never earns it back (docs/performance.md, runs 6-9)
FIT_GRAPH_MIN_REPLAYS = 8


def fit_graphs_pay_off(encoded: list, batches: list) -> bool:
    """Whether ``batches`` (lists of indices into ``encoded``) hold at least
    FIT_GRAPH_MIN_REPLAYS batches per distinct padded shape."""
    shapes = {bucket_length(max(len(encoded[i].input_ids) for i in b)) for b in batches}
    return len(batches) >= FIT_GRAPH_MIN_REPLAYS * max(len(shapes), 1)


def _passes(model, taps, stats, encoded, batches, fisher, seed, device, pad_id, desc, progress=True,
            cuda_graphs: str = "off", batch_size: int | None = None):
    """One pass over ``batches`` (this rank's share) with ``taps`` routing the tracked layers.
    ``cuda_graphs`` (empirical Fisher only): capture each padded batch shape once."""
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


def fit_curvature(model, modules: dict, encoded: list, settings: CurvatureSettings,
                  *, pad_id: int, device=None, progress: bool = True, timings: dict | None = None,
                  cuda_graphs: str = "auto", precision: str = "model", groups: list | None = None,
                  store: str = "device", on_group=None, spill_dir=None,
                  kernels: Kernels = DEFAULT_KERNELS, offload: bool | None = None, on_spill=None,
                  scores: FitScores | None = None, sharded_sums: str = "step") -> Curvature:
    """Fit ``settings.kind`` curvature for ``modules`` on ``encoded`` examples.

    ``groups`` (lists of layer names covering ``modules``, from the memory plan,
    :mod:`prism_select.plan`): the fit runs group by group, each with its own passes over
    the fit batches, so only one group's factors are on the device at a time; the result
    is the same as one group's (every factor of a layer depends only on that layer's
    inputs and output gradients). ``store``: where each finished group's tensors go:
    ``device`` (kept where they were computed), ``host`` (moved to host memory), or
    ``transient`` (dropped after ``on_group``: the returned curvature holds only the
    damping). ``on_group(layers, part)`` is called with each finished group as a
    :class:`Curvature` of its layers (e.g. to precondition a direction with it).
    ``offload`` (EK-FAC; default: ``store != "device"``): a group's float32 eigenbases wait
    in host memory during its eigenvalue pass (the memory plan turns it off when the host
    cannot hold a group's; the numbers are the same).

    Under ``torchrun`` (an initialised process group), each rank runs its share of the
    fit batches. Data-parallel ranks sum the statistics (all-reduce) before each
    eigendecomposition, so every rank ends with the same curvature. With the model sharded
    by FSDP (:func:`factors_sharded`) each rank's statistics of a layer are summed onto its owner rank as the
    passes run, and each rank ends with its own layers' curvature (``meta["owners"]``;
    the damping and shrinkage of every layer). ``sharded_sums`` says when they reach the
    owner: ``step`` (every step: each rank holds only its share of the statistics) or
    ``pass`` (each rank sums its batches of every layer of the group through a pass, and
    the sums travel once at its end: the memory plan picks it where a whole group's sums fit
    every rank, :func:`prism_select.plan.make_plan`). ``timings``, if
    given, receives ``factors_s``, ``eigh_s`` and ``lambda_s`` (summed over groups).
    ``cuda_graphs`` (empirical Fisher only; ``auto``: CUDA devices, models below
    ``graphs.AUTO_MAX_PARAMS``, and passes that replay each shape FIT_GRAPH_MIN_REPLAYS
    times) captures each padded fit-batch shape once and replays it
    (:mod:`prism_select.graphs`); the statistics are the same sums. ``precision``
    (``ScoreSettings.precision``): under ``split32`` the fit computes as the scores do
    (:func:`prism_select.precision.fit_policy`, with ``kernels``). ``spill_dir``: where the CPU's EK-FAC
    fit may keep the factor pass's layer inputs and gradients for the eigenvalue pass
    (an unnamed temporary file, SPILL_MAX_BYTES; None: the system's temporary directory).
    ``on_spill(spill)``: with one group of layers, the spill (:class:`_Spill`, which can
    score the fit examples, :meth:`_Spill.scores`) is handed to it once the fit is done
    instead of being closed; the callee closes it. ``scores`` (:class:`FitScores`; one group
    of layers, a spilled fit): the fit also scores the fit examples along
    ``scores.direction``; the spill is then closed, not handed to ``on_spill``.
    """
    if store not in ("device", "host", "transient"):
        raise ValueError(f"unknown curvature store {store!r}")
    layers = list(modules)
    groups = [list(g) for g in groups] if groups else [layers]
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
    device = device or next(model.parameters()).device
    idx = fit_indices(len(encoded), settings)
    batches = length_batches(encoded, idx, settings.batch_size)
    tensors, damping, shrinkage, owned_by = {}, {}, {}, {}
    sharded = factors_sharded(model, settings.kind)
    with fit_policy(model, precision, kernels):
        for k, group in enumerate(groups):
            tag = f" (group {k + 1}/{len(groups)})" if len(groups) > 1 else ""
            sub = {n: modules[n] for n in group}
            owners = sharding.factor_owners(group, sub) if sharded else None
            before = dict(timings)
            t = _fit_group(model, sub, encoded, batches, len(idx), settings, pad_id=pad_id, device=device,
                           progress=progress, timings=timings, cuda_graphs=cuda_graphs, tag=tag,
                           offload=store != "device" if offload is None else offload, spill_dir=spill_dir,
                           owners=owners, on_spill=on_spill if len(groups) == 1 else None,
                           scores=scores if len(groups) == 1 else None, local_sums=sharded_sums == "pass")
            log.info("curvature%s: %d layers, factors %.1f s, eigendecompositions %.1f s, eigenvalues %.1f s",
                     tag, len(group), *(timings[k] - before[k] for k in ("factors_s", "eigh_s", "lambda_s")))
            if store == "host":
                t = {name: _to_host(x) for name, x in t.items()}
            if owners is None:
                part = apply_damping(Curvature(settings.kind, group, t, {}), settings)
            else:  # this rank's layers; every rank learns every layer's damping and shrinkage
                mine = apply_damping(Curvature(settings.kind, [n for n in group if owners[n] == distributed.rank()],
                                               t, {}), settings)
                part = Curvature(settings.kind, group, t, distributed.merge_dicts(mine.damping),
                                 meta={"owners": owners}, shrinkage=distributed.merge_dicts(mine.shrinkage))
                owned_by.update(owners)
            if on_group is not None:
                on_group(group, part)
            damping.update(part.damping)
            shrinkage.update(part.shrinkage)
            if store != "transient":
                tensors.update(t)
            del t, part
    meta = {"store": store, "groups": len(groups)}
    if sharded:
        meta["owners"] = owned_by
    return Curvature(settings.kind, layers, tensors, damping, meta=meta, shrinkage=shrinkage)


def factors_sharded(model, kind: str) -> bool:
    """Whether a fit of ``kind`` shards its factors over the ranks: K-FAC and EK-FAC of a
    model sharded with FSDP (:mod:`prism_select.sharding`). Each layer's factors then live
    on one rank (:func:`prism_select.sharding.factor_owners`), which receives the other
    ranks' layer inputs and output gradients in every step, so per-rank factor memory
    falls as ``1/K``; data-parallel ranks (a whole model each) sum full factors instead."""
    return kind in ("ekfac", "kfac") and distributed.active() and sharding.is_sharded(model)


def _fit_group(model, modules, encoded, batches, n_examples, settings, *, pad_id, device, progress, timings,
               cuda_graphs, tag="", offload=False, spill_dir=None, owners: dict | None = None, on_spill=None,
               scores: FitScores | None = None, local_sums: bool = False):
    """The fit of one group of layers: the tensors :class:`Curvature` holds.
    ``offload``: the finished tensors go to host memory as soon as the device copies that
    the eigenvalue pass needs are made (the pass then holds only those). ``owners``
    (K-FAC / EK-FAC under FSDP, :func:`prism_select.sharding.factor_owners`): each layer's
    statistics are accumulated, decomposed and kept by its owner rank alone, and this
    rank returns the tensors of the layers it owns. ``local_sums`` (with ``owners``): each
    rank sums its own batches' statistics of every layer of the group through a pass and
    they reach the owners once, at its end (and every rank receives every layer's
    eigenbases once, before the eigenvalue pass), instead of at every step: the same sums,
    far fewer transfers, the whole group's sums on every rank. ``on_spill`` (as in :func:`fit_curvature`)
    receives the factor pass's spill, if one was written, instead of its being closed,
    unless ``scores`` (:class:`FitScores`) were formed from it."""
    import time

    layers = list(modules)
    me = distributed.rank()
    own = [n for n in layers if owners is None or owners[n] == me]
    local = owners is not None and local_sums
    step_sums = owners is not None and not local  # sharded factors summed onto their owners every step
    summing = layers if local else own  # the layers this rank sums statistics for in the passes
    compute = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    tensors: dict = {}
    stats = _Stats(compute)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=compute, device=device)

    def sync():
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    if settings.kind == "diagonal":
        t0 = time.perf_counter()
        D = {n: zeros(*layer_shape(m)) for n, m in modules.items()}
        taps = {n: _DiagTap(m, stats, D[n]) for n, m in modules.items()}
        _passes(model, taps, stats, encoded, batches, settings.fisher, settings.seed, device, pad_id,
                "curvature (diagonal)" + tag, progress, cuda_graphs, settings.batch_size)
        distributed.all_reduce_sum(list(D.values()))
        for n in layers:
            tensors[f"{n}::D"] = D[n] / n_examples
            check_finite(tensors[f"{n}::D"], "the diagonal curvature", layer=n)
        sync()
        timings["factors_s"] += time.perf_counter() - t0
        return tensors

    # Pass 1: Kronecker factors. On the CPU (EK-FAC, one process) the layers' inputs and
    # output gradients only, spilled to a file, from which _spilled_groups forms them;
    # otherwise summed in the pass, where layers reading one input (unsharded) sum their A
    # in one accumulator (q/k/v, gate/up: 0.11 GiB of the embedded model's 1.02 GiB).
    t0 = time.perf_counter()
    spill = None
    if _spill_wanted(model, modules, encoded, batches, device, settings, spill_dir):
        try:
            spill = _Spill(spill_dir)
        except OSError as exc:  # an unwritable directory: the factors are summed in the pass
            log.info("no spill file for the fit (%s); the eigenvalue pass runs the model again", exc)
    stats.spill = spill
    A = S = None
    if spill is not None:
        taps = {n: _SpillTap(m, n, spill) for n, m in modules.items()}
    else:
        # (sharded factors: no probe forward outside the lockstep passes; with local sums it
        # left the ranks' FSDP collectives out of step in the two-process test. A layer that
        # finds its input's product in the batch's cache adds it to its own A instead.)
        first = {n: n for n in layers} if owners is not None else \
            _shared_inputs(model, modules, encoded, batches, pad_id, device)
        # on the CPU (unsharded) a wide factor is summed as its lower block triangle alone
        # (_LowerBlocks)
        packed = owners is None and distributed.world() == 1

        def factor_zeros(D, d):
            if packed and _LowerBlocks.wanted(d, device):
                return _LowerBlocks(D, d, compute)
            return zeros(D, D)

        roots = [n for n in summing if first[n] == n]  # one per accumulator of A
        A = {n: factor_zeros(layer_shape(modules[n])[1], modules[n].in_features) for n in roots}
        A.update({n: A[first[n]] for n in summing})
        readers = {r: sum(first[n] == r for n in summing) for r in roots}
        shared = {n for n in summing if readers[first[n]] > 1}
        S = {n: factor_zeros(layer_shape(modules[n])[0], layer_shape(modules[n])[0]) for n in summing}
        if step_sums:
            taps = {n: _ShardedCovTap(m, stats, A.get(n), S.get(n), owners[n]) for n, m in modules.items()}
        else:
            taps = {n: _CovTap(m, stats, A[n], S[n], n, n in shared) for n, m in modules.items()}
    try:
        _passes(model, taps, stats, encoded, batches, settings.fisher, settings.seed, device, pad_id,
                "curvature factors" + tag, progress, cuda_graphs, settings.batch_size)
    except BaseException:
        if spill is not None:
            spill.close()
        raise
    stats.spill = None
    del taps
    release_host_memory()
    n_tok = stats.n_tokens if stats.n_tokens is not None else torch.zeros((), device=device)
    n_tok = n_tok.to(compute).reshape(1)
    if spill is not None:  # EK-FAC, one process, the CPU (_spill_wanted): factors, eigendecompositions
        # and eigenvalues together, group by group, from the spill
        spill.finish()
        spill.examples = batches
        n_tokens = int(round(float(n_tok)))
        timings["factors_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            tensors, Lam, M4, secs = _spilled_groups(modules, spill, compute, n_tokens, n_examples,
                                                     "curvature" + tag, progress, scores)
            if scores is not None:
                scores.finish(layers)
        except BaseException:
            spill.close()
            raise
        if on_spill is None or scores is not None and scores.scores is not None:
            spill.close(background=True)
        else:
            on_spill(spill)
        _finish_lambda(tensors, Lam, M4, own, n_examples)
        # the wall time, split between the phases as the workers' time was
        dt = time.perf_counter() - t0
        share = secs["eigh"] / max(secs["eigh"] + secs["lambda"], 1e-9)
        timings["eigh_s"] += dt * share
        timings["lambda_s"] += dt * (1 - share)
        return tensors
    for n in roots:  # one factor at a time: a packed one is freed as its full matrix is made
        A[n] = _mirror(A[n])
    A.update({n: A[first[n]] for n in summing})
    for n in summing:
        S[n] = _mirror(S[n])
    if local:
        # Layers reading one input (q/k/v, gate/up) hold bitwise-identical sums here (one
        # product per input in the pass): each input's sum is sent once. Summed apart over
        # more than two ranks, copies at other offsets of the reduction buffer would be
        # added in other orders, differ in their last bits and be decomposed once each.
        first = _identical_across_ranks(roots, A)
        roots = [n for n in roots if first[n] == n]
        A = {n: A[first[n]] for n in summing}
    # sharded factors summed every step were summed on their owners as the pass went
    distributed.all_reduce_sum(([] if step_sums else [A[n] for n in roots] + list(S.values())) + [n_tok])
    if local:  # this rank keeps its own layers' sums and the accumulators they read
        roots = list(dict.fromkeys(first[n] for n in own))
        A, S = {n: A[n] for n in [*roots, *own]}, {n: S[n] for n in own}
    n_tokens = int(round(float(n_tok)))
    sync()
    timings["factors_s"] += time.perf_counter() - t0
    t0 = time.perf_counter()
    # Layers reading the same input have bitwise-identical A (one product per input in
    # the pass): group them by a fingerprint (one host sync), confirm with torch.equal,
    # and decompose each distinct A once.
    # (sums once per pass: grouped before they were sent, roots are distinct already)
    rep = {n: n for n in roots} if local else _identical(roots, A)
    reps = [n for n in roots if rep[n] == n]  # group id -> representative layer
    group_of = {n: reps.index(rep[n]) for n in roots}  # layer -> group id
    for n in own:  # summed in the accumulator of the first layer reading their input
        group_of[n] = group_of[first[n]]
    for n in roots:
        A[n] /= max(n_tokens, 1)
        check_finite(A[n], "the activation covariance", layer=n)
    for n in own:
        S[n] /= n_examples
        check_finite(S[n], "the gradient covariance", layer=n)
    for n in own:  # the duplicates' accumulators are not needed any more
        if n != reps[group_of[n]]:
            A[n] = None
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
    with tqdm(total=len(tasks), desc="eigendecompositions" + tag, unit="factor", leave=False,
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
            # saved (+0.8 GB of host memory for the embedded model, session 8)
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
    if owners is None:
        distributed.share_from_owners([t for kn in tasks for t in results[kn]], [r for r in where for _ in range(2)])
    for n in own:  # layers reading one input share its eigenbasis until _unshare_inputs
        tensors[f"{n}::lamA"], tensors[f"{n}::QA"] = results[("A", reps[group_of[n]])]
        tensors[f"{n}::lamS"], tensors[f"{n}::QS"] = results[("S", n)]
    del A, S, results
    # the decomposed factors and LAPACK's outputs were freed in the workers' heaps
    release_host_memory()
    sync()
    timings["eigh_s"] += time.perf_counter() - t0

    if settings.kind == "kfac":
        _unshare_inputs(tensors, own)
        return tensors

    # Pass 2 (EK-FAC): eigenvalues corrected with per-example gradients in the eigenbasis.
    t0 = time.perf_counter()
    Lam, M4, taps = {}, {}, {}
    # (local sums) a layer's inputs are rotated once per owner and eigenbasis, as the owner
    # does with sums every step
    qa_key = distributed.merge_dicts({n: (me, group_of[n]) for n in own}) if local else None
    for n, m in modules.items():
        if local:  # every layer's eigenbases in the model's dtype, from its owner, for the pass
            out, inp = layer_shape(m)
            dt = m.weight.dtype
            QA = distributed.broadcast_from(tensors.get(f"{n}::QA"), owners[n], (inp, inp), dt, device)
            QS = distributed.broadcast_from(tensors.get(f"{n}::QS"), owners[n], (out, out), dt, device)
            tap = taps[n] = _LambdaTap(m, stats, QA, QS, qa_key[n])
            del QA, QS
        elif owners is not None:
            tap = taps[n] = _ShardedLambdaTap(m, stats, tensors.get(f"{n}::QA"), tensors.get(f"{n}::QS"),
                                              group_of.get(n), owners[n])
            if owners[n] != me:
                continue
        else:
            tap = taps[n] = _LambdaTap(m, stats, tensors[f"{n}::QA"], tensors[f"{n}::QS"], group_of[n])
        if offload and n in own:  # the taps hold the eigenbases in the model's dtype; the float32 ones wait on the
            # host, moved there layer by layer: the group's float32 and half copies never coexist
            for k in ("QA", "lamA", "lamS", "QS"):
                tensors[f"{n}::{k}"] = _to_host(tensors[f"{n}::{k}"])
        # a layer's sums are allocated once its float32 eigenbases have left: allocated for
        # the whole group first, they stood next to all of its float32 eigenbases (the
        # pass-1 factors' size) and exceeded the plan's figure for the fit (tests/test_scale.py)
        Lam[n] = tap.Lam = zeros(*layer_shape(m))
        M4[n] = tap.M4 = zeros(1)
    steps = _lambda_steps(modules, encoded, batches, settings.fisher, device, owners)
    _passes(model, taps, stats, encoded, steps, settings.fisher, settings.seed, device, pad_id,
            "curvature eigenvalues" + tag, progress, cuda_graphs, settings.batch_size)
    del taps
    if not step_sums:
        distributed.all_reduce_sum(list(Lam.values()) + list(M4.values()))
    if local:  # this rank keeps its own layers' sums
        for n in set(layers) - set(own):
            del Lam[n], M4[n]
    _finish_lambda(tensors, Lam, M4, own, n_examples)
    _unshare_inputs(tensors, own)
    sync()
    timings["lambda_s"] += time.perf_counter() - t0
    return tensors


def _identical(names: list, tensors: dict) -> dict:
    """Each name's representative: the first name in ``names`` whose tensor is bitwise
    equal to its own (grouped by a fingerprint, one host sync, confirmed by ``torch.equal``)."""
    fps = torch.stack([torch.stack([tensors[n].sum(), tensors[n].diagonal().sum(), tensors[n][0].sum()])
                       for n in names]).tolist() if names else []
    fp = dict(zip(names, fps))
    rep, reps = {}, []
    for n in names:
        rep[n] = next((r for r in reps if tensors[r].shape == tensors[n].shape and fp[r] == fp[n]
                       and torch.equal(tensors[r], tensors[n])), n)
        if rep[n] == n:
            reps.append(n)
    return rep


def _identical_across_ranks(names: list, tensors: dict) -> dict:
    """:func:`_identical` of every rank's own ``tensors``, merged: two names share a
    representative only where they do on every rank (the same on every rank, so that the
    ranks then sum the same tensors)."""
    mine = _identical(names, tensors)
    views = distributed.gather_values([mine[n] for n in names])
    rep, seen = {}, {}
    for i, n in enumerate(names):
        rep[n] = seen.setdefault(tuple(v[i] for v in views), n)
    return rep


def _unshare_inputs(tensors: dict, own: list) -> None:
    """Give every layer its own copy of an eigenbasis it shares with the layers reading the
    same input (q/k/v, gate/up: one ``lamA``, ``QA`` each from the eigendecompositions):
    the saved curvature stores each layer's tensors apart (safetensors refuses shared
    storage). Done after the eigenvalue pass, which reads them shared: their copies
    (0.12 GB of the embedded model's 1.22 GB of float32 eigenbases) are not held during it."""
    seen = set()
    for n in own:
        for k in ("lamA", "QA"):
            t = tensors.get(f"{n}::{k}")
            if t is None:
                continue
            if t.untyped_storage().data_ptr() in seen:
                tensors[f"{n}::{k}"] = t.clone()
            else:
                seen.add(t.untyped_storage().data_ptr())


#: the CPU's EK-FAC eigenvalue pass (not from a spill, the empirical Fisher, one process)
#: runs each fit batch in steps whose linear layers' inputs and outputs take at most about
#: this many bytes (:func:`_lambda_steps`; at least one example a step). The pass holds
#: the whole curvature (the float32 eigenbases and the eigenvalue sums: 1.6 GB for the
#: embedded model) next to one step's activations, about those inputs and outputs
#: (1.15 MB a token for the embedded model; autograd keeps about 0.7 GiB for a batch of 8
#: demo records, docs/performance.md); the per-example products, and so the sums, do not
#: depend on the steps.
LAMBDA_STEP_MAX_BYTES = 128 << 20


def _lambda_steps(modules: dict, encoded: list, batches: list, fisher: str, device, owners) -> list:
    """The eigenvalue pass's steps: ``batches`` themselves, or on the CPU (the empirical
    Fisher, one process, unsharded factors) each batch cut into consecutive runs of
    examples whose padded tokens' tracked-layer inputs and outputs take at most
    LAMBDA_STEP_MAX_BYTES (estimated at the model's dtype). The sampled Fisher keeps the
    batches: its labels are drawn batch by batch, the same draws as the factor pass's."""
    if (fisher != "empirical" or owners is not None or distributed.world() > 1
            or torch.device(device or "cpu").type != "cpu" or not modules):
        return batches
    per_token = sum(sum(layer_shape(m)) * m.weight.element_size() for m in modules.values())
    steps = []
    for b in batches:
        length = max(len(encoded[i].input_ids) for i in b)
        k = max(1, LAMBDA_STEP_MAX_BYTES // (per_token * length))
        steps += [b[j:j + k] for j in range(0, len(b), k)]
    return steps


def _finish_lambda(tensors: dict, Lam: dict, M4: dict, own: list, n_examples: int) -> None:
    """``Lambda`` and ``LambdaVar`` of each layer into ``tensors`` from the eigenvalue
    pass's sums (which are consumed)."""
    release_host_memory()
    for n in own:  # in place: no second copy of every layer's eigenvalues
        lam, var = _lambda_from_sums(Lam.pop(n), M4.pop(n), n_examples, in_place=True)
        check_finite(lam, "the EK-FAC eigenvalues", layer=n)
        tensors[f"{n}::Lambda"], tensors[f"{n}::LambdaVar"] = lam, var
    release_host_memory()  # the pass's batches


def _lambda_from_sums(lam_sum: torch.Tensor, m4_sum: torch.Tensor, n_examples: int, *, in_place: bool):
    """``(Lambda, LambdaVar)`` of a layer from the eigenvalue pass's sums over
    ``n_examples`` (``in_place``: ``Lambda`` is the divided ``lam_sum`` itself)."""
    lam = lam_sum.div_(n_examples) if in_place else lam_sum / n_examples
    return lam, _lambda_variance(m4_sum / n_examples, lam, n_examples)


def _lambda_variance(m4: torch.Tensor, lam: torch.Tensor, n: int) -> torch.Tensor:
    """The sampling variance of ``Lambda`` (a mean over ``n`` examples), summed over its
    entries, from ``m4 = (1/n) sum_n sum_ij R_nij**4``: the unbiased variance of the
    squares over the examples, divided by ``n``. One example gives nothing to estimate it
    from: then ``sum_ij Lambda_ij**2`` (a standard error as large as the estimate). A
    one-element tensor."""
    second = torch.sum(lam * lam, dtype=torch.float64)
    if n < 2:
        return second.reshape(1).to(m4.dtype)
    return ((m4.double() - second) / (n - 1)).clamp(min=0).to(m4.dtype)


