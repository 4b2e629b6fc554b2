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
