"""The finite-difference and forward-mode routes of ``scoring="fast"`` (library and
benchmarks; not on the CLI), and :func:`make_scorer` over every route. The exact route,
the loss and the kernels are the engine's (:mod:`prism_select.engine`).

Fast route (``fd`` / ``fd-hp`` / ``jvp``)
    ``fd``: central difference ``(L(theta + eps v) - L(theta - eps v)) / 2 eps`` with two
    inference forwards on pre-computed perturbed weights (rounded to the model's dtype).
    ``fd-hp``: the same, but the perturbation is kept out of the rounded weights: each
    tracked layer computes ``W a +- eps (V a)`` (a second matmul per layer).
    ``fd32``: ``fd`` on a float32 copy of the model (for bf16/fp16 models): a PRISM
    ``v`` is far from linear beyond tiny steps, and only float32 activations resolve
    the loss change of a step that small (docs/performance.md).
    ``jvp``: ``torch.func.jvp`` of the losses along ``v`` (forward-mode AD).
    ``eps`` is relative: no tracked layer moves by more than ``fd_eps`` of its norm.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .data.tokenize import token_losses
from .engine.linear import ExactScorer
from .engine.loss import batch_losses, split_causal_lm
from .execution import DEFAULT_KERNELS, FAST_ROUTES, Kernels
from .gradients import has_bias

FAST_MODES = FAST_ROUTES
DEFAULT_FD_EPS = 0.03
#: ``fd32``'s relative step: float32 resolves loss changes of ~1e-6 of the loss, and a
#: preconditioned PRISM ``v`` leaves the linear regime near 1e-4 (docs/performance.md)
DEFAULT_FD32_EPS = 1e-5


def fd_scale(modules: dict, V: dict, fd_eps: float) -> float:
    """Absolute step ``eps`` such that no tracked layer moves by more than ``fd_eps``
    of its own weight norm: ``eps = fd_eps / max_l ||V_l|| / ||W_l||``."""
    worst = 0.0
    for n, m in modules.items():
        wn = float(m.weight.detach().double().pow(2).sum())
        if has_bias(m):
            wn += float(m.bias.detach().double().pow(2).sum())
        vn = float(V[n].double().pow(2).sum())
        if vn > 0:
            worst = max(worst, math.sqrt(vn) / max(math.sqrt(wn), 1e-30))
    return fd_eps / worst if worst > 0 else 1.0


class FDScorer:
    """Central finite differences along ``V`` (see the module docstring).

    Both perturbed copies run in ONE forward of a doubled batch: rows ``[0, B)`` see
    ``theta + eps v`` and rows ``[B, 2B)`` ``theta - eps v``. Each tracked layer does
    one batched matmul with its two weight versions stacked (``fd``), or its own
    weight plus ``+-eps (V a)`` (``fd-hp``); every other op runs once on ``2B`` rows.
    """

    def __init__(self, model, modules: dict, V: dict, fd_eps: float = DEFAULT_FD_EPS, mode: str = "fd",
                 fused_loss: bool = False, dtype: torch.dtype | None = None):
        if mode not in ("fd", "fd-hp"):
            raise ValueError(mode)
        p = next(model.parameters())
        if dtype is not None and dtype != p.dtype:
            # run on a copy in ``dtype`` (fd32: the differences need float32 activations)
            import copy
            names = {id(m): n for n, m in model.named_modules()}
            model = copy.deepcopy(model).to(dtype)
            lookup = dict(model.named_modules())
            modules = {n: lookup[names[id(m)]] for n, m in modules.items()}
            p = next(model.parameters())
        self.model, self.modules, self.mode = model, modules, mode
        self.eps = fd_scale(modules, V, fd_eps)
        self.acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        self.split = split_causal_lm(model) if fused_loss else None
        self.tables = {}
        for n, m in modules.items():
            W = m.weight.detach()
            Vn = V[n].to(device=W.device)
            hi = torch.float64 if W.dtype == torch.float64 else torch.float32
            if mode == "fd":
                full = torch.cat([W, m.bias.detach()[:, None]], 1) if has_bias(m) else W
                full = full.to(hi)
                step = self.eps * Vn.to(hi)
                both = torch.stack([full + step, full - step]).to(W.dtype)  # (2, out, in [+1])
                self.tables[n] = (both[:, :, :m.in_features], both[:, :, -1].contiguous() if has_bias(m) else None)
            else:
                d = (self.eps * Vn.to(hi)).to(W.dtype)
                self.tables[n] = (d[:, :m.in_features].contiguous(), d[:, -1].contiguous() if has_bias(m) else None)

    def __enter__(self):
        for n, m in self.modules.items():
            Wt, bt = self.tables[n]
            if self.mode == "fd":
                def fwd(x, Wt=Wt, bt=bt, out_f=m.out_features):
                    x2 = x.reshape(2, -1, x.shape[-1])
                    y = torch.bmm(x2, Wt.transpose(1, 2))
                    if bt is not None:
                        y = y + bt[:, None, :]
                    return y.view(*x.shape[:-1], out_f)
            else:
                def fwd(x, m=m, Wt=Wt, bt=bt):
                    y = F.linear(x, m.weight, m.bias)
                    d = F.linear(x, Wt, bt)
                    d.view(2, -1)[1].neg_()
                    return y.add_(d)
            m.forward = fwd
        return self

    def __exit__(self, *exc):
        for m in self.modules.values():
            try:
                del m.forward
            except AttributeError:
                pass

    @torch.no_grad()
    def score(self, batch: dict) -> torch.Tensor:
        B = batch["input_ids"].shape[0]
        two = {k: torch.cat([batch[k], batch[k]]) for k in ("input_ids", "labels")}
        two["attention_mask"] = None  # see causal_only
        if "loss_index" in batch:
            bi, ti = batch["loss_index"]
            two["loss_index"] = (torch.cat([bi, bi + B]), torch.cat([ti, ti]))
        entered = "forward" in vars(next(iter(self.modules.values())))
        if not entered:
            self.__enter__()
        try:
            losses, _ = batch_losses(self.model, two, split=self.split, need_grad=False)
        finally:
            if not entered:
                self.__exit__(None, None, None)
        losses = losses.to(self.acc)
        return (losses[:B] - losses[B:]) / (2 * self.eps)


class JVPScorer:
    """Forward-mode directional derivative of every example's loss along ``V``."""

    def __init__(self, model, modules: dict, V: dict):
        self.model, self.modules = model, modules
        self.names = {}
        pname = {id(p): n for n, p in model.named_parameters()}
        self.primals, self.tangents = {}, {}
        for n, m in modules.items():
            W = m.weight
            Vn = V[n].to(device=W.device, dtype=W.dtype)
            self.primals[pname[id(W)]] = W.detach()
            self.tangents[pname[id(W)]] = Vn[:, :m.in_features].contiguous()
            if has_bias(m):
                self.primals[pname[id(m.bias)]] = m.bias.detach()
                self.tangents[pname[id(m.bias)]] = Vn[:, -1].contiguous()

    def score(self, batch: dict) -> torch.Tensor:
        from torch.func import functional_call, jvp

        def f(params):
            out = functional_call(self.model, params, (),
                                  {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                                   "use_cache": False})
            return token_losses(out.logits, batch["labels"])[0]

        _, t = jvp(f, (self.primals,), (self.tangents,))
        return t


def make_scorer(kind: str, model, modules: dict, V: dict, *, fd_eps: float | None = None,
                kernels: Kernels = DEFAULT_KERNELS):
    """``exact`` | ``fd`` | ``fd-hp`` | ``fd32`` | ``jvp`` scorer objects with a ``score(batch)``
    method; ``fd_eps=None`` takes the route's default step; ``kernels``: the exact route's."""
    if fd_eps is None:
        fd_eps = DEFAULT_FD32_EPS if kind == "fd32" else DEFAULT_FD_EPS
    if kind == "exact":
        return ExactScorer(model, modules, V, kernels=kernels)
    if kind in ("fd", "fd-hp"):
        return FDScorer(model, modules, V, fd_eps=fd_eps, mode=kind)
    if kind == "fd32":
        return FDScorer(model, modules, V, fd_eps=fd_eps, mode="fd", dtype=torch.float32)
    if kind == "jvp":
        return JVPScorer(model, modules, V)
    raise ValueError(f"unknown scorer {kind!r}")


