"""The hand-written mixed-precision JVP (benchmarks/mixed_jvp.py, the diagnostic behind
docs/performance.md run 10) against the exact route: in float64 both are exact
derivatives, so they must agree to rounding."""

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from prism_select import engine
from prism_select.data.tokenize import collate, encode
from prism_select.errors import ConfigError

from conftest import linear_modules
from tiny import _norms_in_model_dtype, tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from mixed_jvp import SITES, MixedJVPScorer  # noqa: E402

#: float64 agreement with ExactScorer (both exact; measured ~1e-15)
FLOAT64_REL_TOL = 1e-10
#: a bf16 tiny model, float32 tangent at every site, vs the float64 exact scores of the
#: same (bf16-rounded) weights: a smoke test, dominated by the bf16 primal (measured 0.09;
#: the bf16 exact route measures 0.05 on the same batch)
BF16_MIXED_REL_TOL = 0.25


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _direction(modules, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.out_features, m.in_features + int(m.bias is not None), generator=g,
                           dtype=torch.float64).to(dtype) for n, m in modules.items()}


def _batch(tok, pool_examples):
    return collate([encode(tok, p, r) for p, r in pool_examples], tok.pad_token_id)  # right-padded


def _exact(model, modules, V, batch):
    with engine.ExactScorer(model, modules, V) as sc:
        return sc.score(batch)


def _llama(vocab, *, heads, kv_heads, bias, tied, seed=0, hidden=16, layers=2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      attention_bias=bias, mlp_bias=bias, tie_word_embeddings=tied, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    _norms_in_model_dtype(model)
    model.eval()
    return model


def test_float64_agrees_with_exact_gqa(model, modules, tok, pool_examples):
    # tiny_llama: 2 query heads sharing 1 key/value head (grouped-query attention), no biases
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert all(m.bias is None for m in modules.values())
    V = _direction(modules)
    b = _batch(tok, pool_examples)
    ref = _exact(model, modules, V, b)
    got = MixedJVPScorer(model, modules, V).score(b)
    assert got.dtype == torch.float64
    assert rel_err(got, ref) <= FLOAT64_REL_TOL


@pytest.mark.parametrize("heads,kv_heads,bias,tied", [(2, 2, True, False), (4, 2, True, True), (4, 1, False, True)])
def test_float64_agrees_with_exact_variants(tok, pool_examples, heads, kv_heads, bias, tied):
    model = _llama(len(tok), heads=heads, kv_heads=kv_heads, bias=bias, tied=tied)
    modules = linear_modules(model)
    modules["lm_head"] = model.lm_head  # the (possibly tied) head tracked too
    V = _direction(modules, seed=1)
    b = _batch(tok, pool_examples)
    ref = _exact(model, modules, V, b)
    got = MixedJVPScorer(model, modules, V).score(b)
    assert rel_err(got, ref) <= FLOAT64_REL_TOL


def test_float64_subset_of_layers(model, tok, pool_examples):
    # only late layers tracked: the tangent is zero (skipped) below them
    modules = {n: m for n, m in linear_modules(model).items() if n.startswith("model.layers.1.")
               and ("down_proj" in n or "v_proj" in n)}
    V = _direction(modules, seed=2)
    b = _batch(tok, pool_examples)
    assert rel_err(MixedJVPScorer(model, modules, V).score(b), _exact(model, modules, V, b)) <= FLOAT64_REL_TOL


def test_batch_independent_of_padding(model, modules, tok, pool_examples):
    V = _direction(modules)
    sc = MixedJVPScorer(model, modules, V)
    full = sc.score(_batch(tok, pool_examples))
    alone = torch.cat([sc.score(_batch(tok, [ex])) for ex in pool_examples])
    assert rel_err(alone, full) <= FLOAT64_REL_TOL


def test_bf16_mixed_tangent_close_to_exact(tok, pool_examples):
    model64 = tiny_llama(len(tok), hidden=32)
    modules64 = linear_modules(model64)
    model = tiny_llama(len(tok), hidden=32).to(torch.bfloat16)
    modules = linear_modules(model)
    with torch.no_grad():  # the float64 reference runs on the same bf16-rounded weights
        for p64, p in zip(model64.parameters(), model.parameters()):
            p64.copy_(p.double())
    V = _direction(modules, dtype=torch.float32)
    V64 = {n: t.to(torch.bfloat16).double() for n, t in V.items()}  # the route rounds V to bf16
    b = _batch(tok, pool_examples)
    ref = _exact(model64, modules64, V64, b)
    mixed = MixedJVPScorer(model, modules, V).score(b)
    assert mixed.dtype == torch.float32
    assert rel_err(mixed, ref) <= BF16_MIXED_REL_TOL
    plain = MixedJVPScorer(model, modules, V, sites=()).score(b)  # runs; accuracy is measured elsewhere
    assert torch.isfinite(plain).all()


def test_unsupported_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32))
    with pytest.raises(ConfigError, match="does not support model type GPT2LMHeadModel"):
        MixedJVPScorer(m, {}, {})


def test_unknown_module_and_site_are_refused(model, modules):
    V = _direction(modules)
    stray = torch.nn.Linear(16, 16).double()
    with pytest.raises(ConfigError, match="tracked module 'stray'"):
        MixedJVPScorer(model, {"stray": stray}, {"stray": torch.zeros(16, 17, dtype=torch.float64)})
    with pytest.raises(ConfigError, match="unknown site"):
        MixedJVPScorer(model, modules, V, sites=("residual", "softmax"))
    assert set(SITES) == {"residual", "norm", "attn_softmax", "mlp", "logits"}
