"""The passes' accumulators: per-layer sums on the device, reduced across ranks a few
steps behind the compute (so a collective overlaps the next batches), and a small cache
of the most recent layer inputs that layers sharing one input reuse."""

from __future__ import annotations

import math
from collections import OrderedDict, deque

import torch

from ..model.moe import layer_mask, routed_tokens
from ..runtime import distributed


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
        #: per expert layer (:mod:`prism_select.model.moe`): the real tokens routed to it so far
        self.layer_tokens: dict = {}

    def count_routed(self, name, module):
        """Add the batch's real tokens routed to ``module`` (an expert's layer) to its
        count, in place (a CUDA graph replays it); nothing for any other layer."""
        if self.paused or name is None:
            return
        c = routed_tokens(module, self.sel)
        if c is None:
            return
        t = self.layer_tokens.get(name)
        if t is None:
            t = self.layer_tokens[name] = torch.zeros((), dtype=self.acc, device=self.sel.device)
        t += c.to(self.acc)

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

    def mask_of(self, module, dtype):
        """:meth:`mask` as ``module`` sees the batch's tokens: an expert's layer at its
        slots (:func:`prism_select.model.moe.layer_mask`)."""
        if getattr(module, "slots", None) is None:
            return self.mask(dtype)
        return layer_mask(module, self.sel).to(dtype)[..., None]

    def mask(self, dtype):
        m = self._masks.get(dtype)
        if m is None:
            m = self._masks[dtype] = self.sel.to(dtype)[..., None]
        return m
