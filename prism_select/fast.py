"""Fast kernels behind scoring: the fused exact ``g_z . v`` linear layer, a chunked
cross-entropy that never materialises the whole vocabulary's logits, and the
finite-difference / forward-mode routes of ``--scoring fast``.

Exact route (``ExactScorer``)
    Every tracked ``nn.Linear`` runs through :class:`_ScoredLinear` for the batch.
    With ``V`` the layer's preconditioned target (``out x in [+1]``), the example's
    score is ``sum_t b_t^T V a_t``, computed in one of two orders, chosen per layer so
    that the extra tensor lives in the smaller of the two widths:

    ``u`` (``out <= in``): the forward also forms ``u_t = V a_t`` (a second matmul in
    the model's dtype, tensor cores); the backward adds ``<b_t, u_t>``.
    ``w`` (``out > in``): the forward keeps ``a`` (shared by layers that read the same
    input, e.g. q/k/v or gate/up: no extra memory); the backward forms
    ``w_t = V^T b_t`` and adds ``<w_t, a_t>``.

    The backward computes input gradients only where an earlier layer needs them (no
    weight gradients, none below the first tracked layer: the graph is rooted at a
    zero-size ``anchor`` instead of the embeddings). Token dot products accumulate in
    float32 (float64 for a float64 model, where the whole route is exact).
    Padding needs no mask: with right padding the output gradient ``b_t`` of a padded
    position is exactly zero.

Loss (``fused_token_losses``)
    For the common ``*ForCausalLM`` layout (decoder + plain ``lm_head``) the loss is
    computed from the decoder's hidden states on response tokens only, a chunk of
    tokens at a time; the gradient w.r.t. the hidden states is formed in the same pass
    (``softmax - onehot``, then one matmul with the head), so neither the float32
    logits of the whole batch nor a second head matmul in the backward are needed.
    Other models fall back to ``model(...).logits`` + :func:`token_losses`.

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
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .data.tokenize import collate, token_losses
from .gradients import has_bias
from .execution import DEFAULT_KERNELS, FAST_ROUTES, Kernels
from .precision import cotangent_mm, split_linear, split_of, triton_cdiv

# ----------------------------------------------------------------------------- loss

#: model classes whose logits are exactly ``lm_head(decoder(...).last_hidden_state)``
_PLAIN_HEAD_MODELS = {
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM",
    "OlmoForCausalLM", "Olmo2ForCausalLM", "GemmaForCausalLM", "SmolLM3ForCausalLM",
    "StableLmForCausalLM", "GraniteForCausalLM_",  # granite scales logits: excluded on purpose
}


def split_causal_lm(model):
    """``(decoder, head)`` when logits are exactly ``head(decoder(...)[0])``, else None."""
    if type(model).__name__ not in _PLAIN_HEAD_MODELS:
        return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    dec = getattr(model, "model", None)
    if not isinstance(head, torch.nn.Linear) or dec is None:
        return None
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_softcapping"):
        if getattr(cfg, attr, None):
            return None
    if getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return dec, head


def _ce_chunk_tokens(vocab: int) -> int:
    # ~256 MiB of float32 logits per chunk
    return max(256, (1 << 26) // max(vocab, 1))


class _FusedCE(torch.autograd.Function):
    """Per-example summed CE of labelled positions; the hidden-state gradient is formed
    in the forward (chunk by chunk) and scaled by the incoming gradient in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, need_grad: bool, index=None, kernels: Kernels = DEFAULT_KERNELS):
        B, T, d = hidden.shape
        tgt = labels[:, 1:]
        mask = tgt != -100
        if index is None:
            bi, ti = mask.nonzero(as_tuple=True)  # a device sync; collate_to precomputes it
        else:
            bi, ti = index
        y = tgt[bi, ti]
        h = hidden[bi, ti]  # (N, d): position t predicts token t+1
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        losses = torch.zeros(B, dtype=acc, device=hidden.device)
        dh = torch.empty_like(h) if need_grad else None
        step = _ce_chunk_tokens(weight.shape[0])
        mixed = h.dtype != weight.dtype  # split32: float32 activations, half-precision head
        linear = (lambda a, w, b: split_linear(a, w, b, kernels)) if mixed else F.linear
        for c in range(0, h.shape[0], step):
            logits = linear(h[c:c + step], weight, bias).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            yy = y[c:c + step]
            ce = lse - logits.gather(1, yy[:, None]).squeeze(1)
            losses.index_add_(0, bi[c:c + step], ce)
            if need_grad:
                p = torch.exp(logits.sub_(lse[:, None]))
                p[torch.arange(p.shape[0], device=p.device), yy] -= 1
                dh[c:c + step] = cotangent_mm(p, weight, kernels) if mixed else p.to(h.dtype) @ weight
            del logits
        ctx.shape, ctx.dtype = hidden.shape, hidden.dtype
        if need_grad:
            ctx.save_for_backward(dh, bi, ti)
        return losses, mask.sum(dim=1)

    @staticmethod
    def backward(ctx, grad_losses, _grad_counts):
        dh, bi, ti = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=ctx.dtype, device=dh.device)
        out[bi, ti] = dh * grad_losses[bi].to(dh.dtype)[:, None]
        return out, None, None, None, None, None, None


def loss_index(labels: torch.Tensor):
    """``(example, position)`` of every labelled position (position t predicts t+1)."""
    return (labels[:, 1:] != -100).nonzero(as_tuple=True)


def batch_losses(model, batch: dict, *, split=None, need_grad: bool = True, kernels: Kernels = DEFAULT_KERNELS):
    """Per-example summed response loss (float32+, float64 for float64 models) and
    response token counts, through the fused chunked loss where the model allows
    (``kernels``: those of its split32 head product)."""
    mask = batch.get("attention_mask")
    if split is not None:
        dec, head = split
        hidden = dec(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False)[0]
        need = need_grad and hidden.requires_grad
        return _FusedCE.apply(hidden, head.weight, head.bias, batch["labels"], need, batch.get("loss_index"),
                              kernels)
    out = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=False)
    return token_losses(out.logits, batch["labels"])


def causal_only(batch: dict) -> dict:
    """``batch`` without its attention mask. Exact for right-padded batches under causal
    attention (no real token sees a padded one; padded positions carry no loss), and it
    spares the model a host sync per batch (transformers inspects the mask's values to
    decide whether it can drop it) and lets the attention use its fused causal kernel."""
    return {**batch, "attention_mask": None}


# ----------------------------------------------------------------------------- rowdot

_triton_kernel = None


def _get_triton_kernel():
    global _triton_kernel
    if _triton_kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _rowdot(G, U, OUT, N, K, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
            pid = tl.program_id(0)
            rows = pid * ROWS + tl.arange(0, ROWS)
            rmask = rows < N
            acc = tl.zeros([ROWS], dtype=tl.float32)
            base = rows.to(tl.int64)[:, None] * K
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                m = rmask[:, None] & (cols[None, :] < K)
                g = tl.load(G + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                u = tl.load(U + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
                acc += tl.sum(g * u, axis=1)
            tl.store(OUT + rows, acc, mask=rmask)

        _triton_kernel = _rowdot
    return _triton_kernel


def rowdot(g: torch.Tensor, u: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``sum`` of ``g * u`` over every dim but the first: (B,), float32 (float64 for
    float64 inputs); half-precision products accumulate in float32, on CUDA reduced as
    ``backend`` says (:attr:`prism_select.execution.Kernels.rowdot`)."""
    B = g.shape[0]
    if g.is_cuda and g.dtype == torch.float32:  # einsum would be a batched GEMV: slow on CUDA
        return (g * u).reshape(B, -1).sum(1)
    if not g.is_cuda or g.dtype in (torch.float32, torch.float64):
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        if g.dtype == acc:
            return torch.einsum("bk,bk->b", g.reshape(B, -1), u.reshape(B, -1))
        return (g * u).reshape(B, -1).sum(1, dtype=acc)
    K = g.shape[-1]
    g2, u2 = g.reshape(-1, K).contiguous(), u.reshape(-1, K).contiguous()
    N = g2.shape[0]
    backend = "mulsum" if backend == "auto" else backend
    if backend == "triton":
        out = torch.empty(N, dtype=torch.float32, device=g.device)
        ROWS = 16
        BLOCK_K = min(1024, max(16, 1 << (K - 1).bit_length()))
        _get_triton_kernel()[(triton_cdiv(N, ROWS),)](g2, u2, out, N, K, BLOCK_K=BLOCK_K, ROWS=ROWS)
        return out.view(B, -1).sum(1)
    if backend == "bmm":
        try:
            out = torch.bmm(g2.view(N, 1, K), u2.view(N, K, 1), out_dtype=torch.float32)
            return out.view(B, -1).sum(1)
        except (RuntimeError, TypeError):
            pass
    return (g2 * u2).view(B, -1).sum(1, dtype=torch.float32)


# ----------------------------------------------------------------------------- exact

class _Layer:
    """Per-layer state of the fused exact route (everything the autograd function needs,
    resolved once, so the per-call Python work stays small). Under FSDP2
    (:mod:`prism_select.sharding`) the weight and ``V`` are the layer's own parameters
    (``weight``, ``prism_v``, ``prism_vb``), full only while its block computes: they are
    read at each use instead."""

    def __init__(self, module, V: torch.Tensor | None, state, mode: str | None = None):
        self.module, self.state = module, state
        self.bias = has_bias(module)
        self.sharded = V is None
        if not self.sharded:
            W = module.weight
            self._W, self._b = W, module.bias
            Vd = V.to(device=W.device, dtype=W.dtype)
            self._Vw = Vd[:, :module.in_features].contiguous()
            self._Vb = Vd[:, -1].contiguous() if self.bias else None
        self.mode = mode or ("u" if module.out_features <= module.in_features else "w")
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


class _ScoredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, layer: _Layer):
        ctx.layer = layer
        # float32 activations of a half-precision model (precision "split32"): the
        # products run as split half-precision GEMMs with float32 results
        ctx.split = x.dtype != layer.W.dtype
        k = layer.state.kernels
        linear = (lambda a, w, b: split_linear(a, w, b, k)) if ctx.split else F.linear
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
        if layer.mode == "u":
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

    Use as a context manager (it patches the tracked layers' ``forward`` for its
    lifetime), then call :meth:`score` on collated batches.
    """

    def __init__(self, model, modules: dict, V: dict | None, modes: dict | None = None, fused_loss: bool = False,
                 kernels: Kernels = DEFAULT_KERNELS):
        """``V``: each layer's preconditioned target; None when the layers carry it as
        FSDP2-sharded ``prism_v`` parameters (:func:`prism_select.sharding.set_v`).
        ``kernels``: the kernel choices of the products and dot products."""
        self.model, self.modules = model, modules
        self.kernels = kernels
        self.state = _State(kernels)
        self.layers = {n: _Layer(m, None if V is None else V[n], self.state, (modes or {}).get(n))
                       for n, m in modules.items()}
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
                return _ScoredLinear.apply(x, anchor, layer)
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
            return torch.zeros(B, dtype=self.acc, device=batch["input_ids"].device)
        return torch.stack([p.to(self.acc) for p in parts]).sum(0)


# ----------------------------------------------------------------------------- fast

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


# ----------------------------------------------------------------------------- taps

class Tap:
    """Callbacks of one tracked layer for :func:`tap_linears`: ``on_forward(x)`` in the
    forward, ``on_backward(x, g)`` in the backward (``x`` is None unless
    ``keep_input``)."""

    keep_input = False
    #: set for a step whose statistics are discarded (a rank keeping in step with the others)
    paused = False

    def __init__(self, module):
        self.module = module

    def on_forward(self, x):
        pass

    def on_backward(self, x, g):
        pass


class _TapLinear(torch.autograd.Function):
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
            out = F.linear(x, m.weight, m.bias)
        if not tap.paused:
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
        if not tap.paused:
            tap.on_backward(x, g.to(W.dtype) if ctx.split else g)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return (cotangent_mm(g, W, ctx.kernels) if ctx.split else g @ W), None, None, None


@contextmanager
def tap_linears(model, taps: dict, kernels: Kernels = DEFAULT_KERNELS):
    """Freeze the model and route each ``taps[name].module`` through :class:`_TapLinear`
    (with ``kernels`` under split32); yields the anchor (a zero-size leaf requiring grad
    that roots the backward)."""
    p = next(model.parameters())
    anchor = torch.zeros(0, dtype=p.dtype, device=p.device, requires_grad=True)
    with frozen(model):
        try:
            for tap in taps.values():
                def fwd(x, tap=tap):
                    return _TapLinear.apply(x, anchor, tap, kernels)
                tap.module.forward = fwd
            yield anchor
        finally:
            for tap in taps.values():
                try:
                    del tap.module.forward
                except AttributeError:
                    pass


def collate_to(batch, pad_id, device):
    """``collate`` with a pinned, non-blocking host-to-device copy on CUDA."""
    b = collate(batch, pad_id)
    b["loss_index"] = loss_index(b["labels"])
    if device is not None and torch.device(device).type == "cuda":
        return {k: (tuple(t.pin_memory().to(device, non_blocking=True) for t in v) if isinstance(v, tuple)
                    else v.pin_memory().to(device, non_blocking=True)) for k, v in b.items()}
    if device is None:
        return b
    return {k: (tuple(t.to(device) for t in v) if isinstance(v, tuple) else v.to(device)) for k, v in b.items()}
