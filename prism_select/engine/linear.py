"""The tracked-linear modes: what a tracked ``nn.Linear`` computes while the engine runs it.

Each is an autograd function that replaces the layer's ``forward`` for the duration of a
``with`` block, and restores it on exit.

:class:`SplitPrecisionLinear`  every ``nn.Linear`` of a half-precision model under
    ``--precision split32`` (:func:`prism_select.engine.policy.split32`): float32 activations,
    products as split half-precision GEMMs (:func:`~prism_select.engine.arith.split_linear`),
    float32-accurate input and (under ``float32_grads``) weight gradients.

:class:`ScoringLinear`  the tracked layers under :class:`ExactScorer`, the exact route of
    ``g_z . v``. With ``V`` the layer's preconditioned target (``out x in [+1]``), the
    example's score is ``sum_t b_t^T V a_t``, computed in one of two orders, chosen per
    layer so that the extra tensor lives in the smaller of the two widths:

    ``u`` (``out <= in``): the forward also forms ``u_t = V a_t`` (a second matmul in the
    model's dtype, tensor cores); the backward adds ``<b_t, u_t>``.
    ``w`` (``out > in``): the forward keeps ``a`` (shared by layers that read the same
    input, e.g. q/k/v or gate/up: no extra memory); the backward forms ``w_t = V^T b_t``
    and adds ``<w_t, a_t>``.

    With ``K`` stacked directions (several target sets) the forward keeps ``a`` and the
    backward forms each example's gradient of the layer, ``G = sum_t b_t a_t^T``
    (accumulated in float32, float64 for a float64 model; ``B x out x in`` for the
    batch), then ``<G, V_k>`` for all ``K`` directions in one product (in the model's
    dtype, float32 accumulation): per example ``T + K`` products of the layer's size,
    where forming ``V_k^T b_t`` for every token (the ``w`` order, kept as ``modes="w"``)
    takes ``K T``.

    The backward computes input gradients only where an earlier layer needs them (no
    weight gradients, none below the first tracked layer: the graph is rooted at a
    zero-size ``anchor`` instead of the embeddings). Token dot products accumulate in
    float32 (float64 for a float64 model, where the whole route is exact). Padding needs
    no mask: with right padding the output gradient ``b_t`` of a padded position is
    exactly zero.

:class:`FitTapLinear`  the tracked layers under :func:`tap_linears`, the curvature fit's
    passes: the layer's input and output gradient are handed to its :class:`Tap`, which
    accumulates the fit's statistics (:mod:`prism_select.curvature.fit`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..runtime.execution import DEFAULT_KERNELS, Kernels
from ..runtime.layers import has_bias
from .arith import GRAD32, accumulate32, cotangent_mm, mm_acc, rowdot, split_linear, split_mm, split_of
from .loss import batch_losses, causal_only, split_causal_lm

def _linear(x, W, b=None):
    """``F.linear``, returning a tensor that is not a view: with a bias and a batched
    input, ``F.linear``'s result is a view of its 2-D product, and a model that adds to
    a custom function's output in place (Falcon's parallel attention: ``mlp_output +=
    attention_output``) is refused by autograd for such a view."""
    if b is None or x.dim() <= 2:
        return F.linear(x, W, b)
    return F.linear(x, W).add_(b)


# ----------------------------------------------------------------------------- split precision

class SplitPrecisionLinear(torch.autograd.Function):
    """:func:`split_linear`, and a backward through :func:`cotangent_mm`, with ``kernels``."""

    @staticmethod
    def forward(ctx, x, W, b, kernels: Kernels = DEFAULT_KERNELS):
        ctx.save_for_backward(x if W.requires_grad else None, W)
        ctx.bias, ctx.kernels = b, kernels
        return split_linear(x, W, b, kernels)

    @staticmethod
    def backward(ctx, g):
        x, W = ctx.saved_tensors
        gx = cotangent_mm(g, W, ctx.kernels) if ctx.needs_input_grad[0] else None
        gW = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            if hasattr(W, GRAD32):  # float32_grads: g^T (x_hi + x_lo), g split too
                K = x2.shape[1]
                both = split_mm(g2.t(), split_of(x, W.dtype))
                accumulate32(W, both[:, :K].add_(both[:, K:]))
            else:  # half-precision weight gradients, float32 accumulation
                gW = mm_acc(g2.t().to(W.dtype), x2.to(W.dtype), torch.float32).to(W.dtype)
        b = ctx.bias
        if b is not None and ctx.needs_input_grad[2]:
            if hasattr(b, GRAD32):
                accumulate32(b, g2.sum(0))
            else:
                gb = g2.sum(0).to(W.dtype)
        return gx, gW, gb, None


# ----------------------------------------------------------------------------- exact scoring

class _Layer:
    """Per-layer state of the fused exact route (everything the autograd function needs,
    resolved once, so the per-call Python work stays small). Under FSDP2
    (:mod:`prism_select.runtime.sharding`) the weight and ``V`` are the layer's own parameters
    (``weight``, ``prism_v``, ``prism_vb``), full only while its block computes: they are
    read at each use instead."""

    def __init__(self, module, V: torch.Tensor | None, state, mode: str | None = None):
        self.module, self.state = module, state
        self.bias = has_bias(module)
        self.sharded = V is None
        #: ``K`` when ``V`` stacks K directions (``K x out x in [+1]``), else None
        self.k = None if V is None or V.dim() == 2 else V.shape[0]
        if not self.sharded:
            W = module.weight
            self._W, self._b = W, module.bias
            Vd = V.to(device=W.device, dtype=W.dtype)
            if self.k is None:
                self._Vw = Vd[:, :module.in_features].contiguous()
                self._Vb = Vd[:, -1].contiguous() if self.bias else None
            else:
                self._Vb = Vd[:, :, -1].t().contiguous() if self.bias else None  # out x K
                if mode == "w":  # out x (K in): one product gives every direction's V_k^T b_t
                    self._Vw = Vd[:, :, :module.in_features].permute(1, 0, 2).reshape(module.out_features, -1)
                    self._Vw = self._Vw.contiguous()
                else:  # K x (out in): each example's gradient against every direction at once
                    self._Vw = Vd[:, :, :module.in_features].reshape(self.k, -1).contiguous()
        # several directions: the "g" order by default (each example's gradient of the layer,
        # then one product with the K directions: T + K products of the layer's size per
        # example, against K T in the "w" order, which forms V_k^T b_t for every token)
        self.mode = (mode if mode == "w" else "g") if self.k is not None else (
            mode or ("u" if module.out_features <= module.in_features else "w"))
        self.parts = state.parts

    @property
    def W(self):
        return self.module.weight if self.sharded else self._W

    @property
    def b(self):
        return self.module.bias if self.sharded else self._b

    @property
    def Vw(self):
        return self.module.prism_v if self.sharded else self._Vw

    @property
    def Vb(self):
        if not self.bias:
            return None
        return self.module.prism_vb if self.sharded else self._Vb


class ScoringLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, layer: _Layer):
        ctx.layer = layer
        # float32 activations of a half-precision model (precision "split32"): the
        # products run as split half-precision GEMMs with float32 results
        ctx.split = x.dtype != layer.W.dtype
        if ctx.split and layer.k is not None:
            raise ValueError("several stacked directions are scored in the model's own arithmetic only, "
                             "not under precision split32")
        k = layer.state.kernels
        linear = (lambda a, w, b: split_linear(a, w, b, k)) if ctx.split else _linear
        if layer.mode == "u":
            ctx.t = linear(x, layer.Vw, layer.Vb)
        else:
            ctx.t = x
        return linear(x, layer.W, layer.b)

    @staticmethod
    def backward(ctx, g):
        layer, t = ctx.layer, ctx.t
        ctx.t = None
        k = layer.state.kernels
        mm = (lambda a, b: cotangent_mm(a, b, k)) if ctx.split else torch.matmul
        if layer.k is not None and layer.mode == "g":  # (B, K): <sum_t b_t a_t^T, V_k> (+ the bias column)
            B, acc = g.shape[0], torch.float64 if g.dtype == torch.float64 else torch.float32
            g3 = g.reshape(B, -1, g.shape[-1])
            G = mm_acc(g3.transpose(1, 2), t.reshape(B, -1, t.shape[-1]), acc)  # B x out x in, accumulated
            s = mm_acc(G.reshape(B, -1).to(layer.Vw.dtype), layer.Vw.t(), acc)  # in the model's dtype
            del G
            if layer.bias:
                s = s + g3.sum(1, dtype=acc) @ layer.Vb.to(acc)
        elif layer.k is not None:  # (B, K): sum_t <V_k^T b_t, a_t> (+ the bias column) for each direction k
            B, acc = g.shape[0], torch.float64 if g.dtype == torch.float64 else torch.float32
            z = mm(g, layer.Vw).unflatten(-1, (layer.k, -1))
            s = (z.to(acc) * t.to(acc).unsqueeze(-2)).sum(-1).reshape(B, -1, layer.k).sum(1)
            if layer.bias:
                s = s + g.reshape(B, -1, g.shape[-1]).sum(1, dtype=acc) @ layer.Vb.to(acc)
        elif layer.mode == "u":
            s = rowdot(g, t, k.rowdot)
        else:
            s = rowdot(mm(g, layer.Vw), t, k.rowdot)
            if layer.bias:
                s = s + (g.reshape(g.shape[0], -1, g.shape[-1]).sum(1, dtype=s.dtype) @ layer.Vb.to(s.dtype))
        layer.state.parts.append(s)
        return (mm(g, layer.W) if ctx.needs_input_grad[0] else None), None, None


class _State:
    def __init__(self, kernels: Kernels = DEFAULT_KERNELS):
        self.parts = []
        self.kernels = kernels

    def add(self, s):
        self.parts.append(s)


@contextmanager
def frozen(model):
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, f in flags:
            p.requires_grad_(f)


class ExactScorer:
    """``g_z . V`` for a batch with one forward and one activation-only backward.

    ``V`` may stack ``K`` directions per layer (``K x out x in [+1]``, the same ``K`` for
    every layer): :meth:`score` then gives ``(B, K)``, every direction from the one
    forward and backward.

    Use as a context manager (it patches the tracked layers' ``forward`` for its
    lifetime), then call :meth:`score` on collated batches.
    """

    def __init__(self, model, modules: dict, V: dict | None, modes: dict | None = None, fused_loss: bool = False,
                 kernels: Kernels = DEFAULT_KERNELS):
        """``V``: each layer's preconditioned target; None when the layers carry it as
        FSDP2-sharded ``prism_v`` parameters (:func:`prism_select.runtime.sharding.set_v`).
        ``kernels``: the kernel choices of the products and dot products."""
        self.model, self.modules = model, modules
        self.kernels = kernels
        self.state = _State(kernels)
        self.layers = {n: _Layer(m, None if V is None else V[n], self.state, (modes or {}).get(n))
                       for n, m in modules.items()}
        #: the number of stacked directions (None: one, scores ``(B,)``)
        self.k = next((layer.k for layer in self.layers.values()), None)
        p = next(model.parameters())
        self.acc = torch.float64 if p.dtype == torch.float64 else torch.float32
        self.anchor = torch.zeros(0, dtype=p.dtype, device=p.device, requires_grad=True)
        self.split = split_causal_lm(model) if fused_loss else None
        self._stack = None

    def __enter__(self):
        self._frozen = frozen(self.model)
        self._frozen.__enter__()
        anchor = self.anchor
        for n, layer in self.layers.items():
            def fwd(x, layer=layer):
                return ScoringLinear.apply(x, anchor, layer)
            layer.module.forward = fwd
        return self

    def __exit__(self, *exc):
        for layer in self.layers.values():
            try:
                del layer.module.forward
            except AttributeError:
                pass
        self._frozen.__exit__(*exc)

    def score(self, batch: dict) -> torch.Tensor:
        """Scores of a collated batch, on the device, float32 (float64 for float64 models)."""
        B = batch["input_ids"].shape[0]
        self.state.parts = []
        with torch.enable_grad():
            losses, _ = batch_losses(self.model, causal_only(batch), split=self.split, kernels=self.kernels)
            losses.sum().backward()
        parts, self.state.parts = self.state.parts, []
        if not parts:
            shape = (B,) if self.k is None else (B, self.k)
            return torch.zeros(shape, dtype=self.acc, device=batch["input_ids"].device)
        return torch.stack([p.to(self.acc) for p in parts]).sum(0)


# ----------------------------------------------------------------------------- curvature-fit taps

class Tap:
    """Callbacks of one tracked layer for :func:`tap_linears`: ``on_forward(x)`` in the
    forward, ``on_backward(x, g)`` in the backward (``x`` is None unless
    ``keep_input``)."""

    keep_input = False
    #: set for a step whose statistics are discarded (a rank keeping in step with the others)
    paused = False
    #: called in paused steps too: the tap takes part in collectives that every rank must
    #: run in every step (a sharded curvature fit); it checks ``paused`` itself
    collective = False

    def __init__(self, module):
        self.module = module

    def on_forward(self, x):
        pass

    def on_backward(self, x, g):
        pass


class FitTapLinear(torch.autograd.Function):
    """A tracked layer under :func:`tap_linears`. Under ``--precision split32`` (float32
    input, half-precision weights) the layer propagates float32-accurate activations and
    cotangents (:func:`split_linear`, :func:`cotangent_mm`), while the taps receive both
    rounded to the weights' dtype: statistics on tensor cores, from activations that
    carry no accumulated half-precision drift."""

    @staticmethod
    def forward(ctx, x, anchor, tap: Tap, kernels: Kernels = DEFAULT_KERNELS):
        m = tap.module
        ctx.split = x.dtype != m.weight.dtype
        ctx.kernels = kernels
        if ctx.split:
            out = split_linear(x, m.weight, m.bias, kernels)
            # the high half of the (shared, cached) split is x rounded to the weights'
            # dtype; one tensor per input, so layers reading it share their statistics
            x = split_of(x, m.weight.dtype)[:, :x.shape[-1]].unflatten(0, x.shape[:-1])
        else:
            out = _linear(x, m.weight, m.bias)
        if not tap.paused or tap.collective:
            tap.on_forward(x)
        if tap.keep_input:
            ctx.save_for_backward(x)
        ctx.tap = tap
        return out

    @staticmethod
    def backward(ctx, g):
        tap = ctx.tap
        x = ctx.saved_tensors[0] if tap.keep_input else None
        g = g.contiguous()
        W = tap.module.weight
        if not tap.paused or tap.collective:
            tap.on_backward(x, g.to(W.dtype) if ctx.split else g)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return (cotangent_mm(g, W, ctx.kernels) if ctx.split else g @ W), None, None, None


@contextmanager
def tap_linears(model, taps: dict, kernels: Kernels = DEFAULT_KERNELS):
    """Freeze the model and route each ``taps[name].module`` through :class:`FitTapLinear`
    (with ``kernels`` under split32); yields the anchor (a zero-size leaf requiring grad
    that roots the backward)."""
    p = next(model.parameters())
    anchor = torch.zeros(0, dtype=p.dtype, device=p.device, requires_grad=True)
    with frozen(model):
        try:
            for tap in taps.values():
                def fwd(x, tap=tap):
                    return FitTapLinear.apply(x, anchor, tap, kernels)
                tap.module.forward = fwd
            yield anchor
        finally:
            for tap in taps.values():
                try:
                    del tap.module.forward
                except AttributeError:
                    pass
