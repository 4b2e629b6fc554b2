"""Every weight matrix of a decoder block as an ``nn.Linear``: mixture-of-experts layers
whose experts are fused 3-D parameters, and GPT-2's ``Conv1D``.

The tracked-layer machinery (hooks capturing ``a_t`` and ``b_t``, the exact scorer, the
fit taps, the memory plan, FSDP) handles ``nn.Linear`` modules applied to ``(B, T, in)``
activations. :func:`linearize_model` rewrites, once at load time, the two other kinds of
weight matrix a decoder block may hold into such modules; the model computes the same
function afterwards.

**Fused experts** (transformers 5: ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and
``mlp.experts.down_proj`` ``(E, H, I)`` in a ``...Experts`` module, routed by a
``...TopKRouter``; Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, ...). The experts module is
replaced by :class:`EagerExperts`: one :class:`ExpertMLP` per expert, holding two
:class:`RoutedLinear` layers ``gate_up`` (``2I x H``) and ``down`` (``H x I``) whose
weights are views of the fused parameters' storage (``gate_up_proj[e]``,
``down_proj[e]``: no copy). Expert ``e`` is applied to its tokens gathered per example:
``(B, C_e, H)``, example ``b``'s tokens routed to ``e`` first, in order, then zero slots
up to ``C_e``, the most tokens any example of the batch routes to ``e`` (one host sync
per block). Its output is multiplied by the routing weight (zero at the empty slots) and
added back at the tokens' positions, in expert order, as the fused forward does (the
logits are the same). The per-example structure the tracked-layer machinery needs is
kept: an example's gradient ``G = sum_t b_t a_t^T`` of each expert sums over its own
tokens (an empty slot has ``a = 0``: ``act(0) * 0 = 0``, no bias; and ``b = 0``), and
``b_t`` of ``down`` carries the routing weight that multiplies the expert's output in the
loss. The batch's token mask (padding, the fit's token selection) reaches an expert's
layer at its slots (:func:`layer_mask`). The block's other linear layers that it calls
on its flattened tokens (Qwen2-MoE's shared expert and its gate) are called on them
grouped by example (:class:`TokensAsExamples`). Every expert is tracked, in float32, bfloat16
and float64 (the fused path's ``torch._grouped_mm`` refuses float64). The slots change
with the batch's routing, so CUDA graphs stay off for such a model
(:func:`prism_select.runtime.graphs.graphs_wanted`).

The K-FAC input factor of an expert's layer is normalised by the number of real tokens
routed to that expert in the fit sample (:func:`routed_tokens`), as kronfluence
normalises a layer that sees only those tokens; the output-gradient factor and the
EK-FAC eigenvalues are normalised by the number of fit examples, as for every layer
(an example that routes nothing to an expert has a zero gradient there, and counts).

**The router** (``...TopKRouter.weight``, ``E x H``) is not tracked: its logits are a
linear map of the hidden state, but what reaches the loss goes through the top-k
selection, so its gradient is that of a linear layer only piecewise (constant routing
within a piece); it is left out by default, and the summary counts it as untracked
(``E x H`` per block, well under 1% of an MoE model's parameters).

**Conv1D** (GPT-2, GPT-2's descendants): ``y = x W + b`` with ``W`` stored ``(in, out)``
is the linear map ``W^T``; it is replaced by an ``nn.Linear`` holding ``W^T`` (a
contiguous copy, exact: the same values), so its gradient is reported ``out x in`` like
every other layer's.

:func:`tracking_summary` says what is tracked: per kind of module, how many modules and
parameters, and their share of the model's parameters; with a warning for each decoder
block most of whose parameters are untracked.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict

import torch
from torch import nn

#: a decoder block whose untracked share of its parameters is above this gets a warning
UNTRACKED_WARN_SHARE = 0.5


class RoutedLinear(nn.Linear):
    """One linear map of one expert, applied to its tokens gathered per example,
    ``(B, C, in)``. ``slots``: ``(index, valid)`` of the latest forward, both ``(B, C)``:
    the position in the sequence of each of the example's slots, and whether the slot
    holds a token routed to the expert (the rest are zero padding); see
    :func:`layer_mask`."""

    slots: tuple | None = None


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate) * up)`` with ``[gate; up] = gate_up(x)``."""

    def __init__(self, hidden: int, intermediate: int, act_fn, gate_up_w: torch.Tensor, down_w: torch.Tensor):
        super().__init__()
        self.gate_up = RoutedLinear(hidden, 2 * intermediate, bias=False, device="meta")
        self.down = RoutedLinear(intermediate, hidden, bias=False, device="meta")
        self.gate_up.weight = nn.Parameter(gate_up_w.data, requires_grad=gate_up_w.requires_grad)
        self.down.weight = nn.Parameter(down_w.data, requires_grad=down_w.requires_grad)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act_fn(gate) * up)


class EagerExperts(nn.Module):
    """The experts of one MoE block as per-expert ``nn.Linear`` layers (children ``"0"``,
    ``"1"``, ...), called like the fused module it replaces: ``(hidden (N, H), top_k_index
    (N, k), top_k_weights (N, k)) -> (N, H)`` with ``N = B T`` the block input's tokens
    (the block's ``(B, T)`` is read by a forward pre-hook on the block); each expert runs
    on its tokens gathered per example (see the module docstring)."""

    #: an expert's token slots change with each batch's routing: no CUDA graph replays them
    #: (:func:`prism_select.runtime.graphs.graphs_wanted`)
    routes_tokens = True

    def __init__(self, fused: nn.Module):
        super().__init__()
        gu, dn = fused.gate_up_proj, fused.down_proj
        E, two_i, H = gu.shape
        self.num_experts, self.hidden_dim, self.intermediate_dim = E, H, two_i // 2
        self.act_fn = fused.act_fn
        for e in range(E):
            self.add_module(str(e), ExpertMLP(H, two_i // 2, fused.act_fn, gu[e], dn[e]))
        self._bt: tuple | None = None

    def __len__(self):
        return self.num_experts

    def __getitem__(self, e: int) -> ExpertMLP:
        return self._modules[str(e)]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if hidden_states.dim() == 3:
            B, T, H = hidden_states.shape
        else:
            N, H = hidden_states.shape
            bt = self._bt
            if bt is None or bt[0] * bt[1] != N:
                raise RuntimeError(
                    f"the experts module got {N} tokens but its block's input shape is unknown ({bt}); "
                    "prism-select tracks experts of blocks that pass their (B, T, H) input's tokens to the "
                    "experts in order")
            B, T = bt
        if top_k_index.is_floating_point() and not top_k_weights.is_floating_point():  # (weights, index)
            top_k_index, top_k_weights = top_k_weights, top_k_index
        x = hidden_states.reshape(B, T, H)
        idx = top_k_index.reshape(B, T, -1)
        w = top_k_weights.reshape(B, T, -1)
        E = self.num_experts
        hit = idx[..., None] == torch.arange(E, device=idx.device)  # (B, T, k, E); an expert at most once per token
        routed = hit.any(2)  # (B, T, E)
        weights = (w[..., None] * hit.to(w.dtype)).sum(2)  # (B, T, E): routing weights, 0 off each expert's tokens
        counts = routed.sum(1)  # (B, E)
        # each expert's slots: its tokens of each example first, in order (a stable sort)
        order = torch.argsort((~routed).to(torch.int8), dim=1, stable=True)
        # one host sync per block: the slots an expert needs (at least one, so that every
        # expert runs in every step: sharded fits meet at each layer)
        caps = counts.amax(0).clamp(min=1).tolist()
        out = torch.zeros_like(x)
        for e in range(E):
            C = caps[e]
            pos = order[:, :C, e]  # (B, C)
            valid = torch.arange(C, device=x.device) < counts[:, e:e + 1]
            expert = self[e]
            expert.gate_up.slots = expert.down.slots = (pos, valid)
            at = pos[..., None].expand(B, C, H)
            xe = x.gather(1, at) * valid[..., None].to(x.dtype)
            we = weights[..., e].gather(1, pos) * valid.to(weights.dtype)
            y = expert(xe)
            out = out.scatter_add(1, at, (y * we[..., None]).to(x.dtype))
        return out.reshape(hidden_states.shape)


class TokensAsExamples(nn.Module):
    """A linear layer of an MoE block that the block calls on its tokens flattened to
    ``(B T, in)`` (Qwen2-MoE's ``shared_expert_gate``), called on them as ``(B, T, in)``
    (the block's shape, as its experts read it), so that its tokens stay grouped by
    example for the tracked-layer machinery; the output is flattened back."""

    def __init__(self, linear: nn.Linear, experts: EagerExperts):
        super().__init__()
        self.linear = linear
        self._experts = [experts]  # not a child module

    def forward(self, x):
        return _as_examples(self.linear, x, self._experts[0]._bt)


def _as_examples(fn, x, bt):
    if x.dim() == 2 and bt is not None and bt[0] * bt[1] == x.shape[0]:
        y = fn(x.reshape(*bt, x.shape[-1]))
        return y.reshape(x.shape[0], *y.shape[2:])
    return fn(x)


def _flat_tokens_hooks(module: nn.Module, experts: EagerExperts):
    """The same for a submodule holding linear layers (Qwen2-MoE's ``shared_expert``):
    its input is viewed as ``(B, T, in)`` and its output flattened back, by hooks."""

    def pre(mod, args):
        x = args[0] if args else None
        bt = experts._bt
        mod._prism_flat = isinstance(x, torch.Tensor) and x.dim() == 2 and bt is not None and bt[0] * bt[1] == x.shape[0]
        if mod._prism_flat:
            return (x.reshape(*bt, x.shape[-1]), *args[1:])
        return None

    def post(mod, args, out):
        if getattr(mod, "_prism_flat", False) and isinstance(out, torch.Tensor):
            mod._prism_flat = False
            return out.reshape(-1, *out.shape[2:])
        return None

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def _route_in_input_dtype(router: nn.Module) -> None:
    """Make ``router`` compute in its input's dtype when that differs from its weight's
    (the weight cast for the call, then restored). Under a float32 residual stream
    (``--precision residual32`` and ``split32``: :mod:`prism_select.runtime.precision`,
    :func:`prism_select.engine.policy.split32`) the router is reached by float32 hidden
    states; the routing is then decided from float32 logits (a bf16 or fp16 weight is
    upcast exactly), as a float32 model decides it. Where the router's weight is being
    trained (it requires a gradient under grad mode), the input is cast to the weight's
    dtype instead, so that its gradient keeps the weight's dtype."""
    inner = router.forward

    def forward(hidden_states, *args, **kwargs):
        w = router.weight
        if not (isinstance(hidden_states, torch.Tensor) and hidden_states.is_floating_point()
                and hidden_states.dtype != w.dtype):
            return inner(hidden_states, *args, **kwargs)
        if w.requires_grad and torch.is_grad_enabled():
            return inner(hidden_states.to(w.dtype), *args, **kwargs)
        held = w.data
        w.data = held.to(hidden_states.dtype)
        try:
            return inner(hidden_states, *args, **kwargs)
        finally:
            w.data = held

    router.forward = forward


def _block_shape_hook(experts: EagerExperts):
    def hook(module, args, kwargs):
        h = args[0] if args else next(iter(kwargs.values()), None)
        experts._bt = tuple(h.shape[:2]) if isinstance(h, torch.Tensor) and h.dim() == 3 else None
    return hook


def _fused_experts_layout(m: nn.Module):
    """``(E, I, H)`` if ``m`` is a fused experts module of the layout :class:`EagerExperts`
    reads (concatenated ``[gate; up]``, not transposed, no biases, gated, no post-expert
    norm), ``None`` if it is no fused experts module, or a string saying why it is one
    that is left as it is."""
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not (isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3 and dn.dim() == 3):
        return None
    flags = {"is_transposed": False, "is_concatenated": True, "has_bias": False, "has_gate": True,
             "has_post_expert_norm": False}
    odd = [f"{k}={getattr(m, k)}" for k, v in flags.items() if getattr(m, k, v) != v]
    if any(getattr(m, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias")):
        odd.append("expert biases")
    if not callable(getattr(m, "act_fn", None)):
        odd.append("no act_fn")
    E, two_i, H = gu.shape
    if two_i % 2 or tuple(dn.shape) != (E, H, two_i // 2):
        odd.append(f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(dn.shape)} are not (E, 2I, H), (E, H, I)")
    if odd:
        return f"{type(m).__name__} ({', '.join(odd)})"
    return E, two_i // 2, H


def linearize_model(model: nn.Module) -> dict:
    """Rewrite ``model`` in place so that every weight matrix of its decoder blocks is an
    ``nn.Linear`` (see the module docstring): fused experts modules become
    :class:`EagerExperts`, ``Conv1D`` modules ``nn.Linear``. Returns what was done:
    ``{"experts_modules": n, "experts": total experts, "conv1d": n, "left_fused": [...]}``
    (the fused experts modules of a layout it does not read, left as they are, with a
    warning)."""
    done = {"experts_modules": 0, "experts": 0, "conv1d": 0, "left_fused": []}
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers always has it
        Conv1D = ()
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if Conv1D and isinstance(child, Conv1D):
                w = child.weight
                lin = nn.Linear(w.shape[0], w.shape[1], bias=child.bias is not None, device="meta")
                lin.weight = nn.Parameter(w.data.t().contiguous(), requires_grad=w.requires_grad)
                if child.bias is not None:
                    lin.bias = nn.Parameter(child.bias.data, requires_grad=child.bias.requires_grad)
                lin.prism_from = "Conv1D"
                setattr(parent, child_name, lin)
                done["conv1d"] += 1
                continue
            layout = _fused_experts_layout(child)
            if layout is None:
                continue
            if isinstance(layout, str):
                done["left_fused"].append(f"{full}: {layout}")
                continue
            eager = EagerExperts(child)
            setattr(parent, child_name, eager)
            parent.register_forward_pre_hook(_block_shape_hook(eager), with_kwargs=True)
            # the block's other linear layers read its tokens flattened too (a shared expert
            # and its gate): grouped by example again
            for other_name, other in list(parent.named_children()):
                if other is eager:
                    continue
                if isinstance(other, nn.Linear):
                    setattr(parent, other_name, TokensAsExamples(other, eager))
                elif any(isinstance(m, nn.Linear) for m in other.modules()):
                    _flat_tokens_hooks(other, eager)
                elif isinstance(getattr(other, "weight", None), nn.Parameter) and other.weight.dim() == 2:
                    _route_in_input_dtype(other)  # the router
            done["experts_modules"] += 1
            done["experts"] += eager.num_experts
    if done["left_fused"]:
        warnings.warn("fused experts of a layout prism-select does not read are left untracked: "
                      + "; ".join(done["left_fused"][:3]), stacklevel=2)
    return done


def layer_mask(module: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """The batch's token mask ``mask`` (``B x T``, any dtype) as the layer ``module`` sees
    its tokens: ``mask`` itself for a layer applied to the sequence, and for an expert's
    layer (``(B, C)`` slots) the mask at each slot's position, zero at the padding
    slots."""
    slots = getattr(module, "slots", None) if isinstance(module, RoutedLinear) else None
    if slots is None:
        return mask
    pos, valid = slots
    m = mask.gather(1, pos)
    return m & valid if m.dtype == torch.bool else m * valid.to(m.dtype)


def routed_tokens(module: nn.Module, sel: torch.Tensor) -> torch.Tensor | None:
    """The number of the tokens marked by ``sel`` (``B x T``) that were routed to the
    expert owning ``module`` in its latest forward; None for a layer that is no expert's."""
    if not isinstance(module, RoutedLinear) or module.slots is None:
        return None
    return layer_mask(module, sel.to(torch.bool)).sum()


def is_routed(module: nn.Module) -> bool:
    return isinstance(module, RoutedLinear)


# ----------------------------------------------------------------------------- summary

_BLOCK_RE = re.compile(r"^(.*?(?:^|\.)(?:layers|h|blocks|block)\.\d+)\.")


def _kind(module: nn.Module) -> str:
    if isinstance(module, RoutedLinear):
        return "expert linear"
    if getattr(module, "prism_from", None) == "Conv1D":
        return "linear (Conv1D)"
    if type(module).__name__ == "Linear" and type(module).__module__.startswith("torch"):
        return "linear"
    return type(module).__name__


def tracking_summary(model: nn.Module, modules: dict) -> dict:
    """What the tracked layers cover: ``kinds`` (per kind of tracked module: modules,
    parameters and their share of the model's parameters), ``tracked_parameters``,
    ``model_parameters``, ``tracked_share``, ``untracked_in_blocks`` (per kind of
    untracked parameter inside the decoder blocks: parameters) and ``warnings`` (each
    decoder block whose untracked share is above :data:`UNTRACKED_WARN_SHARE`)."""
    params = OrderedDict((n, p) for n, p in model.named_parameters())
    total = sum(p.numel() for p in params.values())
    kinds: dict = {}
    tracked_ids = set()
    for m in modules.values():
        k = _kind(m)
        out, inp = m.out_features, m.in_features + int(getattr(m, "bias", None) is not None)
        entry = kinds.setdefault(k, {"modules": 0, "parameters": 0})
        entry["modules"] += 1
        entry["parameters"] += out * inp
        tracked_ids.add(id(m.weight))
        if getattr(m, "bias", None) is not None:
            tracked_ids.add(id(m.bias))
    tracked = sum(e["parameters"] for e in kinds.values())
    for e in kinds.values():
        e["share"] = round(e["parameters"] / max(total, 1), 6)
    blocks: dict = OrderedDict()
    untracked_kinds: dict = {}
    owner = {}
    for mn, mod in model.named_modules():
        for pn, p in mod.named_parameters(recurse=False):
            owner[id(p)] = (mn, type(mod).__name__, pn)
    for n, p in params.items():
        match = _BLOCK_RE.match(n)
        if not match:
            continue
        b = blocks.setdefault(match.group(1), {"parameters": 0, "tracked": 0})
        b["parameters"] += p.numel()
        if id(p) in tracked_ids:
            b["tracked"] += p.numel()
        else:
            mod_type = owner.get(id(p), ("", "?", ""))[1]
            key = f"{mod_type}.{n.rsplit('.', 1)[-1]}"
            untracked_kinds[key] = untracked_kinds.get(key, 0) + p.numel()
    peft = hasattr(model, "peft_config") and hasattr(model, "active_adapter")
    note = None
    if peft:
        kinds = {("LoRA " + k): e for k, e in kinds.items()}
        wrapped = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ == "ParamWrapper"})
        note = ("the adapter's LoRA nn.Linear modules are tracked (the base weights are frozen)" +
                ("; its LoRA on raw parameters (PEFT target_parameters, e.g. fused experts) is not"
                 if wrapped else ""))
    warn = []
    for b, e in ({} if peft else blocks).items():
        share = 1 - e["tracked"] / max(e["parameters"], 1)
        if share > UNTRACKED_WARN_SHARE:
            warn.append(f"{b}: {share:.0%} of its {e['parameters']:,} parameters are not tracked")
    if len(warn) > 3:
        warn = warn[:2] + [f"... and {len(warn) - 2} more decoder blocks alike"]
    return {"kinds": kinds, "tracked_parameters": tracked, "model_parameters": total,
            "tracked_share": round(tracked / max(total, 1), 6),
            "untracked_in_blocks": dict(sorted(untracked_kinds.items(), key=lambda kv: -kv[1])),
            "warnings": warn, **({"note": note} if note else {})}


def summary_lines(summary: dict) -> list:
    """The printed form of :func:`tracking_summary`: one line per kind (its warnings are
    printed with the run's)."""
    lines = [f"tracked: {summary['tracked_parameters']:,} of {summary['model_parameters']:,} parameters "
             f"({summary['tracked_share']:.1%})"]
    for k, e in summary["kinds"].items():
        lines.append(f"  {k}: {e['modules']} modules, {e['parameters']:,} parameters ({e['share']:.1%})")
    if summary.get("note"):
        lines.append(f"  ({summary['note']})")
    return lines
