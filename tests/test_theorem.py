"""Paper Theorem 1 in practice: training on the top-scored examples raises the
reward K more than training on the bottom-scored ones."""

import copy

import torch

from prism_select.curvature import CurvatureSettings, fit_curvature
from prism_select.data.tokenize import collate, encode, token_losses
from prism_select.preference import compute_preference
from prism_select.scoring import score_encoded

from conftest import linear_modules
from reference import example_loss
from tiny import ARITHMETIC_POOL

POOL = ARITHMETIC_POOL
K_TOP = 3
STEPS = 3
LR = 1e-4  # small: the first-order (influence) regime the theorem speaks of


def reward(model, chosen, rejected):
    with torch.no_grad():
        m = torch.stack([-example_loss(model, c, True) + example_loss(model, r, True)
                         for c, r in zip(chosen, rejected)])
    return torch.nn.functional.softplus(m).mean().item()


def sgd(model, modules, encoded, steps, lr):
    model = copy.deepcopy(model)
    mods = linear_modules(model)
    params = [m.weight for m in mods.values()]
    opt = torch.optim.SGD(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        b = collate(encoded, pad_id=0)
        total, _ = token_losses(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                b["labels"])
        (total.sum() / len(encoded)).backward()
        opt.step()
    return model


def test_top_scored_examples_raise_the_reward_more(model, modules, tok, pair_examples):
    pool = [encode(tok, p, r) for p, r in POOL]
    chosen = [encode(tok, q, c) for q, c, _ in pair_examples]
    rejected = [encode(tok, q, r) for q, _, r in pair_examples]
    pref = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id)
    # Plain SGD's local geometry is the identity, so the matching score uses H = I.
    cur = fit_curvature(model, modules, pool, CurvatureSettings(kind="identity"), pad_id=tok.pad_token_id)
    scores = score_encoded(model, modules, pool, cur.precondition(pref.direction), pad_id=tok.pad_token_id)
    order = torch.argsort(scores, descending=True).tolist()
    top, bottom = [pool[i] for i in order[:K_TOP]], [pool[i] for i in order[-K_TOP:]]
    k0 = reward(model, chosen, rejected)
    k_top = reward(sgd(model, modules, top, STEPS, LR), chosen, rejected)
    k_bottom = reward(sgd(model, modules, bottom, STEPS, LR), chosen, rejected)
    assert k_top - k0 > k_bottom - k0
    # First order: the gain predicted by the scores matches the measured one.
    predicted = LR * STEPS * scores[order[:K_TOP]].mean().item()
    assert abs((k_top - k0) - predicted) < 0.2 * abs(predicted)
