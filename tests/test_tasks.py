"""Several target sets in one scoring pass (``score --targets A.jsonl B.jsonl``, or one
file whose records carry ``task``): each task's scores equal a separate run on that task
alone (float64, a tiny model built in-process), a killed run resumes with the chunks'
``K`` columns, streaming gives the in-memory scores, and an invalid task set is a named
error."""

import json
from pathlib import Path

import pytest
import torch

from prism_select import scoring
from prism_select.curvature import CurvatureSettings
from prism_select.errors import ConfigError, InputError
from prism_select.examples import make_example
from prism_select.model import ModelSettings
from prism_select.run import score_pool
from prism_select.settings import ScoreSettings
from prism_select.plan import ExampleSize, make_plan

from tiny import save_tiny, tiny_llama, tiny_tokenizer

#: a task's score in a several-task run against the same task's run alone (float64 runs
#: whose only difference is the number of stacked directions scored per batch)
TASK_SCORE_RTOL = 1e-9
TASK_SCORE_ATOL = 1e-12


def _write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tasks")
    pool, targets = make_example(d / "data", n_pool=14, n_pairs=6)
    pairs = [json.loads(line) for line in targets.read_text().splitlines()]
    a = _write(d / "data" / "algebra.jsonl", pairs[:2])
    b = _write(d / "data" / "geometry.jsonl", pairs[2:5])
    c = _write(d / "data" / "misc.jsonl", pairs[5:])
    both = _write(d / "data" / "tagged.jsonl", [{**p, "task": "algebra"} for p in pairs[:2]]
                  + [{**p, "task": "geometry"} for p in pairs[2:5]] + [{**p, "task": "misc"} for p in pairs[5:]])
    return {"model": save_tiny(d / "model", dtype=torch.float64), "pool": pool, "tasks": [a, b, c], "tagged": both,
            "cache": d / "cache"}


def _run(files, targets, out, **kw):
    ms = ModelSettings(model=str(files["model"]), dtype="float64", device="cpu", cache_dir=str(files["cache"]))
    s = ScoreSettings(max_length=128, batch_size=4, chunk_size=4, progress=False, **kw)
    # EK-FAC fitted on the pool (the small-pool rule would rank with identity curvature)
    return score_pool(ms, files["pool"], targets, out, s, CurvatureSettings(kind="ekfac", damping_rule="heuristic"))


def _rows(out):
    return [json.loads(line) for line in (Path(out) / "scores.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def alone(files, tmp_path_factory):
    """Each task's scores from a run on that task alone."""
    d = tmp_path_factory.mktemp("alone")
    return {Path(t).stem: [r["score"] for r in (_run(files, t, d / Path(t).stem), _rows(d / Path(t).stem))[1]]
            for t in files["tasks"]}


def _check_against_alone(rows, alone):
    assert list(rows[0]["scores"]) == ["algebra", "geometry", "misc"]
    for task, ref in alone.items():
        got = torch.tensor([r["scores"][task] for r in rows])
        assert torch.allclose(got, torch.tensor(ref), rtol=TASK_SCORE_RTOL, atol=TASK_SCORE_ATOL), task
        order = sorted(range(len(ref)), key=lambda i: (-ref[i], i))
        assert [rows[i]["ranks"][task] for i in order] == list(range(1, len(ref) + 1))
    assert [r["score"] for r in rows] == [r["scores"]["algebra"] for r in rows]  # the first task's
    assert [r["rank"] for r in rows] == [r["ranks"]["algebra"] for r in rows]


def test_several_files_score_as_separate_runs_in_one_pass(files, alone, tmp_path, monkeypatch):
    passes = []
    real = scoring.score_chunks
    monkeypatch.setattr(scoring, "score_chunks", lambda *a, **k: passes.append(1) or real(*a, **k))
    summary = _run(files, files["tasks"], tmp_path / "run")
    assert len(passes) == 1  # one pass over the pool for the three tasks
    rows = _rows(tmp_path / "run")
    _check_against_alone(rows, alone)
    assert summary["tasks"] == ["algebra", "geometry", "misc"]
    assert [t["pairs"] for t in summary["target_sets"]] == [2, 3, 1]
    pairs = [json.loads(line) for line in (tmp_path / "run" / "pairs.jsonl").read_text().splitlines()]
    assert [p["task"] for p in pairs] == ["algebra"] * 2 + ["geometry"] * 3 + ["misc"]


def test_one_file_whose_records_carry_task_is_the_same_run(files, alone, tmp_path):
    _run(files, files["tagged"], tmp_path / "run")
    _check_against_alone(_rows(tmp_path / "run"), alone)
    # --combine-tasks: one direction from every pair, one score column
    _run(files, files["tagged"], tmp_path / "combined", combine_tasks=True)
    assert "scores" not in _rows(tmp_path / "combined")[0]


def test_a_killed_several_task_run_resumes_to_the_same_scores(files, alone, tmp_path, monkeypatch):
    real_save, saved = scoring._save_chunk, []

    def save_then_stop(partial_dir, k, chunk, out):
        assert out.shape == (len(chunk), 3)  # one column per task
        real_save(partial_dir, k, chunk, out)
        saved.append(k)
        if len(saved) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(scoring, "_save_chunk", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _run(files, files["tasks"], tmp_path / "run")
    assert len(list((tmp_path / "run" / ".partial" / "scores").glob("chunk_*"))) == 2
    monkeypatch.setattr(scoring, "_save_chunk", real_save)
    reused = []
    real_load = scoring._load_chunk
    monkeypatch.setattr(scoring, "_load_chunk", lambda *a: (lambda t: reused.append(t is not None) or t)(real_load(*a)))
    _run(files, files["tasks"], tmp_path / "run")
    assert sum(reused) == 2
    _check_against_alone(_rows(tmp_path / "run"), alone)


def test_streamed_several_task_run_writes_the_in_memory_scores(files, alone, tmp_path):
    _run(files, files["tasks"], tmp_path / "run", stream=True, stream_window=5)
    _check_against_alone(_rows(tmp_path / "run"), alone)


def test_invalid_task_sets_are_named_errors(files, tmp_path):
    pairs = [json.loads(line) for line in Path(files["tasks"][1]).read_text().splitlines()]
    mixed = _write(tmp_path / "mixed.jsonl", [{**pairs[0], "task": "geometry"}] + pairs[1:])
    with pytest.raises(InputError, match="carry 'task' and this one does not") as e:
        _run(files, mixed, tmp_path / "a")
    assert e.value.path is not None and e.value.field == "task"
    (tmp_path / "other").mkdir()
    twin = _write(tmp_path / "other" / "algebra.jsonl", pairs)
    with pytest.raises(ConfigError, match="both task 'algebra'"):
        _run(files, [files["tasks"][0], twin], tmp_path / "b")
    with pytest.raises(ConfigError, match="scores one target set"):
        _run(files, files["tasks"], tmp_path / "c", method="less")
    with pytest.raises(ConfigError, match="targets hold 3 tasks"):
        _run(files, files["tagged"], tmp_path / "d", method="prism_shuffled")
    with pytest.raises(ConfigError, match="not scored in one pass under --shard fsdp"):
        _run(files, files["tasks"], tmp_path / "e", shard="fsdp")
    for out in "abcde":
        assert not (tmp_path / out).exists()  # refused before any work is kept


def test_the_memory_plan_counts_every_direction():
    tok = tiny_tokenizer()
    model = tiny_llama(len(tok), dtype=torch.float32)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n}
    kw = dict(kind="ekfac", device="cpu", batch_size=4, fit_batch_size=4, example=ExampleSize(1 << 20, 64, len(tok)),
              host_available=1 << 34)
    one = make_plan(model, modules, **kw).scoring
    four = make_plan(model, modules, directions=4, **kw).scoring
    tracked = sum(m.weight.numel() for m in modules.values()) * 4
    assert one["v_bytes"] == tracked and four["v_bytes"] == 2 * 4 * tracked  # the stacked V and its layout
    largest = max(m.weight.numel() for m in modules.values())
    # and each example's gradient of the largest layer (float32, and in the model's dtype)
    assert four["peak"] - one["peak"] == four["v_bytes"] - one["v_bytes"] + 4 * largest * (4 + 4)


def test_the_cli_takes_several_target_files(files, alone, tmp_path, capsys):
    from prism_select.cli import main
    args = ["score", "--model", str(files["model"]), "--pool", str(files["pool"]), "--targets",
            *map(str, files["tasks"]), "--out", str(tmp_path / "run"), "--cache-dir", str(files["cache"]),
            "--dtype", "float64", "--device", "cpu", "--max-length", "128", "--batch-size", "4", "--chunk-size", "4",
            "--no-progress", "--curvature", "ekfac", "--damping-rule", "heuristic"]
    assert main(args) == 0
    _check_against_alone(_rows(tmp_path / "run"), alone)
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["inputs"]["target_files"] == [str(Path(t).absolute()) for t in files["tasks"]]
    capsys.readouterr()
    assert main(["score", *args[1:args.index("--out")], "--out", str(tmp_path / "shuffled"),
                 *args[args.index("--out") + 2:], "--method", "prism_shuffled"]) != 0
    err = capsys.readouterr().err
    assert "scores one target set" in err and "--combine-tasks" in err
    assert not (tmp_path / "shuffled").exists()  # refused before the model loads


@pytest.mark.parametrize("method", ["equal", "unpaired"])
def test_the_other_directions_score_several_sets_as_separate_runs(files, tmp_path, method):
    _run(files, files["tasks"][:2], tmp_path / "both", method=method)
    rows = _rows(tmp_path / "both")
    for t in files["tasks"][:2]:
        _run(files, t, tmp_path / Path(t).stem, method=method)
        ref = torch.tensor([r["score"] for r in _rows(tmp_path / Path(t).stem)])
        got = torch.tensor([r["scores"][Path(t).stem] for r in rows])
        assert torch.allclose(got, ref, rtol=TASK_SCORE_RTOL, atol=TASK_SCORE_ATOL), (method, t)
