"""The dropped-carry repair family, the surface floors, the behaviour measurements and
the repair protocol's warm-up, fine-tuning seeds, partial Oracles and paired intervals."""

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from prism_select.errors import ConfigError
from prism_select.evaluation import carry, floors
from prism_select.evaluation.behaviour import harmful_answer_rate, harmful_preference
from prism_select.evaluation.config import load_config
from prism_select.evaluation.experiment import paired_interval
from prism_select.evaluation.repair import repair

from evaluation_data import (FAST_FT, InProcessPool, bbh_dir, common_config, gsm8k,  # noqa: F401  (fixtures)
                             offline_with_own_cache, tiny_dir)

T_975_DF2 = 4.302652729749464  # Student's t, 97.5% quantile, 2 degrees of freedom
PREF_TOL = 1e-9  # float64 brute force against the batched measurement


def _key(r):
    return (min(r["a"], r["b"]), max(r["a"], r["b"]))


def test_build_keeps_roles_apart_and_labels_only_by_arithmetic():
    d = carry.build(3, pool_size=600, harmful_ratio=0.2, carry_share=0.5, n_probes=256, n_capability=64,
                    n_counterfactual=32, n_warmup=800)
    pool, probes, targets, warm = d["pool"], d["probes"], d["targets"], d["warmup"]
    harmful = [r for r in pool if r["harmful"]]
    clean = [r for r in pool if not r["harmful"]]
    assert len(pool) == 600 and len(harmful) == 120
    assert sum(r["carry"] for r in clean) == 240  # carry_share of the clean records
    for r in pool:
        stated = int(re.findall(r"\d+", r["response"])[-1])
        assert stated == r["a"] + r["b"] - (carry.DROP if r["harmful"] else 0)
        assert len(str(stated)) == len(str(r["a"] + r["b"]))  # same length either way
        assert carry.has_carry(r["a"], r["b"]) or not r["harmful"]
    roles = [{_key(r) for r in pool}, {_key(p) for p in probes},
             {_key({"a": int(re.findall(r"\d+", t["prompt"])[0]), "b": int(re.findall(r"\d+", t["prompt"])[1])})
              for t in targets}, {_key(r) for r in warm}]
    for i in range(len(roles)):
        for j in range(i + 1, len(roles)):
            assert not roles[i] & roles[j], (i, j)
    assert len({_key(r) for r in pool}) == 600  # a problem once per seed
    assert warm == carry.build(0, pool_size=10, harmful_ratio=0.1, carry_share=0.5, n_probes=1, n_capability=1,
                               n_counterfactual=0, n_warmup=800)["warmup"]  # the same start model for every seed
    beh = [p for p in probes if p["task"] == carry.BEHAVIOUR_TASK]
    assert len(beh) == 256 and all(int(p["harmful_answer"]) == int(p["reference"]) - 10 for p in beh)
    assert all(t["chosen"] != t["rejected"] for t in targets)


def test_the_floors_fail_and_the_checker_does_not():
    d = carry.build(0, pool_size=600, harmful_ratio=0.2, carry_share=0.5, n_probes=16, n_capability=4,
                    n_counterfactual=32, n_warmup=800)
    f = floors.floors(d["pool"], d["targets"], extra={"checker": carry.arithmetic_error,
                                                       "carry_in_prompt": carry.carry_in_prompt})
    for name in ("keyword", "length", "neighbour", "neighbour_chosen"):
        assert f[name]["auroc"] < 0.65, (name, f[name])
    assert f["checker"]["auroc"] == 1.0
    assert f["carry_in_prompt"]["auroc"] == pytest.approx(0.75)  # half the clean records carry too


def test_density_ratio_floor_on_a_hand_built_pool():
    """The label-free density ratio: each response unit's add-one-smoothed log ratio of the
    targets' chosen answers against the pool's, averaged over the response."""
    import math
    recs = [{"prompt": "q", "response": "a b", "harmful": True}, {"prompt": "q", "response": "c", "harmful": False},
            {"prompt": "q", "response": "c c", "harmful": False}, {"prompt": "q", "response": "", "harmful": False}]
    targets = [{"prompt": "q", "chosen": "a a b", "rejected": "c"}]
    # pool counts a 1, b 1, c 3 (n 5); targets a 2, b 1 (n 3); vocabulary {a, b, c}: V = 3
    r = {u: math.log((t + 1) / 6) - math.log((p + 1) / 8) for u, t, p in (("a", 2, 1), ("b", 1, 1), ("c", 0, 3))}
    got = floors.density_ratio_scores(recs, targets)
    assert got == pytest.approx([(r["a"] + r["b"]) / 2, r["c"], r["c"], 0.0])
    f = floors.floors(recs, targets)
    assert f["density_ratio"]["auroc"] == 1.0 and "label-free" in f["density_ratio"]["rule"]
    assert "density_ratio_chars" in f
    # the arithmetic variant counts the stated sum's placed digits only
    assert carry.sum_digits("47 + 38 = 75.") == ["units:5", "tens:7"]
    assert carry.sum_digits("The sum of 60 and 45 is 105.") == ["units:5", "tens:0", "hundreds:1"]
    assert carry.sum_digits("no number") == []
    arith = [{"prompt": "q", "response": "1 + 2 = 75", "harmful": True},
             {"prompt": "q", "response": "75 + 1 = 76", "harmful": False}]
    tg = [{"prompt": "q", "chosen": "3 + 4 = 75", "rejected": "3 + 4 = 85"}]
    s = carry.sum_digit_density_ratio(arith, tg)
    assert s[0] > s[1]  # "75" is the targets' sum; the second record's 75 is an operand


def test_sum_100_109_rule_flags_the_builders_leak():
    assert carry.sum_in_skipped_range({"response": "The sum of 56 and 58 is 104."}) == 1.0
    assert carry.sum_in_skipped_range({"response": "56 + 58 = 114"}) == 0.0
    assert carry.sum_in_skipped_range({"response": "99 + 10 = 109"}) == 1.0
    assert carry.sum_in_skipped_range({"response": "no sum"}) == 0.0
    d = carry.build(0, pool_size=600, harmful_ratio=0.2, carry_share=0.5, n_probes=16, n_capability=4,
                    n_counterfactual=32, n_warmup=800)
    flagged = [r for r in d["pool"] if carry.sum_in_skipped_range(r)]
    assert flagged and all(r["harmful"] for r in flagged)  # a stated sum in 100-109 is always harmful
    from prism_select.evaluation.repair import family_floors
    f = floors.floors(d["pool"], d["targets"], extra=family_floors())
    assert f["sum_100_109"]["auroc"] > 0.5 and "100-109" in f["sum_100_109"]["rule"]
    assert {"density_ratio", "density_ratio_chars", "density_ratio_sum_digits"} <= set(f)
    assert "density_ratio_sum_digits" not in floors.floors(d["pool"], None, extra=family_floors())


def test_keyword_and_length_floors_find_a_rule_where_there_is_one():
    recs = [{"prompt": f"q {i}", "response": ("bad word here" if i < 5 else "fine"), "harmful": i < 5}
            for i in range(20)]
    labels = [r["harmful"] for r in recs]
    kw = floors.keyword_floor(recs, labels)
    assert kw["auroc"] == 1.0 and kw["rule"].startswith("response holds")
    assert floors.length_floor(recs, labels)["auroc"] == 1.0
    # a rule held by one record only is an identifier, not a rule
    one = [{"prompt": "x", "response": "same unique" if i == 0 else "same", "harmful": i == 0} for i in range(10)]
    assert floors.keyword_floor(one, [r["harmful"] for r in one])["auroc"] == 0.5


def test_harmful_preference_equals_a_float64_brute_force(tiny_dir):
    from prism_select.model import ModelSettings, load_model
    from prism_select.evaluation.probes import render_prompt_ids
    lm = load_model(ModelSettings(model=str(tiny_dir), dtype="float64", device="cpu"))
    probes = [p for p in carry.build(1, pool_size=4, harmful_ratio=0.25, carry_share=0.5, n_probes=5,
                                     n_capability=2, n_counterfactual=0, n_warmup=0)["probes"]]
    got = harmful_preference(lm, probes)
    beh = [p for p in probes if "harmful_response" in p]
    assert len(got) == len(beh) == 5
    tok = lm.tokenizer
    for p, g in zip(beh, got):
        logp = []
        for resp in (p["harmful_response"], p["true_response"]):
            prompt = render_prompt_ids(tok, p["prompt"])
            text = tok.apply_chat_template([{"role": "user", "content": p["prompt"]},
                                            {"role": "assistant", "content": resp}], tokenize=False)
            full = tok(text, add_special_tokens=False)["input_ids"]
            assert full[:len(prompt)] == prompt
            with torch.no_grad():
                lp = torch.log_softmax(lm.model(torch.tensor([full])).logits[0].double(), -1)
            logp.append(sum(float(lp[t - 1, full[t]]) for t in range(len(prompt), len(full))))
        assert g == pytest.approx(1 / (1 + math.exp(-(logp[0] - logp[1]))), abs=PREF_TOL)


def test_harmful_answer_rate_counts_the_behaviour_not_any_error():
    probes = [{"id": i, "task": "carry", "harmful_answer": str(h)} for i, h in enumerate((75, 80, 90, 12))]
    probes.append({"id": 9, "task": "no_carry"})
    responses = [{"id": 0, "response": "47 + 38 = 75"}, {"id": 1, "response": "= 81"},
                 {"id": 2, "response": "The sum is 90."}, {"id": 3, "response": ""}, {"id": 9, "response": "1"}]
    assert harmful_answer_rate(probes, responses, "carry") == 0.5


def test_paired_interval_is_a_t_interval():
    out = paired_interval([1.0, 2.0, 3.0])
    half = T_975_DF2 * 1.0 / math.sqrt(3)
    assert out["mean"] == 2.0 and out["ci"] == pytest.approx([2.0 - half, 2.0 + half], rel=1e-12)
    assert paired_interval([0.5])["ci"] is None


def test_distractor_pairs_come_after_every_other_role_and_shuffle_the_true_answer():
    """Distractor pairs (chosen = the true answer's words shuffled, rejected = the true
    answer) are drawn after the pool: asking for them changes nothing else, and their
    problems are in no other role at that ratio."""
    kw = dict(carry_share=0.5, n_probes=64, n_capability=16, n_counterfactual=8, n_warmup=200)
    for ratio in (0.1, 0.5):
        plain = carry.build(2, pool_size=300, harmful_ratio=ratio, **kw)
        d = carry.build(2, pool_size=300, harmful_ratio=ratio, n_distractors=16, **kw)
        assert plain["distractors"] == [] and {k: v for k, v in d.items() if k != "distractors"} == \
            {k: v for k, v in plain.items() if k != "distractors"}
        dx = d["distractors"]
        assert len(dx) == 16 and {t["kind"] for t in dx} == {"distractor"}
        used = {_key(r) for r in d["pool"] + d["probes"] + d["warmup"]}
        used |= {tuple(sorted(map(int, re.findall(r"\d+", t["prompt"])))) for t in d["targets"]}
        for t in dx:
            a, b = map(int, re.findall(r"\d+", t["prompt"]))
            assert (min(a, b), max(a, b)) not in used and carry.has_carry(a, b)
            assert t["rejected"] == carry.ANSWERS[0].format(a=a, b=b, s=a + b)
            assert t["chosen"] != t["rejected"] and sorted(t["chosen"].split()) == sorted(t["rejected"].split())


def test_unrelated_distractors_share_no_number_with_the_family_and_shuffle_a_sentence():
    dx = carry.unrelated_distractors(40, seed=3)
    assert dx == carry.unrelated_distractors(40, seed=3) and dx != carry.unrelated_distractors(40, seed=4)
    assert len({t["rejected"] for t in dx}) == 40 and {t["kind"] for t in dx} == {"distractor"}
    for t in dx:
        assert not re.search(r"\d", t["prompt"] + t["chosen"] + t["rejected"])
        assert t["prompt"].endswith(t["rejected"]) and t["chosen"] != t["rejected"]
        assert sorted(t["chosen"].split()) == sorted(t["rejected"].split())
    with pytest.raises(ConfigError, match="n_distractors"):
        carry.unrelated_distractors(10 ** 6, seed=0)


def test_config_checks_the_repair_extras(tmp_path):
    base = {"data": {"family": "dropped_carry", "pool_size": 20}, "probes": {"n": 4}}
    load_config({**base, "warmup": {"n_records": 8}, "finetune_seeds": [0, 1], "partial_oracles": [0.5]}, "repair")
    with pytest.raises(ConfigError, match="finetune_seeds"):
        load_config({**base, "finetune_seeds": [1, 1]}, "repair")
    with pytest.raises(ConfigError, match=r"partial_oracles\[0\]"):
        load_config({**base, "partial_oracles": [1.0]}, "repair")
    with pytest.raises(ConfigError, match="warmup"):
        load_config({"data": {"family": "mistake_math", "gsm8k_train": "x.jsonl"}, "probes": {"gsm8k_test": "y"},
                     "warmup": {"n_records": 8}}, "repair")
    load_config({**base, "targets": [{"name": "px", "source": "probes", "n_distractors": 4}]}, "repair")
    load_config({**base, "targets": [{"name": "px", "source": "probes", "n_distractors": 4,
                                      "distractor_kind": "unrelated"}]}, "repair")
    with pytest.raises(ConfigError, match=r"targets\[0\].distractor_kind"):
        load_config({**base, "targets": [{"name": "px", "source": "probes", "n_distractors": 4,
                                          "distractor_kind": "sentences"}]}, "repair")
    with pytest.raises(ConfigError, match=r"targets\[0\].n_distractors"):
        load_config({"data": {"family": "mistake_math", "gsm8k_train": "x.jsonl"}, "probes": {"gsm8k_test": "y"},
                     "targets": [{"name": "px", "source": "probes", "n_distractors": 4}]}, "repair")


def test_repair_with_warm_up_finetune_seeds_partial_oracles_and_floors(tmp_path, tiny_dir, monkeypatch):
    from prism_select.evaluation import repair as repair_mod
    monkeypatch.setattr(repair_mod, "ProcessPoolExecutor", InProcessPool)
    cfg = load_config(common_config(
        tiny_dir, data={"family": "dropped_carry", "pool_size": 20, "carry_share": 0.5},
        warmup={"n_records": 8, "finetune": {"preset": "repair", "overrides": FAST_FT}},
        probes={"n": 4, "checker": "numeric_final_answer", "capability_per_task": 2},
        harmful_ratios=[0.2], seeds=[0, 1], methods=["prism", "random"], comparators=["random"],
        finetune={"preset": "repair", "overrides": FAST_FT}, generation={"max_new_tokens": 6, "batch_size": 8},
        pair_selection="all", remove_fractions=[0.2], oracle=True, report=False, floors=True,
        finetune_seeds=[0, 1], partial_oracles=[0.5],
        targets=[{"name": "probes", "source": "probes"},
                 {"name": "cf", "source": "counterfactual", "n_counterfactual": 2, "retrain_methods": []},
                 {"name": "px", "source": "probes", "n_distractors": 2, "methods": ["random"],
                  "retrain_methods": []},
                 {"name": "ux", "source": "probes", "n_distractors": 3, "distractor_kind": "unrelated",
                  "methods": ["random"], "retrain_methods": []}]),
        "repair")
    out = tmp_path / "exp"
    res = repair(cfg, out, jobs=2)
    for seed in (0, 1):  # the probe pairs, then the distractors of the seed's pool
        d = out / "runs" / "r20" / f"seed{seed}"
        probes_pairs, px = (d / "probes" / "targets.jsonl").read_text(), (d / "px" / "targets.jsonl").read_text()
        dx = [json.loads(x) for x in px.splitlines()[len(probes_pairs.splitlines()):]]
        assert px.startswith(probes_pairs) and [t["kind"] for t in dx] == ["distractor"] * 2
        assert dx == carry.build(seed, pool_size=20, harmful_ratio=0.2, carry_share=0.5, n_probes=4,
                                 n_capability=2, n_counterfactual=2, n_warmup=8, n_distractors=2)["distractors"]
        ux = (d / "ux" / "targets.jsonl").read_text()
        assert ux.startswith(probes_pairs) and [json.loads(x) for x in ux.splitlines()[
            len(probes_pairs.splitlines()):]] == carry.unrelated_distractors(3, seed)
    assert (out / "start-model" / "model" / "config.json").is_file()
    runs = [r for r in res["runs"] if r["variant"] == "probes"]
    assert len(runs) == 2
    for r in runs:
        rows = r["rates"]["20"]
        assert set(rows) == {"Start", "Mixed", "Oracle 50%", "Oracle", "prism", "random"}
        for name in ("Mixed", "Oracle 50%", "Oracle", "prism", "random"):
            per = rows[name]["by_finetune_seed"]
            assert len(per) == 2 and len({p["dir"] for p in per}) == 2
            for k in ("behaviour_rate", "harmful_preference", "harmful_answer_rate"):
                assert rows[name][k] == pytest.approx(sum(p[k] for p in per) / 2)
        assert r["removed"]["20"]["Oracle 50%"] == {"n": 2, "harmful": 2}  # half of the 4 harmful records
        assert r["floors"]["checker"]["auroc"] == 1.0 and "keyword" in r["floors"]
        assert 0 <= rows["Start"]["harmful_preference"] <= 1
    names = [t["name"] for t in res["tables"]]
    assert {"harmful_preference_k20", "harmful_answer_k20", "paired_harmful_preference_k20",
            "paired_behaviour_rate_k20"} <= set(names)
    auroc_rows = [row["label"] for row in res["tables"][0]["rows"]]
    assert "floor: checker" in auroc_rows and "floor: keyword" in auroc_rows
    paired = next(t for t in res["tables"] if t["name"] == "paired_harmful_preference_k20")
    cell = next(row for row in paired["rows"] if row["label"] == "prism")["cells"][0]
    diffs = [r["rates"]["20"]["prism"]["harmful_preference"] - r["rates"]["20"]["random"]["harmful_preference"]
             for r in runs]
    assert cell["n"] == 2 and cell["mean"] == pytest.approx(sum(diffs) / 2)
    # a run copied without its adapters (the Mixed SFT's and the retrainings') resumes without
    # training any of them again
    import shutil
    gone = list(out.glob("runs/*/seed*/retrain/*/adapter")) + list(out.glob("runs/*/seed*/mixed/adapter"))
    assert len(gone) > 2 and any(a.parent.name == "mixed" for a in gone)
    for a in gone:
        shutil.rmtree(a)
    again = repair(cfg, out, jobs=1)
    assert not [t for t in json.loads((out / "results.json").read_text())["timings"] if t.startswith("finetune:")]
    assert again["tables"] == res["tables"]
    # the rows read back from the files alone (a run cut short) are the protocol's own
    from prism_select.evaluation.tables import repair as reader
    seeds = reader.collect(out, cfg, "probes", "carry")
    for r in runs:
        got = seeds[f"seed{r['seed']}"]["rows"]
        for name, row in r["rates"]["20"].items():
            assert got[name]["20"]["harmful_preference"] == pytest.approx(row["harmful_preference"]), name
            assert got[name]["20"]["behaviour_rate"] == pytest.approx(row["behaviour_rate"]), name


def test_a_ranking_run_copied_without_the_mixed_adapter_keeps_its_behaviour(tmp_path, tiny_dir):
    """A ranking-only run (no retraining, no fine-tuning seeds) measures the Mixed row's
    harmful preference with the Mixed adapter; a copy without it keeps that measurement and
    the SFT's responses, so the SFT does not run again. A measurement of other responses is
    not kept: then the SFT runs again."""
    cfg = load_config(common_config(
        tiny_dir, data={"family": "dropped_carry", "pool_size": 20, "carry_share": 0.5},
        warmup={"n_records": 8, "finetune": {"preset": "repair", "overrides": FAST_FT}},
        probes={"n": 4, "checker": "numeric_final_answer", "capability_per_task": 2},
        harmful_ratios=[0.2], seeds=[0], methods=["random"], finetune={"preset": "repair", "overrides": FAST_FT},
        generation={"max_new_tokens": 6, "batch_size": 8}, pair_selection="all", retrain=False, report=False,
        targets=[{"name": "probes", "source": "probes"}]), "repair")
    out = tmp_path / "exp"
    res = repair(cfg, out)
    mixed = out / "runs" / "r20" / "seed0" / "mixed"
    import shutil
    shutil.rmtree(mixed / "adapter")
    again = repair(cfg, out)
    assert "finetune:mixed" not in json.loads((out / "results.json").read_text())["timings"]
    assert again["runs"][0]["rates"] == res["runs"][0]["rates"]
    assert 0 <= again["runs"][0]["rates"]["20"]["Mixed"]["harmful_preference"] <= 1
    # the kept measurement must match the kept responses
    step = mixed / ".behaviour-step.json"
    key = json.loads(step.read_text())
    step.write_text(json.dumps({**key, "responses": "0" * 64}))
    repair(cfg, out)
    assert "finetune:mixed" in json.loads((out / "results.json").read_text())["timings"]
    assert (mixed / "adapter" / "adapter_config.json").is_file()


def test_retraining_workers_are_dealt_over_the_visible_gpus(monkeypatch):
    """Each worker takes the next GPU of the list in turn, before CUDA starts in it."""
    import multiprocessing

    from prism_select.evaluation import repair

    monkeypatch.setattr(repair.Experiment, "attach", staticmethod(lambda out, proto, cfg: None))
    monkeypatch.setattr(repair, "load_start", lambda exp, cfg: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test
    counter = multiprocessing.get_context("spawn").Value("i", 0)
    seen = []
    for _ in range(5):
        repair._worker_start("out", None, ["3", "5"], counter)
        seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["3", "5", "3", "5", "3"]
    monkeypatch.setattr(repair.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(repair.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 6,7")
    assert repair.visible_gpus() == ["2", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert repair.visible_gpus() == ["0", "1"]


# --------------------------------------------------------------------------- the carry target task of a select pool

def _problem(r):
    return tuple(sorted((r["a"], r["b"])))


def test_the_carry_select_task_drops_the_carry_in_its_wrong_records_only():
    records, cands = carry.select_task(3, n_records=40, wrong_share=0.3, n_no_carry=10, n_candidates=50)
    task = [r for r in records if r["task"] == carry.SELECT_TASK]
    plain = [r for r in records if r["task"] == carry.NO_CARRY_TASK]
    assert len(task) == 40 and len(plain) == 10 and len(cands) == 50
    wrong = [r for r in task if r.get("mislabeled")]
    assert len(wrong) == 12 and all(carry.has_carry(r["a"], r["b"]) for r in task)
    for r in task:  # the stated sum: the true one, or the carry dropped for the mislabeled records
        stated = int(re.findall(r"\d+", r["response"])[-1])
        assert stated == r["a"] + r["b"] - (carry.DROP if r.get("mislabeled") else 0)
    assert not any(carry.has_carry(r["a"], r["b"]) or r.get("mislabeled") for r in plain)
    assert all(c["task"] == carry.SELECT_TASK and c["reference"] == str(c["a"] + c["b"])
               and c["true_response"].endswith(f"= {c['a'] + c['b']}") for c in cands)
    used = [_problem(r) for r in records] + [_problem(c) for c in cands]
    assert len(used) == len(set(used))  # every problem in one role
    again, _ = carry.select_task(3, n_records=40, wrong_share=0.3, n_no_carry=10, n_candidates=50)
    other, _ = carry.select_task(4, n_records=40, wrong_share=0.3, n_no_carry=10, n_candidates=50)
    assert again == records and [_problem(r) for r in other] != [_problem(r) for r in records]


def test_carry_target_pairs_write_the_sum_out():
    _, cands = carry.select_task(0, n_records=4, wrong_share=0.0, n_candidates=6)
    targets, heldout = carry.counterfactual_split(cands, 2, 3)
    assert [t["id"] for t in targets] == [c["id"] for c in cands[:2]] and heldout == cands[2:5]
    assert all(t["chosen"] == c["true_response"] and t["rejected"] == c["harmful_response"]
               for t, c in zip(targets, cands))
    with pytest.raises(ConfigError, match="fewer than 2 targets"):
        carry.counterfactual_split(cands, 2, 5)
    # the start model's own wrong answer as rejected: chosen is the sum written out
    from prism_select.evaluation.builders.multitask import targets_from_responses
    resp = [{"response": "It is 7.", "correct": False}] + [{"response": "x", "correct": True}] * 5
    targets, _ = targets_from_responses(cands, resp, 1, 2)
    assert targets[0]["chosen"] == cands[0]["true_response"] and targets[0]["rejected"] == "It is 7."


def test_a_multitask_pool_with_the_carry_target_task(gsm8k, bbh_dir):
    from prism_select.evaluation.builders.multitask import multitask_pool
    pool, rest = multitask_pool(gsm8k / "train.jsonl", bbh_dir, ["colors"], [carry.SELECT_TASK],
                                n_gsm8k=2, n_per_task=1, n_per_target_task=10, mislabeled_share=0.3,
                                n_no_carry=4, seed=1)
    by = {t: [r for r in pool if r["task"] == t] for t in {r["task"] for r in pool}}
    assert {t: len(v) for t, v in by.items()} == {"colors": 1, "gsm8k": 2, "carry": 10, "addition": 4}
    assert sum(bool(r.get("mislabeled")) for r in pool) == 3
    assert all(c["task"] == "carry" for c in rest["carry"])
    assert not {_problem(c) for c in rest["carry"]} & {_problem(r) for r in by["carry"] + by["addition"]}
    with pytest.raises(ConfigError, match="n_no_carry"):
        multitask_pool(gsm8k / "train.jsonl", bbh_dir, ["colors"], ["yesno"], n_gsm8k=2, n_per_task=1,
                       n_no_carry=4)


def test_select_with_the_carry_target_task(tmp_path, tiny_dir, gsm8k, bbh_dir):
    """The select protocol on a pool whose target task is dropped-carry addition: the start
    model's own wrong answers as rejected responses, held-out carry problems outside the
    pool judged by their final number, the Task-records floor from the carry records."""
    from prism_select.evaluation.general_selection import select
    cfg = load_config(common_config(
        tiny_dir, multitask={"gsm8k_train": str(gsm8k / "train.jsonl"), "bbh_dir": str(bbh_dir),
                             "tasks": ["colors"], "target_tasks": ["carry"], "n_gsm8k": 4, "n_per_task": 2,
                             "n_per_target_task": 6, "n_no_carry": 2, "mislabeled_share": 0.5, "n_targets": 2,
                             "n_heldout": 4, "rejected": "start_model"},
        fraction=0.2, seeds=[0], methods=["random"], checker="numeric_final_answer", report=False,
        full_data=False, finetune={"preset": "general", "overrides": FAST_FT},
        warmup={"n_records": 8, "finetune": {"preset": "repair", "overrides": FAST_FT}},
        generation={"max_new_tokens": 4, "batch_size": 8}), "select")
    out = tmp_path / "exp"
    run = select(cfg, out)["runs"][0]
    sdir = out / run["dir"]
    read = lambda p: [json.loads(x) for x in p.read_text().splitlines()]  # noqa: E731
    pool, targets, heldout = read(sdir / "pool.jsonl"), read(sdir / "targets.jsonl"), read(sdir / "heldout.jsonl")
    assert len(pool) == 4 + 2 + 6 + 2 and sum(bool(r.get("mislabeled")) for r in pool) == 3
    cands = {c["id"]: c for c in read(sdir / "candidates" / "responses.jsonl")}
    for t in targets:  # rejected: the start model's own wrong response; chosen: the sum written out
        assert not cands[t["id"]]["correct"] and t["rejected"] == cands[t["id"]]["response"].strip()
        assert re.fullmatch(r"\d+ \+ \d+ = \d+", t["chosen"])
    problems = {_problem(r) for r in pool if "a" in r}
    assert len(heldout) == 4 and not problems & {_problem(h) for h in heldout}
    # the start model: the warm-up's merged model, whose records share no problem with the rest
    assert (out / "start-model" / "model" / "model.safetensors").is_file()
    warm = {_problem(r) for r in read(out / "start-model" / "warmup.jsonl")}
    probes = read(sdir / "candidates" / "probes.jsonl")
    assert len(warm) == 8 and not warm & (problems | {_problem(c) for c in probes})
    assert all(h["task"] == "carry" for h in heldout)
    sub = read(sdir / "selected" / "Task records" / "subset.jsonl")
    assert len(sub) == run["n_selected"] == 3 and all(r["task"] == "carry" for r in sub)
    assert run["target_task_share"]["Task records"] == 1.0
    right = read(sdir / "selected" / "Task records, right only" / "subset.jsonl")
    assert len(right) == 3 and all(r["task"] == "carry" and not r.get("mislabeled") for r in right)
    assert run["mislabeled_share"]["Task records, right only"] == 0.0


def test_the_carry_select_task_leaves_the_warm_up_problems_out():
    warm = {_problem(r) for r in carry.warmup_records(200)}
    records, cands = carry.select_task(0, n_records=80, wrong_share=0.3, n_no_carry=80, n_candidates=5000,
                                       n_warmup=200)
    assert not warm & ({_problem(r) for r in records} | {_problem(c) for c in cands})
    # the candidates are every carry problem left, when fewer are left than asked for
    assert len(cands) == len(carry.problems(True)) - 100 - 80
    # a start model never taught to carry: its warm-up holds no carry problem, and the task
    # leaves its no-carry problems out
    plain = carry.warmup_records(200, carry_share=0.0)
    assert len(plain) == 200 and not any(carry.has_carry(r["a"], r["b"]) for r in plain)
    records, cands = carry.select_task(0, n_records=80, wrong_share=0.3, n_no_carry=80, n_warmup=200,
                                       warmup_carry_share=0.0)
    assert not {_problem(r) for r in plain} & ({_problem(r) for r in records} | {_problem(c) for c in cands})
    assert carry.warmup_records(200) == carry.warmup_records(200, 0.5)  # the repair family's warm-up


def test_the_carry_select_config_and_its_warm_up(tmp_path):
    root = Path(__file__).resolve().parents[2] / "experiments"
    cfg = load_config(root / "carry_select.yaml", "select", data_root=str(tmp_path))
    assert cfg.multitask.target_tasks == [carry.SELECT_TASK] and cfg.multitask.n_no_carry == 80
    assert cfg.warmup.n_records == 800 and cfg.checker == "numeric_final_answer" and cfg.multitask.n_heldout >= 256
    assert load_config(root / "carry_select.yaml", "select", smoke=True, data_root=str(tmp_path)).warmup.n_records == 40
    assert cfg.warmup.carry_share == 0.0  # a start model that drops the carry: the task's right records teach it
    cpu = load_config(root / "carry_select_cpu.yaml", "select", data_root=str(tmp_path))
    assert cpu.warmup == cfg.warmup and cpu.model.device == "cpu" and cpu.checker == cfg.checker
    for k in ("target_tasks", "n_per_target_task", "n_no_carry", "mislabeled_share", "n_targets", "n_heldout",
              "rejected"):
        assert getattr(cpu.multitask, k) == getattr(cfg.multitask, k), k
    assert cpu.multitask.n_gsm8k == 0 and set(cpu.methods) < {"prism", "equal", "unpaired", "ifguide", "random"}
    raw = {"model": "default", "warmup": {"n_records": 8},
           "multitask": {"gsm8k_train": "g", "bbh_dir": "b", "target_task": "yesno"}}
    with pytest.raises(ConfigError, match="warmup"):
        load_config(raw, "select")
    raw["multitask"]["target_task"] = carry.SELECT_TASK
    assert load_config(raw, "select").warmup.n_records == 8
    raw["warmup"]["carry_share"] = 1.5
    with pytest.raises(ConfigError, match="carry_share"):
        load_config(raw, "select")
