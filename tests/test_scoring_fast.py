"""The fused exact route, the chunked loss and the fast (finite-difference) routes
against the reference hook route and explicit per-example gradients, in float64."""

import pytest
import torch

from prism_select import engine
from prism_select.data.tokenize import collate, encode, token_losses
from prism_select.scoring import score_encoded

from reference import flatten, per_example_grads
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


def test_fused_exact_equals_hooks_and_explicit_gradients(model, modules, tok, encoded_pool):
    V = _direction(modules)
    hooks = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, batch_size=3,
                          progress=False, impl="hooks")
    fused = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, batch_size=3, progress=False)
    ref = per_example_grads(model, modules, encoded_pool) @ flatten(V, modules)
    assert rel_err(hooks, ref) <= 1e-10
    assert rel_err(fused, ref) <= 1e-10


@pytest.mark.parametrize("mode", ["u", "w"])
@pytest.mark.parametrize("fused_loss", [False, True])
def test_both_contraction_orders_and_losses(model, modules, tok, encoded_pool, mode, fused_loss):
    V = _direction(modules, 1)
    ref = per_example_grads(model, modules, encoded_pool) @ flatten(V, modules)
    b = collate(encoded_pool, tok.pad_token_id)
    with engine.ExactScorer(model, modules, V, modes={n: mode for n in modules}, fused_loss=fused_loss) as sc:
        got = sc.score(b)
    assert rel_err(got, ref) <= 1e-10
    assert all(p.requires_grad for p in model.parameters())  # flags restored


def test_bias_layers(tok, encoded_pool):
    """Biases are the last column of a layer's gradient matrix, in both orders."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).double().eval()
    from tiny import _norms_in_model_dtype
    _norms_in_model_dtype(model)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    assert all(m.bias is not None for m in modules.values())
    V = _direction(modules, 2)
    flat = torch.cat([torch.cat([V[n][:, :m.in_features].reshape(-1), V[n][:, -1]]) for n, m in modules.items()])
    ref = per_example_grads(model, modules, encoded_pool) @ flat  # reference order: weight, then bias
    b = collate(encoded_pool, tok.pad_token_id)
    for mode in ("u", "w"):
        with engine.ExactScorer(model, modules, V, modes={n: mode for n in modules}) as sc:
            assert rel_err(sc.score(b), ref) <= 1e-10


def test_fused_loss_equals_token_losses(model, tok, encoded_pool):
    b = engine.collate_to(encoded_pool, tok.pad_token_id, "cpu")
    split = engine.split_causal_lm(model)
    assert split is not None
    got, cnt = engine.batch_losses(model, b, split=split, need_grad=False)
    with torch.no_grad():
        ref, rcnt = token_losses(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                 b["labels"])
    assert torch.equal(cnt, rcnt)
    assert rel_err(got, ref) <= 1e-12


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


def test_rowdot_cpu_paths():
    g = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    u = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    ref = (g.double() * u.double()).sum((1, 2))
    got = engine.rowdot(g, u)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, rtol=2e-2, atol=1e-1)
