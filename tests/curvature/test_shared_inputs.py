"""Layers that read one input (q/k/v, gate/up) sum their activation factor ``A`` in one
accumulator during the factor pass (``factors._shared_inputs``, ``factors._CovTap``)."""

import pytest
import torch

from prism_select.curvature import factors as factors_mod, spill as spill_mod, stats as stats_mod
from prism_select.curvature import CurvatureSettings, fit_curvature
from prism_select.curvature import fit as fit_mod
from prism_select.runtime.layers import layer_shape

from memtrack import LiveBytes


def _first_pass(monkeypatch, tracker):
    """Wraps ``fit._passes``: the factor pass's taps and the live tensor bytes at its start."""
    seen = []
    passes = fit_mod._passes

    def spy(model, taps, stats, *a, **k):
        if not seen:
            seen.append((dict(taps), tracker.now))
        return passes(model, taps, stats, *a, **k)

    monkeypatch.setattr(fit_mod, "_passes", spy)
    return seen


def test_layers_reading_one_input_share_one_accumulator(model, modules, tok, encoded_pool, monkeypatch):
    tracker = LiveBytes(list(model.parameters()))
    seen = _first_pass(monkeypatch, tracker)
    with tracker:
        fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind="kfac", batch_size=3),
                      pad_id=tok.pad_token_id)
    taps, live = seen[0]
    for i in range(2):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q = taps[attn + "q_proj"].A
        assert taps[attn + "k_proj"].A is q and taps[attn + "v_proj"].A is q
        assert taps[mlp + "up_proj"].A is taps[mlp + "gate_proj"].A
        assert taps[attn + "o_proj"].A is not q and taps[mlp + "down_proj"].A is not q
    # what is live when the pass starts: one A per distinct input, one S per layer
    distinct = {id(t.A): t.A for t in taps.values()}
    item = next(model.parameters()).element_size()
    assert len(distinct) == 4 * 2  # per block: q/k/v, o, gate/up, down
    factor_bytes = item * (sum(A.numel() for A in distinct.values())
                           + sum(layer_shape(m)[0] ** 2 for m in modules.values()))
    per_layer = item * sum(layer_shape(m)[1] ** 2 + layer_shape(m)[0] ** 2 for m in modules.values())
    assert factor_bytes <= live < per_layer


def test_shared_accumulators_give_the_same_curvature(model, modules, tok, encoded_pool, monkeypatch):
    settings = CurvatureSettings(kind="ekfac", damping=1e-3, batch_size=3)
    got = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    monkeypatch.setattr(fit_mod, "_shared_inputs", lambda model, modules, *a: {n: n for n in modules})
    ref = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert list(got.tensors) == list(ref.tensors)
    for k, t in ref.tensors.items():
        assert torch.equal(got.tensors[k], t), k


def test_shared_accumulator_refuses_a_batch_whose_layers_read_different_inputs():
    lin = [torch.nn.Linear(4, 3, bias=False, dtype=torch.float64) for _ in range(2)]
    stats = stats_mod._Stats(torch.float64)
    A = torch.zeros(4, 4, dtype=torch.float64)
    taps = [factors_mod._CovTap(m, stats, A, torch.zeros(3, 3, dtype=torch.float64), f"l{i}", shared=True)
            for i, m in enumerate(lin)]
    b = {"attention_mask": torch.ones(2, 5, dtype=torch.long)}
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    stats.start(b)
    taps[0].on_forward(x)
    taps[1].on_forward(x)  # the same input: added once
    assert torch.allclose(A, x.reshape(-1, 4).T @ x.reshape(-1, 4))
    stats.start(b)
    taps[0].on_forward(x)
    with pytest.raises(RuntimeError, match="different inputs"):
        taps[1].on_forward(x.clone())


# ----------------------------------------------------------------------------- lower block triangles

TINY_BLOCK = 5  # cuts the tiny model's 16- and 32-wide factors into 4 and 7 blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lower_blocks_equal_the_full_accumulator(dtype):
    """At the embedded model's widths (GRAM_BLOCK as it is), with a bias row, bit for bit;
    the blocks hold 0.62 (1536 wide) and 0.75 (576) of the square."""
    g = torch.Generator().manual_seed(0)
    for D, d, n in ((1536, 1536, 97), (577, 576, 60)):
        P, M = factors_mod._LowerBlocks(D, d, dtype), torch.zeros(D, D, dtype=dtype)
        assert sum(B.numel() for B in P.blocks) == {1536: 0.625, 576: 0.75}[d] * d * d
        for _ in range(2):
            a = torch.randn(n, d, dtype=dtype, generator=g)
            C = torch.randn(D, D, dtype=dtype, generator=g)
            P.gram_(a)
            factors_mod._gram_into(M, a)
            P += C
            M += C
        P2 = factors_mod._LowerBlocks(D, d, dtype)
        P2 += P
        assert torch.equal(factors_mod._mirror(P2), factors_mod._mirror(M))


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_lower_block_factors_give_the_same_curvature(model, modules, tok, encoded_pool, monkeypatch, kind):
    """The factors summed as lower block triangles (on the CPU) equal those summed in full
    ``D x D`` accumulators (to float64 rounding: BLAS takes other paths for the tiny
    model's blocks), and take less memory during the factor pass."""
    from reference import rel_err
    monkeypatch.setattr(factors_mod, "GRAM_BLOCK", TINY_BLOCK)
    monkeypatch.setattr(spill_mod, "SPILL_MAX_BYTES", 0)  # the factors summed in the pass, not from a spill
    settings = CurvatureSettings(kind=kind, damping=1e-3, batch_size=3)
    tracker = LiveBytes(list(model.parameters()))
    seen = _first_pass(monkeypatch, tracker)
    with tracker:
        got = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    taps, live = seen[0]
    assert all(isinstance(t.S, factors_mod._LowerBlocks) for t in taps.values())
    monkeypatch.setattr(factors_mod._LowerBlocks, "wanted", staticmethod(lambda d, device: False))
    tracker = LiveBytes(list(model.parameters()))
    seen = _first_pass(monkeypatch, tracker)
    with tracker:
        ref = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    assert seen[-1][1] > live  # the full accumulators at the start of the pass
    assert list(got.tensors) == list(ref.tensors)
    for k, t in ref.tensors.items():
        if k.endswith(("::QA", "::QS")):  # eigenvectors: through their products
            continue
        assert rel_err(got.tensors[k], t) <= 1e-13, k
    for n in modules:
        for f in ("A", "S"):
            Q, lam = got.tensors[f"{n}::Q{f}"], got.tensors[f"{n}::lam{f}"]
            Q0, lam0 = ref.tensors[f"{n}::Q{f}"], ref.tensors[f"{n}::lam{f}"]
            assert rel_err(Q @ torch.diag(lam) @ Q.T, Q0 @ torch.diag(lam0) @ Q0.T) <= 1e-13, (n, f)
