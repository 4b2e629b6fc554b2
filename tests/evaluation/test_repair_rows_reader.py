"""`prism-select experiment rows retrained` (:mod:`prism_select.evaluation.tables.repair`) on a
run folder built by hand (no model, no training):
the rows it reads back, their rates, which retraining each row comes from, the summary over
seeds, and the refusal of a folder with retrainings under several fine-tuning seeds."""

import json
import math
from pathlib import Path

import pytest

from prism_select.evaluation.repair import retrain_dir
from prism_select.cli import main
from prism_select.evaluation.tables import repair as tables
from script_helpers import write_jsonl as _jsonl

REL_TOL = 1e-12
TASK = "carry"  # the behaviour probes' task; "no_carry" and "plain" are the capability check
IDS = [f"p{i}" for i in range(10)]  # p0 and p1 are the harmful records


def _kept(path: Path, ids: list) -> Path:
    return _jsonl(path, [{"id": i, "prompt": "q", "response": "a"} for i in ids])


def _responses(d: Path, wrong_carry: int, right_no_carry: int, right_plain: int, finished: bool = True) -> None:
    """4 carry probes (``wrong_carry`` answered wrong), 4 no_carry probes and 2 plain ones
    (``right_*`` answered right): behaviour rate wrong_carry / 4, capability the mean of the
    two tasks' accuracies, (right_no_carry / 4 + right_plain / 2) / 2."""
    rows = ([{"id": f"c{i}", "task": TASK, "correct": i >= wrong_carry} for i in range(4)]
            + [{"id": f"n{i}", "task": "no_carry", "correct": i < right_no_carry} for i in range(4)]
            + [{"id": f"q{i}", "task": "plain", "correct": i < right_plain} for i in range(2)])
    _jsonl(d / "responses.jsonl", rows)
    if finished:
        (d / ".responses-step.json").write_text("{}")


def _rates(wrong_carry: int, right_no_carry: int, right_plain: int) -> tuple:
    return wrong_carry / 4, (right_no_carry / 4 + right_plain / 2) / 2


# per data seed: the rows' (wrong carry, right no_carry, right plain); prism's kept set is the
# Oracle's on seed 0 (one shared retraining), its own on seed 1; random's retraining on seed 1
# has its responses but no step record (cut short), so it is left out
KEPT = {0: {"oracle": IDS[2:], "prism": IDS[2:], "random": IDS[:8]},
        1: {"oracle": IDS[2:], "prism": IDS[1:9], "random": IDS[:4] + IDS[6:]}}
COUNTS = {0: {"Start": (4, 4, 2), "Mixed": (3, 3, 2), "Oracle": (0, 4, 1), "random": (2, 2, 1)},
          1: {"Start": (4, 3, 2), "Mixed": (2, 4, 1), "Oracle": (1, 3, 2), "prism": (1, 4, 2), "random": (3, 0, 0)}}


def _build(out: Path) -> Path:
    for seed in (0, 1):
        sd = out / "runs" / "r20" / f"seed{seed}"
        _kept(sd / "pool.jsonl", IDS)
        _responses(sd / "start", *COUNTS[seed]["Start"])
        _responses(sd / "mixed", *COUNTS[seed]["Mixed"])
        oracle = _kept(sd / "oracle" / "kept.jsonl", KEPT[seed]["oracle"])
        _responses(retrain_dir(sd, oracle), *COUNTS[seed]["Oracle"])
        for m in ("prism", "random"):
            kept = _kept(sd / "probes" / "removal" / "k20" / m / "kept.jsonl", KEPT[seed][m])
            if (seed, m) != (0, "prism"):  # seed 0's prism shares the Oracle's retraining
                _responses(retrain_dir(sd, kept), *COUNTS[seed][m], finished=(seed, m) != (1, "random"))
    return out


def test_rows_are_read_from_the_finished_retrainings_with_their_rates(tmp_path):
    out = _build(tmp_path / "exp")
    rows = tables.retrained_rows(out, TASK)
    got = {(r["seed"], r["method"]): r for r in rows}
    assert set(got) == {(0, "Start"), (0, "Mixed"), (0, "Oracle"), (0, "prism"), (0, "random"),
                        (1, "Start"), (1, "Mixed"), (1, "Oracle"), (1, "prism")}  # seed 1's random unfinished
    assert len(rows) == len(got)  # one (targets, fraction) cell: each row once per seed
    counts = {**COUNTS[0], "prism": COUNTS[0]["Oracle"]}
    for (seed, method), r in got.items():
        c = (counts if seed == 0 else COUNTS[1])[method]
        beh, cap = _rates(*c)
        assert (r["setting"], r["targets"], r["fraction"]) == ("r20", "probes", "20")
        assert r["behaviour_rate"] == pytest.approx(beh, rel=REL_TOL), (seed, method)
        assert r["capability"] == pytest.approx(cap, rel=REL_TOL), (seed, method)
        assert r["n_behaviour"] == 4
    # where each row comes from: Start and Mixed their own folders, the rest their kept set's retraining
    for seed in (0, 1):
        sd = out / "runs" / "r20" / f"seed{seed}"
        assert got[(seed, "Start")]["dir"] == f"runs/r20/seed{seed}/start"
        assert got[(seed, "Mixed")]["dir"] == f"runs/r20/seed{seed}/mixed"
        assert got[(seed, "Oracle")]["dir"] == str(retrain_dir(sd, sd / "oracle" / "kept.jsonl").relative_to(out))
    sd1 = out / "runs" / "r20" / "seed1"
    assert got[(1, "prism")]["dir"] == str(
        retrain_dir(sd1, sd1 / "probes" / "removal" / "k20" / "prism" / "kept.jsonl").relative_to(out))
    # seed 0's prism kept exactly the Oracle's records: the same retraining, flagged; the Oracle row itself is not
    assert got[(0, "prism")]["dir"] == got[(0, "Oracle")]["dir"]
    assert [k for k, r in got.items() if r["same_as_oracle"]] == [(0, "prism")]


def test_summary_and_json_of_the_rows(tmp_path, capsys):
    out = _build(tmp_path / "exp")
    assert main(["experiment", "rows", "retrained", str(out), "--task", TASK,
                 "--json", str(tmp_path / "rows.json")]) == 0
    written = json.loads((tmp_path / "rows.json").read_text())
    assert written["rows"] == json.loads(json.dumps(tables.retrained_rows(out, TASK)))
    summ = {s["method"]: s for s in written["summary"]}
    assert [s["method"] for s in written["summary"]] == ["Start", "Mixed", "prism", "random", "Oracle"]
    prism = [_rates(*COUNTS[0]["Oracle"])[0], _rates(*COUNTS[1]["prism"])[0]]
    assert summ["prism"]["seeds"] == [0, 1] and summ["prism"]["same_as_oracle"] == [0]
    assert summ["prism"]["behaviour_rate"] == pytest.approx(sum(prism) / 2, rel=REL_TOL)
    assert summ["prism"]["behaviour_rate_std"] == pytest.approx(abs(prism[0] - prism[1]) / math.sqrt(2), rel=REL_TOL)
    # random finished on seed 0 only: its mean is seed 0's rate, with no standard deviation
    assert summ["random"]["seeds"] == [0]
    assert summ["random"]["behaviour_rate"] == pytest.approx(_rates(*COUNTS[0]["random"])[0], rel=REL_TOL)
    assert summ["random"]["behaviour_rate_std"] is None
    caps = [_rates(*COUNTS[s]["Mixed"])[1] for s in (0, 1)]
    assert summ["Mixed"]["capability"] == pytest.approx(sum(caps) / 2, rel=REL_TOL)
    printed = capsys.readouterr().out
    assert "| r20 | probes | 20 | prism | 0,1 (= Oracle's for [0]) |" in printed
    assert "| r20 | probes | 20 | random | 0 | 0.500 | 0.500 |" in printed


def test_a_folder_with_fine_tuning_seeds_is_refused(tmp_path, capsys):
    """Retrainings under ``retrain/<hash>-ft<seed>`` are not read by this script: it says so,
    names the reader that handles them, and writes nothing."""
    out = _build(tmp_path / "exp")
    sd = out / "runs" / "r20" / "seed1"
    _responses(Path(str(retrain_dir(sd, sd / "pool.jsonl")) + "-ft0"), 1, 1, 1)
    assert main(["experiment", "rows", "retrained", str(out), "--task", TASK,
                 "--json", str(tmp_path / "rows.json")]) == 2
    assert "repair_rows_from_files.py" in capsys.readouterr().err
    assert not (tmp_path / "rows.json").exists()


def test_an_empty_folder_has_no_rows(tmp_path, capsys):
    (tmp_path / "exp" / "runs" / "r20" / "seed0").mkdir(parents=True)
    assert main(["experiment", "rows", "retrained", str(tmp_path / "exp"), "--task", TASK]) == 1
    assert "no finished responses" in capsys.readouterr().err
