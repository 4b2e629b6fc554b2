"""`prism-select experiment rows offsets` (:mod:`prism_select.evaluation.tables.removals`) on a run
folder built by hand: the wrong answers of each retrained row counted by their offset from the true sum, over data and fine-tuning seeds,
unfinished retrainings left out."""

import json
from pathlib import Path

from prism_select.evaluation.repair import retrain_dir
from prism_select.cli import main
from prism_select.evaluation.tables import removals
from script_helpers import write_jsonl as _jsonl

#: probes: id -> (task, a, b)
PROBES = {"c0": ("carry", 47, 38), "c1": ("carry", 19, 23), "n0": ("no_carry", 34, 14), "n1": ("no_carry", 50, 19)}
POOL = [f"p{i}" for i in range(6)]


def _answers(d: Path, sums: dict, finished: bool = True) -> None:
    """Responses stating ``sums[id]`` (None: no number) for each probe."""
    rows = []
    for pid, (task, a, b) in PROBES.items():
        s = sums.get(pid, a + b)
        rows.append({"id": pid, "task": task, "correct": s == a + b,
                     "response": f"{a} + {b} = {s}." if s is not None else "I cannot say."})
    _jsonl(d / "responses.jsonl", rows)
    if finished:
        (d / ".responses-step.json").write_text("{}")


def _seed(run: Path, k: int) -> Path:
    sd = run / "runs" / "r20" / f"seed{k}"
    _jsonl(sd / "probes.jsonl", [{"id": i, "task": t, "a": a, "b": b} for i, (t, a, b) in PROBES.items()])
    _jsonl(sd / "pool.jsonl", [{"id": i} for i in POOL])
    _jsonl(sd / "oracle" / "kept.jsonl", [{"id": i} for i in POOL[2:]])
    _jsonl(sd / "probes" / "removal" / "k30" / "prism" / "kept.jsonl", [{"id": i} for i in POOL[1:5]])
    return sd


def test_wrong_answers_are_counted_by_offset_over_seeds(tmp_path):
    run = tmp_path / "exp"
    for k in (0, 1):
        sd = _seed(run, k)
        mixed = retrain_dir(sd, sd / "pool.jsonl", 0)
        _answers(mixed, {"c0": 75, "c1": 32})                      # two carries dropped
        _answers(retrain_dir(sd, sd / "pool.jsonl", 1), {"c0": 75})
        _answers(retrain_dir(sd, sd / "oracle" / "kept.jsonl", 0), {})
        prism = sd / "probes" / "removal" / "k30" / "prism" / "kept.jsonl"
        _answers(retrain_dir(sd, prism, 0), {"n0": 58, "n1": 79, "c1": None})  # two carries added
        # the second fine-tuning's retraining was cut short: no step record, left out
        _answers(retrain_dir(sd, prism, 1), {"n0": 58, "n1": 79}, finished=False)
    table = removals.offset_rows(run)
    assert dict(table["Mixed"]["carry"]) == {"-10": 6, "right": 2}
    assert dict(table["Mixed"]["no_carry"]) == {"right": 8}
    assert dict(table["Oracle"]["carry"]) == {"right": 4} and dict(table["Oracle"]["no_carry"]) == {"right": 4}
    assert dict(table["prism (top 30%)"]["no_carry"]) == {"+10": 4}
    assert dict(table["prism (top 30%)"]["carry"]) == {"right": 2, "other": 2}


def test_main_writes_the_table(tmp_path, capsys):
    run = tmp_path / "exp"
    sd = _seed(run, 0)
    _answers(retrain_dir(sd, sd / "oracle" / "kept.jsonl"), {"n1": 62})  # an unsuffixed retraining; -7
    out = tmp_path / "offsets.json"
    assert main(["experiment", "rows", "offsets", str(run), "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"Oracle": {"carry": {"right": 2}, "no_carry": {"right": 1, "other": 1}}}
    assert "| Oracle | 2 | 0 | 0 | 0 | 1 | 0 | 0 | 1 |" in capsys.readouterr().out
    assert main(["experiment", "rows", "offsets", str(tmp_path / "empty")]) == 1
