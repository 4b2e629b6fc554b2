"""The training loss of a batch, per example, as the engine computes it.

For the common ``*ForCausalLM`` layout (decoder + plain ``lm_head``) the loss is computed
from the decoder's hidden states on response tokens only, a chunk of tokens at a time;
the gradient w.r.t. the hidden states is formed in the same pass (``softmax - onehot``,
then one matmul with the head), so neither the float32 logits of the whole batch nor a
second head matmul in the backward are needed. Other models fall back to
``model(...).logits`` + :func:`~prism_select.data.tokenize.token_losses`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.tokenize import collate, token_losses
from ..runtime.execution import DEFAULT_KERNELS, Kernels
from .arith import cotangent_mm, split_linear

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


def cpu_response_split(model, modules: dict | None = None):
    """On the CPU: the model's ``(decoder, head)`` (:func:`split_causal_lm`) when the head is
    not among the tracked ``modules``, so that the logits are formed for the response
    positions only (:func:`batch_losses`): the head's GEMM over every prompt position is a
    tenth of a 135M model's forward there. None on other devices: GPUs keep the full head
    (it measured faster there, docs/performance.md)."""
    if next(model.parameters()).device.type != "cpu":
        return None
    split = split_causal_lm(model)
    if split is None or any(m is split[1] for m in (modules or {}).values()):
        return None
    return split


#: bytes of float32 logits per chunk of the fused loss: on the CPU they are resident
#: memory next to the model and its activations (a 135M model's vocabulary of 49,152 gives
#: 341 tokens a chunk there), on accelerators larger chunks keep the head's GEMMs large
CE_CHUNK_BYTES = {"cpu": 1 << 26, "other": 1 << 28}


def _ce_chunk_tokens(vocab: int, device_type: str = "cuda") -> int:
    """Tokens per chunk of the fused loss (at least 256)."""
    budget = CE_CHUNK_BYTES["cpu" if device_type == "cpu" else "other"]
    return max(256, budget // 4 // max(vocab, 1))


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
        step = _ce_chunk_tokens(weight.shape[0], hidden.device.type)
        mixed = h.dtype != weight.dtype  # split32: float32 activations, half-precision head
        linear = (lambda a, w, b: split_linear(a, w, b, kernels)) if mixed else F.linear
        for c in range(0, h.shape[0], step):
            logits = linear(h[c:c + step], weight, bias).to(acc)
            lse = torch.logsumexp(logits, dim=-1)
            yy = y[c:c + step]
            ce = lse - logits.gather(1, yy[:, None]).squeeze(1)
            losses.index_add_(0, bi[c:c + step], ce)
            if need_grad:
                p = logits.sub_(lse[:, None]).exp_()  # the softmax, in the logits' memory
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
