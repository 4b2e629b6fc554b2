"""The fit's sampled Fisher and its fit on a sample of the records, each against a float64
reference written from its definition: every example run alone and unpadded, its loss
from its own token log-probabilities (tests/reference.py), its factors by explicit sums."""

import random

import pytest
import torch

from prism_select.curvature import CurvatureSettings, fit_curvature

from reference import example_loss, rel_err

# float64 end to end: summation order and the eigensolver only (as test_numerics)
FIT_REL_TOL = 1e-9
#: the sampled and the empirical Fisher of the tiny model differ by far more than the
#: tolerance (so a fit that ignored the sampled labels could not pass)
DISTINCT_REL = 1e-3
LAYER = "model.layers.1.mlp.down_proj"


def _pieces(model, module, encoded, labels=None):
    """A (mean over every token of the inputs' outer products) and S (mean over examples
    of the summed output-gradient outer products) of one layer, example by example."""
    A = S = 0
    tokens = 0
    for i, e in enumerate(encoded):
        acts, outs = [], []

        def keep(mod, inp, out):  # returns None: the output is left as it is
            acts.append(inp[0])
            outs.append(out)
        hook = module.register_forward_hook(keep)
        loss = example_loss(model, e, labels=None if labels is None else labels[i])
        hook.remove()
        g, = torch.autograd.grad(loss, outs[0])
        a = acts[0][0].detach()
        A, S, tokens = A + a.T @ a, S + g[0].T @ g[0], tokens + a.shape[0]
    return A / tokens, S / len(encoded)


def _sampled_labels(model, encoded, batch_size: int, seed: int, vocab: int) -> list:
    """Each example's token ids with every response token replaced by one drawn from the
    model's softmax at the previous position.

    The draws as the fit makes them: records in batches of ``batch_size`` sorted by
    (length, index), one generator seeded with ``seed`` for the whole pass, and per batch a
    draw of one token at each (row, position) of its padded grid, which is ``argmax_v p_v
    / E_v`` with ``E`` one Exp(1) variate per (row, position, token), in that order (how
    ``torch.multinomial`` draws a single sample)."""
    gen = torch.Generator().manual_seed(seed)
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i].input_ids), i))
    labels: list = [None] * len(encoded)
    for k in range(0, len(order), batch_size):
        batch = order[k:k + batch_size]
        T = max(len(encoded[i].input_ids) for i in batch)
        E = torch.empty(len(batch), T - 1, vocab, dtype=torch.float32).exponential_(1, generator=gen)
        for row, i in enumerate(batch):
            e = encoded[i]
            with torch.no_grad():
                p = torch.softmax(model(input_ids=torch.tensor([e.input_ids])).logits[0].float(), dim=-1)
            drawn = list(e.input_ids)
            for t in range(e.response_start, len(e.input_ids)):
                drawn[t] = int((p[t - 1] / E[row, t - 1]).argmax())
            labels[i] = drawn
    return labels


def _kron_factors(cur, name):
    QA, QS = cur.tensors[f"{name}::QA"], cur.tensors[f"{name}::QS"]
    return (QA @ torch.diag(cur.tensors[f"{name}::lamA"]) @ QA.T,
            QS @ torch.diag(cur.tensors[f"{name}::lamS"]) @ QS.T)


def test_sampled_fisher_equals_the_explicit_factors_of_labels_drawn_from_the_model(model, modules, tok,
                                                                                   encoded_pool):
    batch, seed = 3, 5
    settings = CurvatureSettings(kind="kfac", damping=1e-3, batch_size=batch, fisher="sampled", seed=seed)
    cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    labels = _sampled_labels(model, encoded_pool, batch, seed, model.config.vocab_size)
    A, S = _pieces(model, modules[LAYER], encoded_pool, labels)
    got_A, got_S = _kron_factors(cur, LAYER)
    assert rel_err(got_A, A) <= FIT_REL_TOL
    assert rel_err(got_S, S) <= FIT_REL_TOL
    _, S_empirical = _pieces(model, modules[LAYER], encoded_pool)
    assert rel_err(S_empirical, S) > DISTINCT_REL
    assert any(lab[e.response_start:] != e.input_ids[e.response_start:] for lab, e in zip(labels, encoded_pool))


def test_a_fit_on_a_sample_equals_the_explicit_factors_of_exactly_those_records(model, modules, tok,
                                                                               encoded_pool):
    n, k, seed = len(encoded_pool), 5, 7
    chosen = sorted(random.Random(seed).sample(range(n), k))  # --fit-examples' documented draw
    assert chosen != sorted(random.Random(seed).sample(range(n - 1), k)) and chosen != list(range(k))
    settings = CurvatureSettings(kind="kfac", damping=1e-3, batch_size=3, fit_examples=k, seed=seed)
    cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    A, S = _pieces(model, modules[LAYER], [encoded_pool[i] for i in chosen])
    got_A, got_S = _kron_factors(cur, LAYER)
    assert rel_err(got_A, A) <= FIT_REL_TOL
    assert rel_err(got_S, S) <= FIT_REL_TOL
    A_all, _ = _pieces(model, modules[LAYER], encoded_pool)
    assert rel_err(A_all, A) > DISTINCT_REL  # the sample's factors are not the whole pool's


@pytest.mark.parametrize("fisher", ["empirical", "sampled"])
def test_the_eigenvalue_pass_sees_the_same_labels_as_the_factor_pass(model, modules, tok, encoded_pool, fisher):
    """EK-FAC's corrected eigenvalues: the mean over examples of the squared per-example
    gradient in the factors' eigenbasis, each gradient from the same labels as the
    factors (the sampled Fisher draws them again from the same seed)."""
    batch, seed = 3, 5
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=batch, fisher=fisher, seed=seed)
    cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    labels = (_sampled_labels(model, encoded_pool, batch, seed, model.config.vocab_size) if fisher == "sampled"
              else [None] * len(encoded_pool))
    W = modules[LAYER].weight
    G = torch.stack([torch.autograd.grad(example_loss(model, e, labels=lab), W)[0]
                     for e, lab in zip(encoded_pool, labels)])
    QA, QS = cur.tensors[f"{LAYER}::QA"], cur.tensors[f"{LAYER}::QS"]
    assert rel_err(cur.tensors[f"{LAYER}::Lambda"], ((QS.T @ G @ QA) ** 2).mean(0)) <= FIT_REL_TOL
