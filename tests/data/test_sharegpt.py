"""ShareGPT records (``conversations`` of ``from`` / ``value`` turns) read as pool and targets."""

from __future__ import annotations

import csv
import json

import pytest

from prism_select.data import load_pool, load_targets
from prism_select.errors import InputError

CONV = [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
        {"from": "human", "value": "and 3+3?"}, {"from": "gpt", "value": "6"}]


def test_sharegpt_pool_jsonl_json_and_system(tmp_path):
    rows = [{"id": "a", "conversations": CONV, "source": "x"},
            {"id": "b", "system": "be brief", "conversations": CONV[:2]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.json").write_text(json.dumps(rows))
    for path in (tmp_path / "p.jsonl", tmp_path / "p.json"):
        a, b = load_pool(path).items
        assert a.prompt == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                            {"role": "user", "content": "and 3+3?"}]
        assert a.response == "6"
        assert b.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
        assert b.response == "4"


def test_sharegpt_pool_csv_cell(tmp_path):
    with open(tmp_path / "p.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "conversations"])
        w.writerow(["a", json.dumps(CONV[:2])])
    (ex,) = load_pool(tmp_path / "p.csv").items
    assert ex.prompt == [{"role": "user", "content": "2+2?"}] and ex.response == "4"


def test_sharegpt_targets(tmp_path):
    rows = [{"id": "t", "conversations": CONV[:1], "chosen": {"from": "gpt", "value": "4"},
             "rejected": {"from": "gpt", "value": "5"}, "task": "math"},
            {"conversations": CONV[:1], "chosen": "four", "rejected": "five"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t, u = load_targets(tmp_path / "t.jsonl").items
    assert (t.prompt, t.chosen, t.rejected, t.task) == ([{"role": "user", "content": "2+2?"}], "4", "5", "math")
    assert (u.chosen, u.rejected) == ("four", "five")


@pytest.mark.parametrize("conv,fragment", [
    ([{"from": "human", "value": "hi"}, {"from": "robot", "value": "x"}], "turn 1: 'from' is 'robot'"),
    ([{"from": "human", "value": 3}, {"from": "gpt", "value": "x"}], "turn 0: 'value' must be a string"),
    ([], "non-empty list"),
    ([{"from": "human", "value": "hi"}, {"from": "human", "value": "again"}], "expected 'assistant'")])
def test_sharegpt_pool_errors_name_the_line_and_field(tmp_path, conv, fragment):
    (tmp_path / "p.jsonl").write_text(json.dumps({"conversations": conv}) + "\n")
    with pytest.raises(InputError, match=fragment) as e:
        load_pool(tmp_path / "p.jsonl")
    assert "line 1" in str(e.value)
