"""The engine's exact route (``ExactScorer`` / ``ScoringLinear``), its fused chunked loss
and ``rowdot`` against the reference hook route and explicit per-example gradients, in
float64."""

import pytest
import torch

from prism_select import engine
from prism_select.data.tokenize import collate, token_losses
from prism_select.scoring import score_encoded

from reference import flatten, per_example_grads, rel_err


def _direction(modules, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.out_features, m.in_features + int(m.bias is not None), generator=g,
                           dtype=torch.float64) for n, m in modules.items()}


def test_fused_exact_equals_hooks_and_explicit_gradients(model, modules, tok, encoded_pool):
    V = _direction(modules)
    hooks = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, batch_size=3,
                          impl="hooks")
    fused = score_encoded(model, modules, encoded_pool, V, pad_id=tok.pad_token_id, batch_size=3)
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
    # stacked with a second direction: the bias column of each
    V2 = _direction(modules, 7)
    flat2 = torch.cat([torch.cat([V2[n][:, :m.in_features].reshape(-1), V2[n][:, -1]]) for n, m in modules.items()])
    ref2 = per_example_grads(model, modules, encoded_pool) @ flat2
    for mode in ("g", "w"):  # each example's gradient against both, or V_k^T b_t per token
        with engine.ExactScorer(model, modules, {n: torch.stack([V[n], V2[n]]) for n in modules},
                                modes={n: mode for n in modules}) as sc:
            assert sc.layers[next(iter(modules))].mode == mode
            got = sc.score(b)
        assert rel_err(got[:, 0], ref) <= 1e-10 and rel_err(got[:, 1], ref2) <= 1e-10


@pytest.mark.parametrize("fused_loss,mode", [(False, None), (True, None), (False, "w")])
def test_stacked_directions_equal_explicit_gradients(model, modules, tok, encoded_pool, fused_loss, mode):
    """K directions stacked per layer: (B, K) scores, each column the explicit
    per-example gradients' product with its direction (the default "g" order, and "w");
    score_directions keeps input order."""
    from prism_select.scoring import score_directions
    Vs = [_direction(modules, seed) for seed in (3, 4, 5)]
    G = per_example_grads(model, modules, encoded_pool)
    ref = torch.stack([G @ flatten(V, modules) for V in Vs], dim=1)
    b = collate(encoded_pool, tok.pad_token_id)
    stacked = {n: torch.stack([V[n] for V in Vs]) for n in modules}
    with engine.ExactScorer(model, modules, stacked, fused_loss=fused_loss,
                            modes=None if mode is None else {n: mode for n in modules}) as sc:
        assert {layer.mode for layer in sc.layers.values()} == {mode or "g"}
        got = sc.score(b)
    assert got.shape == (len(encoded_pool), 3) and rel_err(got, ref) <= 1e-10
    got = score_directions(model, modules, encoded_pool, Vs, pad_id=tok.pad_token_id, batch_size=2)
    assert rel_err(got, ref) <= 1e-10


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


def test_rowdot_cpu_paths():
    g = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    u = torch.randn(3, 5, 7, dtype=torch.bfloat16)
    ref = (g.double() * u.double()).sum((1, 2))
    got = engine.rowdot(g, u)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), ref, rtol=2e-2, atol=1e-1)
