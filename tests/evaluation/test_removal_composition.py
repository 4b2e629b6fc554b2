"""`prism-select experiment rows composition` (:mod:`prism_select.evaluation.tables.removals`) on a
run folder built by hand: what each removal takes out of the pool, by kind and by the probes' question and answer forms, averaged over seeds."""

import json

import pytest

from prism_select.cli import main
from prism_select.evaluation.tables import removals as script
from script_helpers import write_jsonl

PROBES = [
    {"id": "c0", "task": "carry", "prompt": "What is 47 + 38?", "true_response": "47 + 38 = 85",
     "harmful_response": "47 + 38 = 75"},
    {"id": "n0", "task": "no_carry", "prompt": "What is 34 + 14?"},  # a capability probe: no forms of its own
]
# id: (prompt, response, harmful, carry)
POOL = {
    "h_probe": ("What is 19 + 23?", "19 + 23 = 32.", True, True),       # both probe forms (full stop left out)
    "h_other": ("Add 29 and 13.", "The sum of 29 and 13 is 32.", True, True),
    "c_right": ("What is 18 + 25?", "18 plus 25 equals 43.", False, True),
    "n_probe": ("Compute 34 + 14.", "34 + 14 = 48", False, False),
    "n_other": ("Add 50 and 19.", "The sum of 50 and 19 is 69.", False, False),
}


def _seed(run, k: int, removed: dict) -> None:
    sd = run / "runs" / "r20" / f"seed{k}"
    write_jsonl(sd / "probes.jsonl", PROBES)
    write_jsonl(sd / "pool.jsonl", [{"id": i, "prompt": p, "response": r, "harmful": h, "carry": c}
                                    for i, (p, r, h, c) in POOL.items()])
    for method, gone in removed.items():
        write_jsonl(sd / "probes" / "removal" / "k20" / method / "kept.jsonl",
                    [{"id": i} for i in POOL if i not in gone])


def test_removals_are_counted_by_kind_and_probe_form(tmp_path, capsys):
    assert script.form(" 47 + 38 = 75. ") == "N + N = N" == script.form("47 + 38 = 85")
    _seed(tmp_path, 0, {"prism": {"h_probe", "n_probe"}, "random": {"c_right", "n_other"}})
    _seed(tmp_path, 1, {"prism": {"h_probe", "h_other"}, "random": {"h_other", "c_right"}})
    table = script.composition_rows(tmp_path, 20)
    assert table["prism"]["seeds"] == ["seed0", "seed1"]
    assert {k: table["prism"][k] for k in script.COLUMNS} == pytest.approx({
        "removed": 2, "harmful": 1.5, "carry_right": 0, "no_carry": 0.5, "probe_question": 1,
        "probe_answer": 1.5, "harmful_probe_question": 1, "harmful_probe_answer": 1})
    assert {k: table["random"][k] for k in script.COLUMNS} == pytest.approx({
        "removed": 2, "harmful": 0.5, "carry_right": 1, "no_carry": 0.5, "probe_question": 1,
        "probe_answer": 0, "harmful_probe_question": 0, "harmful_probe_answer": 0})
    out = tmp_path / "c.json"
    assert main(["experiment", "rows", "composition", str(tmp_path), "--json", str(out)]) == 0
    assert "| prism | 2 | 2.0 | 1.5 | 0.0 | 0.5 | 1.0 | 1.5 | 1.0 | 1.0 |" in capsys.readouterr().out
    assert json.loads(out.read_text())["random"]["carry_right"] == 1
    assert main(["experiment", "rows", "composition", str(tmp_path), "--removal", "30"]) == 1
