"""The factor and eigenvalue taps of a fit whose model is sharded (FSDP2): each layer's
statistics are summed to the rank that owns the layer, which alone keeps its factors."""

from __future__ import annotations

import torch

from ..runtime import distributed
from .eigenvalues import _LambdaTap, _rotate
from .factors import _CovTap, _gram, _key, _with_ones


class _ShardedCovTap(_CovTap):
    """Pass 1 with the factors sharded over the ranks (FSDP, ``owner`` from
    :func:`prism_select.runtime.sharding.factor_owners`): every rank forms the products of its own
    batch (masked inputs with the bias's ones column, masked too; output gradients), and
    they are summed onto the layer's owner, which alone accumulates ``A`` and ``S`` (None
    elsewhere), with the same sums as one process. Each rank multiplies only its own
    examples, so the products divide over the ranks (the ranks meet at every layer's
    collective: a product formed by the owner alone over every rank's examples would put
    ``world`` times its cost on every rank's path). An input read by several layers of one
    owner is summed once. A stand-in step adds zeros, and the owner still adds the other
    ranks' sums."""

    collective = True

    def __init__(self, module, stats, A, S, owner: int, name=None):
        super().__init__(module, stats, A, S, name)
        self.owner = owner

    def on_forward(self, x):
        st = self.stats
        st.count_routed(self.name, self.module)
        k = _key(x, self.bias, "owner", self.owner)
        if k in st.cache:
            total = st.cache[k][1]
        else:
            w = x.shape[-1] + int(self.bias)
            if self.paused:
                C = torch.zeros(w, w, dtype=st.acc, device=x.device)
            else:
                m = st.mask_of(self.module, x.dtype)
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
