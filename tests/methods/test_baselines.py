"""Baselines against brute-force float64 references on the tiny Llama (see test_numerics.py).

References compute hidden states with forward hooks on the decoder blocks (not
``output_hidden_states``) and gradients with explicit autograd per example / per token.
"""

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from prism_select.methods import describe_methods, get
from prism_select.methods import generation as gen_mod
from prism_select.run.compare import compare, options_for
from prism_select.methods.ifguide import contrastive_target, ifguide_rank, ifguide_threshold, token_scores
from prism_select.curvature import CurvatureSettings
from prism_select.data.records import PoolExample, TargetPair
from prism_select.data.tokenize import Encoded, encode
from prism_select.errors import ConfigError, InputError, OutputError
from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
from prism_select.run import Inputs, RunContext, score_pool
from prism_select.settings import ScoreSettings
from prism_select.selection import read_scores

from reference import example_loss, flat_grad, flatten, per_example_grads

REL_TOL = 1e-8  # float64 end to end: only summation order differs
LAYER = 1  # hidden_states[1] = output of decoder block 0 of the 2-layer tiny model


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# --------------------------------------------------------------------------- fixtures

@pytest.fixture
def lm(model, tok, tmp_path):
    settings = ModelSettings(model="tiny-test", device="cpu", cache_dir=str(tmp_path / "cache"))
    return LoadedModel(model, tok, settings, model_fingerprint(model), {"kind": "test"})


@pytest.fixture
def make_ctx(lm, modules, tok, tmp_path, pool_examples, pair_examples):
    """A RunContext built directly (no files), identity curvature by default."""
    counter = [0]

    def make(method, options=None, curvature="identity", seed=0, with_pairs=True, damping_rule="auto"):
        counter[0] += 1
        pool = [PoolExample(f"p{i}", p, r, i) for i, (p, r) in enumerate(pool_examples)]
        pairs = [TargetPair(f"q{i}", q, c, r, i) for i, (q, c, r) in enumerate(pair_examples)] if with_pairs else []
        inputs = Inputs(pool=pool, encoded=[encode(tok, e.prompt, e.response) for e in pool], pairs=pairs,
                        chosen=[encode(tok, p.prompt, p.chosen) for p in pairs],
                        rejected=[encode(tok, p.prompt, p.rejected) for p in pairs],
                        invalid=[], truncated={"pool": 0, "targets": 0})
        settings = ScoreSettings(method=method, batch_size=3, progress=False, seed=seed,
                                 method_options=dict(options or {}))
        return RunContext(lm, modules, inputs, settings, CurvatureSettings(kind=curvature, damping_rule=damping_rule),
                          tmp_path / f"run{counter[0]}")
    return make


def block_hidden(model, enc: Encoded, layer: int) -> torch.Tensor:
    """Reference h_l(x, y): output of decoder block ``layer - 1`` by a hook, averaged
    over the response positions, one example at a time, with the graph."""
    caught = []
    h = model.model.layers[layer - 1].register_forward_hook(
        lambda mod, i, o: caught.append(o[0] if isinstance(o, tuple) else o))
    model(input_ids=torch.tensor([enc.input_ids]))
    h.remove()
    return caught[0][0, enc.response_start:].mean(0)


def ref_concept(model, ctx, layer=LAYER):
    hc = torch.stack([block_hidden(model, e, layer) for e in ctx.inputs.chosen]).detach()
    hr = torch.stack([block_hidden(model, e, layer) for e in ctx.inputs.rejected]).detach()
    v = hc.mean(0) - hr.mean(0)
    return v, v / v.norm()


def flat_grad_kept(modules, loss):
    """flat_grad keeping the graph (several token terms share one forward); a layer the
    loss does not use gets zeros."""
    params = [m.weight for m in modules.values()]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)])


def token_loss_terms(model, enc: Encoded) -> list:
    logits = model(input_ids=torch.tensor([enc.input_ids])).logits[0]
    lp = torch.log_softmax(logits, -1)
    return [-lp[t - 1, enc.input_ids[t]] for t in range(enc.response_start, len(enc.input_ids))]


# --------------------------------------------------------------------------- registry

def test_registry_and_descriptions():
    for name in ("random", "ifguide", "vecfilter", "projdiff", "conceptinf", "saefeat"):
        assert callable(get(name).fn)
    d = describe_methods()
    assert list(d)[:3] == ["prism", "equal", "unpaired"]
    assert all(isinstance(t, str) and t and "\n" not in t for t in d.values())


def test_unknown_option_is_config_error(make_ctx):
    with pytest.raises(ConfigError, match="no option"):
        get("vecfilter").fn(make_ctx("vecfilter", {"layr": 1}))


# --------------------------------------------------------------------------- random

def test_random_is_seeded_and_reproducible(make_ctx):
    s1, rows = get("random").fn(make_ctx("random", seed=3))
    s2, _ = get("random").fn(make_ctx("random", seed=3))
    s3, _ = get("random").fn(make_ctx("random", seed=4))
    assert rows == [] and s1.dtype == torch.float64 and len(s1) == 8
    assert torch.equal(s1, s2) and not torch.equal(s1, s3)
    assert torch.equal(s1, torch.rand(8, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    assert bool(((s1 >= 0) & (s1 < 1)).all())


# --------------------------------------------------------------------------- IF-Guide

def test_ifguide_rank_on_hand_made_token_scores():
    ts = [torch.tensor([1.0, 5, 2]), torch.tensor([6.0, 0]), torch.tensor([3.0]), torch.tensor([7.0, 8])]
    # all tokens sorted: 0 1 2 3 5 6 7 8; the 0.5 quantile (linear) is 3 + 0.5 * (5 - 3) = 4
    assert ifguide_threshold(ts, 0.5) == pytest.approx(4.0)
    # above tau: doc0 {5}, doc1 {6}, doc2 {}, doc3 {7, 8}: s = 1 1 0 2 -> .5 .5 0 1 ; f = 5 6 0 15 -> /15
    s = [0.5, 0.5, 0.0, 1.0]
    f = [5 / 15, 6 / 15, 0.0, 1.0]
    expect = [2 * a * b / (a + b) if a + b > 0 else 0.0 for a, b in zip(s, f)]
    got = ifguide_rank(ts, 0.5, "harmonic")
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(expect, rel=1e-12)
    assert got.tolist() == pytest.approx([0.4, 0.4 / 0.9, 0.0, 1.0], rel=1e-12)
    assert ifguide_rank(ts, 0.5, "sum").tolist() == [8.0, 6.0, 3.0, 15.0]
    # every document alike: both statistics normalise to 0, so every R is 0
    assert ifguide_rank([torch.tensor([1.0, 2.0])] * 3, 0.5).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError):
        ifguide_rank(ts, 1.5)
    with pytest.raises(ConfigError):
        ifguide_rank(ts, 0.5, "median")


def _ifguide_reference_target(model, modules, ctx):
    Q = len(ctx.inputs.chosen)
    return (sum(flat_grad(model, modules, example_loss(model, c)) for c in ctx.inputs.chosen) / Q
            - sum(flat_grad(model, modules, example_loss(model, r)) for r in ctx.inputs.rejected) / Q)


def test_ifguide_loss_term_token_scores_equal_explicit_per_token_gradients(model, modules, tok, make_ctx):
    ctx = make_ctx("ifguide")
    g, lc, lr = contrastive_target(model, modules, ctx.inputs.chosen, ctx.inputs.rejected,
                                   pad_id=tok.pad_token_id, batch_size=2)
    ref_g = _ifguide_reference_target(model, modules, ctx)
    assert rel_err(flatten(g, modules), ref_g) <= REL_TOL
    assert lc.tolist() == pytest.approx([float(example_loss(model, c).detach()) for c in ctx.inputs.chosen], rel=REL_TOL)
    # identity curvature: V = g; token_chunk 5 exercises several batched backwards per batch
    got = token_scores(model, modules, ctx.inputs.encoded, g, pad_id=tok.pad_token_id, attribution="loss",
                       batch_size=3, token_chunk=5)
    ref = []
    for e in ctx.inputs.encoded:
        ref.append(torch.stack([flat_grad_kept(modules, lt) @ ref_g for lt in token_loss_terms(model, e)]))
    assert [len(t) for t in got] == [e.n_response for e in ctx.inputs.encoded]
    assert rel_err(torch.cat(got), torch.cat(ref)) <= REL_TOL
    # the token terms add up to the summed-loss influence g_z . g
    G = per_example_grads(model, modules, ctx.inputs.encoded)
    assert rel_err(torch.stack([t.sum() for t in got]), G @ ref_g) <= REL_TOL


def test_ifguide_position_token_scores_equal_explicit_decomposition(model, modules, tok, make_ctx):
    ctx = make_ctx("ifguide")
    g, _, _ = contrastive_target(model, modules, ctx.inputs.chosen, ctx.inputs.rejected, pad_id=tok.pad_token_id)
    got = token_scores(model, modules, ctx.inputs.encoded, g, pad_id=tok.pad_token_id, attribution="position",
                       batch_size=3)
    for e, t in zip(ctx.inputs.encoded[:3], got[:3]):
        # explicit: b_t = dl(z)/do_t by autograd on each layer's output, a_t its input
        ins, outs = {}, {}
        def grab(n):
            def hook(mod, i, o):
                ins[n], outs[n] = i[0], o
            return hook
        hs = [m.register_forward_hook(grab(n)) for n, m in modules.items()]
        loss = example_loss(model, e)
        for h in hs:
            h.remove()
        names = list(modules)
        bs = torch.autograd.grad(loss, [outs[n] for n in names])
        ref = sum(((b[0] @ g[n]) * ins[n][0]).sum(-1) for n, b in zip(names, bs))
        assert len(t) == len(e.input_ids)
        assert rel_err(t, ref.detach()) <= REL_TOL
    G = per_example_grads(model, modules, ctx.inputs.encoded)
    assert rel_err(torch.stack([t.sum() for t in got]), G @ flatten(g, modules)) <= REL_TOL


def test_ifguide_target_and_position_scores_run_the_head_at_response_positions_only(model, modules, tok,
                                                                                    make_ctx):
    """On the CPU the target's and the position scores' losses form logits at the response
    positions only (the fused loss of the split decoder and head), not at every position
    through the head module; the numbers themselves are checked against explicit
    gradients above."""
    ctx = make_ctx("ifguide")
    head_rows = []
    h = model.get_output_embeddings().register_forward_hook(lambda mod, i, o: head_rows.append(i[0].shape))
    try:
        V, _, _ = contrastive_target(model, modules, ctx.inputs.chosen, ctx.inputs.rejected, pad_id=tok.pad_token_id)
        got = token_scores(model, modules, ctx.inputs.encoded, V, pad_id=tok.pad_token_id, attribution="position",
                           batch_size=3)
    finally:
        h.remove()
    assert head_rows == []
    assert len(got) == len(ctx.inputs.encoded) and all(torch.isfinite(t).all() for t in got)


def test_ifguide_token_scores_hand_the_heap_back_after_each_batch(model, modules, tok, make_ctx, monkeypatch):
    """On the CPU the token scores trim the heap after every batch: each batch leaves small
    score tensors between the pages its activations came from, and untrimmed the heap crept
    ~150 MiB over a 1,000-record pool inside a `compare`."""
    from prism_select.methods import ifguide as ifguide_mod
    ctx = make_ctx("ifguide")
    g, _, _ = contrastive_target(model, modules, ctx.inputs.chosen, ctx.inputs.rejected, pad_id=tok.pad_token_id)
    done, trims = [], []
    scores = ifguide_mod._position_scores
    monkeypatch.setattr(ifguide_mod, "_position_scores", lambda *a: done.append(1) or scores(*a))
    monkeypatch.setattr(ifguide_mod, "release_host_memory", lambda *device: trims.append(len(done)))
    token_scores(model, modules, ctx.inputs.encoded, g, pad_id=tok.pad_token_id, attribution="position", batch_size=2)
    assert len(done) >= 2 and trims == list(range(1, len(done) + 1))


def test_ifguide_method_rankings(model, modules, tok, make_ctx):
    ctx = make_ctx("ifguide", {"ranking": "harmonic", "quantile": 0.9, "token_attribution": "loss"})
    scores, rows = get("ifguide").fn(ctx)
    g, _, _ = contrastive_target(model, modules, ctx.inputs.chosen, ctx.inputs.rejected, pad_id=tok.pad_token_id)
    ts = token_scores(model, modules, ctx.inputs.encoded, g, pad_id=tok.pad_token_id, attribution="loss")
    assert torch.allclose(scores, ifguide_rank(ts, 0.9, "harmonic"), rtol=1e-9, atol=1e-12)
    assert ctx.info["method"]["options"]["token_attribution"] == "loss"
    assert ctx.info["method"]["tau"] == pytest.approx(ifguide_threshold(ts, 0.9), rel=1e-9)
    assert [r["id"] for r in rows] == ["q0", "q1", "q2"]
    # "sum" = summed-loss influence g_z . H^-1 g through the shared score loop
    ctx2 = make_ctx("ifguide", {"ranking": "sum"})
    s2, _ = get("ifguide").fn(ctx2)
    ref = per_example_grads(model, modules, ctx.inputs.encoded) @ _ifguide_reference_target(model, modules, ctx)
    assert rel_err(s2, ref) <= REL_TOL
    # the harmonic run's token_sum column is the score "sum" gives, from the token scores
    assert "token_sum" not in ctx2.columns
    assert rel_err(ctx.columns["token_sum"], ref) <= REL_TOL
    with pytest.raises(ConfigError):
        get("ifguide").fn(make_ctx("ifguide", {"ranking": "mean"}))


def test_ifguide_passes_run_at_the_memory_plans_batches(model, modules, tok, make_ctx, monkeypatch):
    """IF-Guide's target pairs and token scores run at the memory plan's batches, not the
    settings': under a capped plan (many runs sharing one GPU) the settings' batch of
    token scores (every position's logits, their softmax and gradient) ran out of the cap
    while PRISM's scoring, at the plan's batch, fitted. The scores do not depend on it."""
    from prism_select.methods import ifguide as ifguide_mod
    from prism_select.plan import HEADROOM_BYTES, ExampleSize, make_plan
    example = 1 << 26  # per example; the settings' batch of 3 does not fit, 1 does
    plan = make_plan(model, modules, kind="identity", device="cuda", batch_size=3, fit_batch_size=3,
                     example=ExampleSize(example, 64, 100), gpu_total=HEADROOM_BYTES + int(1.5 * example * 1.25),
                     weights=0, host_available=1 << 40)
    assert plan.scoring["batch_size"] == 1 and plan.direction["batch_size"] == 1
    seen = {}
    target, scores_of = ifguide_mod.contrastive_target, ifguide_mod.token_scores
    monkeypatch.setattr(ifguide_mod, "contrastive_target",
                        lambda *a, **k: seen.setdefault("target", k["batch_size"]) and target(*a, **k))
    monkeypatch.setattr(ifguide_mod, "token_scores",
                        lambda *a, **k: seen.setdefault("tokens", k["batch_size"]) and scores_of(*a, **k))
    unplanned, _ = get("ifguide").fn(make_ctx("ifguide", {"ranking": "harmonic"}))
    assert seen == {"target": 3, "tokens": 3}
    seen.clear()
    monkeypatch.setattr(RunContext, "plan", property(lambda self: plan))
    planned, _ = get("ifguide").fn(make_ctx("ifguide", {"ranking": "harmonic"}))
    assert seen == {"target": 1, "tokens": 1}
    assert torch.allclose(planned, unplanned, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("disk", ["writable", "full"])
def test_last_use_fits_with_the_direction_on_disk_and_frees_the_curvature(modules, make_ctx, monkeypatch, disk):
    """``RunContext.last_use``: the caller's direction is out of memory while the curvature
    is fitted (a full disk: it stays, and the result is the same), the run's curvature is
    dropped, and ``v`` equals preconditioning with the kept curvature. Under the heuristic
    damping rule: a small fit's split-half check scores the direction, so it is held then."""
    import errno
    import tempfile

    from prism_select.run import curvature_provider
    g = {n: torch.randn(m.weight.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
         for i, (n, m) in enumerate(modules.items())}
    given = dict(g)
    held_during_fit = []
    real = curvature_provider.load_or_fit_curvature

    def spy(*a, **kw):
        held_during_fit.append(len(given))
        return real(*a, **kw)

    monkeypatch.setattr(curvature_provider, "load_or_fit_curvature", spy)
    if disk == "full":
        def refuse(**kw):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    ctx = make_ctx("prism", curvature="ekfac", damping_rule="heuristic")
    v = ctx.last_use(given)
    assert held_during_fit == [0 if disk == "writable" else len(g)]
    assert given == {} and ctx.curvatures._curvature is None
    ref = make_ctx("prism", curvature="ekfac", damping_rule="heuristic").curvature().precondition(dict(g))  # cached
    assert list(v) == list(ref) and all(torch.equal(v[n], ref[n]) for n in ref)


def test_cpu_direction_holds_one_half_of_a_batch_at_a_time(make_ctx, monkeypatch):
    """On the CPU the direction differentiates the chosen and the rejected half each with
    its own forward (``one_graph``): both halves' activations alive at once were the
    stage's host-memory peak."""
    from prism_select.methods import prism
    seen = []
    real = prism.compute_preference

    def spy(*a, **kw):
        seen.append(kw.get("one_graph"))
        return real(*a, **kw)

    monkeypatch.setattr(prism, "compute_preference", spy)
    ctx = make_ctx("prism")
    assert ctx.lm.device.type == "cpu"
    prism.prism_method(ctx)
    assert seen == [True]


# --------------------------------------------------------------------------- concept methods

def test_vecfilter_matches_explicit_hidden_states(model, make_ctx):
    ctx = make_ctx("vecfilter", {"layer": LAYER})
    scores, rows = get("vecfilter").fn(ctx)
    v, vhat = ref_concept(model, ctx)
    H = torch.stack([block_hidden(model, e, LAYER) for e in ctx.inputs.encoded]).detach()
    assert rel_err(scores, H @ vhat) <= REL_TOL
    assert rows[0]["proj_chosen"] == pytest.approx(float(block_hidden(model, ctx.inputs.chosen[0], LAYER).detach() @ vhat),
                                                   rel=REL_TOL)
    cos, _ = get("vecfilter").fn(make_ctx("vecfilter", {"layer": LAYER, "similarity": "cosine"}))
    assert rel_err(cos, (H @ v) / (H.norm(dim=1) * v.norm())) <= REL_TOL
    # default layer: round(2/3 * 2) = 1
    ctx_d = make_ctx("vecfilter")
    get("vecfilter").fn(ctx_d)
    assert ctx_d.info["method"]["options"]["layer"] == 1
    with pytest.raises(ConfigError):
        get("vecfilter").fn(make_ctx("vecfilter", {"layer": 3}))


def test_projdiff_with_given_responses(model, tok, make_ctx, pool_examples):
    own = [f"I think {i}." for i in range(len(pool_examples))]
    ctx = make_ctx("projdiff", {"layer": LAYER, "responses": own})
    scores, _ = get("projdiff").fn(ctx)
    _, vhat = ref_concept(model, ctx)
    ref = torch.stack([(block_hidden(model, e, LAYER) - block_hidden(model, encode(tok, p, y), LAYER)) @ vhat
                       for e, (p, _), y in zip(ctx.inputs.encoded, pool_examples, own)]).detach()
    assert rel_err(scores, ref) <= REL_TOL
    # a mapping id -> text gives the same
    s2, _ = get("projdiff").fn(make_ctx("projdiff", {"layer": LAYER,
                                                       "responses": {f"p{i}": y for i, y in enumerate(own)}}))
    assert torch.equal(scores, s2)
    with pytest.raises(ConfigError):
        get("projdiff").fn(make_ctx("projdiff", {"responses": own[:3]}))


def test_draw_tokens_samples_each_row_from_its_own_distribution_and_generator():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    n = 20000
    gens = [torch.Generator().manual_seed(k) for k in range(n)]
    counts = torch.bincount(torch.tensor(gen_mod.draw_tokens(probs[:1].expand(n, 4), gens)), minlength=4)
    freq = counts.double() / n
    # binomial standard error at n = 20000 is at most 0.0036: 5 of them
    assert counts[1] == 0 and torch.allclose(freq, probs[0], atol=0.018)
    assert gen_mod.draw_tokens(probs[1:], [torch.Generator().manual_seed(3)]) == [3]
    # a row's token depends on its own generator only, not on the other rows of the batch
    alone = gen_mod.draw_tokens(probs[:1], [torch.Generator().manual_seed(7)])
    batch = gen_mod.draw_tokens(probs[[1, 0]], [torch.Generator().manual_seed(1), torch.Generator().manual_seed(7)])
    assert batch[1] == alone[0]
    # the same as drawing u from the generator and walking the cumulative distribution
    u = float(torch.rand((), generator=torch.Generator().manual_seed(7), dtype=torch.float64))
    assert alone[0] == next(k for k, c in enumerate(torch.cumsum(probs[0], 0).tolist()) if c > u)


def test_projdiff_samples_caches_and_reuses_own_responses(model, tok, lm, make_ctx, monkeypatch):
    ctx = make_ctx("projdiff", {"layer": LAYER, "max_new_tokens": 4})
    s1, _ = get("projdiff").fn(ctx)
    info = ctx.info["method"]["own_responses"]
    assert info["generated"] == 8 and info["reused"] == 0
    path = gen_mod.cache_path(lm.settings.resolved_cache_dir(), lm.fingerprint)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(recs) == 8 and all(r["n_tokens"] <= 4 for r in recs)
    # reused only when the key matches: same settings -> no sampling at all
    calls = []
    real = gen_mod.sample_responses
    monkeypatch.setattr(gen_mod, "sample_responses", lambda *a, **k: calls.append(1) or real(*a, **k))
    ctx2 = make_ctx("projdiff", {"layer": LAYER, "max_new_tokens": 4})
    s2, _ = get("projdiff").fn(ctx2)
    assert torch.equal(s1, s2) and calls == [] and ctx2.info["method"]["own_responses"]["reused"] == 8
    # the scores are those of the cached texts
    by_prompt = {r["prompt_sha"]: r["response"] for r in recs}  # the cache is in sampling order
    from prism_select.io import sha256_json
    texts = [by_prompt[sha256_json(list(e.input_ids[: e.response_start]))] for e in ctx.inputs.encoded]
    s3, _ = get("projdiff").fn(make_ctx("projdiff", {"layer": LAYER, "responses": texts}))
    assert torch.allclose(s1, s3, rtol=1e-12, atol=0)
    # other generation settings -> sampled again; the same settings from scratch -> the same texts
    ctx3 = make_ctx("projdiff", {"layer": LAYER, "max_new_tokens": 3})
    get("projdiff").fn(ctx3)
    assert calls and ctx3.info["method"]["own_responses"]["generated"] == 8
    # the responses are one entry of the cache: listed, and pruned under a size bound
    from prism_select import cache
    root = Path(lm.settings.resolved_cache_dir())
    listed = [e for e in cache.entries(root) if e.kind == "generations"]
    assert [e.path for e in listed] == [path.parent] and listed[0].complete
    assert listed[0].size > path.stat().st_size  # the responses and the marker
    cache.prune(root, max_bytes=0, keep=[e.path for e in cache.entries(root) if e.kind != "generations"])
    assert not path.parent.exists()  # sampled again below, from scratch
    s4, _ = get("projdiff").fn(make_ctx("projdiff", {"layer": LAYER, "max_new_tokens": 4}))
    assert torch.equal(s1, s4)


def test_conceptinf_equals_explicit_gradient_of_the_concept_projection(model, modules, make_ctx):
    ctx = make_ctx("conceptinf", {"layer": LAYER})
    scores, rows = get("conceptinf").fn(ctx)
    _, vhat = ref_concept(model, ctx)
    f = sum(block_hidden(model, c, LAYER) @ vhat for c in ctx.inputs.chosen) / len(ctx.inputs.chosen)
    grad_f = flat_grad_kept(modules, f)
    G = per_example_grads(model, modules, ctx.inputs.encoded)
    assert rel_err(scores, G @ (-grad_f)) <= REL_TOL
    assert ctx.info["method"]["f"] == pytest.approx(float(f.detach()), rel=REL_TOL)
    assert len(rows) == 3


def test_conceptinf_sign_first_order(model, modules, make_ctx):
    """A small step that upweights the top-scored example raises f more than the bottom one."""
    ctx = make_ctx("conceptinf", {"layer": LAYER})
    scores, _ = get("conceptinf").fn(ctx)
    _, vhat = ref_concept(model, ctx)

    def f_after(i, eps=1e-4):
        g = flat_grad(model, modules, example_loss(model, ctx.inputs.encoded[i]))
        params = [m.weight for m in modules.values()]
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            k = 0
            for p in params:
                p -= eps * g[k:k + p.numel()].view_as(p)
                k += p.numel()
            val = float(sum(block_hidden(model, c, LAYER) @ vhat for c in ctx.inputs.chosen))
            for p, s in zip(params, saved):
                p.copy_(s)
        return val

    with torch.no_grad():
        base = float(sum(block_hidden(model, c, LAYER) @ vhat for c in ctx.inputs.chosen))
    top, bottom = int(scores.argmax()), int(scores.argmin())
    assert f_after(top) - base > 0 > f_after(bottom) - base


# --------------------------------------------------------------------------- SAE-Feat

def _sae(path, d_model=16, d_sae=12, layer=LAYER, threshold=True, seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    t = {"W_enc": torch.randn(d_model, d_sae, generator=g, dtype=torch.float64),
         "b_enc": 0.1 * torch.randn(d_sae, generator=g, dtype=torch.float64),
         "b_dec": 0.1 * torch.randn(d_model, generator=g, dtype=torch.float64)}
    if threshold:
        t["threshold"] = 0.2 * torch.rand(d_sae, generator=g, dtype=torch.float64)
    t.update(extra)
    save_file(t, str(path), metadata=None if layer is None else {"layer": str(layer)})
    return t


def _ref_acts(model, t, enc, reduce="mean"):
    caught = []
    h = model.model.layers[LAYER - 1].register_forward_hook(lambda mod, i, o: caught.append(o))
    with torch.no_grad():
        model(input_ids=torch.tensor([enc.input_ids]))
    h.remove()
    hs = caught[0][0, enc.response_start:]
    rows = []
    for x in hs:  # token by token
        pre = (x - t["b_dec"]) @ t["W_enc"] + t["b_enc"]
        act = torch.clamp(pre, min=0)
        if "threshold" in t:
            act = torch.where(pre > t["threshold"], act, torch.zeros_like(act))
        rows.append(act)
    a = torch.stack(rows)
    return a.mean(0) if reduce == "mean" else a.max(0).values


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_saefeat_latent_choice_and_scores(model, make_ctx, tmp_path, reduce):
    t = _sae(tmp_path / "sae.safetensors")
    ctx = make_ctx("saefeat", {"sae": str(tmp_path / "sae.safetensors"), "reduce": reduce})
    scores, rows = get("saefeat").fn(ctx)
    ac = torch.stack([_ref_acts(model, t, e, reduce) for e in ctx.inputs.chosen]).mean(0)
    ar = torch.stack([_ref_acts(model, t, e, reduce) for e in ctx.inputs.rejected]).mean(0)
    k = int(torch.argmax(ac - ar))
    assert ctx.info["method"]["options"]["latent"] == k
    assert ctx.info["method"]["layer_from"] == "metadata"
    ref = torch.stack([_ref_acts(model, t, e, reduce)[k] for e in ctx.inputs.encoded])
    assert torch.allclose(scores, ref, rtol=1e-10, atol=1e-12)
    # an explicit latent and layer; no target pairs needed then
    ctx2 = make_ctx("saefeat", {"sae": str(tmp_path / "sae.safetensors"), "latent": 3, "layer": LAYER,
                                "reduce": reduce}, with_pairs=False)
    s2, rows2 = get("saefeat").fn(ctx2)
    assert rows2 == []
    ref2 = torch.stack([_ref_acts(model, t, e, reduce)[3] for e in ctx.inputs.encoded])
    assert torch.allclose(s2, ref2, rtol=1e-10, atol=1e-12)


#: a fitted SAE of a 2-sparse code over a 24-atom dictionary leaves at most this fraction
#: of the variance unexplained (it reaches about 0.01-0.03)
SAE_FIT_MAX_FVU = 0.1


def _sparse_rows(n=3000, d=16, atoms=24, active=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(atoms, d, generator=g, dtype=torch.float64)
    D /= D.norm(dim=1, keepdim=True)
    codes = torch.zeros(n, atoms, dtype=torch.float64)
    for i in range(n):
        idx = torch.randperm(atoms, generator=g)[:active]
        codes[i, idx] = 1 + torch.rand(active, generator=g, dtype=torch.float64)
    return 3.0 * (codes @ D) + 0.5  # an offset and a scale the fit must absorb


def test_fit_sae_reconstructs_a_sparse_code_and_saves_in_input_units(tmp_path):
    from prism_select.methods.saefeat import SAE, fit_sae, load_sae, save_sae
    X = _sparse_rows()
    # a few "massive activation" rows (a first token's): left out of the fit
    huge = 1000.0 * torch.ones(5, X.shape[1], dtype=X.dtype)
    tensors, stats = fit_sae(torch.cat([huge, X]), d_sae=48, l1=0.5, steps=1500, batch_tokens=512, lr=3e-3)
    assert stats["outliers"] == 5 and stats["tokens"] == len(X)
    assert stats["fvu"] < SAE_FIT_MAX_FVU
    assert 0 < stats["l0"] < X.shape[1] / 2  # sparse: about 6 latents a row for a 2-sparse code
    # the saved tensors act on unscaled inputs: encode, decode, the fit's own fvu (every
    # row is in its evaluation sample here)
    save_sae(tmp_path / "fit.safetensors", tensors, layer=LAYER)
    loaded, meta = load_sae(tmp_path / "fit.safetensors", d_model=16)
    assert meta["layer"] == str(LAYER)
    f = SAE(loaded, "cpu", torch.float64).encode(X)
    Xh = f @ tensors["W_dec"] + tensors["b_dec"]
    fvu = float((X - Xh).pow(2).sum() / (X - X.mean(0)).pow(2).sum())
    assert math.isclose(fvu, stats["fvu"], rel_tol=1e-9)
    assert math.isclose(float((f > 0).sum(1).double().mean()), stats["l0"], rel_tol=1e-12)


def test_saefeat_fits_an_sae_on_the_pool(model, make_ctx, tmp_path):
    from prism_select.methods.saefeat import save_sae
    ctx = make_ctx("saefeat", {"sae": "pool", "sae_width": 32, "sae_steps": 200})
    scores, rows = get("saefeat").fn(ctx)
    info = ctx.info["method"]
    assert info["layer_from"] == "fit on the pool" and info["d_sae"] == 32
    fit = info["sae_fit"]
    n_tokens = sum(len(e.input_ids) for e in ctx.inputs.encoded)
    assert fit["tokens"] + fit["outliers"] == n_tokens and fit["layer"] == info["options"]["layer"] and 0 <= fit["fvu"] < 1
    assert len(rows) == len(ctx.inputs.pairs) and torch.isfinite(scores).all()
    # the same fit (seeded) written to a file and read back scores the same latent alike
    from prism_select.methods.saefeat import fit_sae, pool_hidden_tokens
    X = pool_hidden_tokens(model, ctx.inputs.encoded, fit["layer"], ctx.pad_id, 3)
    tensors, _ = fit_sae(X, d_sae=32, steps=200, seed=0)
    save_sae(tmp_path / "pool.safetensors", tensors, layer=fit["layer"])
    s2, _ = get("saefeat").fn(make_ctx("saefeat", {"sae": str(tmp_path / "pool.safetensors"),
                                                     "latent": info["options"]["latent"]}))
    assert torch.allclose(scores, s2, rtol=1e-9, atol=1e-12)
    with pytest.raises(ConfigError, match="sae_width"):
        get("saefeat").fn(make_ctx("saefeat", {"sae": "pool", "sae_width": 0}))


def test_saefeat_errors(make_ctx, tmp_path):
    run = lambda **o: get("saefeat").fn(make_ctx("saefeat", o))  # noqa: E731
    with pytest.raises(ConfigError, match="sae"):
        run()
    with pytest.raises(InputError, match="not found"):
        run(sae=str(tmp_path / "missing.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(InputError, match="safetensors"):
        run(sae=str(tmp_path / "junk.safetensors"))
    save_file({"W_enc": torch.zeros(16, 4)}, str(tmp_path / "nob.safetensors"))
    with pytest.raises(InputError, match="b_enc"):
        run(sae=str(tmp_path / "nob.safetensors"), layer=1)
    _sae(tmp_path / "wide.safetensors", d_model=20)
    with pytest.raises(InputError, match="hidden size 16"):
        run(sae=str(tmp_path / "wide.safetensors"))
    save_file({"W_enc": torch.zeros(12, 16), "b_enc": torch.zeros(12)}, str(tmp_path / "t.safetensors"))
    with pytest.raises(InputError, match="transposed"):
        run(sae=str(tmp_path / "t.safetensors"), layer=1)
    save_file({"W_enc": torch.zeros(16, 4), "b_enc": torch.zeros(4), "threshold": torch.zeros(5)},
              str(tmp_path / "thr.safetensors"))
    with pytest.raises(InputError, match="threshold"):
        run(sae=str(tmp_path / "thr.safetensors"), layer=1)
    _sae(tmp_path / "nolayer.safetensors", layer=None)
    with pytest.raises(ConfigError, match="layer"):
        run(sae=str(tmp_path / "nolayer.safetensors"))
    _sae(tmp_path / "ok.safetensors")
    with pytest.raises(ConfigError, match="latent"):
        run(sae=str(tmp_path / "ok.safetensors"), latent=12)


# --------------------------------------------------------------------------- score_pool and compare

POOL_LABELS = [False, True, False, False, False, True, False, False]


def _write_inputs(tmp_path, pool_examples, pair_examples):
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "response": r, "harmful": y}) + "\n"
                            for i, ((p, r), y) in enumerate(zip(pool_examples, POOL_LABELS))))
    targets = tmp_path / "targets.jsonl"
    targets.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q, "chosen": c, "rejected": r}) + "\n"
                               for i, (q, c, r) in enumerate(pair_examples)))
    return pool, targets


@pytest.mark.parametrize("name", ["random", "ifguide", "vecfilter", "projdiff", "conceptinf", "saefeat"])
def test_every_baseline_runs_through_score_pool(lm, tmp_path, pool_examples, pair_examples, name):
    pool, targets = _write_inputs(tmp_path, pool_examples, pair_examples)
    opts = {"projdiff": {"max_new_tokens": 3}, "saefeat": {"sae": str(tmp_path / "sae.safetensors")},
            "ifguide": {"ranking": "harmonic"}}.get(name, {})
    if name == "saefeat":
        _sae(tmp_path / "sae.safetensors")
    s = ScoreSettings(method=name, batch_size=4, progress=False, method_options=opts)
    summary = score_pool(lm, pool, targets, tmp_path / "run", s, CurvatureSettings(kind="identity"))
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run == json.loads(json.dumps(summary))

    assert run["method"] == name and run["method_info"]["name"] == name
    rows = [json.loads(x) for x in (tmp_path / "run" / "scores.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(8)]
    assert all(math.isfinite(r["score"]) for r in rows)
    # IF-Guide's harmonic rank writes its document sums beside the scores; the others nothing
    extra = {k for r in rows for k in r} - {"id", "score", "rank"}
    assert extra == ({"token_sum"} if name == "ifguide" else set())
    if name == "ifguide":
        assert all(math.isfinite(r["token_sum"]) for r in rows)
        # the method's own warnings (ties) are the run's too
        assert "ties" in run["method_info"] and set(run["method_info"]["warnings"]) <= set(run["warnings"])
        assert [r["id"] for r in read_scores(tmp_path / "run" / "scores.jsonl")] == \
            [r["id"] for r in sorted(rows, key=lambda r: r["rank"])]


def test_options_for_splits_per_method_options():
    opts = {"layer": 2, "quantile": 0.9, "vecfilter": {"similarity": "cosine"}, "projdiff.max_new_tokens": 5,
            "sae": "x.safetensors"}
    assert options_for("vecfilter", opts) == {"layer": 2, "similarity": "cosine"}
    assert options_for("projdiff", opts) == {"layer": 2, "max_new_tokens": 5}
    assert options_for("ifguide", opts) == {"quantile": 0.9}
    assert options_for("random", opts) == {}
    assert options_for("prism", opts) == {}  # a target direction takes no options
    with pytest.raises(ConfigError):
        options_for("vecfilter", {"vecfilter": 3})


def test_compare_writes_table_with_sklearn_metrics_and_reuses_curvature(lm, tmp_path, pool_examples,
                                                                        pair_examples):
    from sklearn.metrics import average_precision_score, roc_auc_score
    pool, targets = _write_inputs(tmp_path, pool_examples, pair_examples)
    s = ScoreSettings(batch_size=4, progress=False, method_options={"ifguide.quantile": 0.9, "layer": 1})
    res = compare(lm, pool, targets, tmp_path / "cmp", ["prism", "ifguide", "vecfilter"], s,
                  CurvatureSettings(kind="kfac", batch_size=4), label="harmful")
    out = tmp_path / "cmp"
    assert json.loads((out / "compare.json").read_text()) == json.loads(json.dumps(res))
    md = (out / "compare.md").read_text()
    for row in res["methods"]:
        m = row["method"]
        scored = [json.loads(x) for x in (out / m / "scores.jsonl").read_text().splitlines()]
        y = [POOL_LABELS[int(r["id"][1:])] for r in scored]
        sc = [r["score"] for r in scored]
        assert row["auroc"] == roc_auc_score(y, sc)
        assert row["auprc"] == average_precision_score(y, sc)
        assert f"| {m} | {row['wall_s']:.2f} | {row['auroc']:.4f} | {row['auprc']:.4f} |" in md
    runs = {m: json.loads((out / m / "run.json").read_text()) for m in ["prism", "ifguide", "vecfilter"]}
    assert runs["prism"]["curvature"]["reused"] is False
    assert runs["ifguide"]["curvature"]["reused"] is True
    assert runs["ifguide"]["curvature"]["path"] == runs["prism"]["curvature"]["path"]
    assert "curvature" not in runs["vecfilter"]
    assert runs["ifguide"]["settings"]["method_options"] == {"quantile": 0.9}
    assert runs["vecfilter"]["settings"]["method_options"] == {"layer": 1}
    assert res["n_positive"] == 2
    with pytest.raises(ConfigError):
        compare(lm, pool, targets, tmp_path / "cmp2", ["prism", "nope"], s)


def test_cli_methods_and_compare(tmp_path, tok, pool_examples, pair_examples, capsys):
    from prism_select.cli import main
    from tiny import tiny_llama
    assert main(["methods"]) == 0
    listed = capsys.readouterr().out
    assert "ifguide" in listed and "prism" in listed
    mdir = tmp_path / "m"
    tiny_llama(len(tok)).save_pretrained(mdir)
    tok.save_pretrained(mdir)
    pool, targets = _write_inputs(tmp_path, pool_examples, pair_examples)
    rc = main(["compare", "--pool", str(pool), "--targets", str(targets), "--out", str(tmp_path / "c"),
               "--methods", "random", "vecfilter", "--label", "harmful", "--model", str(mdir),
               "--dtype", "float64", "--device", "cpu", "--cache-dir", str(tmp_path / "cache"),
               "--no-progress", "--curvature", "identity", "--option", "vecfilter.layer=1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| random |" in text and "| vecfilter |" in text
    assert json.loads((tmp_path / "c" / "vecfilter" / "run.json").read_text())["method_info"]["options"]["layer"] == 1


def test_a_stopped_compare_resumes_reusing_its_finished_methods(lm, tmp_path, pool_examples, pair_examples,
                                                                monkeypatch):
    """A compare killed after its first method: the same call reuses that method's finished
    run (no second scoring) and scores the rest; other settings are refused as before."""
    from prism_select.run import job
    pool, targets = _write_inputs(tmp_path, pool_examples, pair_examples)
    s = ScoreSettings(batch_size=4, progress=False)
    c = CurvatureSettings(kind="identity")
    out = tmp_path / "cmp"
    real, calls = job._score_pool, []

    def stop_at_second(*a, **k):
        calls.append(a[4].method)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(job, "_score_pool", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        compare(lm, pool, targets, out, ["random", "prism"], s, c)
    first = (out / "random" / "scores.jsonl").read_bytes()
    monkeypatch.setattr(job, "_score_pool", real)
    scored = []
    monkeypatch.setattr(job, "_method_fn", lambda m, f=job._method_fn: (scored.append(m), f(m))[1])
    res = compare(lm, pool, targets, out, ["random", "prism"], s, c)
    assert scored == ["prism"]  # random's finished run was reused, not scored again
    assert [r["method"] for r in res["methods"]] == ["random", "prism"]
    assert (out / "random" / "scores.jsonl").read_bytes() == first
    with pytest.raises(OutputError):  # a finished run with other settings is still refused
        compare(lm, pool, targets, out, ["random"], dataclasses.replace(s, seed=1), c)


def test_the_settings_know_exactly_the_registered_methods():
    """Method names are checked in settings.py through the registry: every registered
    method is accepted, any other name refused with the known names."""
    from prism_select.methods import names
    from prism_select.settings import DirectionSettings

    assert set(names(kind="baseline")) == {"random", "ifguide", "ifguide_harmonic", "vecfilter", "projdiff",
                                           "conceptinf", "saefeat", "less", "judge"}
    for name in names():
        DirectionSettings(method=name)
    with pytest.raises(ConfigError, match="unknown method 'nosuch'.*use one of conceptinf, equal"):
        DirectionSettings(method="nosuch")

def test_projdiff_holds_the_generation_entry_locked_while_it_samples(lm, make_ctx, monkeypatch):
    """While ProjDiff samples its own responses the generation entry's write lock is held,
    so that eviction (``--cache-max-gb``, ``cache prune``) passes the entry by."""
    from prism_select import cache, locks
    root = Path(lm.settings.resolved_cache_dir())
    path = gen_mod.cache_path(root, lm.fingerprint)
    seen = []
    real = gen_mod.sample_responses

    def sampling(*a, **k):
        seen.append(locks.is_held(cache.lock_path(path.parent)))
        others = [e.path for e in cache.entries(root) if e.kind != "generations"]
        cache.prune(root, max_bytes=0, keep=others)  # evicts every unheld generation entry
        seen.append(path.parent.exists())
        return real(*a, **k)

    monkeypatch.setattr(gen_mod, "sample_responses", sampling)
    get("projdiff").fn(make_ctx("projdiff", {"layer": LAYER, "max_new_tokens": 2}))
    assert seen and all(seen)
    assert not locks.is_held(cache.lock_path(path.parent))  # released when the responses are written
