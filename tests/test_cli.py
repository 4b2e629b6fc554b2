"""The command line as a user meets it: help, the console after each command, devices."""

import argparse
import json

import pytest
import torch

from prism_select import cli
from prism_select.errors import ConfigError
from prism_select.examples import make_example
from prism_select.io import atomic_write_jsonl
from prism_select.model import ModelSettings


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from _subparsers(sub)


def test_every_option_has_help_and_every_command_an_example():
    parser = cli.build_parser()
    subs = dict(_subparsers(parser))
    assert {"score", "select", "compare", "demo", "report", "methods", "experiment", "mistake-math"} <= set(subs)
    for name, sub in subs.items():
        for action in sub._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
        assert "prism-select " in (sub.epilog or ""), f"{name} --help has no example"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["score", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "examples per forward/backward (default: 8)" in text
    assert "(default: 2048)" in text and "seeds every random choice of the run (default: 0)" in text
    assert "example: prism-select score --model default" in text


def test_report_warns_about_an_unknown_label(tmp_path, capsys):
    pool, _ = make_example(tmp_path / "data", n_pool=4)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text(json.dumps({"inputs": {"pool": str(pool)}}))
    cli._warn_unknown_label(tmp_path / "run", "harmfull")
    err = capsys.readouterr().err
    assert f"warning: no record of {pool} has a field 'harmfull'; did you mean --label harmful?" in err
    cli._warn_unknown_label(tmp_path / "run", "harmful")
    assert capsys.readouterr().err == ""


def test_demo_console_shows_text_flags_pi_and_every_file(tmp_path, capsys):
    pool, targets = make_example(tmp_path / "data", n_pool=6)
    recs = [json.loads(x) for x in pool.read_text().splitlines()]
    run = tmp_path / "run"
    atomic_write_jsonl(run / "scores.jsonl", [{"id": r["id"], "score": -i, "rank": i + 1} for i, r in enumerate(recs)])
    for f in ("pairs.jsonl", "run.json"):
        (run / f).write_text("{}\n")
    summary = {"counts": {"pool": 6, "pairs": 8}, "timings": {"total_s": 70.2},
               "pi": {"min": 0.2, "mean": 0.4, "max": 0.6}}
    cli._print_demo(summary, tmp_path, pool, targets, top=3)
    out = capsys.readouterr().out
    assert "pi (per target pair" in out and "mean 0.400" in out
    line = out.splitlines()[3]
    assert recs[0]["prompt"][:15] in line and recs[0]["response"].replace("\n", " ") in line
    assert ("harmful" if recs[0]["harmful"] else "correct") in line and "..." in line  # the prompt is cut
    assert all(len(x) < 130 for x in out.splitlines()[3:6])
    wrote = out.splitlines()[-1]
    for f in (pool, targets, run / "scores.jsonl", run / "pairs.jsonl", run / "run.json"):
        assert str(f) in wrote


def test_the_cli_sets_passive_openmp_waits_before_torch_loads():
    """Importing the CLI (as the prism-select script does) sets OMP_WAIT_POLICY=PASSIVE
    unless the user set it, before torch and its OpenMP runtime are loaded: spinning
    waits stalled every parallel region on a shared CPU (the demo's eigendecompositions)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    code = "import os, sys, prism_select.cli; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["PASSIVE", "False"]
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # the user's own setting stays
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["ACTIVE", "False"]


def test_mps_device(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="'mps' was asked for but is not available here"):
        ModelSettings("x", device="mps").resolved_device()
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ModelSettings("x", device="mps").resolved_device().type == "mps"
    assert ModelSettings("x").resolved_device().type == "mps"  # auto: after CUDA, before the CPU
    with pytest.raises(ConfigError, match="float64 is not supported on 'mps'"):
        ModelSettings("x", device="mps", dtype="float64").resolved_dtype()


def test_score_prints_the_next_command(tmp_path, capsys):
    from tiny import save_tiny

    model = save_tiny(tmp_path / "model")
    pool, targets = make_example(tmp_path / "data", n_pool=6, n_pairs=2)
    out = tmp_path / "run"
    assert cli.main(["score", "--model", str(model), "--pool", str(pool), "--targets", str(targets), "--out", str(out),
                     "--device", "cpu", "--dtype", "float32", "--max-length", "128", "--no-progress",
                     "--cache-dir", str(tmp_path / "cache")]) == 0
    text = capsys.readouterr().out
    assert f"next: prism-select select --run {out} --pool {pool} --keep 5% --out selected.jsonl" in text
    assert f"{out / 'pairs.jsonl'}" in text.splitlines()[-2]


def test_score_logs_each_stage_with_its_time(tmp_path, capsys):
    """With progress on, each stage ends with one console line (stderr) and its time,
    and the curvature line says whether it was fitted or came from the cache."""
    import re

    from tiny import save_tiny

    model = save_tiny(tmp_path / "model")
    pool, targets = make_example(tmp_path / "data", n_pool=6, n_pairs=2)
    for out, curvature in (("a", r"fitted in \d+\.\d s"), ("b", r"loaded from the cache \S+ in \d+\.\d s")):
        assert cli.main(["score", "--model", str(model), "--pool", str(pool), "--targets", str(targets), "--out",
                         str(tmp_path / out), "--device", "cpu", "--dtype", "float32", "--max-length", "128",
                         "--cache-dir", str(tmp_path / "cache"), "--damping-rule", "heuristic"]) == 0
        lines = [x.strip() for x in re.split(r"[\r\n]", capsys.readouterr().err) if x.strip()]
        for stage in (r"model loaded in \d+\.\d s", r"inputs read in \d+\.\d s",
                      r"target direction \(prism, 2 pairs\): \d+\.\d s", r"curvature \(ekfac\): " + curvature,
                      r"scoring: \d+\.\d s"):
            assert any(re.fullmatch(stage, x) for x in lines), (stage, lines)


def test_score_options_are_generated_from_the_settings_fields(capsys):
    """One source of defaults: parsing no option gives the dataclasses' defaults; every CLI
    field of every stage has its option; values are parsed and checked as the fields say."""
    import dataclasses

    from prism_select.curvature import CurvatureSettings
    from prism_select.settings import ScoreSettings
    base = ["score", "--pool", "p.jsonl", "--out", "o"]
    a = cli.build_parser().parse_args(base)
    s, c = cli._score_settings(a)
    assert s == ScoreSettings() and c == CurvatureSettings()
    for cls in (ScoreSettings, CurvatureSettings, ModelSettings):
        for f in dataclasses.fields(cls):
            assert hasattr(a, f.name) == f.metadata.get("cli", False), f.name
    a = cli.build_parser().parse_args(base + ["--max-gpu-memory", "70GiB", "--shrinkage", "auto", "--no-progress",
                                              "--modules", "mlp", "q_proj", "--curvature", "kfac", "--seed", "3",
                                              "--option", "layer=2", "--damping", "1e-3"])
    s, c = cli._score_settings(a)
    assert s.max_gpu_memory == 70 << 30 and c.shrinkage == "auto" and s.progress is False
    assert s.modules == ["mlp", "q_proj"] and c.kind == "kfac" and s.seed == c.seed == 3
    assert s.method_options == {"layer": 2} and c.damping == 1e-3
    assert cli._score_settings(cli.build_parser().parse_args(base + ["--shrinkage", "0.3"]))[1].shrinkage == 0.3
    for bad, field in ((["--max-gpu-memory", "lots"], "max_gpu_memory"), (["--shrinkage", "on"], "shrinkage"),
                       (["--batch-size", "0"], "batch_size"), (["--stream", "--method", "random"], "stream")):
        assert cli.main(base + bad) == 2
        assert f"setting '{field}'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's own checks: exit 2 too
        cli.build_parser().parse_args(base + ["--curvature", "exact"])
    assert e.value.code == 2


def test_keys_hold_exactly_the_fields_that_change_the_artifact():
    from prism_select.curvature import CurvatureSettings, FitSettings
    from prism_select.settings import ScoreSettings
    from prism_select.settings import key_of
    a, b = ScoreSettings(), ScoreSettings(batch_size=2, overwrite=True, progress=False, max_gpu_memory=1 << 30,
                                          cache_max_gb=5.0)
    assert a.run_key() == b.run_key()
    assert ScoreSettings(precision="split32").run_key() != a.run_key()
    c = CurvatureSettings()
    assert key_of(c) == key_of(CurvatureSettings(batch_size=2))
    assert key_of(c, FitSettings) == key_of(CurvatureSettings(damping=1e-3, shrinkage="auto"), FitSettings)
    assert key_of(c) != key_of(CurvatureSettings(damping=1e-3))


def test_experiment_cells_print_paired_intervals():
    from prism_select.cli_experiment import _cell_text
    assert _cell_text({"mean": 0.1, "std": 0.2, "ci": [-0.1, 0.3]}) == "+0.100 [-0.100, +0.300]"
    assert _cell_text({"mean": 0.5, "std": 0.1}) == "0.500 +- 0.100"
    assert _cell_text({"mean": 0.5, "std": None}) == "0.500" and _cell_text({"mean": None}) == "-"
