"""PRISM's numbers against brute-force float64 references on a tiny Llama."""

import math
import re

import pytest
import torch

from prism_select.curvature import CurvatureSettings, fit_curvature
from prism_select.preference import compute_preference
from prism_select.scoring import Chunking, score_encoded

from reference import example_loss, explicit_fisher_pieces, flat_grad, flatten, per_example_grads, rel_err

REL_TOL = 1e-8  # float64 end to end: only summation order differs
PAD_TOL = 1e-10  # scores under other padding / batch composition


def test_pi_and_margin_match_length_normalised_likelihoods(model, modules, tok, encoded_pairs):
    chosen, rejected = encoded_pairs
    pref = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2)
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        def mean_logp(e):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([e.input_ids])).logits[0]
            lp = torch.log_softmax(logits, -1)
            toks = [lp[t - 1, e.input_ids[t]] for t in range(e.response_start, len(e.input_ids))]
            return float(sum(toks) / len(toks))
        pbar_c, pbar_r = math.exp(mean_logp(c)), math.exp(mean_logp(r))
        assert pref.pi[i].item() == pytest.approx(pbar_c / (pbar_c + pbar_r), rel=REL_TOL)
        assert pref.margin[i].item() == pytest.approx(mean_logp(c) - mean_logp(r), rel=REL_TOL)


def test_g_kl_is_minus_grad_of_reward(model, modules, tok, encoded_pairs):
    chosen, rejected = encoded_pairs
    pref = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2)
    K = 0
    for c, r in zip(chosen, rejected):
        m = -example_loss(model, c, mean=True) + example_loss(model, r, mean=True)
        K = K + torch.nn.functional.softplus(m)
    K = K / len(chosen)
    ref = -flat_grad(model, modules, K)
    assert rel_err(flatten(pref.direction, modules), ref) <= REL_TOL


def test_equal_and_unpaired_directions(model, modules, tok, encoded_pairs):
    chosen, rejected = encoded_pairs
    eq = compute_preference(model, modules, chosen, rejected, method="equal", pad_id=tok.pad_token_id)
    ref = sum(flat_grad(model, modules, example_loss(model, c, True))
              - flat_grad(model, modules, example_loss(model, r, True))
              for c, r in zip(chosen, rejected)) / len(chosen)
    assert rel_err(flatten(eq.direction, modules), ref) <= REL_TOL
    un = compute_preference(model, modules, chosen, rejected, method="unpaired", pad_id=tok.pad_token_id)
    U = sum(torch.exp(-example_loss(model, c, True)) for c in chosen) / len(chosen)
    assert rel_err(flatten(un.direction, modules), -flat_grad(model, modules, U)) <= REL_TOL


def test_identity_scores_equal_explicit_gradient_dot_products(model, modules, tok, encoded_pool, encoded_pairs):
    chosen, rejected = encoded_pairs
    pref = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id)
    cur = fit_curvature(model, modules, encoded_pool, CurvatureSettings(kind="identity"), pad_id=tok.pad_token_id)
    v = cur.precondition(pref.direction)
    scores = score_encoded(model, modules, encoded_pool, v, pad_id=tok.pad_token_id, batch_size=3)
    G = per_example_grads(model, modules, encoded_pool)
    ref = G @ flatten(pref.direction, modules)
    assert rel_err(scores, ref) <= REL_TOL


def test_scores_invariant_to_padding_and_batch_size(model, modules, tok, encoded_pool, encoded_pairs):
    chosen, rejected = encoded_pairs
    pref = compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id)
    runs = [score_encoded(model, modules, encoded_pool, pref.direction, pad_id=tok.pad_token_id,
                          batch_size=bs, chunking=Chunking(cs))
            for bs, cs in [(1, 1), (3, 5), (8, 8)]]
    for s in runs[1:]:
        assert torch.allclose(s, runs[0], rtol=PAD_TOL, atol=0)


@pytest.mark.parametrize("kind", ["kfac", "ekfac", "diagonal"])
def test_curvature_matches_explicit_construction(model, modules, tok, encoded_pool, kind):
    """Every tracked layer: the factors from the two passes equal explicit per-example
    computations, and precondition() equals an explicit damped inverse of that matrix."""
    settings = CurvatureSettings(kind=kind, damping=1e-3, batch_size=3)
    cur = fit_curvature(model, modules, encoded_pool, settings, pad_id=tok.pad_token_id)
    name = "model.layers.1.mlp.down_proj"
    A, S, G = explicit_fisher_pieces(model, modules, name, encoded_pool, tok)
    out_f, in_f = G.shape[1:]
    if kind == "diagonal":
        D = (G ** 2).mean(0)
        assert torch.allclose(cur.tensors[f"{name}::D"], D, rtol=1e-9, atol=1e-14)
        M = torch.diag(D.T.reshape(-1))  # column-major vec
    else:
        QA, QS = cur.tensors[f"{name}::QA"], cur.tensors[f"{name}::QS"]
        # The eigenbases diagonalise the explicit factors.
        assert torch.allclose(QA.T @ A @ QA, torch.diag(torch.diag(QA.T @ A @ QA)), atol=1e-10)
        assert torch.allclose(QS.T @ S @ QS, torch.diag(torch.diag(QS.T @ S @ QS)), atol=1e-10)
        if kind == "kfac":
            M = torch.kron(A, S)
        else:
            Lam = ((QS.T @ G @ QA) ** 2).mean(0)
            assert torch.allclose(cur.tensors[f"{name}::Lambda"], Lam, rtol=1e-9, atol=1e-14)
            Q = torch.kron(QA, QS)
            M = Q @ torch.diag(Lam.T.reshape(-1)) @ Q.T
    g = torch.randn(out_f, in_f, dtype=torch.float64)
    ref = torch.linalg.solve(M + 1e-3 * torch.eye(M.shape[0], dtype=M.dtype), g.T.reshape(-1))
    got = cur.precondition({n: (g if n == name else torch.zeros_like(modules[n].weight)) for n in modules})[name]
    assert rel_err(got.T.reshape(-1), ref) <= 1e-7


class OneLinearLM(torch.nn.Module):
    """Every token embeds to the same vector, so each linear input is the same ``a``
    and the empirical Fisher is exactly ``a a^T (x) S``: K-FAC is exact here."""

    def __init__(self, vocab=7, dim=3, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(vocab, dim).double()
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(dim, generator=g, dtype=torch.float64).expand(vocab, dim))
        self.proj = torch.nn.Linear(dim, vocab, bias=True).double()
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(vocab, dim, generator=g, dtype=torch.float64))

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        class Out:
            pass
        o = Out()
        o.logits = self.proj(self.emb(input_ids))
        return o


@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_kronecker_inverse_equals_explicit_damped_fisher_inverse(kind):
    from prism_select.data.tokenize import Encoded
    torch.manual_seed(0)
    lm = OneLinearLM()
    modules = {"proj": lm.proj}
    # One prompt token, one response token: one position carries the loss.
    encoded = [Encoded([0, t], 1) for t in [1, 2, 3, 4, 5, 6, 2, 3]]
    lam = 0.05
    cur = fit_curvature(lm, modules, encoded, CurvatureSettings(kind=kind, damping=lam, batch_size=3), pad_id=0)
    def grad_with_bias(e):
        gw, gb = torch.autograd.grad(example_loss(lm, e), [lm.proj.weight, lm.proj.bias])
        return torch.cat([gw, gb[:, None]], dim=1)  # bias as the last input column

    G = torch.stack([grad_with_bias(e) for e in encoded])
    vecs = G.transpose(1, 2).reshape(len(encoded), -1)  # column-major vec(G_n)
    F = vecs.T @ vecs / len(encoded)
    g = torch.randn(*G.shape[1:], dtype=torch.float64)
    ref = torch.linalg.solve(F + lam * torch.eye(F.shape[0], dtype=F.dtype), g.T.reshape(-1))
    got = cur.precondition({"proj": g})["proj"]
    assert rel_err(got.T.reshape(-1), ref) <= 1e-9


@pytest.mark.parametrize("accumulate", ["device", "host"])
def test_non_finite_direction_names_the_layer(model, modules, tok, encoded_pairs, accumulate):
    """A layer whose gradient holds an inf stops the direction with NumericalError naming
    that layer, whether the gradient is checked where autograd left it or in the host
    accumulator."""
    from prism_select.errors import NumericalError

    chosen, rejected = encoded_pairs
    name = sorted(modules)[3]
    modules[name].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
    with pytest.raises(NumericalError, match=re.escape(name)):
        compute_preference(model, modules, chosen, rejected, pad_id=tok.pad_token_id, batch_size=2,
                           accumulate=accumulate)
