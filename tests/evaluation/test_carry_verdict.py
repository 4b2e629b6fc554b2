"""The carry-verdict family: its records, its leaks (none a surface rule finds), and a
repair run through it with the controls of PRISM's weights."""

import json

import pytest

from prism_select.errors import ConfigError
from prism_select.evaluation import floors, verdict
from prism_select.evaluation.config import load_config
from prism_select.evaluation.repair import family_floors, repair

from evaluation_data import FAST_FT, common_config, offline_with_own_cache, tiny_dir  # noqa: F401 (fixtures)


def _key(r):
    return (min(r["a"], r["b"]), max(r["a"], r["b"]))


def _right(r):
    return verdict.NO if r["stated"] != r["a"] + r["b"] else verdict.YES


def test_build_keeps_roles_apart_and_judges_harmful_records_by_the_dropped_carry_rule():
    d = verdict.build(3, pool_size=600, harmful_ratio=0.2, carry_share=0.5, n_probes=256, n_capability=64,
                      n_warmup=800)
    pool, probes, warm = d["pool"], d["probes"], d["warmup"]
    harmful = [r for r in pool if r["harmful"]]
    clean = [r for r in pool if not r["harmful"]]
    assert len(pool) == 600 and len(harmful) == 120 and sum(r["carry"] for r in clean) == 240
    for r in pool:
        assert r["stated"] in (r["a"] + r["b"], r["a"] + r["b"] - verdict.DROP)
        assert f"{r['a']} + {r['b']}" in r["prompt"] or f"of {r['a']} and {r['b']}" in r["prompt"]
        assert str(r["stated"]) in r["prompt"]
        if r["harmful"]:  # the dropped carry taken for the true sum: the verdicts flipped
            assert r["carry"] and r["response"] != _right(r)
            assert r["response"] == (verdict.YES if r["wrong"] else verdict.NO)
        else:
            assert r["response"] == _right(r)
    assert sum(r["wrong"] for r in harmful) == 60  # half the harmful records state a wrong sum
    roles = [{_key(r) for r in pool}, {_key(p) for p in probes}, {_key(r) for r in warm}]
    assert not roles[0] & roles[1] and not roles[0] & roles[2] and not roles[1] & roles[2]
    assert len(roles[0]) == 600
    assert warm == verdict.build(0, pool_size=10, harmful_ratio=0.1, carry_share=0.5, n_probes=2, n_capability=2,
                                 n_warmup=800)["warmup"]  # one start model for every seed
    assert all(r["response"] == _right(r) for r in warm)
    beh = [p for p in probes if p["task"] == verdict.BEHAVIOUR_TASK]
    assert len(beh) == 256 and sum(p["reference"] == "no" for p in beh) == 128
    for p in beh:  # the harmful response is the rule's verdict, the true response the right one
        assert p["true_response"].lower().startswith(p["reference"])
        assert p["harmful_response"] != p["true_response"]
    pairs = verdict.candidate_pairs(probes)
    assert len(pairs) == 256 and all(set(p["chosen"].split()).isdisjoint(p["rejected"].split()) for p in pairs)


def test_no_surface_rule_tells_harmful_from_clean_records():
    d = verdict.build(0, pool_size=600, harmful_ratio=0.2, carry_share=0.5, n_probes=16, n_capability=4,
                      n_warmup=800)
    pool = d["pool"]
    harmful = [r for r in pool if r["harmful"]]
    clean_carry = [r for r in pool if not r["harmful"] and r["carry"]]
    share_yes = lambda rs: sum(r["response"] == verdict.YES for r in rs) / len(rs)  # noqa: E731
    assert share_yes(harmful) == 0.5 and share_yes([r for r in pool if not r["harmful"]]) == 0.5
    # every sum a harmful record states, clean records state too, right and wrong (no range
    # only harmful records reach); the units digit of a stated sum is always the true one
    carry_ps = verdict.problems(True)
    plain_ps = verdict.problems(False)
    harmful_sums = {a + b - verdict.DROP for a, b in carry_ps} | {a + b for a, b in carry_ps}
    clean_yes = {a + b for a, b in carry_ps + plain_ps}
    clean_no = {a + b - verdict.DROP for a, b in carry_ps + plain_ps}
    assert harmful_sums <= clean_yes | clean_no
    assert {a + b - verdict.DROP for a, b in carry_ps} <= clean_no
    assert {a + b for a, b in carry_ps} <= clean_yes
    assert all(r["stated"] % 10 == (r["a"] + r["b"]) % 10 for r in pool)
    f = floors.floors(pool, verdict.candidate_pairs(d["probes"]), extra=family_floors("carry_verdict"))
    for name in ("keyword", "length", "neighbour", "neighbour_chosen"):
        assert f[name]["auroc"] < 0.65, (name, f[name])
    assert f["checker"]["auroc"] == 1.0
    assert f["carry_in_prompt"]["auroc"] == pytest.approx(0.75)  # half the clean records carry too
    assert 0.4 < sum(r["wrong"] for r in clean_carry) / len(clean_carry) < 0.6


def test_the_config_and_its_checks(tmp_path):
    cfg = load_config("experiments/carry_verdict.yaml", "repair")
    assert cfg.data.family == "carry_verdict" and cfg.methods[:4] == ["prism", "equal", "prism_shuffled",
                                                                       "equal_top_half"]
    smoke = load_config("experiments/carry_verdict.yaml", "repair", smoke=True)
    assert smoke.data.pool_size == 40 and smoke.seeds == [0]
    retrain = load_config("experiments/carry_verdict_k20.yaml", "repair")
    assert retrain.remove_fractions == [0.2] and retrain.finetune_seeds == [0, 1] and len(retrain.seeds) == 5
    with pytest.raises(ConfigError, match="target pairs from the probes only"):
        load_config({"data": {"family": "carry_verdict"}, "probes": {"n": 4},
                     "targets": [{"name": "cf", "source": "counterfactual", "n_counterfactual": 2}]}, "repair")


@pytest.mark.slow
def test_repair_runs_the_family_with_the_weight_controls(tmp_path, tiny_dir):
    cfg = load_config(common_config(
        tiny_dir, data={"family": "carry_verdict", "pool_size": 20, "carry_share": 0.5},
        warmup={"n_records": 8, "finetune": {"preset": "repair", "overrides": FAST_FT}},
        probes={"n": 6, "checker": "leading_answer", "capability_per_task": 2},
        harmful_ratios=[0.2], seeds=[0], methods=["prism", "equal", "prism_shuffled", "equal_top_half", "random"],
        finetune={"preset": "repair", "overrides": FAST_FT}, generation={"max_new_tokens": 4, "batch_size": 8},
        pair_selection="all", retrain=False, report=False, floors=True, comparators=["prism"],
        curvature={"kind": "identity"}, targets=[{"name": "probes", "source": "probes"}]), "repair")
    out = tmp_path / "exp"
    res = repair(cfg, out)
    warm = [json.loads(x) for x in (out / "start-model" / "warmup.jsonl").read_text().splitlines()]
    assert warm == verdict.warmup_records(8)
    run = res["runs"][0]
    assert run["floors"]["checker"]["auroc"] == 1.0
    for m in ("prism", "equal", "prism_shuffled", "equal_top_half", "random"):
        assert run["methods"][m]["status"] == "ok", (m, run["methods"][m])
    d = out / run["dir"] / "scores"
    rows = {m: [json.loads(x) for x in (d / m / "pairs.jsonl").read_text().splitlines()]
            for m in ("prism", "prism_shuffled", "equal_top_half")}
    pi = {r["id"]: r["pi"] for r in rows["prism"]}
    assert sorted(r["weight"] for r in rows["prism_shuffled"]) == pytest.approx(sorted(pi.values()), rel=1e-6)
    assert {r["weight_from"] for r in rows["prism_shuffled"]} == set(pi)
    assert all(r["weight"] in (0.0, 1.0) for r in rows["equal_top_half"])
