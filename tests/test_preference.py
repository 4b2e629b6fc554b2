"""Margins, ``pi`` and the target directions of :func:`compute_preference` against
float64 autograd references on a tiny in-process model.

The references write each quantity from its definition (paper Sec. 2.2, 4.4), one pair
at a time with no padding (:mod:`reference`): ``m_q = -lbar(q, y+) + lbar(q, y-)``,
``pi_q = sigmoid(m_q)``, and each direction as minus the autograd gradient of its
reward: ``K = mean_q log(1 + exp(m_q))`` (``g_KL``), ``E = mean_q m_q`` (``g_0``, equal
weights), ``U = mean_q exp(-lbar(q, y+))`` (``g_U``, unpaired)."""

import pytest
import torch

from prism_select.data.tokenize import encode
from prism_select.preference import compute_preference

from reference import example_loss, flat_grad, flatten, rel_err

# The model and every reference are float64; what separates them is the order of the
# sums (batched, padded, token-summed losses against one example at a time).
REL_TOL = 1e-9
ABS_TOL = 1e-12

PAIRS = [
    ("What is 1+1?", "1+1=3. The answer is 3.", "1+1=2. The answer is 2."),
    ("What is 5+2?", "5+2=8. The answer is 8.", "5+2=7."),
    ("What is 6-1?", "6-1=4.", "6-1=5. The answer is 5, since 6 take away 1 leaves 5."),
    ("Name a fruit.", "An apple.", "A carrot, which is a vegetable."),
    ("Say hi.", "Hi!", "Goodbye, see you later."),
]


@pytest.fixture
def pairs(tok):
    chosen = [encode(tok, q, c) for q, c, _ in PAIRS]
    rejected = [encode(tok, q, r) for q, _, r in PAIRS]
    return chosen, rejected


def _reference(model, modules, chosen, rejected):
    """``(lbar+, lbar-, margin, pi)`` and ``-grad`` of each method's reward, from autograd."""
    def losses():  # a graph of its own for each gradient
        return (torch.stack([example_loss(model, e, mean=True) for e in chosen]),
                torch.stack([example_loss(model, e, mean=True) for e in rejected]))

    rewards = {"prism": lambda lc, lr: torch.nn.functional.softplus(lr - lc).mean(),
               "equal": lambda lc, lr: (lr - lc).mean(), "unpaired": lambda lc, lr: torch.exp(-lc).mean()}
    grads = {m: -flat_grad(model, modules, r(*losses())) for m, r in rewards.items()}
    with torch.no_grad():
        lc, lr = losses()
    return lc, lr, lr - lc, torch.sigmoid(lr - lc), grads


@pytest.fixture
def reference(model, modules, pairs):
    return _reference(model, modules, *pairs)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=REL_TOL, atol=ABS_TOL)


@pytest.mark.parametrize("batch_size, one_graph, accumulate", [(8, False, "device"), (2, False, "device"),
                                                               (2, True, "device"), (3, True, "host")])
def test_margins_pi_and_g_kl_match_the_reward_k(model, modules, tok, pairs, reference, batch_size, one_graph,
                                                accumulate):
    lc, lr, margin, pi, grads = reference
    assert float((pi - 0.5).abs().min()) > 1e-4  # pi and 1 - pi differ, so the weights are told apart
    pref = compute_preference(model, modules, *pairs, method="prism", pad_id=tok.pad_token_id,
                              batch_size=batch_size, one_graph=one_graph, accumulate=accumulate)
    _close(pref.loss_chosen, lc)
    _close(pref.loss_rejected, lr)
    _close(pref.margin, margin)
    _close(pref.pi, pi)
    _close(pref.weights, pi)
    assert set(pref.direction) == set(modules)
    for n, m in modules.items():
        assert pref.direction[n].shape == m.weight.shape
    assert rel_err(flatten(pref.direction, modules), grads["prism"]) < REL_TOL


@pytest.mark.parametrize("method", ["equal", "unpaired"])
@pytest.mark.parametrize("one_graph", [False, True])
def test_the_ablations_match_their_rewards(model, modules, tok, pairs, reference, method, one_graph):
    lc, _, margin, pi, grads = reference
    pref = compute_preference(model, modules, *pairs, method=method, pad_id=tok.pad_token_id, batch_size=2,
                              one_graph=one_graph)
    _close(pref.margin, margin)  # reported for every method
    _close(pref.pi, pi)
    _close(pref.weights, torch.ones_like(pi) if method == "equal" else torch.exp(-lc))
    assert rel_err(flatten(pref.direction, modules), grads[method]) < REL_TOL


def test_the_references_tell_the_weights_apart(model, modules, pairs, reference):
    """The comparisons above can fail: a direction weighted by ``1 - pi`` (or by ``pi`` of
    the flipped margin, the same) is farther than the tolerance from ``g_KL``."""
    chosen, rejected = pairs
    *_, pi, grads = reference
    def gbar(e):  # the gradient of the token-average loss
        return flat_grad(model, modules, example_loss(model, e, mean=True))

    diffs = torch.stack([gbar(c) - gbar(r) for c, r in zip(chosen, rejected)])
    assert rel_err((pi[:, None] * diffs).mean(0), grads["prism"]) < REL_TOL  # g_KL as the paper writes it
    assert rel_err(((1 - pi)[:, None] * diffs).mean(0), grads["prism"]) > 1e3 * REL_TOL
    assert rel_err(diffs.mean(0), grads["prism"]) > 1e3 * REL_TOL  # equal weights differ too
