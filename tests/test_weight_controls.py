"""The controls of PRISM's weights (prism_shuffled, equal_top_half) against float64 references."""

import json

import pytest
import torch

from prism_select.curvature import CurvatureSettings
from prism_select.errors import ConfigError
from prism_select.evaluation.experiment import resolve_methods
from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
from prism_select.run import score_pool
from prism_select.settings import ScoreSettings
from prism_select.preference import compute_preference, pair_margins, shuffled_weights, top_half_weights

from conftest import write_inputs
from reference import example_loss, flat_grad, flatten, rel_err

REL_TOL = 1e-8  # float64 end to end: only summation order differs
PAIRS = [  # six pairs whose pi differ: a permutation that moves them is visible
    ("What is 1+1?", "1+1=3. The answer is 3.", "1+1=2. The answer is 2."),
    ("What is 5+2?", "5+2=8. The answer is 8.", "5+2=7. The answer is 7."),
    ("What is 6-1?", "6-1=4.", "6-1=5."),
    ("Is 4+4=9?", "Yes.", "No."),
    ("Is 2+2=4?", "No.", "Yes."),
    ("Name a colour.", "Blue sky.", "Red."),
]


@pytest.fixture
def pairs6(tok):
    from prism_select.data.tokenize import encode
    return [encode(tok, q, c) for q, c, _ in PAIRS], [encode(tok, q, r) for q, _, r in PAIRS]


def _weighted_reference(model, modules, chosen, rejected, w):
    """(1/|Q|) sum_q w_q (gbar_{q,y+} - gbar_{q,y-}), each pair's gradients by autograd alone."""
    return sum(float(w[q]) * (flat_grad(model, modules, example_loss(model, c, True))
                              - flat_grad(model, modules, example_loss(model, r, True)))
               for q, (c, r) in enumerate(zip(chosen, rejected))) / len(chosen)


def test_pair_margins_are_compute_preferences(model, modules, tok, pairs6):
    chosen, rejected = pairs6
    pref = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=4)
    margin, pi = pair_margins(model, chosen, rejected, pad_id=tok.pad_token_id, batch_size=4)
    assert torch.allclose(margin, pref.margin, rtol=REL_TOL, atol=0)
    assert torch.allclose(pi, pref.pi, rtol=REL_TOL, atol=0)


def test_shuffled_weights_permute_prisms_and_give_their_weighted_direction(model, modules, tok, pairs6):
    chosen, rejected = pairs6
    prism = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=4)
    w, perm = shuffled_weights(prism.pi, seed=3)
    assert sorted(perm.tolist()) == list(range(len(PAIRS))) and perm.tolist() != list(range(len(PAIRS)))
    assert torch.equal(w, prism.pi[perm])  # the same weights, reassigned
    assert torch.allclose(w.sort().values, prism.pi.sort().values, rtol=0, atol=0)
    assert not torch.allclose(w, prism.pi)
    assert torch.equal(shuffled_weights(prism.pi, seed=3)[1], perm)  # seeded
    sh = compute_preference(model, modules, chosen, rejected, method="prism_shuffled", pad_id=tok.pad_token_id,
                            batch_size=4, weights=w)
    assert torch.equal(sh.weights, w) and torch.allclose(sh.pi, prism.pi, rtol=REL_TOL, atol=0)
    ref = _weighted_reference(model, modules, chosen, rejected, w)
    assert rel_err(flatten(sh.direction, modules), ref) <= REL_TOL
    assert rel_err(flatten(prism.direction, modules), ref) > 1e-3  # the assignment matters


def test_top_half_selects_the_pairs_above_the_median():
    pi = torch.tensor([0.1, 0.9, 0.5, 0.7], dtype=torch.float64)  # median 0.6
    assert top_half_weights(pi).tolist() == [0.0, 1.0, 0.0, 1.0]
    pi = torch.tensor([0.2, 0.4, 0.3], dtype=torch.float64)  # median 0.3: the middle pair is not above it
    assert top_half_weights(pi).tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ConfigError, match="pi differ"):
        top_half_weights(torch.full((4,), 0.5, dtype=torch.float64))


def test_top_half_direction_is_equal_aggregation_over_the_top_pairs(model, modules, tok, pairs6):
    chosen, rejected = pairs6
    _, pi = pair_margins(model, chosen, rejected, pad_id=tok.pad_token_id)
    w = top_half_weights(pi)
    order = pi.argsort(descending=True)
    assert set(torch.nonzero(w).flatten().tolist()) == set(order[:3].tolist())
    top = compute_preference(model, modules, chosen, rejected, method="equal_top_half", pad_id=tok.pad_token_id,
                             batch_size=4, weights=w)
    ref = _weighted_reference(model, modules, chosen, rejected, w)
    assert rel_err(flatten(top.direction, modules), ref) <= REL_TOL


def test_weights_go_with_the_controls_only(model, modules, tok, pairs6):
    chosen, rejected = pairs6
    with pytest.raises(ConfigError, match="no weights"):
        compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id,
                           weights=torch.ones(len(chosen), dtype=torch.float64))
    with pytest.raises(ConfigError, match="one weight per pair"):
        compute_preference(model, modules, chosen, rejected, method="prism_shuffled", pad_id=tok.pad_token_id)


def test_controls_through_score_pool_record_their_weights(model, tok, tmp_path, pool_examples):
    lm = LoadedModel(model, tok, ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / "cache")),
                     model_fingerprint(model), {"kind": "test"})
    pool, targets = write_inputs(tmp_path, pool_examples, PAIRS)
    rows = {}
    for method, opts in (("prism", {}), ("prism_shuffled", {"shuffle_seed": 1}), ("equal_top_half", {})):
        s = ScoreSettings(method=method, batch_size=4, progress=False, method_options=opts)
        score_pool(lm, pool, targets, tmp_path / method, s, CurvatureSettings(kind="identity"))
        rows[method] = [json.loads(x) for x in (tmp_path / method / "pairs.jsonl").read_text().splitlines()]
    pi = {r["id"]: r["pi"] for r in rows["prism"]}
    sh = rows["prism_shuffled"]
    assert sorted(r["weight_from"] for r in sh) == sorted(pi)
    for r in sh:  # each pair carries the pi of the pair it names
        assert r["weight"] == pytest.approx(pi[r["weight_from"]], rel=1e-6)
    assert any(r["weight_from"] != r["id"] for r in sh)
    run = json.loads((tmp_path / "prism_shuffled" / "run.json").read_text())
    assert run["weights"]["shuffle_seed"] == 1 and run["weights"]["rule"] == "pi permuted across the pairs"
    median = sorted(pi.values())[2:4]
    top = {r["id"] for r in rows["equal_top_half"] if r["weight"] == 1.0}
    assert top == {k for k, v in pi.items() if v > sum(median) / 2}
    assert all(r["weight"] in (0.0, 1.0) for r in rows["equal_top_half"])


def test_control_options_are_checked(model, tok, tmp_path, pool_examples):
    lm = LoadedModel(model, tok, ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / "cache")),
                     model_fingerprint(model), {"kind": "test"})
    pool, targets = write_inputs(tmp_path, pool_examples, PAIRS)
    for method, opts, match in (("prism_shuffled", {"seed": 1}, "takes only shuffle_seed"),
                                ("prism_shuffled", {"shuffle_seed": -1}, "integer >= 0"),
                                ("equal_top_half", {"shuffle_seed": 1}, "takes no options")):
        s = ScoreSettings(method=method, batch_size=4, progress=False, method_options=opts)
        with pytest.raises(ConfigError, match=match):
            score_pool(lm, pool, targets, tmp_path / "bad", s, CurvatureSettings(kind="identity"))


def test_all_leaves_the_controls_out():
    every = resolve_methods("all")
    assert "prism" in every and "prism_shuffled" not in every and "equal_top_half" not in every
    assert resolve_methods(["prism_shuffled", "equal_top_half"]) == ["prism_shuffled", "equal_top_half"]
