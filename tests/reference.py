"""Brute-force float64 references: explicit per-example gradients with autograd.

Nothing here uses the package's batching or loss code (``collate``, ``token_losses``): each
example runs alone, unpadded, and its loss is written out from the definition, so a bug in
the package's own token shift or masking cannot hide in a shared helper."""

from __future__ import annotations

import torch


def token_log_probs(model, enc, labels=None):
    """``log p(y_t | y_<t)`` of every response token of ``enc`` (position ``t >=
    response_start``, predicted by the logits at ``t - 1``), in float64 from the model's
    own forward of the example alone. ``labels``: token ids to score instead of the
    example's own (one per position of ``enc.input_ids``)."""
    ids = torch.tensor([enc.input_ids])
    logits = model(input_ids=ids).logits[0].double()
    labels = ids[0] if labels is None else torch.as_tensor(labels)
    logp = torch.log_softmax(logits, dim=-1)
    positions = range(enc.response_start, len(enc.input_ids))
    return torch.stack([logp[t - 1, labels[t]] for t in positions])


def example_loss(model, enc, mean: bool = False, labels=None):
    """The summed (``mean``: averaged) negative log-likelihood of ``enc``'s response."""
    lp = token_log_probs(model, enc, labels)
    return -lp.mean() if mean else -lp.sum()


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


def explicit_fisher_pieces(model, modules, name, encoded, tok):
    """A, S (token-level, explicit loops) and per-example G for one layer, by autograd."""
    m = modules[name]
    acts = []
    h = m.register_forward_hook(lambda mod, i, o: acts.append(i[0].detach()))
    Gs, A, S, T = [], 0, 0, 0
    for e in encoded:
        acts.clear()
        outs = []
        h2 = m.register_forward_hook(lambda mod, i, o: outs.append(o))
        loss = example_loss(model, e)
        h2.remove()
        gout, = torch.autograd.grad(loss, outs[0], retain_graph=True)
        a, g = acts[-1][0], gout[0]
        A = A + a.T @ a
        S = S + g.T @ g
        T += a.shape[0]
        Gs.append(torch.autograd.grad(loss, m.weight)[0])
    h.remove()
    return A / T, S / len(encoded), torch.stack(Gs)
