"""Selection rules on hand-built pools: quotas, per-task budgets, thresholds, duplicate and
overlap control, the decisions file and manifest, trainer formats, ShareGPT input."""

from __future__ import annotations

import json

import pytest

from prism_select.errors import ConfigError
from prism_select.io import sha256_file
from prism_select.selection import select
from prism_select.selection_rules import Rules, decide, explain_text, largest_remainder

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def sentence(i: int, n: int = 20) -> str:
    """A distinct text of ``n`` words for each ``i`` (no long n-gram shared with another ``i``)."""
    return " ".join(f"{WORDS[(i * 7 + k * 3) % 26]}{i}x{k}" for k in range(n))


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_run(tmp_path, pool_rows, scores, targets=None):
    pool = write_jsonl(tmp_path / "pool.jsonl", pool_rows)
    run = tmp_path / "run"
    run.mkdir()
    write_jsonl(run / "scores.jsonl", scores)
    inputs = {"pool": str(pool), "targets": str(targets) if targets else ""}
    (run / "run.json").write_text(json.dumps({"status": "complete", "inputs": inputs,
                                              "fingerprints": {"pool_file": sha256_file(pool)}}))
    return run, pool


def ranked(ids, tasks=None):
    """Scores with ids[0] best; ``tasks``: {task: [score per id]} adds per-task scores."""
    rows = [{"id": x, "score": float(len(ids) - r), "rank": r + 1} for r, x in enumerate(ids)]
    for t, vals in (tasks or {}).items():
        for row, v in zip(rows, vals):
            row.setdefault("scores", {})[t] = v
    return rows


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------ quotas

def test_largest_remainder():
    assert largest_remainder({"a": 6, "b": 3, "c": 1}, 5) == {"a": 3, "b": 2, "c": 0}  # 3, 1.5, .5: tie -> b
    assert largest_remainder({"a": 1, "b": 9}, 4) == {"a": 0, "b": 4}  # .4 / 3.6
    assert largest_remainder({"a": 1, "b": 1, "c": 1}, 3) == {"a": 1, "b": 1, "c": 1}
    assert sum(largest_remainder({"a": 7, "b": 5, "c": 2}, 9).values()) == 9


def test_stratify_quota_counts(tmp_path):
    # 12 records: source A holds the 6 best, B the next 4, C the last 2; keep 6 -> A 3, B 2, C 1
    pool = [{"id": f"r{i}", "prompt": sentence(i), "response": sentence(100 + i),
             "source": "A" if i < 6 else "B" if i < 10 else "C"} for i in range(12)]
    run, pool_path = make_run(tmp_path, pool, ranked([f"r{i}" for i in range(12)]))
    out = tmp_path / "sel.jsonl"
    s = select(run, pool_path, out, keep="6", stratify="source")
    kept = [r["id"] for r in read(out)]
    assert kept == ["r0", "r1", "r2", "r6", "r7", "r10"]
    assert s["counts"]["keep"] == {"quota": 6} and s["counts"]["drop"] == {"quota": 6}
    dec = {d["id"]: d for d in read(tmp_path / "sel.decisions.jsonl")}
    assert dec["r3"] == {"id": "r3", "decision": "drop", "reason": "quota", "score": 9.0, "rank": 4, "stratum": "A"}
    with pytest.raises(ConfigError, match="no scored record has a field 'sorce'.*source"):
        select(run, pool_path, tmp_path / "typo.jsonl", keep="6", stratify="sorce")
    # plain top-k would keep r0..r5, all from A
    plain = select(run, pool_path, tmp_path / "plain.jsonl", keep="6")
    assert plain["counts"]["keep"] == {"budget": 6}
    assert [r["id"] for r in read(tmp_path / "plain.jsonl")] == [f"r{i}" for i in range(6)]


# ------------------------------------------------------------------ duplicates and overlap

def test_planted_duplicate_and_near_copy_of_a_target_are_dropped(tmp_path):
    target_text = sentence(50, 30)
    targets = write_jsonl(tmp_path / "targets.jsonl", [
        {"id": "t0", "prompt": target_text, "chosen": "yes indeed", "rejected": "no never"}])
    near = target_text.split()
    near[15] = "changed"  # one word changed: still shares a 13-gram with the target
    pool = [{"id": f"r{i}", "prompt": sentence(i, 40), "response": sentence(100 + i)} for i in range(8)]
    pool[1] = {"id": "r1", "prompt": " ".join(near), "response": "an answer of its own"}  # near-copy of t0
    pool[3] = {"id": "r3", "prompt": pool[2]["prompt"], "response": pool[2]["response"]}  # exact copy of r2
    words = pool[4]["prompt"].split()
    pool[5] = {"id": "r5", "prompt": " ".join(words[:20] + ["other"] + words[21:]), "response": pool[4]["response"]}
    ids = [f"r{i}" for i in range(8)]
    run, pool_path = make_run(tmp_path, pool, ranked(ids), targets)
    out = tmp_path / "sel.jsonl"
    s = select(run, pool_path, out, keep="4", dedup=True, exclude_overlap=True)
    assert [r["id"] for r in read(out)] == ["r0", "r2", "r4", "r6"]
    dec = {d["id"]: d for d in read(tmp_path / "sel.decisions.jsonl")}
    assert dec["r1"]["decision"] == "drop" and dec["r1"]["reason"] == "overlap"
    assert dec["r1"]["of"] == "target:t0" and dec["r1"]["by"] == "13-gram"
    assert (dec["r3"]["reason"], dec["r3"]["of"]) == ("duplicate", "r2")
    assert (dec["r5"]["reason"], dec["r5"]["of"]) == ("near_duplicate", "r4") and dec["r5"]["similarity"] >= 0.8
    assert dec["r7"]["reason"] == "budget"
    assert s["counts"]["drop"] == {"overlap": 1, "duplicate": 1, "near_duplicate": 1, "budget": 1}
    # without the rules the planted records are kept
    select(run, pool_path, tmp_path / "plain.jsonl", keep="4")
    assert [r["id"] for r in read(tmp_path / "plain.jsonl")] == ["r0", "r1", "r2", "r3"]


def test_eval_file_overlap_by_minhash_and_flag_only(tmp_path):
    base = sentence(7, 14).split()
    # an eval text sharing no 13-gram with r2 (a word changed every 10) but most 5-word shingles
    shuffled = list(base)
    shuffled[6] = "zzz"
    ev = write_jsonl(tmp_path / "eval.jsonl", [{"id": "e9", "question": " ".join(shuffled), "answer": "4"}])
    pool = [{"id": f"r{i}", "prompt": sentence(i), "response": sentence(100 + i)} for i in range(4)]
    pool[2] = {"id": "r2", "prompt": " ".join(base), "response": "a fresh answer here"}
    run, pool_path = make_run(tmp_path, pool, ranked([f"r{i}" for i in range(4)]))
    rules = Rules(keep="4", eval_files=(ev,), overlap_threshold=0.3)
    texts = {p["id"]: (p["prompt"], p["response"], p) for p in pool}
    from prism_select.selection_rules import reference_texts
    dec = {d["id"]: d for d in decide(read(run / "scores.jsonl"), rules, texts, reference_texts(None, [ev]))}
    assert dec["r2"]["reason"] == "overlap" and dec["r2"]["of"] == "eval:eval.jsonl:e9"
    assert dec["r2"]["by"] == "minhash"
    s = select(run, pool_path, tmp_path / "f.jsonl", keep="4", eval_files=(ev,), flag_overlap=True,
               overlap_threshold=0.3)
    assert s["kept"] == 4 and s["counts"]["flagged_overlap"] == 1
    flagged = [d for d in read(tmp_path / "f.decisions.jsonl") if "overlap" in d]
    assert [d["id"] for d in flagged] == ["r2"] and flagged[0]["decision"] == "keep"


# ------------------------------------------------------------------ thresholds and tasks

def test_min_score_alone_with_keep_and_with_remove(tmp_path):
    pool = [{"id": f"r{i}", "prompt": sentence(i), "response": sentence(100 + i)} for i in range(6)]
    run, pool_path = make_run(tmp_path, pool, ranked([f"r{i}" for i in range(6)]))  # scores 6..1
    s = select(run, pool_path, tmp_path / "a.jsonl", min_score=3.5)
    assert [r["id"] for r in read(tmp_path / "a.jsonl")] == ["r0", "r1", "r2"]
    assert s["counts"]["drop"] == {"min_score": 3}
    s = select(run, pool_path, tmp_path / "b.jsonl", keep="5", min_score=2.5)
    assert s["kept"] == 4 and s["counts"]["drop"] == {"min_score": 2}
    s = select(run, pool_path, tmp_path / "c.jsonl", remove="3", min_score=5.5)  # only r0 scores >= 5.5
    assert s["kept"] == 5 and s["counts"]["drop"] == {"removed": 1}


def test_per_task_top_and_max(tmp_path):
    ids = [f"r{i}" for i in range(6)]
    pool = [{"id": x, "prompt": sentence(i), "response": sentence(100 + i)} for i, x in enumerate(ids)]
    tasks = {"math": [9, 8, 7, 1, 2, 3], "code": [1, 2, 3, 9, 8, 0]}
    run, pool_path = make_run(tmp_path, pool, ranked(ids, tasks))
    select(run, pool_path, tmp_path / "t.jsonl", keep="4", per_task="top")
    dec = {d["id"]: d for d in read(tmp_path / "t.decisions.jsonl")}
    assert {x for x, d in dec.items() if d["decision"] == "keep"} == {"r0", "r1", "r3", "r4"}
    assert dec["r0"]["task"] == "math" and dec["r3"]["task"] == "code" and dec["r0"]["reason"] == "task"
    assert dec["r0"]["scores"] == {"math": 9, "code": 1}
    select(run, pool_path, tmp_path / "m.jsonl", keep="2", per_task="max")  # max: 9, 8, 7, 9, 8, 3
    assert [r["id"] for r in read(tmp_path / "m.jsonl")] == ["r0", "r3"]


def test_per_task_scores_must_be_numbers():
    from prism_select.errors import InputError

    rows = ranked(["a", "b"], {"math": [1.0, float("nan")]})
    with pytest.raises(InputError, match="'scores' must map each task to a finite number"):
        decide(rows, Rules(keep="1", per_task="max"))


def test_per_task_without_task_scores_is_a_named_error(tmp_path):
    pool = [{"id": "a", "prompt": "p", "response": "r"}, {"id": "b", "prompt": "q", "response": "s"}]
    run, pool_path = make_run(tmp_path, pool, ranked(["a", "b"]))
    with pytest.raises(ConfigError, match="per_task.*no per-task scores.*--stratify"):
        select(run, pool_path, tmp_path / "o.jsonl", keep="1", per_task="top")
    assert not (tmp_path / "o.jsonl").exists()


# ------------------------------------------------------------------ record

def test_decisions_and_manifest_and_explain(tmp_path, capsys):
    from prism_select.cli import main

    pool = [{"id": f"r{i}", "prompt": sentence(i), "response": sentence(100 + i)} for i in range(5)]
    pool.append({"id": "r5", "prompt": pool[0]["prompt"], "response": pool[0]["response"]})
    run, pool_path = make_run(tmp_path, pool, ranked([f"r{i}" for i in range(6)]))
    out = tmp_path / "selected.jsonl"
    assert main(["select", "--run", str(run), "--pool", str(pool_path), "--keep", "3", "--dedup",
                 "--out", str(out)]) == 0
    decisions = read(tmp_path / "selected.decisions.jsonl")
    assert len(decisions) == 6
    assert all(set(d) >= {"id", "decision", "reason", "score", "rank"} for d in decisions)
    manifest = json.loads((tmp_path / "selected.manifest.json").read_text())
    assert manifest["inputs"]["pool"]["sha256"] == sha256_file(pool_path)
    assert manifest["inputs"]["scores"]["sha256"] == sha256_file(run / "scores.jsonl")
    assert manifest["outputs"]["selected.jsonl"]["sha256"] == sha256_file(out)
    assert manifest["outputs"]["selected.decisions.jsonl"]["sha256"] == sha256_file(tmp_path / "selected.decisions.jsonl")
    assert manifest["settings"]["dedup"] is True and manifest["settings"]["keep"] == "3"
    assert manifest["counts"]["keep"] == {"budget": 3}
    assert manifest["counts"]["drop"] == {"duplicate": 1, "budget": 2}
    capsys.readouterr()
    assert main(["explain", str(out)]) == 0
    text = capsys.readouterr().out
    assert "duplicate" in text and "r5 (#6, 1, of r0)" in text and "budget" in text
    assert main(["explain", str(run)]) == 0  # a run directory: its select found beside it
    assert capsys.readouterr().out == text
    assert explain_text(decisions).splitlines()[0].startswith("decision")
    from prism_select.evaluation.report import write_report
    page = write_report(run).read_text()
    assert "<h2>Selection</h2>" in page and "near_duplicate" not in page and "r5 (#6, 1, of r0)" in page


# ------------------------------------------------------------------ formats

def _chat_pool(tmp_path):
    pool = [{"id": "c0", "messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
            {"id": "c1", "prompt": "capital of France?", "response": "Paris"},
            {"id": "c2", "instruction": "add", "input": "1 and 2", "output": "3"}]
    return make_run(tmp_path, pool, ranked(["c0", "c1", "c2"]))


def test_llamafactory_format_and_dataset_info(tmp_path):
    run, pool_path = _chat_pool(tmp_path)
    out = tmp_path / "lf" / "prism_top.json"
    out.parent.mkdir()
    s = select(run, pool_path, out, keep="2", fmt="llamafactory")
    assert s["kept"] == 2
    info = json.loads((tmp_path / "lf" / "dataset_info.json").read_text())
    entry = info["prism_top"]
    assert entry["file_name"] == "prism_top.json" and entry["formatting"] == "sharegpt"
    rows = json.loads(out.read_text())
    assert rows[0]["messages"][0] == {"role": "system", "content": "be brief"}
    assert rows[1]["messages"][-1] == {"role": "assistant", "content": "Paris"}
    import datasets
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "lf" / entry["file_name"]), split="train")
    assert len(ds) == 2 and entry["columns"]["messages"] in ds.column_names
    man = json.loads((tmp_path / "lf" / "prism_top.manifest.json").read_text())
    assert "dataset_info.json" in man["outputs"]
    plain = [{"id": "p0", "instruction": "add", "input": "1 and 2", "output": "3"},
             {"id": "p1", "prompt": "capital of France?", "response": "Paris"}]
    (tmp_path / "plain").mkdir()
    run2, pool2 = make_run(tmp_path / "plain", plain, ranked(["p0", "p1"]))
    select(run2, pool2, tmp_path / "lf" / "plain_top.json", keep="2", fmt="llamafactory")
    entry = json.loads((tmp_path / "lf" / "dataset_info.json").read_text())["plain_top"]  # beside prism_top
    assert entry == {"file_name": "plain_top.json", "columns": {"prompt": "instruction", "query": "input",
                                                                "response": "output", "system": "system",
                                                                "history": "history"}}
    rows = json.loads((tmp_path / "lf" / "plain_top.json").read_text())
    assert rows[0] == {"instruction": "add\n\n1 and 2", "input": "", "output": "3", "system": "", "history": []}
    assert "prism_top" in json.loads((tmp_path / "lf" / "dataset_info.json").read_text())
    with pytest.raises(ConfigError, match="give --out"):
        select(run, pool_path, tmp_path / "x.jsonl", keep="1", fmt="llamafactory")


@pytest.mark.parametrize("fmt,suffix,check", [
    ("trl", ".jsonl", lambda r: r["messages"][-1] == {"role": "assistant", "content": "Paris"}),
    ("sharegpt", ".jsonl", lambda r: r["conversations"] == [{"from": "human", "value": "capital of France?"},
                                                            {"from": "gpt", "value": "Paris"}]),
    ("alpaca", ".json", lambda r: (r["instruction"], r["output"]) == ("capital of France?", "Paris")),
    ("jsonl", ".out", lambda r: {k: v for k, v in r.items() if v is not None}
     == {"id": "c1", "prompt": "capital of France?", "response": "Paris"})])
def test_trainer_formats_load_with_datasets(tmp_path, fmt, suffix, check):
    import datasets

    run, pool_path = _chat_pool(tmp_path)
    out = tmp_path / f"sel{suffix}"
    assert select(run, pool_path, out, keep="3", fmt=fmt)["kept"] == 3
    ds = datasets.load_dataset("json", data_files=str(out), split="train")
    assert len(ds) == 3 and check(ds[1])


def test_sharegpt_output_reads_back_as_a_pool(tmp_path):
    from prism_select.data import load_pool

    run, pool_path = _chat_pool(tmp_path)
    out = tmp_path / "sg.jsonl"
    select(run, pool_path, out, keep="3", fmt="sharegpt")
    items = load_pool(out).items
    assert items[0].prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert items[0].response == "4" and items[2].response == "3"


def test_the_record_never_replaces_an_input(tmp_path):
    from prism_select.errors import OutputError

    pool = [{"id": "a", "prompt": "p", "response": "r"}, {"id": "b", "prompt": "q", "response": "s"}]
    run, _ = make_run(tmp_path, pool, ranked(["a", "b"]))
    pool_path = tmp_path / "x.decisions.jsonl"
    pool_path.write_text((tmp_path / "pool.jsonl").read_text())
    (run / "run.json").write_text(json.dumps({"status": "complete", "inputs": {"pool": str(pool_path)},
                                              "fingerprints": {"pool_file": sha256_file(pool_path)}}))
    before = pool_path.read_bytes()
    with pytest.raises(OutputError, match="it is an input"):
        select(run, pool_path, tmp_path / "x.jsonl", keep="1")
    assert pool_path.read_bytes() == before and not (tmp_path / "x.jsonl").exists()


def test_without_datasketch_the_error_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasketch", None)  # import datasketch -> ImportError
    texts = {"a": ("p", "r", {}), "b": ("q", "s", {})}
    with pytest.raises(ConfigError, match="need the datasketch package.*pip install datasketch"):
        decide(ranked(["a", "b"]), Rules(keep="1", dedup=True), texts)
    assert [d["decision"] for d in decide(ranked(["a", "b"]), Rules(keep="1"), texts)] == ["keep", "drop"]
