"""A hand-written forward-mode JVP of Llama-style causal LMs with a mixed-precision tangent:
a diagnostic behind docs/performance.md run 10, not a scoring route of the library.

``MixedJVPScorer`` returns, per example, the directional derivative of the summed
response-token loss along the preconditioned direction ``V`` -- the same quantity as
:class:`prism_select.engine.ExactScorer` (``g_z . V``, same sign, no normalisation) --
with one pass that carries a primal and a tangent through the network:

    tracked linear  y = W x (+ b)      ydot = W xdot + V_w x (+ V_b)
    other linear    y = W x (+ b)      ydot = W xdot

The primal runs as transformers' ``LlamaForCausalLM`` runs it in the model's dtype
(RMSNorm statistics in float32, softmax of the attention in float32, logits cast to
float32 for the loss). The tangent is kept in ``tangent_dtype`` (float32) at the
"sites" named in ``sites`` and in the model's dtype elsewhere:

    residual      the residual-stream tangent and the additions into it (the o_proj /
                  down_proj tangent outputs are produced in this dtype)
    norm          the RMSNorm JVP  ndot = r (xdot - n mean(n xdot)), times the weight
    attn_softmax  q/k tangents (incl. RoPE), Sdot = s (qdot k^T + q kdot^T), the softmax
                  JVP  Pdot = P (Sdot - rowsum(P Sdot)), and Odot = Pdot v + P vdot
    mlp           the gate/up tangents and the SwiGLU product rule
    logits        the vocabulary-logit tangent fed to the cross-entropy JVP
                  (sum_v p_v ldot_v - ldot_y, always computed in float32)

Matmuls always take their operands in the model's dtype (tensor cores on a GPU); the
product is produced in the consuming site's dtype (float32 output of a bf16 GEMM costs
nothing extra on a GPU; on a CPU it is emulated with a float32 GEMM of the bf16-rounded
operands, which has the same rounding). ``fp32_matmuls=True`` instead feeds the
tangent GEMMs float32 operands (no tensor cores) -- a diagnostic.

For a float32 or float64 model every site is in the model's dtype and the route is an
exact forward-mode derivative (float64: agrees with ``ExactScorer`` to ~1e-12).

Right padding with causal attention needs no mask: padded positions come after every
real one, and the labels (-100 off the response) mask the loss.

Only ``LlamaForCausalLM`` is supported (checked on construction, ConfigError otherwise).

Measured (``benchmarks/jvp_accuracy.py``, embedded SmolLM2-135M, PRISM's EK-FAC-
preconditioned ``v``, 128 GSM8K records, CPU): against exact scores computed in float32,
the plain bf16 JVP (``sites=()``) gives Spearman 0.969 and every float32 tangent site,
alone or together, also gives 0.965-0.970, as does the bf16 exact route (0.971). The
tangent's precision does not limit accuracy; the bf16 rounding of the *primal*
(residual stream, then GEMM operands) does. This is a diagnostic tool, not a faster
route: its GEMM FLOPs equal the exact route's (``matmul_flops_per_token``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prism_select.errors import ConfigError
from prism_select.engine.loss import _ce_chunk_tokens
from prism_select.runtime.layers import has_bias

#: tangent sites that can be kept in ``tangent_dtype`` (see the module docstring)
SITES = ("residual", "norm", "attn_softmax", "mlp", "logits")
#: the per-layer linear modules the route knows how to differentiate
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _unsupported(what: str):
    raise ConfigError("scoring", f"the mixed-precision JVP route does not support {what}",
                      "use --scoring exact (it supports every model)")


class MixedJVPScorer:
    """``g_z . V`` by a hand-written forward-mode JVP (see the module docstring).

    model: a transformers ``LlamaForCausalLM`` (bf16, fp16, float32 or float64).
    modules: name -> tracked ``nn.Linear`` (decoder projections and/or ``lm_head``).
    V: name -> ``out x in`` (``out x (in+1)`` with a bias column) direction.
    tangent_dtype: the high-precision tangent dtype used at ``sites`` for half-precision
        models (float32 and float64 models keep everything in their own dtype).
    sites: the sites kept in ``tangent_dtype`` (default: all of :data:`SITES`); pass
        ``()`` for a plain half-precision JVP.
    fp32_matmuls: tangent GEMMs with ``tangent_dtype`` operands (diagnostic, slow).
    v_dtype: the dtype ``V`` is stored (and rounded) in; default the model's dtype, as
        ``ExactScorer`` does. ``float32`` with ``fp32_matmuls`` keeps ``V`` unrounded;
        ``"split"`` stores ``V`` as two model-dtype terms ``V_hi + V_lo`` (two half-precision
        GEMMs for ``V x``: ~16 significant bits of ``V`` on tensor cores).
    emulate_operands, emulate_kinds: diagnostic for a float32 model: round the operands of
        the GEMMs of ``emulate_kinds`` (``linear``: every nn.Linear incl. ``V x``; ``attn``:
        ``q k^T`` and ``P v``; ``head``: lm_head) to ``emulate_operands`` (e.g. bf16), primal
        and tangent alike, and (``residual``) the stored primal residual stream; everything
        else stays float32. Tells which roundings of a bf16 run matter.
    """

    def __init__(self, model, modules: dict, V: dict, *, tangent_dtype: torch.dtype = torch.float32,
                 sites=SITES, fp32_matmuls: bool = False, v_dtype=None,
                 emulate_operands: torch.dtype | None = None, emulate_kinds=("linear", "attn", "head", "residual")):
        self.model = model
        self._check_model(model)
        sites = tuple(sites)
        bad = [s for s in sites if s not in SITES]
        if bad:
            raise ConfigError("jvp_sites", f"unknown site(s) {bad}", f"use a subset of {', '.join(SITES)}")
        p = model.model.embed_tokens.weight
        self.lo = p.dtype
        self.hi = tangent_dtype if self.lo in (torch.bfloat16, torch.float16) else self.lo
        self.sites = frozenset(sites)
        self.fp32_matmuls = bool(fp32_matmuls) and self.hi != self.lo
        self.acc = torch.float64 if self.lo == torch.float64 else torch.float32
        self.stat = torch.float64 if self.lo == torch.float64 else torch.float32  # RMSNorm / softmax primal
        self.dev = p.device
        cfg = model.config

        # tracked modules -> their place in the network
        where = {}
        for i, layer in enumerate(model.model.layers):
            for nm in _ATTN:
                where[id(getattr(layer.self_attn, nm))] = (i, nm)
            for nm in _MLP:
                where[id(getattr(layer.mlp, nm))] = (i, nm)
        where[id(model.lm_head)] = (None, "lm_head")
        self.split_v = v_dtype == "split"
        vdt = self.lo if v_dtype in (None, "split") else v_dtype
        self.V = {}  # id(module) -> (V_w, V_b) in vdt (default the model dtype, as ExactScorer rounds it)
        self.V2 = {}  # id(module) -> the remainder V - V_w (split V only)
        for name, m in modules.items():
            if id(m) not in where:
                _unsupported(f"the tracked module {name!r} ({type(m).__name__}); it tracks the q/k/v/o, "
                             "gate/up/down projections and lm_head of a LlamaForCausalLM")
            if name not in V:
                raise ConfigError("direction", f"no direction for the tracked module {name!r}")
            Vf = V[name].detach().to(device=m.weight.device)
            Vn = Vf.to(vdt)
            want = (m.out_features, m.in_features + int(has_bias(m)))
            if tuple(Vn.shape) != want:
                raise ConfigError("direction", f"{name!r}: direction of shape {tuple(Vn.shape)}, expected {want}")
            self.V[id(m)] = (Vn[:, :m.in_features].contiguous(), Vn[:, -1].contiguous() if has_bias(m) else None)
            if self.split_v:
                Vr = (Vf.to(torch.float64) - Vn.to(torch.float64)).to(vdt)
                self.V2[id(m)] = (Vr[:, :m.in_features].contiguous(), Vr[:, -1].contiguous() if has_bias(m) else None)
        self.first = min((where[id(m)][0] if where[id(m)][0] is not None else len(model.model.layers))
                         for m in modules.values()) if modules else None
        self.n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
        self._hi_cache = {}
        #: set to a list to receive ``(example index, per-token tangent)`` chunks (diagnostics)
        self.token_terms = None
        self.emu = emulate_operands
        self.emu_kinds = frozenset(emulate_kinds) if emulate_operands is not None else frozenset()

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_model(model):
        name = type(model).__name__
        if name != "LlamaForCausalLM":
            _unsupported(f"model type {name} (only LlamaForCausalLM)")
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            _unsupported(f"hidden_act={cfg.hidden_act!r} (only silu)")
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            _unsupported(f"pretraining_tp={cfg.pretraining_tp}")
        if not isinstance(model.lm_head, torch.nn.Linear):
            _unsupported(f"an lm_head of type {type(model.lm_head).__name__}")
        dec = model.model
        norms = [dec.norm] + [n for layer in dec.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        for n in norms:
            if not type(n).__name__.endswith("RMSNorm") or _norm_eps(n) is None or not hasattr(n, "weight"):
                _unsupported(f"the norm module {type(n).__name__}")
        for layer in dec.layers:
            for nm in _ATTN:
                if type(getattr(layer.self_attn, nm)) is not torch.nn.Linear:
                    _unsupported(f"self_attn.{nm} of type {type(getattr(layer.self_attn, nm)).__name__} "
                                 "(adapters / quantised layers)")
            for nm in _MLP:
                if type(getattr(layer.mlp, nm)) is not torch.nn.Linear:
                    _unsupported(f"mlp.{nm} of type {type(getattr(layer.mlp, nm)).__name__}")
        if model.training and getattr(cfg, "attention_dropout", 0.0):
            _unsupported("attention dropout in training mode (call model.eval())")

    # ------------------------------------------------------------------ context (interface parity)
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    # ------------------------------------------------------------------ precision helpers
    def _r(self, t, kind: str):
        """``t`` rounded through ``emulate_operands`` where ``kind`` is emulated (diagnostic)."""
        if t is None or kind not in self.emu_kinds:
            return t
        return t.to(self.emu).to(t.dtype)

    def _dt(self, site: str) -> torch.dtype:
        return self.hi if site in self.sites else self.lo

    def _as_hi(self, t: torch.Tensor) -> torch.Tensor:
        """Cached ``hi`` copy of a (bf16-rounded) weight, for the CPU emulation."""
        k = id(t)
        c = self._hi_cache.get(k)
        if c is None or c[0] is not t:
            c = (t, t.to(self.hi))
            self._hi_cache[k] = c
        return c[1]

    def _linear(self, a, w, b, out_dtype):
        """``a @ w^T (+ b)``: operands in the model dtype (or ``hi`` under fp32_matmuls),
        product in ``out_dtype`` (float32 output of a half-precision GEMM)."""
        if self.fp32_matmuls:
            y = F.linear(a.to(self.hi), self._as_hi(w), None if b is None else self._as_hi(b))
            return y.to(out_dtype)
        a = a.to(self.lo)
        if w.dtype != self.lo:  # an unrounded (float32) V: half-precision x, float32 V
            return F.linear(a.to(w.dtype), w, b).to(out_dtype)
        if out_dtype == self.lo:
            return F.linear(a, w, b)
        if a.is_cuda:
            try:
                y = torch.mm(a.reshape(-1, a.shape[-1]), w.t(), out_dtype=out_dtype).view(*a.shape[:-1], w.shape[0])
                return y if b is None else y + b.to(out_dtype)
            except (RuntimeError, TypeError):
                pass
        # exact emulation: the products of half-precision numbers are exact in float32
        return F.linear(a.to(out_dtype), self._as_hi(w) if out_dtype == self.hi else w.to(out_dtype),
                        None if b is None else b.to(out_dtype))

    def _bmm(self, a, b, out_dtype):
        """``a @ b`` over leading dims with half-precision operands, product in ``out_dtype``."""
        if self.fp32_matmuls:
            return torch.matmul(a.to(self.hi), b.to(self.hi)).to(out_dtype)
        a, b = a.to(self.lo), b.to(self.lo)
        if out_dtype == self.lo:
            return torch.matmul(a, b)
        if a.is_cuda:
            try:
                lead = a.shape[:-2]
                y = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=out_dtype)
                return y.view(*lead, *y.shape[-2:])
            except (RuntimeError, TypeError):
                pass
        return torch.matmul(a.to(out_dtype), b.to(out_dtype))

    def _lin(self, m, x, xdot, out_dtype, kind="linear"):
        """Primal and tangent of one linear module (``xdot`` None = zero tangent)."""
        x, xdot = self._r(x, kind), self._r(xdot, kind)
        y = F.linear(x, m.weight, m.bias)
        tv = self.V.get(id(m))
        if xdot is None and tv is None:
            return y, None
        ydot = None
        if xdot is not None:
            ydot = self._linear(xdot, m.weight, None, out_dtype)
        if tv is not None:
            d = self._linear(x, tv[0], tv[1], out_dtype)
            ydot = d if ydot is None else ydot.add_(d)
            tv2 = self.V2.get(id(m))
            if tv2 is not None:
                ydot.add_(self._linear(x, tv2[0], tv2[1], out_dtype))
        return y, ydot

    # ------------------------------------------------------------------ blocks
    def _norm(self, mod, h, hdot):
        """LlamaRMSNorm: ``w * (x rsqrt(mean x^2 + eps)).to(dtype)`` with x in float32."""
        x = h.to(self.stat)
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + _norm_eps(mod))
        n = x * r
        y = mod.weight * n.to(h.dtype)
        if hdot is None:
            return y, None
        c = self._dt("norm")
        xd = hdot.to(c)
        nc = n.to(c)
        nd = r.to(c) * (xd - nc * (nc * xd).mean(-1, keepdim=True))
        return y, mod.weight.to(c) * nd

    def _attention(self, att, x, xdot, cos, sin, cos_t, sin_t):
        B, T, _ = x.shape
        D = att.head_dim
        c = self._dt("attn_softmax")
        q, qd = self._lin(att.q_proj, x, xdot, c)
        k, kd = self._lin(att.k_proj, x, xdot, c)
        v, vd = self._lin(att.v_proj, x, xdot, c)

        def heads(t):
            return None if t is None else t.view(B, T, -1, D).transpose(1, 2)

        q, k, v, qd, kd, vd = map(heads, (q, k, v, qd, kd, vd))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if qd is not None:
            qd = _rope(qd, cos_t if c == self.hi else cos, sin_t if c == self.hi else sin)
        if kd is not None:
            kd = _rope(kd, cos_t if c == self.hi else cos, sin_t if c == self.hi else sin)
        k, v, kd, vd = (_repeat_kv(t, self.n_rep) for t in (k, v, kd, vd))

        scale = att.scaling
        q, k, v, qd, kd, vd = (self._r(t, "attn") for t in (q, k, v, qd, kd, vd))
        s = torch.matmul(q, k.transpose(-1, -2)) * scale  # as eager attention: model-dtype scores
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu_(1)
        s = s.to(self.stat).masked_fill_(causal, float("-inf"))
        P = torch.softmax(s, dim=-1)
        Plo = self._r(P.to(self.lo), "attn")
        o = torch.matmul(Plo, v)
        out_h = o.transpose(1, 2).reshape(B, T, -1)
        if qd is None and kd is None and vd is None:
            y, yd = self._lin(att.o_proj, out_h, None, self._dt("residual"))
            return y, yd

        od = None
        if qd is not None or kd is not None:
            sd = None
            if qd is not None:
                sd = self._bmm(qd, k.transpose(-1, -2), c)
            if kd is not None:
                t = self._bmm(q, kd.transpose(-1, -2), c)
                sd = t if sd is None else sd.add_(t)
            sd = sd * scale
            sd = sd.masked_fill_(causal, 0)
            Pc = P.to(c)
            pd = Pc * (sd - (Pc * sd).sum(-1, keepdim=True))
            od = self._bmm(self._r(pd, "attn"), v, c)
        if vd is not None:
            t = self._bmm(Plo, vd, c)
            od = t if od is None else od.add_(t)
        od_h = od.transpose(1, 2).reshape(B, T, -1)
        return self._lin(att.o_proj, out_h, od_h, self._dt("residual"))

    def _mlp(self, mlp, x, xdot):
        c = self._dt("mlp")
        g, gd = self._lin(mlp.gate_proj, x, xdot, c)
        u, ud = self._lin(mlp.up_proj, x, xdot, c)
        a = F.silu(g) * u
        if gd is None and ud is None:
            return self._lin(mlp.down_proj, a, None, self._dt("residual"))
        gc, uc = g.to(c), u.to(c)
        sg = torch.sigmoid(gc)
        ad = None
        if gd is not None:
            ad = (sg * (1 + gc * (1 - sg))) * gd.to(c) * uc
        if ud is not None:
            t = (gc * sg) * ud.to(c)
            ad = t if ad is None else ad.add_(t)
        return self._lin(mlp.down_proj, a, ad, self._dt("residual"))

    def _add(self, h, hdot, y, ydot, dt):
        h = self._r(h + y, "residual")
        if ydot is None:
            return h, hdot
        ydot = ydot.to(dt)
        return h, (ydot if hdot is None else hdot.to(dt).add_(ydot))

    # ------------------------------------------------------------------ score
    @torch.no_grad()
    def score(self, batch: dict) -> torch.Tensor:
        """Per-example ``d/dt sum_response_loss(theta + t V)`` at ``t = 0``; float32
        (float64 for a float64 model), on the model's device."""
        ids = batch["input_ids"].to(self.dev)
        labels = batch["labels"].to(self.dev)
        B, T = ids.shape
        out = torch.zeros(B, dtype=self.acc, device=self.dev)
        if self.first is None:
            return out
        dec = self.model.model
        h = dec.embed_tokens(ids)
        pos = torch.arange(T, device=self.dev)[None]
        cos, sin = dec.rotary_emb(h, pos)
        cos_t, sin_t = dec.rotary_emb(h.to(self.hi), pos)  # float32 tables for the tangent
        res = self._dt("residual")
        hd = None
        for i, layer in enumerate(dec.layers):
            x, xd = self._norm(layer.input_layernorm, h, hd)
            y, yd = self._attention(layer.self_attn, x, xd, cos, sin, cos_t, sin_t)
            h, hd = self._add(h, hd, y, yd, res)
            x, xd = self._norm(layer.post_attention_layernorm, h, hd)
            y, yd = self._mlp(layer.mlp, x, xd)
            h, hd = self._add(h, hd, y, yd, res)
        n, nd = self._norm(dec.norm, h, hd)

        # cross-entropy JVP on response tokens: sum_v p_v ldot_v - ldot_y
        tgt = labels[:, 1:]
        bi, ti = (tgt != -100).nonzero(as_tuple=True)
        if bi.numel() == 0:
            return out
        y = tgt[bi, ti]
        hs = n[bi, ti]
        hds = None if nd is None else nd[bi, ti]
        head = self.model.lm_head
        c = self._dt("logits")
        step = _ce_chunk_tokens(head.out_features)
        for s0 in range(0, hs.shape[0], step):
            sl = slice(s0, s0 + step)
            logits, ld = self._lin(head, hs[sl], None if hds is None else hds[sl], c, kind="head")
            if ld is None:
                continue
            p = torch.softmax(logits.to(self.acc), dim=-1)
            ld = ld.to(self.acc)
            t = (p * ld).sum(-1) - ld.gather(1, y[sl, None]).squeeze(1)
            out.index_add_(0, bi[sl], t)
            if self.token_terms is not None:
                self.token_terms.append((bi[sl], t))
        return out


# ---------------------------------------------------------------------- helpers

def _norm_eps(mod):
    for attr in ("variance_epsilon", "eps"):
        v = getattr(mod, attr, None)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x, cos, sin):
    """``x cos + rotate_half(x) sin`` (linear in x: the same map for the tangent)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


def _repeat_kv(t, n_rep):
    if t is None or n_rep == 1:
        return t
    B, H, T, D = t.shape
    return t[:, :, None].expand(B, H, n_rep, T, D).reshape(B, H * n_rep, T, D)


def matmul_flops_per_token(model, modules: dict, seq_len: int, response_frac: float = 1.0) -> dict:
    """Matmul FLOPs per token (2 per multiply-add) of a plain forward, this JVP and the
    exact route (forward + activation backward), for a decoder of ``seq_len`` tokens
    (the average causal attention span is ~seq_len/2); ``response_frac`` of the tokens
    carry a loss (the head runs on those only in the scoring routes)."""
    cfg = model.config
    dec = model.model
    L = len(dec.layers)
    d_attn = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    tracked = {id(m) for m in modules.values()}
    lin = [(m.in_features * m.out_features, id(m) in tracked) for layer in dec.layers
           for m in (*(getattr(layer.self_attn, n) for n in _ATTN), *(getattr(layer.mlp, n) for n in _MLP))]
    P_dec = sum(p for p, _ in lin)
    P_tr = sum(p for p, t in lin if t)
    P_head = model.lm_head.in_features * model.lm_head.out_features
    attn = L * 2 * 2 * d_attn * (seq_len / 2)  # QK^T and PV
    fwd = 2 * P_dec + attn + 2 * P_head
    head_r = 2 * P_head * response_frac
    head_tr = id(model.lm_head) in tracked
    jvp = (2 * P_dec + attn + head_r            # primal (head on response tokens only)
           + 2 * P_dec + 2 * P_tr                # W xdot + V x
           + 2 * attn                            # qdot k^T + q kdot^T, Pdot v + P vdot
           + head_r * (2 if head_tr else 1))     # W_head ndot (+ V_head n)
    exact = (2 * P_dec + attn + head_r + 2 * P_tr  # forward with V a (u mode) / V^T b (w mode)
             + 2 * P_dec + 2 * attn + head_r)      # activation backward (dQ,dK,dV,dP) + head
    return {"forward": fwd, "jvp": jvp, "exact": exact, "P_decoder": P_dec, "P_tracked": P_tr, "P_head": P_head,
            "attention_fwd": attn}
