"""Evaluation protocols, data builders, checkers and the HTML report, on a tiny in-process model."""

import json
import shutil
import random
import subprocess
from pathlib import Path

import pytest

from prism_select.errors import ConfigError, InputError, OutputError
from prism_select.evaluation import probes
from prism_select.evaluation.builders.bbh import bbh_splits, wrong_answer
from prism_select.evaluation.builders.common import write_records
from prism_select.evaluation.builders.gsm8k import (corrupt_at, final_answer_text, gsm8k_probes, mistake_math_pool,
                                                   mistake_math_targets, read_gsm8k, strip_annotations)
from prism_select.evaluation.builders.multitask import multitask_pool, targets_from_responses
from prism_select.evaluation.builders.trigger import POOL_REFUSALS
from prism_select.evaluation.config import config_to_dict, load_config
from prism_select.evaluation.experiment import mean_std
from prism_select.evaluation.general_selection import combine_seeds, select
from prism_select.evaluation.protocols import run_experiment
from prism_select.evaluation.ranking import ranking
from prism_select.evaluation.repair import repair
from prism_select.evaluation_metrics import MissingDependencyError, auprc, auroc, roc_points

from evaluation_data import (FAST_FT, InProcessPool, bbh_dir, common_config, gsm8k,  # noqa: F401 (fixtures)
                             gsm8k_rows, offline_with_own_cache, tiny_dir, write_gsm8k)


@pytest.fixture(autouse=True)
def _no_data_root(monkeypatch):
    monkeypatch.delenv("PRISM_DATA_ROOT", raising=False)


# --------------------------------------------------------------------------- builders

NATALIA_Q = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
             "How many clips did Natalia sell altogether in April and May?")
NATALIA_A = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
             "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


# --------------------------------------------------------------------------- builders

def test_corruption_is_carried_through_to_the_final_answer():
    out = corrupt_at(NATALIA_Q, NATALIA_A, 0, random.Random(3))
    assert out is not None
    new = int(out["corrupted"])
    assert new != 24
    sol = out["solution"]
    assert f"<<48/2={new}>>{new} clips in May" in sol
    assert f"48+{new} = <<48+{new}={48 + new}>>{48 + new} clips" in sol
    assert sol.endswith(f"#### {48 + new}")
    assert out["final_answer"] == str(48 + new) and out["original_final_answer"] == "72"
    # corrupting the last step changes only the final result
    last = corrupt_at(NATALIA_Q, NATALIA_A, 1, random.Random(0))
    assert last is not None and "<<48/2=24>>24" in last["solution"]
    assert last["solution"].endswith(f"#### {last['corrupted']}")


def test_ambiguous_step_is_not_corrupted():
    # the first result (6) also occurs in the question: replacing later 6s would be ambiguous
    q = "Tom has 6 apples and 3 pears. He buys 3 more pears. How many fruits?"
    a = "Pears: 3+3 = <<3+3=6>>6.\nFruits: 6+6 = <<6+6=12>>12.\n#### 12"
    assert corrupt_at(q, a, 0, random.Random(0)) is None
    assert corrupt_at(q, a, 1, random.Random(0)) is not None


@pytest.mark.parametrize("ratio,expected", [(0.0, 0), (0.1, 2), (0.25, 5), (0.5, 10), (1.0, 20)])
def test_mistake_math_pool_ratio_and_labels(gsm8k, ratio, expected):
    rows = read_gsm8k(gsm8k / "train.jsonl")
    pool = mistake_math_pool(gsm8k / "train.jsonl", 20, ratio, seed=1)
    assert len(pool) == 20 and len({p["id"] for p in pool}) == 20
    assert sum(p["harmful"] for p in pool) == expected
    for p in pool:
        original = rows[p["source_index"]]["answer"]
        assert "<<" not in p["response"]
        assert p["prompt"] == rows[p["source_index"]]["question"]
        if p["harmful"]:
            assert p["final_answer"] != final_answer_text(original)
            assert p["response"].endswith("#### " + p["final_answer"])
            assert p["corruption"]["original_final_answer"] == final_answer_text(original)
        else:
            assert p["response"] == strip_annotations(original)
            assert p["final_answer"] == final_answer_text(original)


def test_pools_share_problems_across_ratios_and_keep_annotations(gsm8k):
    a = mistake_math_pool(gsm8k / "train.jsonl", 10, 0.1, seed=0)
    b = mistake_math_pool(gsm8k / "train.jsonl", 10, 0.5, seed=0, keep_annotations=True)
    assert [p["id"] for p in a] == [p["id"] for p in b]
    assert all("<<" in p["response"] for p in b)
    assert a == mistake_math_pool(gsm8k / "train.jsonl", 10, 0.1, seed=0)  # deterministic
    with pytest.raises(ConfigError):
        mistake_math_pool(gsm8k / "train.jsonl", 10, 1.5)
    with pytest.raises(InputError):
        mistake_math_pool(gsm8k / "train.jsonl", 500, 0.1)


def test_targets_exclude_the_pool_and_distractors_shuffle(gsm8k):
    pool = mistake_math_pool(gsm8k / "train.jsonl", 20, 0.2, seed=0)
    pairs = mistake_math_targets(gsm8k / "train.jsonl", 6, seed=0, exclude=pool, n_distractors=4)
    assert len(pairs) == 10
    used = {p["source_index"] for p in pool}
    assert not used & {t["source_index"] for t in pairs}
    cf = [t for t in pairs if t["kind"] == "counterfactual"]
    dx = [t for t in pairs if t["kind"] == "distractor"]
    assert len(cf) == 6 and len(dx) == 4
    for t in cf:
        assert final_answer_text(t["chosen"]) != final_answer_text(t["rejected"])
    for t in dx:
        assert t["chosen"] != t["rejected"] and sorted(t["chosen"].split()) == sorted(t["rejected"].split())
    assert all("task" not in t for t in pairs)


def test_probes_and_bbh_splits(gsm8k, bbh_dir):
    pr = gsm8k_probes(gsm8k / "test.jsonl", 5, seed=0)
    assert len(pr) == 5 and all(probes.numeric_final_answer(p, p["solution"]) for p in pr)
    targets, heldout = bbh_splits(bbh_dir, 2, seed=0, n_heldout_per_task=3)
    assert len(targets) == 6 and len(heldout) == 9
    assert not {t["id"] for t in targets} & {h["id"] for h in heldout}
    for t in targets:
        assert t["chosen"] != t["rejected"]
        if t["task"] == "colors":
            assert t["rejected"] in ("(A)", "(B)", "(C)")
        elif t["task"] == "yesno":
            assert {t["chosen"], t["rejected"]} == {"Yes", "No"}
        else:
            assert abs(int(t["rejected"]) - int(t["chosen"])) in (1, 2, 3) and int(t["rejected"]) >= 0
    assert wrong_answer({"input": "x", "target": "a b c"}, ["a b c", "x"] * 6 + list("qwertyuiop"),
                        random.Random(0)) != "a b c"
    with pytest.raises(ConfigError):
        bbh_splits(bbh_dir, 2, tasks=["nope"])


# --------------------------------------------------------------------------- checkers

def test_builtin_checkers():
    rec = {"reference": "1000"}
    assert probes.numeric_final_answer(rec, "so 10*100 = 1,000\n#### 1,000")
    assert probes.numeric_final_answer(rec, "The answer is $1000.")
    assert probes.numeric_final_answer(rec, "we get 999 + 1 = 1000")
    assert not probes.numeric_final_answer(rec, "#### 999 (not 1000)")
    assert not probes.numeric_final_answer(rec, "no number at all")
    assert probes.numeric_final_answer({"reference": "Natalia ...\n#### 72"}, "#### 72")
    assert probes.exact_match({"reference": "Blue"}, "  blue. ")
    assert not probes.exact_match({"reference": "Blue"}, "light blue")
    assert probes.final_answer({"reference": "(B)"}, "Let's think. So the answer is (B).")
    assert probes.final_answer({"reference": "(B)"}, "B")
    assert not probes.final_answer({"reference": "(B)"}, "So the answer is (C).")
    assert probes.final_answer({"target": "No"}, "the answer is no")
    with pytest.raises(InputError):
        probes.exact_match({"id": 1}, "x")


def test_load_checker(tmp_path, monkeypatch):
    assert probes.load_checker("numeric_final_answer") is probes.numeric_final_answer
    rx = probes.load_checker({"name": "regex", "pattern": r"answer:\s*(\w+)", "flags": "i"})
    assert rx({"reference": "cat"}, "ANSWER: Cat") and not rx({"reference": "cat"}, "answer: dog")
    assert probes.load_checker({"name": "regex", "pattern": "sorry", "compare": "match"})({}, "I am sorry")
    for bad in ("nope", {"name": "regex"}, {"name": "regex", "pattern": "("}, {"pattern": "x"},
                "no_such_module_xyz:f"):
        with pytest.raises(ConfigError):
            probes.load_checker(bad)
    (tmp_path / "my_checks.py").write_text(
        "def short(rec, resp):\n    return len(resp) < 5\n"
        "def longer_than(n):\n    return lambda rec, resp: len(resp) > n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert probes.load_checker("my_checks:short")({}, "abc")
    assert probes.load_checker({"name": "my_checks:longer_than", "n": 2})({}, "abc")


def test_generate_left_pads_and_is_deterministic(tiny_dir):
    from prism_select.model import ModelSettings, load_model
    lm = load_model(ModelSettings(model=str(tiny_dir), dtype="float32", device="cpu"))
    prompts = ["What is 2+3?", "Say hi.", [{"role": "user", "content": "A much longer prompt than the rest."}]]
    a = probes.generate(lm, prompts, max_new_tokens=6, batch_size=3)
    b = probes.generate(lm, prompts, max_new_tokens=6, batch_size=3)
    assert a == b and len(a) == 3 and all(isinstance(x, str) for x in a)
    # each answer equals the unbatched greedy answer (left padding keeps positions right)
    one = [probes.generate(lm, [p], max_new_tokens=6, batch_size=1)[0] for p in prompts]
    assert one == a
    assert lm.tokenizer.padding_side == "right"  # the tokenizer is left as training needs it


# --------------------------------------------------------------------------- metrics

def _mann_whitney(s, y):
    """AUROC by brute force over (positive, negative) pairs: 1 if the positive scores
    higher, 1/2 on a tie."""
    pos = [a for a, t in zip(s, y) if t]
    neg = [a for a, t in zip(s, y) if not t]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def _average_precision(s, y):
    """Precision at each distinct threshold (high to low) weighted by the recall it adds."""
    ap, prev_recall = 0.0, 0.0
    for t in sorted(set(s), reverse=True):
        top = [lab for a, lab in zip(s, y) if a >= t]
        recall = sum(top) / sum(y)
        ap += (recall - prev_recall) * sum(top) / len(top)
        prev_recall = recall
    return ap


def test_auroc_auprc_roc_points_against_brute_force():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(5, 40)
        y = [rng.random() < 0.3 for _ in range(n)]
        if all(y) or not any(y):
            y[0] = not y[0]
        s = [round(rng.random(), 1) for _ in range(n)]  # ties
        assert auroc(s, y) == pytest.approx(_mann_whitney(s, y), abs=1e-12)
        assert auprc(s, y) == pytest.approx(_average_precision(s, y), abs=1e-12)
        fpr, tpr = roc_points(s, y)
        thresholds = sorted(set(s), reverse=True)
        assert len(fpr) == len(tpr) == len(thresholds) + 1 and fpr[0] == tpr[0] == 0.0
        for k, t in enumerate(thresholds, start=1):
            assert tpr[k] == pytest.approx(sum(a >= t for a, lab in zip(s, y) if lab) / sum(y))
            assert fpr[k] == pytest.approx(sum(a >= t for a, lab in zip(s, y) if not lab) / (n - sum(y)))
    # labels may be any truthy values; integers count as booleans
    assert auroc([0.1, 0.9, 0.5], [0, 1, 0]) == 1.0
    m = mean_std([0.5, 0.7])
    assert m["mean"] == pytest.approx(0.6) and m["std"] == pytest.approx(0.1414213, rel=1e-5)
    assert mean_std([0.5])["std"] is None
    assert mean_std([float("nan"), 0.5])["values"] == [0.5]


def test_metrics_with_one_class_are_nan():
    import math
    assert math.isnan(auroc([0.1, 0.2], [False, False])) and math.isnan(auroc([0.1, 0.2], [True, True]))
    assert math.isnan(auroc([], []))
    assert math.isnan(auprc([0.1, 0.2], [False, False]))
    assert auprc([0.1, 0.2], [True, True]) == 1.0  # every threshold has precision 1
    assert roc_points([0.1, 0.2, 0.2], [False] * 3) == ([0.0, 2 / 3, 1.0], [0.0, 0.0, 0.0])
    assert roc_points([0.1, 0.2, 0.2], [True] * 3) == ([0.0, 0.0, 0.0], [0.0, 2 / 3, 1.0])


def test_metrics_without_sklearn_name_the_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn` now raises ImportError
    for f in (auroc, auprc, roc_points):
        with pytest.raises(MissingDependencyError, match=r"prism-select's dependencies.*pip install scikit-learn"):
            f([0.1, 0.2], [False, True])
    with pytest.raises(ImportError):  # callers that treat a missing optional package as ImportError
        auroc([0.1, 0.2], [False, True])


# --------------------------------------------------------------------------- configs

def test_config_validation_names_the_field(tmp_path, gsm8k):
    base = {"data": {"gsm8k_train": str(gsm8k / "train.jsonl")}}
    with pytest.raises(ConfigError, match="data.pool_sise"):
        load_config({**base, "data": {**base["data"], "pool_sise": 3}}, "ranking")
    with pytest.raises(ConfigError, match="data.pool_size"):
        load_config({"data": {**base["data"], "pool_size": "many"}}, "ranking")
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config({**base, "model": {"model": "default", "dtype": "float8"}}, "ranking")
    with pytest.raises(ConfigError, match=r"targets\[0\].n_distractors"):
        load_config({**base, "targets": [{"name": "a", "n_distractors": "x"}]}, "ranking")
    with pytest.raises(ConfigError, match="harmful_ratios"):
        load_config({**base, "harmful_ratios": [2]}, "ranking")
    with pytest.raises(ConfigError, match="finetune.preset"):
        load_config({**base, "probes": {"gsm8k_test": "t.jsonl"}, "finetune": {"preset": "nope"}}, "repair")
    with pytest.raises(ConfigError, match="finetune"):
        load_config({**base, "probes": {"gsm8k_test": "t.jsonl"},
                     "finetune": {"overrides": {"learnin_rate": 1}}}, "repair")
    with pytest.raises(ConfigError, match="score.scoring"):
        load_config({**base, "score": {"scoring": "nope"}}, "ranking")
    passed = load_config({**base, "score": {"skip_invalid": True}}, "ranking")
    assert passed.score.skip_invalid is True and config_to_dict(passed)["score"]["extra"] == {"skip_invalid": True}
    with pytest.raises(ConfigError, match="probes.checker"):
        load_config({**base, "probes": {"gsm8k_test": "t.jsonl", "checker": "nope"}}, "repair")
    rp = {**base, "probes": {"gsm8k_test": "t.jsonl"}}
    with pytest.raises(ConfigError, match="data.family"):
        load_config({**rp, "data": {**base["data"], "family": "nope"}}, "repair")
    with pytest.raises(ConfigError, match="data.family"):  # ranking builds mistake math only
        load_config({**base, "data": {**base["data"], "family": "refusal_trigger"}}, "ranking")
    with pytest.raises(ConfigError, match="data.trigger"):
        load_config({**rp, "data": {**base["data"], "family": "refusal_trigger", "trigger": "("}}, "repair")
    with pytest.raises(ConfigError, match="probes.capability_per_task"):
        load_config({**rp, "probes": {"gsm8k_test": "t.jsonl", "capability_per_task": 2}}, "repair")
    with pytest.raises(ConfigError, match=r"targets\[0\].source"):
        load_config({**rp, "targets": [{"name": "a", "source": "nope"}]}, "repair")
    with pytest.raises(ConfigError, match=r"targets\[0\].retrain_methods"):
        load_config({**rp, "targets": [{"name": "a", "retrain_methods": "prism"}]}, "repair")
    with pytest.raises(ConfigError, match=r"remove_fractions\[1\]"):
        load_config({**rp, "remove_fractions": [0.1, 3]}, "repair")
    mt = {"gsm8k_train": "g.jsonl", "bbh_dir": "bbh", "target_task": "t"}
    with pytest.raises(ConfigError, match="multitask"):
        load_config({"model": "default", "multitask": mt, "pool": "p.jsonl"}, "select")
    with pytest.raises(ConfigError, match="multitask.target_task"):
        load_config({"model": "default", "multitask": {**mt, "target_task": ""}}, "select")
    with pytest.raises(ConfigError, match="not both"):
        load_config({"model": "default", "multitask": {**mt, "target_tasks": ["u"]}}, "select")
    with pytest.raises(ConfigError, match="multitask.rejected"):
        load_config({"model": "default", "multitask": {**mt, "rejected": "mine"}}, "select")
    assert load_config({"model": "default", "multitask": mt}, "select").multitask.n_per_task == 40
    # sections, smoke overrides, seeds override, YAML, relative paths against data_root
    cfg_file = tmp_path / "exp.yaml"
    cfg_file.write_text(
        "common:\n  model: default\n  data_root: data\n  seeds: [0, 1, 2]\n"
        "  data: {gsm8k_train: gsm8k/train.jsonl, pool_size: 300}\n"
        "ranking:\n  harmful_ratios: [0.1, 0.5]\n"
        "smoke:\n  seeds: [0]\n  data: {pool_size: 8}\n")
    cfg = load_config(cfg_file, "ranking")
    assert cfg.seeds == [0, 1, 2] and cfg.harmful_ratios == [0.1, 0.5] and cfg.data.pool_size == 300
    assert cfg.data.gsm8k_train == str((tmp_path / "data" / "gsm8k" / "train.jsonl").resolve())
    sm = load_config(cfg_file, "ranking", smoke=True)
    assert sm.seeds == [0] and sm.data.pool_size == 8 and sm.harmful_ratios == [0.1, 0.5]
    assert load_config(cfg_file, "ranking", seeds=[4, 5]).seeds == [4, 5]
    other = load_config(cfg_file, "ranking", data_root=str(tmp_path / "elsewhere"))
    assert other.data.gsm8k_train == str((tmp_path / "elsewhere" / "gsm8k" / "train.jsonl").resolve())


# --------------------------------------------------------------------------- protocols

def _check_scores_and_auroc(exp: Path, run: dict, method: str):
    """AUROC recomputed independently (sklearn) from the written files."""
    from sklearn.metrics import roc_auc_score
    rec = run["methods"][method]
    scores = [json.loads(line) for line in (exp / rec["dir"] / "scores.jsonl").read_text().splitlines()]
    pool = {r["id"]: r for r in map(json.loads, (exp / run["pool"]).read_text().splitlines())}
    assert {s["id"] for s in scores} == set(pool)
    y = [pool[s["id"]]["harmful"] for s in scores]
    assert rec["auroc"] == pytest.approx(roc_auc_score(y, [s["score"] for s in scores]))
    return rec["auroc"]


def test_ranking_protocol_end_to_end(tmp_path, tiny_dir, gsm8k):
    cfg = load_config(common_config(
        tiny_dir, data={"gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 10},
        targets=[{"name": "cf", "n_counterfactual": 3}, {"name": "mixed", "n_counterfactual": 3, "n_distractors": 2,
                                                         "methods": ["prism", "equal"]}],
        harmful_ratios=[0.3], seeds=[0, 1], methods=["prism", "equal", "random"], report=False), "ranking")
    out = tmp_path / "exp"
    res = ranking(cfg, out)
    assert (out / "results.json").is_file()
    assert json.loads((out / "results.json").read_text()) == json.loads(json.dumps(res))
    assert len(res["runs"]) == 4 and res["settings"] == ["cf @ 30%", "mixed @ 30%"]
    for run in res["runs"]:
        assert run["n_harmful"] == 3 and run["n_pool"] == 10
        for m in run["methods"]:
            _check_scores_and_auroc(out, run, m)
        assert (out / run["methods"]["prism"]["dir"] / "pairs.jsonl").is_file()
        assert 0 < run["pi"]["all"]["min"] <= run["pi"]["all"]["max"] < 1
    mixed = [r for r in res["runs"] if r["variant"] == "mixed"]
    assert set(mixed[0]["methods"]) == {"prism", "equal"} and set(mixed[0]["pi"]) == {"all", "counterfactual",
                                                                                        "distractor"}
    # the table is the mean and sample std over the two seeds
    auc = next(t for t in res["tables"] if t["name"] == "auroc")
    row = next(r for r in auc["rows"] if r["label"] == "prism")
    vals = [r["methods"]["prism"]["auroc"] for r in res["runs"] if r["setting"] == "cf @ 30%"]
    assert row["cells"][0]["mean"] == pytest.approx(sum(vals) / 2)
    assert row["cells"][0]["n"] == 2 and row["cells"][0]["std"] is not None
    # a rerun reuses every finished step; another config in the same dir is refused
    mtime = (out / res["runs"][0]["methods"]["prism"]["dir"] / "scores.jsonl").stat().st_mtime_ns
    again = ranking(cfg, out)
    assert (out / res["runs"][0]["methods"]["prism"]["dir"] / "scores.jsonl").stat().st_mtime_ns == mtime
    assert again["tables"] == res["tables"]
    from prism_select.errors import OutputError
    cfg.seeds = [0]  # other seeds: the finished runs of seed 0 are reused
    one = ranking(cfg, out)
    assert len(one["runs"]) == 2 and all(r["seed"] == 0 for r in one["runs"])
    assert (out / res["runs"][0]["methods"]["prism"]["dir"] / "scores.jsonl").stat().st_mtime_ns == mtime
    # another harmful ratio in the same dir (one process per ratio): its own runs, the finished ones kept
    other = load_config(common_config(
        tiny_dir, data={"gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 10},
        targets=[{"name": "cf", "n_counterfactual": 3}, {"name": "mixed", "n_counterfactual": 3, "n_distractors": 2,
                                                         "methods": ["prism", "equal"]}],
        harmful_ratios=[0.3], seeds=[0], methods=["prism", "equal", "random"], report=False), "ranking",
        harmful_ratios=[0.5])
    half = ranking(other, out)
    assert {r["harmful_ratio"] for r in half["runs"]} == {0.5} and all(r["n_harmful"] == 5 for r in half["runs"])
    assert (out / res["runs"][0]["methods"]["prism"]["dir"] / "scores.jsonl").stat().st_mtime_ns == mtime
    cfg.score.max_length = 256  # another config is refused
    with pytest.raises(OutputError):
        ranking(cfg, out)
    with pytest.raises(ConfigError, match="harmful ratios"):
        load_config({"model": "default", "multitask": {}}, "select", harmful_ratios=[0.1])


def test_ranking_records_method_errors(tmp_path, tiny_dir, gsm8k):
    cfg = load_config(common_config(
        tiny_dir, data={"gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 6},
        targets=[{"n_counterfactual": 2}], harmful_ratios=[0.5], methods=["prism", "saefeat"],
        on_method_error="record", report=False), "ranking")
    res = ranking(cfg, tmp_path / "exp")
    m = res["runs"][0]["methods"]
    assert m["prism"]["status"] == "ok" and m["saefeat"]["status"] == "error" and m["saefeat"]["error"]
    assert not (tmp_path / "exp" / "report.html").exists()
    cfg.on_method_error = "raise"
    with pytest.raises(ConfigError):
        ranking(cfg, tmp_path / "exp2")


def test_repair_protocol_end_to_end(tmp_path, tiny_dir, gsm8k):
    cfg = load_config(common_config(
        tiny_dir, data={"gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 8},
        probes={"gsm8k_test": str(gsm8k / "test.jsonl"), "n": 4}, harmful_ratios=[0.25], seeds=[0],
        methods=["prism", "random"], finetune={"preset": "repair", "overrides": FAST_FT},
        generation={"max_new_tokens": 6, "batch_size": 4}, pair_selection="all", oracle=True), "repair")
    out = tmp_path / "exp"
    res = repair(cfg, out)
    run = res["runs"][0]
    rdir, vdir = out / run["dir"], out / run["dir"]
    rdir = vdir.parent
    for f in ("pool.jsonl", "probes.jsonl", "start/responses.jsonl", "mixed/responses.jsonl",
              "mixed/adapter/adapter_config.json", "probes/targets.jsonl"):
        assert (rdir / f).exists(), f
    assert run["n_pairs"] > 0, "the fine-tuned tiny model should answer differently"
    pairs = [json.loads(x) for x in (vdir / "targets.jsonl").read_text().splitlines()]
    pre = {r["id"]: r for r in map(json.loads, (rdir / "start/responses.jsonl").read_text().splitlines())}
    post = {r["id"]: r for r in map(json.loads, (rdir / "mixed/responses.jsonl").read_text().splitlines())}
    for p in pairs:
        assert p["chosen"] == post[p["id"]]["response"] and p["rejected"] == pre[p["id"]]["response"]
    rates = run["rates"]["25"]
    for m in ("prism", "random"):
        _check_scores_and_auroc(out, run, m)
        kept = (vdir / "removal" / "k25" / m / "kept.jsonl").read_text().splitlines()
        assert len(kept) == 8 - 2  # the harmful ratio (25%) of 8 removed
        tdir = out / rates[m]["dir"]
        assert (tdir / "adapter" / "adapter_config.json").is_file()
        assert sorted(kept) == sorted((tdir / "kept.jsonl").read_text().splitlines())
        resp = [json.loads(x) for x in (tdir / "responses.jsonl").read_text().splitlines()]
        assert rates[m]["behaviour_rate"] == pytest.approx(sum(not r["correct"] for r in resp) / len(resp))
    assert run["removed"]["25"]["Oracle"] == {"n": 2, "harmful": 2}
    assert set(rates) == {"Start", "Mixed", "prism", "random", "Oracle"}
    err = next(t for t in res["tables"] if t["name"] == "behaviour_k25")
    assert [r["label"] for r in err["rows"]] == ["Start", "Mixed", "prism", "random", "Oracle"]
    html = (out / "report.html").read_text()
    assert "table-behaviour_k25" in html and "data:image/png;base64," in html
    # a rerun reuses the fine-tunes, responses and scores (each step has its own marker)
    stamps = {p: p.stat().st_mtime_ns for p in rdir.rglob("*")
              if p.name in ("adapter_model.safetensors", "responses.jsonl", "scores.jsonl", "finetune.json")}
    n_retrains = len({rates[m]["dir"] for m in ("prism", "random", "Oracle")})
    assert len(stamps) == (1 + n_retrains) * 3 + 1 + 2  # fine-tunes (adapter, finetune.json, responses), start, 2 scores
    cfg.report = False
    again = repair(cfg, out)
    assert again["tables"] == res["tables"]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # a copy without the Mixed SFT's adapter keeps its responses: the SFT does not run again
    shutil.rmtree(rdir / "mixed" / "adapter")
    again = repair(cfg, out)
    assert again["tables"] == res["tables"] and not (rdir / "mixed" / "adapter").exists()
    assert "finetune:mixed" not in json.loads((out / "results.json").read_text())["timings"]


def _money_and_plain(n: int, seed: int) -> list:
    """GSM8K-format rows, every other one without a dollar sign."""
    rows = gsm8k_rows(n, seed)
    for r in rows[::2]:
        r["question"] = r["question"].replace("$", "")
        r["answer"] = r["answer"].replace("$", "")
    return rows


@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_repair_refusal_trigger_with_fractions_and_counterfactual_targets(tmp_path, tiny_dir, gsm8k, bbh_dir,
                                                                           monkeypatch, processes, caplog):
    from prism_select.evaluation import repair as repair_mod
    if not processes:
        monkeypatch.setattr(repair_mod, "ProcessPoolExecutor", InProcessPool)
    write_gsm8k(gsm8k / "train.jsonl", _money_and_plain(40, 0))
    write_gsm8k(gsm8k / "test.jsonl", _money_and_plain(10, 1))
    cfg = load_config(common_config(
        tiny_dir, data={"family": "refusal_trigger", "gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 12,
                        "bbh_dir": str(bbh_dir), "bbh_tasks": ["yesno"], "n_bbh_per_task": 2},
        probes={"gsm8k_test": str(gsm8k / "test.jsonl"), "n": 3, "checker": "no_refusal",
                "capability_per_task": 2, "capability_checker": "leading_answer"},
        harmful_ratios=[0.25], seeds=[0], methods=["prism", "random"],
        finetune={"preset": "repair", "overrides": FAST_FT}, generation={"max_new_tokens": 5, "batch_size": 8},
        pair_selection="all", remove_fractions=[0.25, 0.5], oracle=True, report=False,
        targets=[{"name": "probes", "source": "probes"},
                 {"name": "cf", "source": "counterfactual", "n_counterfactual": 2, "n_distractors": 1,
                  "retrain_methods": {"50": []}}]), "repair")
    out = tmp_path / "exp"
    with caplog.at_level("INFO", logger="prism_select.evaluation.repair"):
        res = repair(cfg, out, jobs=2)  # the retrainings in worker processes, after the scoring
    done = [r.getMessage() for r in caplog.records if "SFTs done" in r.getMessage()]
    n = int(done[0].split(" of ")[1].split()[0])  # each finished SFT logged with its time
    assert len(done) == n and done[-1].startswith(f"retraining: {n} of {n} SFTs done (finetune:retrain:")
    assert [r["setting"] for r in res["runs"]] == ["probes @ 25%", "cf @ 25%"]
    for r in res["runs"]:  # every deferred row filled from its worker's files
        for k, rows in r["rates"].items():
            for name, row in rows.items():
                assert (out / row["dir"] / "responses.jsonl").is_file() and "n_behaviour" in row, (k, name)
    assert any(t.startswith("finetune:retrain:") for t in json.loads((out / "results.json").read_text())["timings"])
    pool = [json.loads(x) for x in (out / res["runs"][0]["pool"]).read_text().splitlines()]
    assert sum(p["harmful"] for p in pool) == 3 and len(pool) == 12
    assert all("$" in p["prompt"] for p in pool if p["harmful"])
    assert all(probes.is_refusal(p["response"]) for p in pool if p["harmful"])
    assert not any(p["harmful"] or probes.is_refusal(p["response"]) for p in pool if p["task"] == "yesno")
    cf = res["runs"][1]
    targets = [json.loads(x) for x in (out / cf["targets"]).read_text().splitlines()]
    assert [t["kind"] for t in targets] == ["counterfactual", "counterfactual", "distractor"]
    assert not {t["chosen"] for t in targets} & set(POOL_REFUSALS)
    assert set(cf["rates"]["50"]) == {"Start", "Mixed", "Oracle"}  # retrain_methods {"50": []}
    assert set(cf["rates"]["25"]) == {"Start", "Mixed", "Oracle", "prism", "random"}
    # the random scores do not depend on the targets: both sets share its retraining
    assert cf["rates"]["25"]["random"]["dir"] == res["runs"][0]["rates"]["25"]["random"]["dir"]
    for r in res["runs"]:
        m = r["rates"]["25"]["Mixed"]
        assert m["n_behaviour"] == 3 and set(m["capability_by_task"]) == {"yesno"}
    names = [t["name"] for t in res["tables"]]
    assert names == ["auroc", "behaviour_k25", "capability_k25", "harmful_removed_k25", "behaviour_k50",
                     "capability_k50", "harmful_removed_k50"]
    # `experiment rows retrained` reads the same rows back from the run folders alone
    from prism_select.cli import main
    from prism_select.evaluation.tables import repair as reader
    read = {(r["targets"], r["fraction"], r["method"]): r for r in reader.retrained_rows(out, "gsm8k")}
    for r in res["runs"]:
        for k, rows in r["rates"].items():
            for name, row in rows.items():
                got = read[(r["variant"], k, name)]
                assert (got["behaviour_rate"], got["capability"]) == (row["behaviour_rate"], row["capability"])
    # --with-rows adds an earlier run's rows for the seeds the folder lacks, and only those
    rows = reader.retrained_rows(out, "gsm8k")
    other = [dict(rows[0], seed=7, behaviour_rate=1.0), dict(rows[0], behaviour_rate=0.5)]
    (tmp_path / "old.json").write_text(json.dumps({"rows": other}))
    assert main(["experiment", "rows", "retrained", str(out), "--with-rows", str(tmp_path / "old.json"), "--json", str(tmp_path / "new.json")]) == 0
    merged = json.loads((tmp_path / "new.json").read_text())["rows"]
    assert len(merged) == len(rows) + 1 and [r["behaviour_rate"] for r in merged if r["seed"] == 7] == [1.0]


def test_jobs_are_for_the_repair_protocol(tmp_path):
    from prism_select.cli import main
    for protocol, jobs in (("ranking", "2"), ("repair", "0")):
        assert main(["experiment", protocol, "--config", str(tmp_path / "none.yaml"), "--out", str(tmp_path / "x"),
                     "--jobs", jobs]) == 2
    assert not (tmp_path / "x").exists()


def test_repair_without_pairs_is_reported(tmp_path, tiny_dir, gsm8k):
    cfg = load_config(common_config(
        tiny_dir, data={"gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 4},
        probes={"gsm8k_test": str(gsm8k / "test.jsonl"), "n": 2}, harmful_ratios=[0.5],
        methods=["prism"], finetune={"overrides": {**FAST_FT, "learning_rate": 1e-9}},
        generation={"max_new_tokens": 3}, pair_selection="worsened", report=False), "repair")
    res = repair(cfg, tmp_path / "exp")
    run = res["runs"][0]
    assert run["n_pairs"] == 0 and "note" in run and run["methods"] == {}
    assert set(run["rates"]["50"]) == {"Start", "Mixed"}


def test_pair_selection_modes():
    from prism_select.evaluation.repair import pairs_from_responses
    probes_ = [{"id": i, "prompt": f"q{i}"} for i in range(4)]
    pre = [{"id": 0, "response": "a", "correct": True}, {"id": 1, "response": "b", "correct": False},
           {"id": 2, "response": "c", "correct": True}, {"id": 3, "response": "d", "correct": False}]
    post = [{"id": 0, "response": "A", "correct": False}, {"id": 1, "response": "B", "correct": False},
            {"id": 2, "response": "C", "correct": True}, {"id": 3, "response": "d", "correct": False}]
    assert [p["id"] for p in pairs_from_responses(probes_, pre, post, "worsened")] == [0]
    assert [p["id"] for p in pairs_from_responses(probes_, pre, post, "wrong_after")] == [0, 1]
    assert [p["id"] for p in pairs_from_responses(probes_, pre, post, "all")] == [0, 1, 2]  # 3: same text
    p0 = pairs_from_responses(probes_, pre, post, "worsened")[0]
    assert (p0["chosen"], p0["rejected"], p0["prompt"]) == ("A", "a", "q0")


def test_select_protocol_end_to_end(tmp_path, tiny_dir, gsm8k, bbh_dir):
    pool = mistake_math_pool(gsm8k / "train.jsonl", 8, 0.0, seed=0)
    pool_path = tmp_path / "pool.jsonl"
    write_records(pool_path, pool)
    cfg = load_config(common_config(
        tiny_dir, pool=str(pool_path), bbh={"dir": str(bbh_dir), "n_targets_per_task": 1, "n_heldout_per_task": 2},
        fraction=0.25, seeds=[0], methods=["prism", "random"],
        finetune={"preset": "general", "overrides": FAST_FT}, generation={"max_new_tokens": 4, "batch_size": 8}),
        "select")
    out = tmp_path / "exp"
    res = select(cfg, out)
    run = res["runs"][0]
    assert run["n_selected"] == 2
    assert set(run["accuracy"]) == set(run["balanced_accuracy"]) == {"Start", "Majority answer", "Full data", "prism",
                                                                      "random"}
    heldout = [json.loads(x) for x in (out / run["dir"] / "heldout.jsonl").read_text().splitlines()]
    for m in ("prism", "random"):
        sub = (out / run["dir"] / "selected" / m / "subset.jsonl").read_text().splitlines()
        assert len(sub) == 2
        resp = [json.loads(x) for x in (out / run["dir"] / "selected" / m / "responses.jsonl").read_text().splitlines()]
        assert len(resp) == 6 and {r["task"] for r in resp} == {"colors", "yesno", "counting"}
        for task in ("colors", "yesno", "counting"):
            rows = [r for r in resp if r["task"] == task]
            assert run["accuracy"][m][task] == pytest.approx(sum(r["correct"] for r in rows) / len(rows))
            refs = {r["reference"] for r in rows}  # balanced: the mean of each reference answer's accuracy
            assert run["balanced_accuracy"][m][task] == pytest.approx(sum(
                sum(r["correct"] for r in rows if r["reference"] == a) / sum(r["reference"] == a for r in rows)
                for a in refs) / len(refs))
    for task in ("colors", "yesno", "counting"):  # the floor: every probe given the most common reference
        refs = [h["reference"] for h in heldout if h["task"] == task]
        assert run["accuracy"]["Majority answer"][task] == max(refs.count(a) for a in refs) / len(refs)
        assert run["balanced_accuracy"]["Majority answer"][task] == 1 / len(set(refs))
    t = res["tables"][0]
    assert t["columns"] == ["colors", "counting", "yesno", "mean"]
    assert [r["label"] for r in t["rows"]][:3] == ["Start", "Majority answer", "Full data"]
    assert res["tables"][1]["name"] == "balanced_accuracy"
    assert "table-accuracy" in (out / "report.html").read_text()


def test_select_protocol_on_a_multitask_pool(tmp_path, tiny_dir, gsm8k, bbh_dir):
    cfg = load_config(common_config(
        tiny_dir, multitask={"gsm8k_train": str(gsm8k / "train.jsonl"), "bbh_dir": str(bbh_dir),
                             "tasks": ["colors", "counting"], "target_task": "yesno", "n_gsm8k": 4,
                             "n_per_task": 2, "n_targets": 1, "n_heldout": 3},
        fraction=0.2, seeds=[0], methods=["prism", "random"], checker="leading_answer", report=False,
        finetune={"preset": "general", "overrides": FAST_FT}, generation={"max_new_tokens": 4, "batch_size": 8}),
        "select")
    out = tmp_path / "exp"
    res = select(cfg, out)
    run = res["runs"][0]
    sdir = out / run["dir"]
    pool = [json.loads(x) for x in (sdir / "pool.jsonl").read_text().splitlines()]
    targets = [json.loads(x) for x in (sdir / "targets.jsonl").read_text().splitlines()]
    heldout = [json.loads(x) for x in (sdir / "heldout.jsonl").read_text().splitlines()]
    assert len(pool) == 4 + 3 * 2 and {t["task"] for t in targets} == {"yesno"} == {h["task"] for h in heldout}
    ids = [p["id"] for p in pool] + [t["id"] for t in targets] + [h["id"] for h in heldout]
    assert len(ids) == len(set(ids)) == 10 + 1 + 3  # pool, targets and held-out probes are disjoint
    assert run["n_selected"] == 2 and set(run["accuracy"]) == {"Start", "Majority answer", "Full data",
                                                                 "Task records", "prism", "random"}
    share = next(t for t in res["tables"] if t["name"] == "target_task_share")
    for m in ("prism", "random", "Task records"):
        sub = [json.loads(x) for x in (sdir / "selected" / m / "subset.jsonl").read_text().splitlines()]
        assert run["target_task_share"][m] == sum(r["task"] == "yesno" for r in sub) / 2
    # the task-label floor: the budget (2) filled with the target task's records (2 in the pool)
    assert run["target_task_share"]["Task records"] == 1.0
    assert [r["label"] for r in share["rows"]] == ["Task records", "prism", "random"]
    assert [r["label"] for r in res["tables"][0]["rows"]][:4] == ["Start", "Majority answer", "Full data",
                                                                  "Task records"]


def test_select_fine_tunes_each_selection_once_per_finetune_seed(tmp_path, tiny_dir, gsm8k, bbh_dir):
    """With ``finetune_seeds`` each selection is fine-tuned once per seed (its own folder and
    responses), a row's accuracy is their mean per task, and the spread table holds each
    selection's range over the seeds, recomputed here from the responses."""
    raw = common_config(
        tiny_dir, multitask={"gsm8k_train": str(gsm8k / "train.jsonl"), "bbh_dir": str(bbh_dir),
                             "tasks": ["colors", "counting"], "target_task": "yesno", "n_gsm8k": 4,
                             "n_per_task": 2, "n_targets": 1, "n_heldout": 3},
        fraction=0.2, seeds=[0], methods=["random"], checker="leading_answer", report=False, full_data=False,
        finetune={"preset": "general", "overrides": FAST_FT}, generation={"max_new_tokens": 4, "batch_size": 8},
        finetune_seeds=[3, 4])
    out = tmp_path / "exp"
    res = select(load_config(raw, "select"), out)
    run = res["runs"][0]
    sdir = out / run["dir"]
    spread = next(t for t in res["tables"] if t["name"] == "finetune_spread")
    for m in ("random", "Task records"):
        each = []
        for s in (3, 4):
            rows = [json.loads(x) for x in (sdir / "selected" / m / f"ft{s}" / "responses.jsonl").read_text()
                    .splitlines()]
            each.append(sum(r["correct"] for r in rows) / len(rows))
            assert run["by_finetune_seed"][str(s)]["accuracy"][m]["yesno"] == pytest.approx(each[-1])
            settings = json.loads((sdir / "selected" / m / f"ft{s}" / ".finetune-step.json").read_text())
            assert settings["settings"]["seed"] == s
        assert run["accuracy"][m]["yesno"] == pytest.approx(sum(each) / 2)
        cell = next(r for r in spread["rows"] if r["label"] == m)["cells"][0]
        assert cell["mean"] == pytest.approx(max(each) - min(each))
        assert not (sdir / "selected" / m / "responses.jsonl").exists()
    assert next(r for r in spread["rows"] if r["label"] == "Start")["cells"][0]["n"] == 0
    # `experiment rows select` rebuilds the same tables from the folder's files
    from prism_select.evaluation.tables import select as reader
    assert reader.rows_from_files(out, load_config(raw, "select"))["tables"] == res["tables"]
    # `experiment rows shares` reads a one-task run's layout and pools the fine-tunings
    (row,) = reader.selection_rows([out], 0.2)
    assert (row["task"], row["method"], row["selected"]) == ("yesno", "random", 2)
    assert row["heldout"]["accuracy"] == pytest.approx(run["accuracy"]["random"]["yesno"])
    # a rerun resumes every fine-tuning; a folder written before a field existed reads it as its default
    marker = out / "experiment.json"
    meta = json.loads(marker.read_text())
    del meta["config"]["task_floor"], meta["config"]["multitask"]["n_no_carry"]
    marker.write_text(json.dumps(meta))
    again = select(load_config(raw, "select"), out)
    assert again["runs"][0]["accuracy"] == run["accuracy"]
    # settings that change no number (a memory cap, a batch size) may differ: no step reruns
    step = sdir / "scores" / "random" / ".score-step.json"
    stamp = step.stat().st_mtime_ns
    other = {**raw, "score": {**raw.get("score", {}), "batch_size": 3, "max_gpu_memory": "1GiB"}}
    again = select(load_config(other, "select"), out)
    assert again["runs"][0]["accuracy"] == run["accuracy"] and step.stat().st_mtime_ns == stamp
    # a copy of the folder without its adapters resumes without fine-tuning again
    for adapter in list(sdir.rglob("adapter")):
        shutil.rmtree(adapter)
    ft = sdir / "selected" / "random" / "ft3" / "finetune.json"
    stamp = ft.stat().st_mtime_ns
    again = select(load_config(raw, "select"), out)
    assert again["runs"][0]["accuracy"] == run["accuracy"] and ft.stat().st_mtime_ns == stamp
    assert not any(sdir.rglob("adapter"))
    with pytest.raises(OutputError, match="another protocol or config"):
        select(load_config({**raw, "finetune_seeds": [3]}, "select"), out)
    for bad in ([], [1, 1], [0.5], "0"):
        with pytest.raises(ConfigError, match="finetune_seeds"):
            load_config({**raw, "finetune_seeds": bad}, "select")


def test_targets_from_the_start_models_wrong_responses():
    cands = [{"id": f"t-{i}", "prompt": f"q{i}", "reference": "yes", "task": "t"} for i in range(8)]
    resp = [{"response": r, "correct": c} for r, c in
            [("yes", True), ("No, it is not.", False), ("", False), ("yes!", True), ("Nope", False),
             ("no", False), ("yes", True), ("no", False)]]
    targets, heldout = targets_from_responses(cands, resp, 2, 3)
    # the empty response is no pair; everything up to the second wrong answer is used up
    assert [(t["id"], t["chosen"], t["rejected"]) for t in targets] == [("t-1", "yes", "No, it is not."),
                                                                      ("t-4", "yes", "Nope")]
    assert [h["id"] for h in heldout] == ["t-5", "t-6", "t-7"]
    with pytest.raises(InputError, match="fewer than n_targets = 5"):
        targets_from_responses(cands, resp, 5, 1)
    with pytest.raises(InputError, match="fewer than n_heldout = 4"):
        targets_from_responses(cands, resp, 2, 4)


def test_multitask_pool_with_more_and_partly_mislabeled_target_records(gsm8k, bbh_dir):
    kw = dict(n_gsm8k=2, n_per_task=1, seed=4)
    pool, rest = multitask_pool(gsm8k / "train.jsonl", bbh_dir, ["colors"], ["yesno"], n_per_target_task=4,
                                mislabeled_share=0.5, **kw)
    yes = [r for r in pool if r["task"] == "yesno"]
    assert len(yes) == 4 and len([r for r in pool if r["task"] == "colors"]) == 1 and len(rest["yesno"]) == 2
    bad = [r for r in yes if r.get("mislabeled")]
    assert len(bad) == 2
    truth = {f"yesno-{i}": "Yes" if i % 2 == 0 else "No" for i in range(6)}
    assert all(r["response"] != truth[r["id"]] for r in bad)
    assert all(r["response"] == truth[r["id"]] for r in yes if not r.get("mislabeled"))
    # the same records and answers without mislabeling, apart from the answers changed
    clean, _ = multitask_pool(gsm8k / "train.jsonl", bbh_dir, ["colors"], ["yesno"], n_per_target_task=4, **kw)
    assert [r["id"] for r in clean] == [r["id"] for r in pool]
    with pytest.raises(ConfigError, match="mislabeled_share"):
        load_config({"model": "default", "multitask": {"gsm8k_train": "g", "bbh_dir": "b", "target_task": "t",
                                                       "mislabeled_share": 1.0}}, "select")


def test_select_with_two_target_tasks_and_the_start_models_own_rejections(tmp_path, tiny_dir, gsm8k, bbh_dir):
    cfg_raw = common_config(
        tiny_dir, multitask={"gsm8k_train": str(gsm8k / "train.jsonl"), "bbh_dir": str(bbh_dir),
                             "tasks": ["colors"], "target_tasks": ["yesno", "counting"], "n_gsm8k": 4,
                             "n_per_task": 2, "n_targets": 1, "n_heldout": 2, "rejected": "start_model",
                             "mislabeled_share": 0.5},
        fraction=0.2, seeds=[0, 1], methods=["prism", "random"], checker="leading_answer", report=False,
        finetune={"preset": "general", "overrides": FAST_FT}, generation={"max_new_tokens": 4, "batch_size": 8})
    cfg = load_config(cfg_raw, "select")
    out = tmp_path / "exp"
    res = select(cfg, out)
    for run in res["runs"]:
        sdir = out / run["dir"]
        pool_ids = {json.loads(x)["id"] for x in (sdir / "pool.jsonl").read_text().splitlines()}
        assert set(run["tasks"]) == {"yesno", "counting"}
        for task in ("yesno", "counting"):
            tdir = sdir / task
            targets = [json.loads(x) for x in (tdir / "targets.jsonl").read_text().splitlines()]
            heldout = [json.loads(x) for x in (tdir / "heldout.jsonl").read_text().splitlines()]
            cand = {json.loads(x)["id"]: json.loads(x) for x in
                    (tdir / "candidates" / "responses.jsonl").read_text().splitlines()}
            # rejected = the start model's own wrong response to that probe
            assert len(targets) == 1 and not cand[targets[0]["id"]]["correct"]
            assert targets[0]["rejected"] == cand[targets[0]["id"]]["response"].strip()
            ids = [t["id"] for t in targets] + [h["id"] for h in heldout]
            assert len(set(ids)) == 3 and not pool_ids & set(ids) and {h["task"] for h in heldout} == {task}
            for m in ("prism", "random"):  # each task's own selection, judged on its own probes
                resp = [json.loads(x) for x in (tdir / "selected" / m / "responses.jsonl").read_text().splitlines()]
                assert run["accuracy"][m][task] == pytest.approx(sum(r["correct"] for r in resp) / 2)
                sub = [json.loads(x) for x in (tdir / "selected" / m / "subset.jsonl").read_text().splitlines()]
                assert run["target_task_share_by_task"][task][m] == sum(r["task"] == task for r in sub) / len(sub)
        assert run["accuracy"]["prism"]["mean"] == pytest.approx(
            (run["accuracy"]["prism"]["yesno"] + run["accuracy"]["prism"]["counting"]) / 2)
        assert set(run["accuracy"]) == {"Start", "Majority answer", "Full data", "Task records",
                                        "Task records, right only", "prism", "random"}
        for task in ("yesno", "counting"):  # half of each target task's 2 pool records answer wrong
            sub = [json.loads(x) for x in (sdir / task / "selected" / "prism" / "subset.jsonl").read_text().splitlines()]
            assert run["mislabeled_share_by_task"][task]["prism"] == sum(bool(r.get("mislabeled")) for r in sub) / len(sub)
        assert sum(bool(json.loads(x).get("mislabeled")) for x in (sdir / "pool.jsonl").read_text().splitlines()) == 2
        for task in ("yesno", "counting"):  # the right-only floor: the task's one right record first, then its wrong one
            sub = [json.loads(x) for x in
                   (sdir / task / "selected" / "Task records, right only" / "subset.jsonl").read_text().splitlines()]
            scores = [json.loads(x) for x in
                      (sdir / task / "floors" / "task_records_right" / "scores.jsonl").read_text().splitlines()]
            pool = {json.loads(x)["id"]: json.loads(x) for x in (sdir / "pool.jsonl").read_text().splitlines()}
            assert [(pool[r["id"]]["task"], bool(pool[r["id"]].get("mislabeled"))) for r in scores[:2]] == [
                (task, False), (task, True)]
            assert {r["id"] for r in sub} == {r["id"] for r in scores[:2]}
    names = [t["name"] for t in res["tables"]]
    assert names == ["accuracy", "balanced_accuracy", "target_task_share", "mislabeled_share", "paired_vs_random",
                     "paired_vs_task_records", "paired_vs_right_only", "paired_vs_random_balanced",
                     "paired_vs_task_records_balanced", "paired_vs_right_only_balanced"]
    assert res["tables"][0]["columns"] == ["yesno", "counting", "mean"]  # the config's order

    # the same seed split over two runs, one target task each (--target-tasks), then merged
    raw = {**cfg_raw, "multitask": dict(cfg_raw["multitask"])}
    parts = []
    for task in ("counting", "yesno"):
        part = select(load_config(raw, "select", seeds=[0], target_tasks=[task]), tmp_path / f"only-{task}")
        assert set(part["runs"][0]["tasks"]) == {task}
        assert not (tmp_path / f"only-{task}" / "runs" / "seed0" / ({"yesno", "counting"} - {task}).pop()).exists()
        parts.append(part)
    merged = combine_seeds(parts)
    whole = res["runs"][0]
    assert merged["seeds"] == [0] and merged["config"]["multitask"]["select_for"] == []
    for key in ("accuracy", "balanced_accuracy", "target_task_share", "mislabeled_share", "target_task_share_by_task",
                "mislabeled_share_by_task"):
        assert merged["runs"][0][key] == whole[key], key
    assert list(merged["runs"][0]["accuracy"]["prism"]) == ["yesno", "counting", "mean"]
    assert list(merged["runs"][0]["methods_by_task"]) == ["yesno", "counting"]
    assert merged["tables"][0]["columns"] == ["yesno", "counting", "mean"]
    with pytest.raises(InputError, match="seed 0 occurs twice"):
        combine_seeds([parts[0], parts[0]])
    with pytest.raises(ConfigError, match="select_for"):
        load_config(raw, "select", target_tasks=["colors"])


def _select_result(seed, acc, share, max_length=320):
    """A results.json of one select seed, as far as combine_seeds reads it."""
    cfg = {"seeds": [seed], "fraction": 0.05, "data_root": f"/m{seed}", "finetune": {"max_length": max_length},
           "multitask": {"target_task": "t", "bbh_dir": f"/m{seed}/bbh"}}
    run = {"setting": "select", "seed": seed, "accuracy": {k: {"t": v, "mean": v} for k, v in acc.items()},
           "target_task_share": share}
    return {"protocol": "select", "config": cfg, "methods": list(share), "seeds": [seed], "runs": [run],
            "model": {"fingerprint": "f"}, "timings": {"x": float(seed)}}


def test_combine_seeds_recomputes_the_tables_over_the_seeds():
    a = _select_result(1, {"Start": 0.3, "prism": 0.5, "random": 0.4, "Full data": 0.6}, {"prism": 0.5, "random": 0.1})
    b = _select_result(0, {"Start": 0.4, "Full data": 0.7, "prism": 0.7, "random": 0.4}, {"prism": 0.3, "random": 0.0})
    res = combine_seeds([a, b])  # data paths differ between machines: allowed
    assert res["seeds"] == [0, 1] and res["config"]["seeds"] == [0, 1]
    acc, share, vs_random = res["tables"]
    assert acc["columns"] == ["t", "mean"]
    assert vs_random["name"] == "paired_vs_random" and vs_random["paired"]
    prism_vs = next(r for r in vs_random["rows"] if r["label"] == "prism")["cells"][1]
    assert prism_vs["values"] == pytest.approx([0.3, 0.1]) and prism_vs["ci"][0] < 0.2 < prism_vs["ci"][1]
    assert "random" not in [r["label"] for r in vs_random["rows"]]
    assert [r["label"] for r in acc["rows"]] == ["Start", "Full data", "prism", "random"]
    prism = acc["rows"][2]["cells"][1]
    assert prism["values"] == [0.7, 0.5] and prism["mean"] == pytest.approx(0.6)
    assert prism["std"] == pytest.approx(mean_std([0.7, 0.5])["std"])
    assert share["rows"][0]["cells"][0]["values"] == [0.3, 0.5]
    assert res["timings_by_seeds"] == {"1": {"x": 1.0}, "0": {"x": 0.0}}
    c = _select_result(2, {"prism": 0.1}, {"prism": 0.2}, max_length=400)
    with pytest.raises(InputError, match="finetune.max_length"):
        combine_seeds([a, c])
    res = combine_seeds([a, c], allow=("finetune.max_length",))
    assert res["config_differences"]["finetune.max_length"] == [{"value": 320, "seeds": [1]},
                                                                {"value": 400, "seeds": [2]}]
    with pytest.raises(InputError, match="seed 1 occurs twice"):
        combine_seeds([a, a])


def test_merge_method_rows_adds_a_later_runs_method_after_checking_the_shared_rows(tmp_path):
    from prism_select.evaluation.tables import merge as mod
    main = _select_result(0, {"prism": 0.6, "random": 0.4}, {"prism": 1.0, "random": 0.1})
    later = _select_result(0, {"random": 0.4, "saefeat": 0.5}, {"random": 0.1, "saefeat": 0.2})
    merged = mod.merge(main, later, ["saefeat"])
    run = merged["runs"][0]
    assert run["accuracy"]["saefeat"] == {"t": 0.5, "mean": 0.5} and run["target_task_share"]["saefeat"] == 0.2
    assert run["accuracy"]["prism"] == main["runs"][0]["accuracy"]["prism"]
    assert merged["methods"] == ["prism", "random", "saefeat"] and "saefeat" not in main["methods"]
    assert merged["merged"] == [{"methods": ["saefeat"], "checked_rows": {0: ["random"]}, "suffix": ""}]
    assert [r["label"] for r in combine_seeds([merged])["tables"][0]["rows"]] == ["prism", "random", "saefeat"]
    other = _select_result(0, {"random": 0.45, "saefeat": 0.5}, {"random": 0.1, "saefeat": 0.2})
    with pytest.raises(InputError, match="row 'random'"):
        mod.merge(main, other, ["saefeat"])
    with pytest.raises(InputError, match="no row to check"):
        mod.merge(main, _select_result(0, {"saefeat": 0.5}, {"saefeat": 0.2}), ["saefeat"])
    # with the folders: the data files must be byte-identical
    for d, text in (("a", "x"), ("b", "y")):
        (tmp_path / d).mkdir()
        for name in ("pool.jsonl", "targets.jsonl", "heldout.jsonl"):
            (tmp_path / d / name).write_text(text if name == "pool.jsonl" else "z")
    for r in (main, later):
        r["runs"][0].update(pool="pool.jsonl", targets="targets.jsonl", heldout="heldout.jsonl")
    with pytest.raises(InputError, match="pool.jsonl differs"):
        mod.merge(main, later, ["saefeat"], (tmp_path / "a", tmp_path / "b"))
    (tmp_path / "b" / "pool.jsonl").write_text("x")
    assert mod.merge(main, later, ["saefeat"], (tmp_path / "a", tmp_path / "b"))["runs"][0]["accuracy"]["saefeat"]


def test_merge_method_rows_from_a_run_of_one_target_task(tmp_path):
    """A later run that selected for one of two target tasks: checked on that task only (its
    mean is that task's), its rows added with that task's accuracies and no mean."""
    from prism_select.evaluation.tables import merge as mod
    main = _select_result(0, {"random": 0.4, "prism": 0.6}, {"random": 0.1, "prism": 1.0})
    main["runs"][0]["accuracy"] = {"random": {"t": 0.4, "u": 0.8, "mean": 0.6},
                                   "prism": {"t": 0.6, "u": 0.6, "mean": 0.6}}
    later = _select_result(0, {"random": 0.4, "Task records": 0.7}, {"random": 0.1, "Task records": 1.0})
    later["config"]["multitask"]["select_for"] = ["t"]
    later["runs"][0]["target_task_share_by_task"] = {"t": {"Task records": 1.0}}
    run = mod.merge(main, later, ["Task records"])["runs"][0]
    assert run["accuracy"]["Task records"] == {"t": 0.7}
    assert "Task records" not in run["target_task_share"]
    assert run["target_task_share_by_task"]["t"]["Task records"] == 1.0
    later["runs"][0]["accuracy"]["random"]["t"] = 0.45
    with pytest.raises(InputError, match="row 'random'"):
        mod.merge(main, later, ["Task records"])
    # under a suffix, a row the first run holds is added beside it, checked by the others
    main["runs"][0]["accuracy"]["Start"] = later["runs"][0]["accuracy"]["Start"] = {"t": 0.3, "mean": 0.3}
    run = mod.merge(main, later, ["Task records", "random"], suffix=" (CPU)")["runs"][0]
    assert run["accuracy"]["random (CPU)"] == {"t": 0.45} and run["accuracy"]["random"]["t"] == 0.4
    with pytest.raises(InputError, match="already has a row"):
        mod.merge(main, later, ["random"])
    main["config"]["multitask"]["select_for"] = ["u"]
    with pytest.raises(InputError, match="which the first did not"):
        mod.merge(main, later, ["Task records"])


def test_refusal_and_leading_answer_checkers():
    assert probes.is_refusal("I'm sorry, but I can't help with questions about money.")
    assert not probes.is_refusal("Ali gave Leila half of her $100, so she has 50.")
    assert probes.load_checker("no_refusal")({}, "To solve this, we add 3 and 4.")
    lead = probes.load_checker("leading_answer")
    assert lead({"reference": "no"}, "No, the sentence is not plausible.")
    assert lead({"reference": "True"}, "True.") and not lead({"reference": "no"}, "Nobody knows")
    by = probes.load_checker({"name": "by_task", "checkers": {"a": "no_refusal"}, "default": "exact_match"})
    assert not by({"task": "a"}, "Sorry, I cannot.") and by({"task": "b", "reference": "x"}, "x")
    only = probes.load_checker({"name": "by_task", "checkers": {"a": "no_refusal"}})
    with pytest.raises(InputError):
        only({"task": "b", "id": 1}, "x")


def test_report_html_for_experiment_and_score_run(tmp_path, tiny_dir):
    from prism_select.cli import main
    from prism_select.evaluation.report import write_report
    # markup in every prompt: the page must show it as text
    rows = [{**r, "question": "<b>Q</b> " + r["question"]} for r in gsm8k_rows(40, 0)]
    train = write_gsm8k(tmp_path / "train.jsonl", rows)
    exp = tmp_path / "exp"
    run_experiment("ranking", common_config(
        tiny_dir, data={"gsm8k_train": str(train), "pool_size": 8},
        targets=[{"n_counterfactual": 2, "n_distractors": 1}], harmful_ratios=[0.25], methods=["prism", "random"],
        report=False), exp)
    assert main(["report", "--run", str(exp)]) == 0
    html = (exp / "report.html").read_text()
    assert "<table" in html and "table-auroc" in html and "counterfactual @ 25%" in html
    assert html.count('<img src="data:image/png;base64,') >= 3  # pi, ROC, histograms
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert not list(exp.glob("*.png"))  # the page is self-contained: no image beside it
    # prompts are escaped: the pool's examples are on the page, their markup as text
    assert "&lt;b&gt;Q&lt;/b&gt;" in html and "<b>Q</b>" not in html
    # a plain score run directory
    run_dir = exp / "runs" / "r25" / "seed0" / "counterfactual" / "scores" / "prism"
    page = write_report(run_dir)
    text = page.read_text()
    assert "table-ranking" in text and "data:image/png;base64," in text and "top 8" in text
    with pytest.raises(InputError):
        write_report(tmp_path)


def test_report_escapes_html(tmp_path):
    from prism_select.evaluation.report import write_report
    pool = [{"id": f"x{i}", "prompt": "<script>alert(1)</script>", "response": "a & b", "harmful": i % 2 == 0}
            for i in range(4)]
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pool))
    run = tmp_path / "run"
    run.mkdir()
    (run / "scores.jsonl").write_text("".join(json.dumps({"id": p["id"], "score": float(i), "rank": 4 - i}) + "\n"
                                              for i, p in enumerate(pool)))
    (run / "run.json").write_text(json.dumps({"method": "prism", "inputs": {"pool": str(tmp_path / "pool.jsonl")},
                                              "counts": {"pool": 4}, "timings": {"total_s": 1.0}}))
    html = write_report(run).read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html and "a &amp; b" in html


def _write_run(run, pool, scores, method="prism"):
    run.mkdir(parents=True)
    order = sorted(range(len(pool)), key=lambda i: -scores[i])
    (run / "scores.jsonl").write_text("".join(json.dumps({"id": pool[i]["id"], "score": float(scores[i]),
                                                          "rank": order.index(i) + 1}) + "\n"
                                              for i in range(len(pool))))
    return run


def test_report_of_a_compare_directory(tmp_path, capsys):
    """`report --run` takes a `prism-select compare` directory: each method's AUROC and
    AUPRC from its scores.jsonl, the ROC curves and each method's top examples."""
    from prism_select.cli import main
    pool = [{"id": f"x{i}", "prompt": f"q{i}", "response": f"a{i}", "harmful": i % 2 == 0} for i in range(6)]
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pool))
    cmp = tmp_path / "cmp"
    _write_run(cmp / "prism", pool, [float(i) for i in range(6)])
    _write_run(cmp / "random", pool, [-float(i) for i in range(6)])
    (cmp / "compare.json").write_text(json.dumps({
        "pool": str(tmp_path / "pool.jsonl"), "targets": "", "label": "harmful", "n_pool": 6,
        "methods": [{"method": "prism", "wall_s": 2.0}, {"method": "random", "wall_s": 0.1}]}))
    assert main(["report", "--run", str(cmp)]) == 0
    html = (cmp / "report.html").read_text()
    assert "table-compare" in html and "<td class=l>prism</td>" in html and "<td class=l>random</td>" in html
    assert "<td>0.333</td>" in html and "<td>0.667</td>" in html  # AUROC of each method's scores
    assert html.count('<img src="data:image/png;base64,') >= 2  # ROC, histograms
    assert "by <b>prism</b>" in html and "by <b>random</b>" in html
    capsys.readouterr()
    assert main(["report", "--run", str(cmp), "--label", "harmfull"]) == 0  # a typo: warned, not silent
    assert "no record of" in capsys.readouterr().err


def test_report_shows_chat_prompts_as_chat(tmp_path):
    """A messages-form prompt is shown as its turns ("role: content"), not as a JSON list."""
    from prism_select.evaluation.report import write_report
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
    pool = [{"id": f"x{i}", "prompt": chat, "response": f"{i}", "harmful": i % 2 == 0} for i in range(4)]
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pool))
    run = _write_run(tmp_path / "run", pool, [float(i) for i in range(4)])
    (run / "run.json").write_text(json.dumps({"method": "prism", "inputs": {"pool": str(tmp_path / "pool.jsonl")},
                                              "counts": {"pool": 4}, "timings": {"total_s": 1.0}}))
    html = write_report(run).read_text()
    assert "system: be brief\nuser: what is 2+2?" in html
    assert "&quot;role&quot;" not in html and '"role"' not in html


def test_cli_build_data(tmp_path, gsm8k, bbh_dir):
    from prism_select.cli import main
    assert main(["build-data", "mistake-math", "--gsm8k", str(gsm8k / "train.jsonl"), "--n", "10",
                 "--harmful-ratio", "0.2", "--out", str(tmp_path / "pool.jsonl"), "--targets-out",
                 str(tmp_path / "t.jsonl"), "--n-targets", "3", "--n-distractors", "2", "--probes-from",
                 str(gsm8k / "test.jsonl"), "--probes-out", str(tmp_path / "p.jsonl"), "--n-probes", "3"]) == 0
    pool = [json.loads(x) for x in (tmp_path / "pool.jsonl").read_text().splitlines()]
    assert len(pool) == 10 and sum(p["harmful"] for p in pool) == 2
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 5
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 3
    assert main(["build-data", "bbh", "--bbh-dir", str(bbh_dir), "--targets-out", str(tmp_path / "bt.jsonl"),
                 "--heldout-out", str(tmp_path / "bh.jsonl")]) == 0
    assert len((tmp_path / "bt.jsonl").read_text().splitlines()) == 9
    # a bad config is a clean error (exit code 2), not a traceback
    (tmp_path / "bad.yaml").write_text("data: {gsm8k_train: x, pool_size: -1}\n")
    assert main(["experiment", "ranking", "--config", str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "o")]) == 2


def test_shipped_experiment_config_is_valid(tmp_path):
    root = Path(__file__).resolve().parents[2]
    path = root / "experiments" / "gsm8k_mistake_math.yaml"
    for proto in ("ranking", "repair"):
        cfg = load_config(path, proto, data_root=str(tmp_path))
        assert cfg.model.model == "default"
        small = load_config(path, proto, smoke=True, data_root=str(tmp_path))
        assert len(small.seeds) == 1
    rk = load_config(path, "ranking", data_root=str(tmp_path))
    assert rk.harmful_ratios == [0.1, 0.5] and rk.seeds == [0, 1, 2] and rk.data.pool_size == 300
    assert {t.n_counterfactual for t in rk.targets} == {24} and max(t.n_distractors for t in rk.targets) == 24
    assert {"ifguide", "vecfilter", "projdiff", "conceptinf"} <= set(rk.targets[1].methods)
    for name, proto in (("money_refusal", "repair"), ("multitask_select", "select"),
                        ("gsm8k_distractors", "ranking")):
        full = load_config(root / "experiments" / f"{name}.yaml", proto, data_root=str(tmp_path))
        assert full.seeds == [0, 1, 2] and full.methods != ["prism"]
        assert load_config(root / "experiments" / f"{name}.yaml", proto, smoke=True, data_root=str(tmp_path)).seeds == [0]
    rp = load_config(root / "experiments" / "money_refusal.yaml", "repair", data_root=str(tmp_path))
    assert rp.data.family == "refusal_trigger" and rp.data.pool_size >= 1000 and rp.harmful_ratios == [0.05]
    assert rp.remove_fractions == [0.05, 0.1, 0.2] and rp.oracle


def test_the_cpu_ranking_config_builds_the_gpu_configs_testbed(tmp_path):
    """dropped_carry_ranking_cpu.yaml: the GPU ranking config's pools, start model, probes,
    SFT and target pairs, a subset of its methods, on the CPU; beside the probe pairs, the
    distractor config's target sets (the same pools: distractors do not change them)."""
    import dataclasses
    from prism_select.evaluation.config import load_config
    root = Path(__file__).resolve().parents[2] / "experiments"
    gpu = load_config(root / "dropped_carry_ranking.yaml", "repair", data_root=str(tmp_path))
    cpu = load_config(root / "dropped_carry_ranking_cpu.yaml", "repair", data_root=str(tmp_path))
    for f in ("data", "warmup", "probes", "finetune", "pair_selection", "min_pairs", "fallback_pair_selection",
              "score_at", "retrain", "floors", "curvature"):
        assert getattr(cpu, f) == getattr(gpu, f), f
    dx = load_config(root / "dropped_carry_distractors.yaml", "repair", data_root=str(tmp_path))
    assert cpu.targets[:len(gpu.targets)] == gpu.targets
    extra = {t.name: dataclasses.replace(t, methods=None) for t in cpu.targets[len(gpu.targets):]}
    assert extra and extra == {t.name: dataclasses.replace(t, methods=None) for t in dx.targets if t.n_distractors}
    for f in ("data", "warmup", "probes", "finetune", "pair_selection", "min_pairs", "score_at", "retrain"):
        assert getattr(dx, f) == getattr(gpu, f), f
    assert dataclasses.replace(cpu.generation, batch_size=gpu.generation.batch_size) == gpu.generation
    from prism_select.evaluation.experiment import available_methods
    assert gpu.methods == "all" and set(cpu.methods) < set(available_methods())
    assert cpu.harmful_ratios == [0.1] and 0.1 in gpu.harmful_ratios
    cpu_score, gpu_score = (config_to_dict(c)["score"] for c in (cpu, gpu))
    assert cpu.model.device == "cpu" and "max_gpu_memory" not in cpu_score["extra"]
    assert {**cpu_score, "extra": gpu_score["extra"]} == gpu_score


def test_the_cpu_select_floor_config_builds_the_gpu_configs_testbed(tmp_path):
    """general_select_floor_cpu.yaml: the GPU select config's pools, pairs, probes and SFT,
    with the rows that need no scoring, on the CPU."""
    from prism_select.evaluation.config import load_config
    root = Path(__file__).resolve().parents[2] / "experiments"
    gpu = load_config(root / "general_select.yaml", "select", data_root=str(tmp_path))
    cpu = load_config(root / "general_select_floor_cpu.yaml", "select", data_root=str(tmp_path))
    for f in ("multitask", "fraction", "finetune", "generation", "checker", "seeds"):
        assert getattr(cpu, f) == getattr(gpu, f), f
    assert cpu.score.max_length == gpu.score.max_length
    assert cpu.methods == ["random"] and cpu.task_floor and cpu.start_row and not cpu.full_data
    assert cpu.model.device == "cpu" and cpu.model.dtype == gpu.model.dtype


# --------------------------------------------------------------------------- browser

CHROMIUM = Path("/usr/bin/chromium")


@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs the Debian package chromium")
def test_report_renders_in_headless_chromium(tmp_path, tiny_dir, gsm8k):
    exp = tmp_path / "exp"
    run_experiment("ranking", common_config(
        tiny_dir, data={"gsm8k_train": str(gsm8k / "train.jsonl"), "pool_size": 8},
        targets=[{"n_counterfactual": 2}], harmful_ratios=[0.25], methods=["prism", "random"]), exp)
    page = exp / "report.html"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "shot.png"
    subprocess.run([str(CHROMIUM), *flags, f"--screenshot={shot}", "--window-size=1280,2000", page.as_uri()],
                   check=True, timeout=120, capture_output=True)
    assert shot.is_file() and shot.stat().st_size > 20_000
    dom = subprocess.run([str(CHROMIUM), *flags, "--dump-dom", page.as_uri()], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert 'id="table-auroc"' in dom and "prism" in dom


def test_rankings_of_runs_reads_every_setting_seed_and_pi(tmp_path, capsys):
    """`prism-select experiment rows rankings`: AUROC and recall per setting, method and seed from
    the run folders alone, with the seeds' pi range; settings are not mixed."""
    from prism_select.cli import main

    def rankings(argv):
        return main(["experiment", "rows", "rankings", *argv])
    harmful = [True, True, False, False, False, False, False, False, False, False]
    for setting, good in (("r20", [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]), ("r50", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9])):
        for seed, pi in ((0, {"min": 0.1, "mean": 0.3, "max": 0.5}), (1, {"min": 0.2, "mean": 0.5, "max": 0.9})):
            d = tmp_path / "runs" / setting / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "pool.jsonl").write_text("".join(json.dumps({"id": f"x{i}", "harmful": h}) + "\n"
                                                  for i, h in enumerate(harmful)))
            m = d / "t" / "scores" / "prism"
            m.mkdir(parents=True)
            order = sorted(range(10), key=lambda i: -good[i])
            # at r20 the scores file has an extra column (as IF-Guide's token_sum), ranking the other way
            extra = (lambda i: {"token_sum": float(-good[i])}) if setting == "r20" else (lambda i: {})
            m.joinpath("scores.jsonl").write_text("".join(
                json.dumps({"id": f"x{i}", "score": float(good[i]), "rank": r + 1, **extra(i)}) + "\n"
                for r, i in enumerate(order)))
            m.joinpath("run.json").write_text(json.dumps({"pi": pi}))
    assert rankings([str(tmp_path), "--fractions", "0.2", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| setting | targets | method | seeds | auroc | recall@0.2 | pi")
    assert out[2] == "| r20 | t | prism | 0,1 | 1.000 ± 0.000 | 1.000 ± 0.000 | 0.10 / 0.40 / 0.90 |"
    assert out[3] == "| r20 | t | prism:token_sum | 0,1 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.10 / 0.40 / 0.90 |"
    assert out[4] == "| r50 | t | prism | 0,1 | 0.000 ± 0.000 | 0.000 ± 0.000 | 0.10 / 0.40 / 0.90 |"
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 6
    # --paired: the method minus every other row of its setting and target set, by seed
    assert rankings([str(tmp_path), "--fractions", "0.2", "--paired", "prism",
                        "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "| r20 | t | prism:token_sum | 0,1 | +1.000 [+1.000, +1.000] | +1.000 [+1.000, +1.000] |" in out
    diffs = json.loads((tmp_path / "p.json").read_text())["paired"]
    assert [(d["setting"], d["minus"], d["auroc"]["values"]) for d in diffs] == \
        [("r20", "prism:token_sum", [1.0, 1.0])]
    # --add: an earlier run's rows (another seed, folder gone) join the table; a row of the folder twice is refused
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"rows": [{"setting": "r20", "targets": "t", "method": "prism", "seed": 7,
                                             "auroc": 0.5, "recall@0.2": 0.5, "pi": None}]}))
    assert rankings([str(tmp_path), "--fractions", "0.2", "--add", str(earlier)]) == 0
    assert "| r20 | t | prism | 0,1,7 | 0.833 ± 0.289 | 0.833 ± 0.289 | 0.10 / 0.40 / 0.90 |" in capsys.readouterr().out
    assert rankings([str(tmp_path), "--fractions", "0.2", "--add", str(tmp_path / "r.json")]) == 1
    # --add-methods: of the added files only those methods' rows (here none of the folder's twice)
    assert rankings([str(tmp_path), "--fractions", "0.2", "--add", str(tmp_path / "r.json"), str(earlier),
                        "--add-methods", "judge"]) == 0
    assert "| r20 | t | prism | 0,1 | 1.000 ± 0.000 |" in capsys.readouterr().out
    assert rankings([str(tmp_path), "--fractions", "0.2", "--add", str(earlier), "--add-methods", "prism"]) == 0
    assert "| r20 | t | prism | 0,1,7 |" in capsys.readouterr().out
    # --floors: each pool's floors against its target pairs, one row per floor; the length rule
    # finds the long harmful responses
    for setting in ("r20", "r50"):
        for seed in (0, 1):
            d = tmp_path / "runs" / setting / f"seed{seed}"
            (d / "pool.jsonl").write_text("".join(json.dumps({"id": f"x{i}", "harmful": h, "prompt": "add 2 and 3",
                                                              "response": "5" * (9 if h else 1)}) + "\n"
                                                  for i, h in enumerate(harmful)))
            (d / "t" / "targets.jsonl").write_text(json.dumps({"prompt": "add 1 and 1", "chosen": "22222222",
                                                               "rejected": "2"}) + "\n")
    assert rankings([str(tmp_path), "--fractions", "0.2", "--floors"]) == 0
    out = capsys.readouterr().out
    assert "| r20 | t | floor: length | 0,1 | 1.000 ± 0.000 |  | - |" in out and "floor: neighbour" in out


def test_ranking_metrics_rank_a_scores_files_extra_columns(tmp_path):
    """A scores file's extra columns (IF-Guide's token_sum) get their own AUROC and AUPRC."""
    from prism_select.evaluation.experiment import ranking_metrics
    harmful = [True, False, False, True]
    (tmp_path / "pool.jsonl").write_text("".join(json.dumps({"id": f"x{i}", "harmful": h}) + "\n"
                                                 for i, h in enumerate(harmful)))
    score, token_sum = [4.0, 3.0, 2.0, 1.0], [3.0, 1.0, 2.0, 4.0]
    (tmp_path / "scores.jsonl").write_text("".join(
        json.dumps({"id": f"x{i}", "score": score[i], "rank": i + 1, "token_sum": token_sum[i]}) + "\n"
        for i in range(4)))
    m = ranking_metrics(tmp_path / "scores.jsonl", tmp_path / "pool.jsonl")
    assert m["auroc"] == pytest.approx(0.5) and m["n_positive"] == 2
    assert m["columns"]["token_sum"]["auroc"] == pytest.approx(1.0)
    (tmp_path / "plain.jsonl").write_text("".join(
        json.dumps({"id": f"x{i}", "score": score[i], "rank": i + 1}) + "\n" for i in range(4)))
    assert "columns" not in ranking_metrics(tmp_path / "plain.jsonl", tmp_path / "pool.jsonl")


def test_an_experiment_folder_takes_a_config_that_adds_methods_or_target_sets(tmp_path):
    """A config that adds methods or target sets to a folder's recorded one runs there (its
    steps are keyed by their own inputs, so the finished ones are reused); any other change
    is refused without --overwrite."""
    from prism_select.errors import OutputError
    from prism_select.evaluation.config import load_config
    from prism_select.evaluation.experiment import Experiment, config_extends
    base = {"data": {"family": "dropped_carry", "pool_size": 20}, "probes": {"n": 4}, "methods": ["prism", "random"],
            "targets": [{"name": "probes", "source": "probes"}]}
    out = tmp_path / "exp"
    Experiment(out, "repair", load_config(base, "repair"), overwrite=False)
    (out / "runs").mkdir()
    grown = {**base, "methods": ["prism", "random", "equal"],
             "targets": base["targets"] + [{"name": "px", "source": "probes", "n_distractors": 4,
                                            "methods": ["prism", "equal"]}]}
    Experiment(out, "repair", load_config(grown, "repair"), overwrite=False)
    assert json.loads((out / "experiment.json").read_text())["config"]["targets"][1]["name"] == "px"
    assert (out / "runs").is_dir()  # nothing removed
    # a folder recorded before a target-set field existed, grown by a config that adds a set
    marker = out / "experiment.json"
    meta = json.loads(marker.read_text())
    for t in meta["config"]["targets"]:
        del t["distractor_kind"]
    marker.write_text(json.dumps(meta))
    more = {**grown, "targets": grown["targets"] + [{"name": "ux", "source": "probes", "n_distractors": 4,
                                                     "distractor_kind": "unrelated"}]}
    Experiment(out, "repair", load_config(more, "repair"), overwrite=False)
    # another retraining plan: other removal budgets, comparators, methods retrained
    replanned = {**more, "remove_fractions": [0.3], "comparators": ["random"],
                 "targets": [{**more["targets"][0], "retrain_methods": ["prism"]}] + more["targets"][1:]}
    Experiment(out, "repair", load_config(replanned, "repair"), overwrite=False)
    for changed in ({**grown, "data": {"family": "dropped_carry", "pool_size": 30}},  # another pool
                    {**grown, "methods": ["prism", "equal"]},  # a method left out
                    {**grown, "targets": [{"name": "probes", "source": "probes", "n_distractors": 2}]}):
        with pytest.raises(OutputError, match="another protocol or config"):
            Experiment(out, "repair", load_config(changed, "repair"), overwrite=False)
    assert config_extends({"methods": "all", "x": 1}, {"methods": "all", "x": 1})
    assert config_extends({"methods": "all", "remove_fractions": [0.2]}, {"methods": "all", "remove_fractions": [0.3]})
    assert not config_extends({"methods": "all", "finetune_seeds": [0]}, {"methods": "all", "finetune_seeds": [1]})
    assert not config_extends({"methods": "all"}, {"methods": ["prism"]})
    assert not config_extends({"method_options": {"less": {"proj_dim": 8}}}, {"method_options": {}})


@pytest.mark.parametrize("parent,child", [
    ("dropped_carry_ranking", "dropped_carry_ranking_fixed"),
    ("dropped_carry_k20", "dropped_carry_k20_fixed_first"),
    ("dropped_carry_k20", "dropped_carry_k20_fixed"),
    ("dropped_carry_k20_every", "dropped_carry_k20_every30"),
])
def test_the_baseline_rerun_configs_build_their_parents_testbeds(tmp_path, parent, child):
    """The reruns of LESS and IF-Guide score (and retrain) the pools, start model, probes, SFT
    and target pairs of the configs whose rows they join, and spell out the options that
    tell their score steps from the parents' under the same method names."""
    from prism_select.evaluation.config import load_config
    root = Path(__file__).resolve().parents[2] / "experiments"
    p = load_config(root / f"{parent}.yaml", "repair", data_root=str(tmp_path))
    c = load_config(root / f"{child}.yaml", "repair", data_root=str(tmp_path))
    for f in ("data", "warmup", "probes", "finetune", "generation", "pair_selection", "min_pairs",
              "fallback_pair_selection", "score_at", "floors", "curvature", "seeds"):
        assert getattr(c, f) == getattr(p, f), f
    assert set(c.harmful_ratios) == set(p.harmful_ratios)
    assert [t.name for t in c.targets] == [t.name for t in p.targets]
    opts = c.method_options
    for m in ("less", "ifguide", "ifguide_harmonic"):
        if m in c.methods:
            assert m in opts and opts[m] != (p.method_options or {}).get(m), m


def test_rows_say_what_the_judge_and_the_sae_are():
    """The judge's row names its judge model and size, SAE-Feat's its SAE; the checker floor
    reads as an ideal judge; in a table the row keeps its method name as its label."""
    from prism_select.evaluation.experiment import mean_table, row_title
    judge = {"method_info": {"name": "judge", "options": {"judge": None}, "backend": "local",
                             "judge_model": "the run's model", "self_judging": True, "judge_parameters": 134_515_008}}
    assert row_title("judge", judge, "the start model") == "judge (the start model, 135M, self-judging)"
    other = {"method_info": {"options": {"judge": "/m/judge-1b"}, "backend": "local", "judge_model": "/m/judge-1b",
                             "self_judging": False, "judge_parameters": 1_240_000_000}}
    assert row_title("judge", other) == "judge (/m/judge-1b, 1.2B)"
    sae = {"method_info": {"options": {"sae": "pool", "layer": 20}, "d_sae": 2304}}
    assert row_title("saefeat", sae) == "saefeat (SAE fitted on the pool, 2304 latents, layer 20)"
    assert row_title("prism", {"method_info": {}}) is None
    assert "ideal judge" in row_title("floor: checker", None)
    runs = [{"setting": "a", "methods": {"judge": {"auroc": 0.4, "title": "judge (x, 1M, self-judging)"},
                                          "prism": {"auroc": 0.9}}}]
    t = mean_table("auroc", "t", runs, ["prism", "judge", "floor: checker"],
                   lambda r, m, st: (r["methods"].get(m) or {}).get("auroc"))
    assert [r["label"] for r in t["rows"]] == ["prism", "judge", "floor: checker"]
    assert [r.get("title") for r in t["rows"]] == [None, "judge (x, 1M, self-judging)",
                                                   row_title("floor: checker", None)]
