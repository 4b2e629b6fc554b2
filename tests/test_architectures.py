"""Tiny random-init models of many Hugging Face architectures, built from their configs,
against float64 brute force: every weight matrix of the decoder blocks tracked (experts
and Conv1D included), identity-curvature scores equal to explicit per-example gradient
dot products, and the EK-FAC / K-FAC factors of one layer equal to their explicit
construction."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers as tf

from prism_select.curvature import CurvatureSettings, fit_curvature
from prism_select.data.tokenize import encode
from prism_select.model import tracked_linear_modules
from prism_select.model.moe import EagerExperts, RoutedLinear, linearize_model, tracking_summary
from prism_select.scoring import score_encoded

from reference import example_loss, rel_err
from tiny import tiny_tokenizer

REL_TOL = 1e-7  # float64 end to end; attention kernels differ between padded and lone examples
FACTOR_TOL = 1e-9

POOL = [("What is 2+3?", "5."), ("Name a colour.", "Blue!"), ("Say hi.", "Hi there."),
        ("Spell cat.", "c-a-t")]

H, HEADS, KV, HEAD_DIM = 16, 2, 1, 8
COMMON = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV,
              max_position_embeddings=128, tie_word_embeddings=False)


def _configs(vocab: int) -> dict:
    """name -> (config class name, model class name, config kwargs)."""
    llama_like = dict(COMMON, vocab_size=vocab, intermediate_size=24, head_dim=HEAD_DIM)
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", llama_like),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", llama_like),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", llama_like),
        "mistral": ("MistralConfig", "MistralForCausalLM", llama_like),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(llama_like, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                           norm_topk_prob=True)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(llama_like, moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts=4,
                           num_experts_per_tok=2, norm_topk_prob=False)),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
                  dict(llama_like, intermediate_size=8, num_experts=4, num_experts_per_tok=2)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                    dict(llama_like, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(llama_like, query_pre_attn_scalar=HEAD_DIM, sliding_window=64)),
        "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                        dict(llama_like, query_pre_attn_scalar=HEAD_DIM, sliding_window=64)),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(llama_like, pad_token_id=1)),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", llama_like),
        "gpt2": ("GPT2Config", "GPT2LMHeadModel",
                 dict(vocab_size=vocab, n_embd=H, n_layer=1, n_head=HEADS, n_positions=128,
                      bos_token_id=2, eos_token_id=2)),
        "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                     dict(COMMON, vocab_size=vocab, intermediate_size=32, num_key_value_heads=None,
                          use_parallel_residual=True)),
        "falcon": ("FalconConfig", "FalconForCausalLM",
                   dict(vocab_size=vocab, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                        new_decoder_architecture=False, multi_query=True, bias=True, parallel_attn=True,
                        bos_token_id=2, eos_token_id=2)),
    }


ARCHS = list(_configs(10))
MOE = {"qwen3_moe", "qwen2_moe", "olmoe", "mixtral"}


class _Norm64(torch.nn.Module):
    """An RMSNorm computed in the model's dtype (HF's compute in float32 whatever the
    model's dtype; a float64 reference needs the whole function in float64).
    ``offset``: Gemma's ``(1 + w)`` scale."""

    def __init__(self, weight, eps, offset):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, h):
        return (self.offset + self.weight) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))


def _norms_in_float64(model):
    for mod in list(model.modules()):
        for name, child in list(mod.named_children()):
            cls = type(child).__name__
            if cls.endswith("RMSNorm") and getattr(child, "weight", None) is not None:
                eps = getattr(child, "variance_epsilon", getattr(child, "eps", 1e-6))
                setattr(mod, name, _Norm64(child.weight, eps, 1.0 if cls.startswith("Gemma") else 0.0))


def build(arch: str, vocab: int, seed: int = 0):
    """A float64 random-init model of ``arch`` (larger-than-default init, so gradients are
    well away from zero), before :func:`linearize_model`."""
    cfg_cls, model_cls, kw = _configs(vocab)[arch]
    cfg = getattr(tf, cfg_cls)(**kw)
    cfg._attn_implementation = "sdpa" if arch not in ("gemma2", "gemma3_text") else "eager"
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(cfg).to(torch.float64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    _norms_in_float64(model)
    if hasattr(model, "set_experts_implementation"):  # the fused reference forward (for the logits test)
        try:
            model.set_experts_implementation("eager")
        except Exception:
            pass
    return model.eval()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def encoded(tok):
    return [encode(tok, p, r) for p, r in POOL]


def _block_weight_matrices(model) -> int:
    """The number of parameters of the decoder blocks' weight matrices (2-D, and the
    fused experts' 3-D ones), routers excluded."""
    total = 0
    for n, p in model.named_parameters():
        if ".layers." in n or ".h." in n:
            if p.dim() >= 2 and not n.endswith("mlp.gate.weight") and "router" not in n:
                total += p.numel()
    return total


def _reference_scores(model, modules, encoded, V):
    """``sum_layers <G_n, V>`` per example, ``G_n`` by autograd on the example alone."""
    params, shapes = [], []
    for m in modules.values():
        params.append(m.weight)
        if m.bias is not None:
            params.append(m.bias)
    out = []
    for e in encoded:
        grads = iter(torch.autograd.grad(example_loss(model, e), params, allow_unused=True))
        s = 0.0
        for n, m in modules.items():
            g = next(grads)
            g = torch.zeros_like(m.weight) if g is None else g
            if m.bias is not None:
                gb = next(grads)
                g = torch.cat([g, (torch.zeros_like(m.bias) if gb is None else gb)[:, None]], 1)
            s = s + (g * V[n]).sum()
        out.append(s)
    return torch.stack(out)


def _random_direction(modules, seed=1):
    g = torch.Generator().manual_seed(seed)
    from prism_select.runtime.layers import layer_shape
    return {n: torch.randn(*layer_shape(m), generator=g, dtype=torch.float64) for n, m in modules.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_block_matrix_tracked_and_scores_match_brute_force(arch, tok, encoded):
    model = build(arch, len(tok))
    ids = torch.tensor([encoded[0].input_ids, encoded[0].input_ids[::-1]])
    n_matrices = _block_weight_matrices(model)
    with torch.no_grad():
        before = model(input_ids=ids).logits
    linearize_model(model)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.allclose(after, before, rtol=1e-12, atol=1e-12)  # the same function
    modules = tracked_linear_modules(model)
    # every weight matrix of the decoder blocks (each expert's among them) is tracked
    assert sum(m.weight.numel() for m in modules.values()) == n_matrices
    if arch in MOE:
        experts = [m for m in model.modules() if isinstance(m, EagerExperts)]
        assert experts and sum(isinstance(m, RoutedLinear) for m in modules.values()) == 2 * sum(
            len(e) for e in experts)
    summary = tracking_summary(model, modules)
    assert summary["warnings"] == []
    V = _random_direction(modules)
    got = score_encoded(model, modules, encoded, V, pad_id=tok.pad_token_id, batch_size=3)
    ref = _reference_scores(model, modules, encoded, V)
    assert rel_err(got, ref) <= REL_TOL


def _explicit_pieces(model, module, encoded):
    """One layer's explicit ``A`` (over the tokens it sees: an expert's routed tokens),
    ``S`` (over examples) and per-example ``G``, each example alone."""
    Gs, A, S, T = [], 0, 0, 0
    for e in encoded:
        seen = []
        h = module.register_forward_hook(lambda mod, i, o: seen.append((i[0], o)))
        loss = example_loss(model, e)
        h.remove()
        (a, o), = seen
        gout, = torch.autograd.grad(loss, o, retain_graph=True)
        a, g = a[0].detach(), gout[0]
        if module.bias is not None:  # the bias as an input column of ones
            a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
        A = A + a.T @ a
        S = S + g.T @ g
        T += int(module.slots[1].sum()) if isinstance(module, RoutedLinear) else a.shape[0]
        grads = torch.autograd.grad(loss, [module.weight] + ([module.bias] if module.bias is not None else []))
        Gs.append(torch.cat([grads[0]] + [gb[:, None] for gb in grads[1:]], 1))
    return A / T, S / len(encoded), torch.stack(Gs)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt2", "falcon"])
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_factors_of_one_layer_match_explicit_construction(arch, kind, tok, encoded):
    """An expert's factors come from its own tokens (A normalised by their count); K-FAC's
    A and S and EK-FAC's eigenvalues equal the explicit ones."""
    model = build(arch, len(tok))
    linearize_model(model)
    modules = tracked_linear_modules(model)
    name = next(n for n in modules if n.endswith(("experts.1.down", "mlp.c_fc", "dense_h_to_4h")))
    cur = fit_curvature(model, modules, encoded, CurvatureSettings(kind=kind, damping=1e-3, batch_size=3),
                        pad_id=tok.pad_token_id)
    A, S, G = _explicit_pieces(model, modules[name], encoded)
    t = cur.tensors
    A_fit = t[f"{name}::QA"] @ torch.diag(t[f"{name}::lamA"]) @ t[f"{name}::QA"].T
    S_fit = t[f"{name}::QS"] @ torch.diag(t[f"{name}::lamS"]) @ t[f"{name}::QS"].T
    assert rel_err(A_fit, A) <= FACTOR_TOL
    assert rel_err(S_fit, S) <= FACTOR_TOL
    if kind == "ekfac":
        QA, QS = t[f"{name}::QA"], t[f"{name}::QS"]
        Lam = ((QS.T @ G @ QA) ** 2).mean(0)
        assert rel_err(t[f"{name}::Lambda"], Lam) <= FACTOR_TOL


@pytest.mark.parametrize("arch,targets", [("qwen3_moe", ["q_proj", "v_proj", "gate_up", "down"]),
                                          ("gpt2", ["c_attn", "c_fc"])])
def test_lora_on_two_architectures_matches_brute_force(arch, targets, tok, encoded):
    """LoRA on the linearised model (the experts' and Conv1D's linear maps among the
    targets): the tracked modules are the adapter's, and their scores match."""
    peft = pytest.importorskip("peft")
    model = build(arch, len(tok))
    linearize_model(model)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets,
                                                    lora_dropout=0.0))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.3)
    pm.eval()
    modules = tracked_linear_modules(pm)
    assert modules and all(".lora_" in n for n in modules)
    if arch == "qwen3_moe":
        assert any(".experts.3.down.lora_B" in n for n in modules)
    V = _random_direction(modules)
    got = score_encoded(pm, modules, encoded, V, pad_id=tok.pad_token_id, batch_size=3)
    ref = _reference_scores(pm, modules, encoded, V)
    assert rel_err(got, ref) <= REL_TOL


def test_summary_warns_when_most_of_a_block_is_untracked(tok):
    model = build("qwen3_moe", len(tok))
    linearize_model(model)
    modules = tracked_linear_modules(model, ["self_attn"])
    s = tracking_summary(model, modules)
    assert s["kinds"]["linear"]["modules"] == 4
    assert s["tracked_share"] < 0.5
    assert len(s["warnings"]) == 1 and "model.layers.0" in s["warnings"][0]
    full = tracking_summary(model, tracked_linear_modules(model))
    assert full["kinds"]["expert linear"]["modules"] == 8
    assert "Qwen3MoeTopKRouter.weight" in full["untracked_in_blocks"]


def test_memory_plan_counts_every_expert(tok):
    from prism_select.runtime.layers import layer_shape
    from prism_select.plan import ExampleSize, make_plan, stored_bytes

    model = build("qwen3_moe", len(tok))
    linearize_model(model)
    modules = tracked_linear_modules(model)
    plan = make_plan(model, modules, kind="ekfac", device="cuda", batch_size=8, fit_batch_size=8,
                     example=ExampleSize(1 << 20, 64, 100), gpu_total=100 << 30, weights=0,
                     host_available=1000 << 30)
    experts = [m for m in modules.values() if isinstance(m, RoutedLinear)]
    assert len(experts) == 2 * 4  # E = 4 experts of 2 linear maps, one block
    assert plan.fit["stored_bytes"] == sum(stored_bytes("ekfac", *layer_shape(m), 8) for m in modules.values())
    assert plan.fit["stored_bytes"] > sum(stored_bytes("ekfac", *layer_shape(m), 8) for m in experts) > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt2"])
def test_score_runs_a_saved_model_with_experts_and_conv1d_in_float64(arch, tok, tmp_path):
    """Through load_model and score_pool: the saved model's fused experts (whose fused
    forward refuses float64) and Conv1D layers are tracked, and run.json says so."""
    from prism_select.examples import make_example
    from prism_select.model import ModelSettings
    from prism_select.run import score_pool
    from prism_select.settings import ScoreSettings

    model = build(arch, len(tok)).float()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    pool, targets = make_example(tmp_path / "data", n_pool=6, n_pairs=2)
    ms = ModelSettings(model=str(tmp_path / "model"), dtype="float64", device="cpu",
                       cache_dir=str(tmp_path / "cache"))
    run = score_pool(ms, pool, targets, tmp_path / "run", ScoreSettings(max_length=64, batch_size=3, progress=False),
                     CurvatureSettings(kind="ekfac", damping_rule="heuristic"))
    kinds = run["tracking"]["kinds"]
    if arch == "qwen3_moe":
        assert kinds["expert linear"]["modules"] == 8
        assert any(".mlp.experts.3.down" in n for n in run["tracked_modules"])
        assert run["model"]["linearized"]["experts"] == 4
    else:
        assert kinds["linear (Conv1D)"]["modules"] == 4
        assert run["model"]["linearized"]["conv1d"] == 4
    assert not any("untracked" in w for w in run["warnings"])
    assert run["counts"]["pool"] == 6


def test_expert_layers_in_the_hook_routes(tok, encoded):
    """The hook-based scorer (``impl="hooks"``) and the per-example gradients of the
    activation taps (LESS's) see each expert's tokens at its slots, padding masked."""
    from prism_select.gradients import Taps, activation_grad_mode
    from prism_select.data.tokenize import collate
    from prism_select.engine import batch_losses, causal_only

    model = build("qwen3_moe", len(tok))
    linearize_model(model)
    modules = tracked_linear_modules(model)
    V = _random_direction(modules)
    got = score_encoded(model, modules, encoded, V, pad_id=tok.pad_token_id, batch_size=3, impl="hooks")
    assert rel_err(got, _reference_scores(model, modules, encoded, V)) <= REL_TOL
    name = "model.layers.0.mlp.experts.2.down"
    b = collate(encoded, tok.pad_token_id, torch.device("cpu"))
    with activation_grad_mode(model), Taps({name: modules[name]}) as taps:
        taps.mask = b["attention_mask"]
        losses, _ = batch_losses(model, causal_only(b))
        losses.sum().backward()
        G = taps.per_example_grads(name)
    ref = torch.stack([torch.autograd.grad(example_loss(model, e), modules[name].weight)[0] for e in encoded])
    assert rel_err(G, ref) <= REL_TOL


def test_cuda_graphs_are_off_for_expert_layers(tok):
    from prism_select.errors import ConfigError
    from prism_select.runtime.graphs import graphs_wanted

    model = build("mixtral", len(tok))
    assert graphs_wanted("auto", "cuda", model)
    linearize_model(model)
    assert not graphs_wanted("auto", "cuda", model)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        graphs_wanted("on", "cuda", model)


def test_an_adapter_on_fused_expert_parameters_keeps_them_fused_and_says_so(tok, tmp_path):
    """PEFT's LoRA on raw parameters (``target_parameters``) addresses the fused experts by
    name: they stay fused, its LoRA matrices there (a weight delta, never applied to the
    tokens) are not tracked, and the summary says so; the LoRA on q_proj is tracked."""
    peft = pytest.importorskip("peft")
    from prism_select.model import ModelSettings, load_model

    model = build("qwen3_moe", len(tok)).float()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"],
                                                    target_parameters=["mlp.experts.gate_up_proj"]))
    pm.save_pretrained(tmp_path / "adapter")
    lm = load_model(ModelSettings(model=str(tmp_path / "model"), adapter=str(tmp_path / "adapter"), dtype="float32",
                                  device="cpu", cache_dir=str(tmp_path / "cache")))
    modules = tracked_linear_modules(lm.model)
    assert sorted(n.rsplit(".", 3)[-3] for n in modules) == ["q_proj", "q_proj"]
    assert "skipped" in lm.source["linearized"]
    s = tracking_summary(lm.model, modules)
    assert "target_parameters" in s["note"] and s["warnings"] == []


#: exact scores of a bf16 expert model under ``--precision split32`` against float64
#: arithmetic on the same (bf16-rounded) weights: measured 1.3e-3 - 8.6e-3 relative error
#: over qwen3_moe / mixtral / olmoe / qwen2_moe x 3 seeds, against 4.0e-3 - 0.32 for the
#: plain bf16 route (CPU, 2026-12-08)
MOE_SPLIT_SCORE_TOL = 2e-2
#: ``residual32`` on these tiny models: 3.8e-3 - 4.9e-2 (no gain is claimed here; as for
#: dense models its effect on scores is measured on real ones, tests/test_precision.py)
MOE_RESIDUAL_SCORE_TOL = 1e-1


def _bf16_and_its_float64_twin(arch, vocab, seed):
    """The linearized model in bf16, and the same model in float64 holding the bf16
    weights (built twice: a deep copy would keep the first one's block hooks)."""
    half = build(arch, vocab, seed=seed)
    linearize_model(half)
    half = half.to(torch.bfloat16)
    ref = build(arch, vocab, seed=seed)
    linearize_model(ref)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).double())
    return half, ref


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_half_precision_policies_score_expert_layers(arch, tok, encoded):
    """``residual32`` and ``split32`` reach the routers with float32 hidden states: the
    routers compute in float32 (no dtype clash with their bf16 weights), and split32's
    scores are closer to float64 arithmetic on the same weights than bf16's."""
    from prism_select.data.tokenize import collate
    from prism_select.runtime.execution import ExecutionContext
    from prism_select.scoring import make_scorer

    half, ref = _bf16_and_its_float64_twin(arch, len(tok), seed=0)
    mods = tracked_linear_modules(ref)
    V = {n: v.to(torch.bfloat16).double() for n, v in _random_direction(mods).items()}
    want = _reference_scores(ref, mods, encoded, V)
    batch = collate(encoded, tok.pad_token_id, torch.device("cpu"))
    err = {}
    for precision in ("model", "residual32", "split32"):
        with make_scorer(half, tracked_linear_modules(half), V,
                         execution=ExecutionContext.of(half, precision=precision)) as sc:
            got = sc.score(batch).double()
        assert torch.isfinite(got).all(), precision
        err[precision] = rel_err(got, want)
    assert err["split32"] <= MOE_SPLIT_SCORE_TOL and err["split32"] < err["model"], err
    assert err["residual32"] <= MOE_RESIDUAL_SCORE_TOL, err
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())  # the routers' weights restored


@pytest.mark.parametrize("precision", ["residual32", "split32"])
def test_score_runs_a_bf16_expert_model_under_each_precision(precision, tok, tmp_path):
    """Through load_model and score_pool at bf16: the target direction, the EK-FAC fit and
    the scores of an expert model under ``--precision``: finite, the precision recorded."""
    from prism_select.examples import make_example
    from prism_select.model import ModelSettings
    from prism_select.run import score_pool
    from prism_select.settings import ScoreSettings

    build("qwen3_moe", len(tok)).float().save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    pool, targets = make_example(tmp_path / "data", n_pool=6, n_pairs=2)
    ms = ModelSettings(model=str(tmp_path / "model"), dtype="bfloat16", device="cpu",
                       cache_dir=str(tmp_path / "cache"))
    run = score_pool(ms, pool, targets, tmp_path / "run",
                     ScoreSettings(max_length=64, batch_size=3, progress=False, precision=precision),
                     CurvatureSettings(kind="ekfac", damping_rule="heuristic"))
    assert run["tracking"]["kinds"]["expert linear"]["modules"] == 8
    assert json.dumps(run).count(f'"{precision}"') >= 1  # the run records the precision it ran
    scores = [json.loads(line)["score"] for line in (tmp_path / "run" / "scores.jsonl").read_text().splitlines()]
    assert len(scores) == 6 and all(math.isfinite(s) for s in scores)
