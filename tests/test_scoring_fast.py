"""The fast routes (finite differences, forward mode) against the exact route, in float64
(the exact route itself: tests/engine/test_exact.py)."""

import pytest
import torch

from prism_select.data.tokenize import encode
from prism_select.scoring import score_encoded

from tiny import tiny_llama


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture
def encoded_pool(tok, pool_examples):
    return [encode(tok, p, r) for p, r in pool_examples]


def _direction(modules, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.out_features, m.in_features + int(m.bias is not None), generator=g,
                           dtype=torch.float64) for n, m in modules.items()}


@pytest.mark.parametrize("mode", ["fd", "fd-hp"])
def test_finite_differences_approach_exact(model, modules, tok, encoded_pool, mode):
    V = _direction(modules, 3)
    exact = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False)
    fdv = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False,
                        scoring=mode, fd_eps=1e-4, batch_size=3)
    assert rel_err(fdv, exact) <= 1e-5
    # "fast" is the default fast route
    fastv = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False,
                          scoring="fast", fd_eps=1e-4)
    assert rel_err(fastv, exact) <= 1e-5


#: fd32 (float32 arithmetic, central differences) against float64 exact at a step of
#: 1e-3 on the tiny model (measured: 3.6e-4 from float64 weights, 2.4e-4 from bf16)
FD32_REL_TOL = 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fd32_matches_exact_scores_of_the_same_weights(tok, encoded_pool, dtype):
    """fd32 runs a float32 copy: from a bf16 model it gives the float32-accurate scores of
    those bf16 weights (what bf16 exact scoring only approximates), and leaves the model
    untouched."""
    import copy

    from prism_select.pipeline import ScoreSettings
    model = tiny_llama(len(tok)).to(dtype)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    V = _direction(modules, 6)
    ref_model = copy.deepcopy(model).double()
    ref_modules = {n: m for n, m in ref_model.named_modules() if n in modules}
    exact = score_encoded(ref_model, ref_modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False,
                        scoring="fd32", fd_eps=1e-3, batch_size=3)
    assert rel_err(got, exact) <= FD32_REL_TOL
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert ScoreSettings(scoring="fd32").scoring == "fd32"


def test_fd_restores_the_model(model, modules, tok, encoded_pool):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    V = _direction(modules, 4)
    score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False, scoring="fast")
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any("forward" in vars(m) for m in modules.values())


def test_jvp_route(tok, encoded_pool):
    model = tiny_llama(len(tok))
    model.config._attn_implementation = "eager"
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    V = _direction(modules, 5)
    exact = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False)
    jv = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, progress=False, scoring="jvp")
    assert rel_err(jv, exact) <= 1e-6  # eager attention computes its softmax in float32


