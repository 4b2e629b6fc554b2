"""Brute-force float64 references: explicit per-example gradients with autograd."""

from __future__ import annotations

import torch

from prism_select.data.tokenize import collate, token_losses


def example_loss(model, enc, mean: bool = False):
    b = collate([enc], pad_id=0)
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    total, count = token_losses(logits, b["labels"])
    return total[0] / count[0] if mean else total[0]


def flat_grad(model, modules, loss):
    params = []
    for m in modules.values():
        params.append(m.weight)
        if m.bias is not None:
            params.append(m.bias)
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads])


def per_example_grads(model, modules, encoded, mean=False):
    return torch.stack([flat_grad(model, modules, example_loss(model, e, mean)) for e in encoded])


def flatten(direction: dict, modules) -> torch.Tensor:
    """Layer matrices (out x in') -> the same flat order as flat_grad (weights, no bias)."""
    return torch.cat([direction[n].reshape(-1) for n in modules])


def rel_err(a, b) -> float:
    """Relative error of ``a`` against the reference ``b`` (Frobenius norms)."""
    return float((a - b).norm() / b.norm())

