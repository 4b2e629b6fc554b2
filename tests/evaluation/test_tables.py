"""``prism-select experiment rows|merge|aggregate`` against golden outputs: every table the
verb prints, byte for byte, and every JSON it writes, value for value, on synthetic run folders
(``tests/table_runs.py``) and on the results files under ``docs/results/``. The golden files
(``golden/tables/``: the printed text whole, the JSON files by the SHA-256 of their content) are the outputs of
the scripts these verbs replaced, on the same inputs."""

import hashlib
import json
from pathlib import Path

import pytest

from prism_select.cli import main
from table_runs import repair_run, select_run

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent / "golden" / "tables"
EXP = ROOT / "experiments"
R = "docs/results"

#: (stdout golden, argv after ``prism-select``, JSON files written)
CASES = [
    ("rff.out", ["experiment", "rows", "repair", "repair_ft", "--config", str(EXP / "dropped_carry.yaml"),
                 "--json", "rff.json", "--markdown", "rff.md"], ["rff.json"]),
    ("ror.out", ["experiment", "rows", "retrained", "repair_one", "--task", "carry", "--json", "ror.json"], ["ror.json"]),
    ("rank_ft.out", ["experiment", "rows", "rankings", "repair_ft", "--floors", "--family", "dropped_carry",
                     "--paired", "prism", "--json", "rank_ft.json"], ["rank_ft.json"]),
    ("off.out", ["experiment", "rows", "offsets", "repair_ft", "--json", "off.json"], ["off.json"]),
    ("comp.out", ["experiment", "rows", "composition", "repair_ft", "--removal", "20", "--json", "comp.json"],
     ["comp.json"]),
    ("srf.out", ["experiment", "rows", "select", "select", "--config", str(EXP / "carry_select_cpu.yaml"),
                 "--json", "srf.json", "--markdown", "srf.md"], ["srf.json"]),
    ("shares.out", ["experiment", "rows", "shares", "select", "--fraction", "0.05", "--json", "shares.json"],
     ["shares.json"]),
    ("agg_multitask.md", ["experiment", "aggregate", *[f"{R}/multitask-select/seed{s}/results.json" for s in range(3)],
                          "--allow", "score.max_length", "finetune.overrides.max_length", "--json", "agg_multitask.json"],
     ["agg_multitask.json"]),
    ("merge_general.out", ["experiment", "merge", f"{R}/general-select/results.json",
                           f"{R}/general-select/task_floor_cpu.json", "--methods", "Task records", "random",
                           "--suffix", " (CPU)", "--json", "merge_general.json"], ["merge_general.json"]),
    ("agg_general.md", ["experiment", "aggregate", "merge_general.json", "--against", "Task records (CPU)", "prism",
                        "random", "--task", "boolean_expressions", "--json", "agg_general.json"], ["agg_general.json"]),
    ("rank_k20.md", ["experiment", "rows", "rankings", "empty", "--add", f"{R}/dropped-carry-ranking/k20_rows.json",
                     "--paired", "prism", "--json", "rank_k20.json"], ["rank_k20.json"]),
    ("rank_grad.md", ["experiment", "rows", "rankings", "empty", "--add",
                      f"{R}/dropped-carry-ranking/gradient_1_50_rows.json", "--fractions", "0.05,0.1,0.2",
                      "--paired", "prism", "--json", "rank_grad.json"], ["rank_grad.json"]),
    ("repair_of_runs_s17.md", ["experiment", "rows", "retrained", "empty", "--with-rows",
                               f"{R}/money-refusal/s17-retrain/rows.json", "--json", "repair_of_runs_s17.json"],
     ["repair_of_runs_s17.json"]),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    repair_run(d / "repair_ft")
    repair_run(d / "repair_one", finetune_seeds=None)
    select_run(d / "select")
    (d / "empty").mkdir()
    (d / "docs").symlink_to(ROOT / "docs")
    return d


def _sha(path: Path) -> str:
    """SHA-256 of the JSON file's content with its keys sorted (the order a folder listing
    gave some of them is the file system's)."""
    return hashlib.sha256(json.dumps(json.loads(path.read_text()), sort_keys=True).encode()).hexdigest()


def test_every_table_is_the_golden_one(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    shas = json.loads((GOLDEN / "sha256.json").read_text())
    for golden, argv, written in CASES:  # in order: the general-select aggregate reads the merge's output
        assert main(argv) == 0, argv
        assert capsys.readouterr().out == (GOLDEN / golden).read_text(), golden
        for f in written:
            assert _sha(workdir / f) == shas[f], f
    for md in ("rff.md", "srf.md"):
        assert (workdir / md).read_text() == (GOLDEN / md).read_text(), md


def test_retrained_rows_refuse_a_folder_of_several_finetune_seeds(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    assert main(["experiment", "rows", "retrained", "repair_ft", "--task", "carry"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (GOLDEN / "ror_ft.err").read_text().strip() in captured.err


def test_the_old_script_names_run_the_verb(workdir, monkeypatch):
    """experiments/carry_offsets.py (one of the thin scripts) prints the verb's table."""
    import subprocess
    import sys
    monkeypatch.chdir(workdir)
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, str(EXP / "carry_offsets.py"), "repair_ft"], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert out == (GOLDEN / "off.out").read_text()
