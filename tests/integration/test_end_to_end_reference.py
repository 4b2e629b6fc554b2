"""``prism-select score`` end to end against a float64 brute force that shares nothing with
the package but tokenisation: the model loaded by transformers itself, every example run
alone, its loss from its own token log-probabilities (tests/reference.py), the target
direction as minus the gradient of PRISM's reward, the diagonal curvature and the scores
by explicit sums over the tracked layers' per-example gradients."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prism_select import cli
from prism_select.data.tokenize import encode
from prism_select.examples import make_example

from reference import example_loss, rel_err
from tiny import save_tiny

#: the CLI's batched, padded float64 run against one example at a time (the loaded
#: model's RMSNorm computes in float32, so the two paths round differently there)
SCORE_REL_TOL = 1e-5
DAMPING = 1e-3
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("e2e")
    pool, targets = make_example(d / "data", n_pool=8, n_pairs=3)
    model_dir = save_tiny(d / "model", dtype=torch.float64)
    out = d / "run"
    argv = ["score", "--model", str(model_dir), "--pool", str(pool), "--targets", str(targets), "--out", str(out),
            "--device", "cpu", "--dtype", "float64", "--curvature", "diagonal", "--damping", str(DAMPING),
            "--max-length", str(MAX_LENGTH), "--batch-size", "3", "--no-progress", "--cache-dir", str(d / "cache")]
    assert cli.main(argv) == 0
    return model_dir, pool, targets, out


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _brute_force(model_dir, pool, targets, tracked):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    weights = [model.get_submodule(n).weight for n in tracked]
    pool_enc = [encode(tok, r["prompt"], r["response"], MAX_LENGTH) for r in _records(pool)]
    pairs = [(encode(tok, p["prompt"], p["chosen"], MAX_LENGTH), encode(tok, p["prompt"], p["rejected"], MAX_LENGTH))
             for p in _records(targets)]
    # PRISM's reward K = mean_q log(1 + exp(m_q)), m_q = lbar(q, y-) - lbar(q, y+); direction -grad K
    margins = [example_loss(model, r, mean=True) - example_loss(model, c, mean=True) for c, r in pairs]
    K = sum(torch.nn.functional.softplus(m) for m in margins) / len(pairs)
    direction = [-g for g in torch.autograd.grad(K, weights)]
    G = [torch.autograd.grad(example_loss(model, e), weights) for e in pool_enc]
    D = [torch.stack([g[k] for g in G]).pow(2).mean(0) for k in range(len(weights))]  # diagonal empirical Fisher
    scores = torch.stack([sum((g[k] * direction[k] / (D[k] + DAMPING)).sum() for k in range(len(weights)))
                          for g in G])
    pi = torch.sigmoid(torch.stack(margins).detach())
    return scores.detach(), pi


def test_score_equals_a_float64_brute_force(cli_run):
    model_dir, pool, targets, out = cli_run
    run = json.loads((out / "run.json").read_text())
    want, pi = _brute_force(model_dir, pool, targets, run["tracked_modules"])
    got = {r["id"]: r for r in _records(out / "scores.jsonl")}
    ids = [r["id"] for r in _records(pool)]
    scores = torch.tensor([got[i]["score"] for i in ids], dtype=torch.float64)
    assert rel_err(scores, want) <= SCORE_REL_TOL
    order = sorted(range(len(ids)), key=lambda i: -float(want[i]))
    assert [got[ids[i]]["rank"] for i in order] == list(range(1, len(ids) + 1))
    assert rel_err(torch.tensor([p["pi"] for p in _records(out / "pairs.jsonl")], dtype=torch.float64),
                   pi) <= SCORE_REL_TOL
