"""IF-Guide's document rules on short records: the response-only threshold, tie accounting,
and a default rule that does not tie most of a dropped-carry pool."""

import pytest
import torch

from prism_select.methods import get
from prism_select.methods import ifguide as ifguide_mod
from prism_select.methods.ifguide import ifguide_rank, ifguide_threshold, response_token_scores, ties
from prism_select.curvature import CurvatureSettings
from prism_select.data.records import PoolExample, TargetPair
from prism_select.data.tokenize import Encoded, encode
from prism_select.errors import ConfigError
from prism_select.evaluation import carry
from prism_select.model import LoadedModel, ModelSettings, model_fingerprint
from prism_select.run import Inputs, RunContext
from prism_select.settings import ScoreSettings

IFGUIDE = get("ifguide").fn


def _ctx(tmp_path, tok, model, modules, records, pairs, options, out="run"):
    lm = LoadedModel(model, tok, ModelSettings("tiny-test", device="cpu", cache_dir=str(tmp_path / "cache")),
                     model_fingerprint(model), {})
    pool = [PoolExample(f"p{i}", p, r, i) for i, (p, r) in enumerate(records)]
    tp = [TargetPair(f"q{i}", q, c, r, i) for i, (q, c, r) in enumerate(pairs)]
    inputs = Inputs(pool=pool, encoded=[encode(tok, e.prompt, e.response) for e in pool], pairs=tp,
                    chosen=[encode(tok, p.prompt, p.chosen) for p in tp],
                    rejected=[encode(tok, p.prompt, p.rejected) for p in tp], invalid=[],
                    truncated={"pool": 0, "targets": 0})
    settings = ScoreSettings(method="ifguide", batch_size=32, progress=False, method_options=options)
    return RunContext(lm, modules, inputs, settings, CurvatureSettings(kind="identity"), tmp_path / out)


def test_response_token_scores_are_the_positions_predicting_the_response():
    enc = [Encoded(list(range(6)), 4), Encoded(list(range(4)), 1)]
    ts = [torch.arange(6.0), torch.arange(4.0) + 10]
    got = response_token_scores(ts, enc, "position")
    # positions 3 and 4 predict response tokens 4 and 5; the last position predicts nothing
    assert [t.tolist() for t in got] == [[3.0, 4.0], [10.0, 11.0, 12.0]]
    assert response_token_scores(ts, enc, "loss") == ts  # loss terms are response tokens already


def test_a_planted_prompt_token_score_does_not_count():
    """A prompt position scoring far above every response token: under the response-only
    threshold it neither sets tau nor counts for its record."""
    enc = [Encoded(list(range(8)), 5) for _ in range(4)]
    ts = [torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 0.0]) * (k + 1) for k in range(4)]
    ts[0][1] = 1000.0  # a prompt token of record 0
    resp = response_token_scores(ts, enc, "position")
    assert max(float(t.max()) for t in resp) == 12.0
    got = ifguide_rank(resp, 0.75, "harmonic")
    assert int(got.argmax()) == 3 and float(got[0]) == 0.0
    assert int((resp[0] > ifguide_threshold(resp, 0.75)).sum()) == 0
    # over every position the planted score is above tau and counts for record 0
    assert int((ts[0] > ifguide_threshold(ts, 0.75)).sum()) == 1


def test_ties_count_records_sharing_a_score():
    t = ties(torch.tensor([0.0, 0.0, 0.0, 1.0, 2.0, 2.0, 3.0]))
    assert t == {"tied": 5, "share": 5 / 7, "largest": 3, "largest_value": 0.0}
    assert ties(torch.tensor([1.0, 2.0, 3.0])) == {"tied": 0, "share": 0.0, "largest": 0, "largest_value": None}


def test_method_thresholds_response_tokens_and_records_ties(tmp_path, tok, model, modules, monkeypatch, caplog):
    from conftest import PAIRS, POOL

    planted = {}

    def fake_token_scores(model, modules, encoded, V, **kw):
        out = []
        for i, e in enumerate(encoded):
            t = torch.zeros(len(e.input_ids), dtype=torch.float64)
            n = e.n_response
            t[e.response_start - 1: len(e.input_ids) - 1] = 0.1 * (i + 1) + 0.001 * torch.arange(n)
            out.append(t)
        out[2][0] = 50.0  # record p2's first prompt position
        planted["scores"] = out
        return out

    monkeypatch.setattr(ifguide_mod, "token_scores", fake_token_scores)
    ctx = _ctx(tmp_path, tok, model, modules, POOL, PAIRS, {"ranking": "harmonic", "quantile": 0.9})
    with caplog.at_level("WARNING"):
        scores, _ = IFGUIDE(ctx)
    info = ctx.info["method"]
    assert info["tau"] < 1 and float(scores[2]) == 0.0 and info["options"]["threshold_tokens"] == "response"
    n_resp = sum(e.n_response for e in ctx.inputs.encoded)
    assert info["tokens"] == n_resp
    # only the last record holds response tokens above the 0.9 quantile: the rest tie at 0
    assert info["records_above_tau"] == 1 and info["ties"]["tied"] == len(POOL) - 1
    assert info["warnings"] and "ties" in info["warnings"][0] and "ranking=sum" in info["warnings"][0]
    assert any("ties" in r.getMessage() for r in caplog.records)
    # the record-wide rule counts the planted prompt score
    ctx2 = _ctx(tmp_path, tok, model, modules, POOL, PAIRS,
                {"ranking": "harmonic", "quantile": 0.9, "threshold_tokens": "all"}, out="run2")
    s2, _ = IFGUIDE(ctx2)
    assert float(s2[2]) > 0
    with pytest.raises(ConfigError, match="threshold_tokens"):
        IFGUIDE(_ctx(tmp_path, tok, model, modules, POOL, PAIRS, {"threshold_tokens": "prompt"}, out="run3"))


def test_default_rule_ties_under_a_tenth_of_a_dropped_carry_pool(tmp_path, tok, modules, model):
    data = carry.build(0, pool_size=300, harmful_ratio=0.2, carry_share=0.5, n_probes=4, n_capability=4,
                       n_counterfactual=8, n_warmup=0)
    records = [(r["prompt"], r["response"]) for r in data["pool"]]
    pairs = [(t["prompt"], t["chosen"], t["rejected"]) for t in data["targets"]]
    ctx = _ctx(tmp_path, tok, model, modules, records, pairs, {})
    scores, _ = IFGUIDE(ctx)
    info = ctx.info["method"]
    assert info["options"]["ranking"] == "sum"
    assert info["ties"] == ties(scores) and info["ties"]["share"] < ifguide_mod.TIE_WARN_SHARE
    assert info["warnings"] == []


def test_ifguide_harmonic_is_ifguide_with_the_harmonic_rule(tmp_path, tok, model, modules):
    from conftest import PAIRS, POOL

    a, _ = IFGUIDE(_ctx(tmp_path, tok, model, modules, POOL, PAIRS, {"ranking": "harmonic"}))
    ctx = _ctx(tmp_path, tok, model, modules, POOL, PAIRS, {}, out="run2")
    b, _ = get("ifguide_harmonic").fn(ctx)
    assert torch.equal(a, b) and ctx.info["method"]["name"] == "ifguide_harmonic"
    assert ctx.info["method"]["options"]["ranking"] == "harmonic"
