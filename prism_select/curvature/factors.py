"""The factor pass's pieces: the Kronecker factors' Gram products (formed in lower
blocks where a whole product would not fit), the taps that sum A, S and the
diagonal during the passes, and the detection of layers that share one input (one A
for q/k/v, one for gate/up)."""

from __future__ import annotations

import torch

from ..engine import Tap, collate_to, mm_acc, mm_acc_into, tap_linears
from ..runtime import distributed
from ..runtime.layers import has_bias


def _key(x, *extra):
    """Identifies one input tensor within a batch. The cache entry also holds ``x``, so
    its memory cannot be reused by another tensor (with the same address) meanwhile."""
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x._version) + extra


#: on the CPU a factor ``a^T a`` wider than this is formed block by block, the lower block
#: triangle only (``_gram_into``), and mirrored once after the pass (``_mirror``): about
#: 0.65 of the full product's time at 576 and 1536 wide (measured on a 2-core EPYC,
#: benchmarks/results/INDEX.md). GPUs keep the one full product.
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
        st.count_routed(self.name, self.module)
        k = _key(x, self.bias)
        hit = st.cache.get(k)
        if hit is None:
            a = (x * st.mask_of(self.module, x.dtype)).reshape(-1, x.shape[-1])  # padding rows zeroed
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


class _DiagTap(Tap):
    keep_input = True

    def __init__(self, module, stats, D):
        super().__init__(module)
        self.stats, self.D, self.bias = stats, D, has_bias(module)

    def on_backward(self, x, g):
        xa = _with_ones(x) if self.bias else x
        G = mm_acc(g.transpose(1, 2), xa, self.stats.acc)
        self.D += (G * G).sum(0)


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
