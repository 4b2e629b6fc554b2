"""Reliability of the `score` job: bad input, atomic outputs, resume/refuse,
caches keyed by fingerprints, untrusted files, determinism."""

import builtins
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch

from prism_select.cli import main
from prism_select.curvature import CurvatureSettings
from prism_select.errors import CacheError, ConfigError, InputError, ModelError, NumericalError, OutputError
from prism_select.examples import make_example
from prism_select.model import ModelSettings
from prism_select.run import prepare_inputs, score_pool
from prism_select.settings import ScoreSettings

from tiny import save_tiny, tiny_llama, tiny_tokenizer

OUTPUTS = ("scores.jsonl", "pairs.jsonl", "run.json")


@pytest.fixture
def model_dir(tmp_path):
    return save_tiny(tmp_path / "model")


@pytest.fixture
def data(tmp_path):
    return make_example(tmp_path / "data", n_pool=10, n_pairs=3)


def settings(tmp_path, model_dir, **kw):
    return ModelSettings(model=str(model_dir), dtype="float32", device="cpu", cache_dir=str(tmp_path / "cache"))


def run(tmp_path, model_dir, pool, targets, out, curvature="ekfac", rule="heuristic", **kw):
    """A run on a tiny model; ``rule`` heuristic: these 10 records are fitted (the default
    ``auto`` ranks a pool this small with identity curvature)."""
    s = ScoreSettings(max_length=128, batch_size=4, progress=False, chunk_size=4, **kw)
    return score_pool(settings(tmp_path, model_dir), pool, targets, out, s,
                      CurvatureSettings(kind=curvature, damping_rule=rule))


def scores_of(out):
    return [json.loads(line) for line in (Path(out) / "scores.jsonl").read_text().splitlines()]


def no_outputs(out):
    return not any((Path(out) / f).exists() for f in OUTPUTS)


def test_schema_of_written_files(tmp_path, model_dir, data):
    out = tmp_path / "run"
    summary = run(tmp_path, model_dir, *data, out)
    rows = scores_of(out)
    assert [set(r) for r in rows] == [{"id", "score", "rank"}] * 10
    assert sorted(r["rank"] for r in rows) == list(range(1, 11))
    by_rank = sorted(rows, key=lambda r: r["rank"])
    assert all(a["score"] >= b["score"] for a, b in zip(by_rank, by_rank[1:]))
    pairs = [json.loads(x) for x in (out / "pairs.jsonl").read_text().splitlines()]
    assert len(pairs) == 3 and {"id", "pi", "margin"} <= set(pairs[0])
    assert all(abs(p["pi"] - 1 / (1 + math.exp(-p["margin"]))) < 1e-12 for p in pairs)
    rj = json.loads((out / "run.json").read_text())
    for key in ("settings", "curvature_settings", "versions", "fingerprints", "timings", "counts", "model"):
        assert key in rj
    assert rj["status"] == "complete" and rj == json.loads(json.dumps(summary))
    assert not (out / ".partial").exists()


BAD_POOLS = {
    "empty.jsonl": "",
    "badjson.jsonl": '{"prompt": "a", "response": "b"}\n{not json}\n',
    "missing.jsonl": '{"prompt": "a"}\n',
    "mistyped.jsonl": '{"prompt": "a", "response": 3}\n',
    "emptyresp.jsonl": '{"prompt": "a", "response": "  "}\n',
    "dupids.jsonl": '{"id": 1, "prompt": "a", "response": "b"}\n{"id": 1, "prompt": "c", "response": "d"}\n',
    "pool.xml": "<pool/>",
}


@pytest.mark.parametrize("name", sorted(BAD_POOLS))
def test_bad_pool_gives_named_error_and_no_output(tmp_path, model_dir, data, name):
    bad = tmp_path / name
    bad.write_text(BAD_POOLS[name])
    out = tmp_path / "run"
    with pytest.raises(InputError) as e:
        run(tmp_path, model_dir, bad, data[1], out)
    assert name in str(e.value)
    assert no_outputs(out)


def test_non_utf8_and_cli_exit_code(tmp_path, model_dir, data, capsys):
    bad = tmp_path / "bytes.jsonl"
    bad.write_bytes(b'{"prompt": "a", "response": "\xff\xfe"}\n')
    out = tmp_path / "run"
    code = main(["score", "--model", str(model_dir), "--pool", str(bad), "--targets", str(data[1]),
                 "--out", str(out), "--device", "cpu", "--no-progress", "--cache-dir", str(tmp_path / "c")])
    assert code == 2
    err = capsys.readouterr().err
    assert "bytes.jsonl, line 1: not UTF-8" in err and "Traceback" not in err
    assert no_outputs(out)


def test_chosen_equal_rejected_and_unfit_response(tmp_path, model_dir, data):
    t = tmp_path / "t.jsonl"
    t.write_text('{"prompt": "q", "chosen": "same", "rejected": "same"}\n')
    with pytest.raises(InputError, match="t.jsonl, line 1"):
        run(tmp_path, model_dir, data[0], t, tmp_path / "r1")
    long_pool = tmp_path / "long.jsonl"
    long_pool.write_text(json.dumps({"prompt": "q", "response": "x" * 400}) + "\n")
    with pytest.raises(InputError, match="max_length"):
        run(tmp_path, model_dir, long_pool, data[1], tmp_path / "r2")
    assert no_outputs(tmp_path / "r1") and no_outputs(tmp_path / "r2")


def test_skip_invalid_lists_records_in_run_json(tmp_path, model_dir, data):
    pool = tmp_path / "mixed.jsonl"
    lines = data[0].read_text().splitlines()
    pool.write_text("\n".join(lines[:4] + ['{"prompt": "a"}', json.dumps({"prompt": "q", "response": "y" * 400})]
                              + lines[4:]) + "\n")
    summary = run(tmp_path, model_dir, pool, data[1], tmp_path / "run", skip_invalid=True)
    assert summary["counts"]["invalid"] == 2 and summary["counts"]["pool"] == 10
    assert {r["row"] for r in summary["invalid_records"]} == {4, 5}


def test_select_checks_the_pool_file_of_a_real_run(tmp_path, model_dir, data, capsys):
    """run.json records the pool file's bytes; `select` refuses an edited pool (before
    writing anything) and accepts the scored one."""
    out = tmp_path / "run"
    run(tmp_path, model_dir, *data, out)
    edited = tmp_path / "edited.jsonl"
    edited.write_text(data[0].read_text().replace("The answer is", "So the answer is", 1))
    args = ["select", "--run", str(out), "--keep", "3"]
    assert main(args + ["--pool", str(edited), "--out", str(tmp_path / "a.jsonl")]) == 2
    assert "not the pool scored" in capsys.readouterr().err and not (tmp_path / "a.jsonl").exists()
    assert main(args + ["--pool", str(data[0]), "--out", str(tmp_path / "a.jsonl")]) == 0
    assert capsys.readouterr().out.startswith("wrote 3 of 10 scored records")


def test_finished_run_is_refused_unless_overwrite(tmp_path, model_dir, data):
    out = tmp_path / "run"
    run(tmp_path, model_dir, *data, out)
    with pytest.raises(OutputError, match="overwrite"):
        run(tmp_path, model_dir, *data, out)
    run(tmp_path, model_dir, *data, out, overwrite=True)


def test_unfinished_run_with_other_settings_is_refused(tmp_path, model_dir, data):
    """An output directory holding an unfinished run (its .partial/ key) with other
    settings is refused; resuming with the same settings is tested with SIGKILL in
    test_resume.py."""
    out = tmp_path / "run"
    (out / ".partial").mkdir(parents=True)
    (out / ".partial" / "key.json").write_text(json.dumps({"settings": {"method": "equal"}}))
    with pytest.raises(CacheError, match="unfinished run"):
        run(tmp_path, model_dir, *data, out)
    assert no_outputs(out)
    run(tmp_path, model_dir, *data, out, overwrite=True)
    assert (out / "run.json").exists()


def test_inputs_after_a_kill_are_refused_when_edited(tmp_path, model_dir, data, monkeypatch):
    """A run stopped after its first score chunk, then the pool edited: the same command is
    refused (the pool's fingerprint differs), not resumed with the old chunk mixed in;
    the kept chunk stays."""
    from prism_select import scoring
    real_save = scoring._save_chunk

    def save_then_stop(*a):
        real_save(*a)
        raise KeyboardInterrupt
    monkeypatch.setattr(scoring, "_save_chunk", save_then_stop)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, model_dir, *data, out)
    monkeypatch.undo()
    chunks = sorted((out / ".partial").rglob("chunk_*"))
    assert chunks
    edited = data[0].read_text().replace("The answer is", "So the answer is", 1)
    assert edited != data[0].read_text()
    data[0].write_text(edited)
    with pytest.raises(CacheError, match=r"unfinished run with other settings or inputs \(differs in: .*pool"):
        run(tmp_path, model_dir, *data, out)
    assert sorted((out / ".partial").rglob("chunk_*")) == chunks and no_outputs(out)


def test_no_input_file_is_modified(tmp_path, model_dir, data):
    """score, select and report read the pool, the targets and the model directory and
    change none of their bytes or modification times."""
    inputs = [*data, *sorted(p for p in model_dir.rglob("*") if p.is_file())]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in inputs}
    out = tmp_path / "run"
    run(tmp_path, model_dir, *data, out)
    assert main(["select", "--run", str(out), "--pool", str(data[0]), "--remove", "2",
                 "--out", str(tmp_path / "kept.jsonl")]) == 0
    assert main(["report", "--run", str(out)]) == 0
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in inputs} == before


def test_unwritable_output_fails_before_work(tmp_path, model_dir, data, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    called = []
    monkeypatch.setattr("prism_select.run.job.load_model", lambda *a: called.append(1))
    with pytest.raises(OutputError):
        run(tmp_path, model_dir, *data, blocker / "run")
    assert not called


@pytest.mark.parametrize("case", ["targets_missing", "no_targets", "bad_pool_record", "bad_target_record",
                                  "adapter_missing", "bad_modules_regex"])
def test_inputs_are_checked_before_the_model_loads(tmp_path, model_dir, data, monkeypatch, case):
    called = []
    monkeypatch.setattr("prism_select.run.job.load_model", lambda *a: called.append(1))
    pool, targets = data
    bad = tmp_path / "bad.jsonl"
    ms = settings(tmp_path, model_dir)
    if case == "targets_missing":
        targets, error = tmp_path / "nope.jsonl", InputError
    elif case == "no_targets":
        targets, error = None, ConfigError
    elif case == "bad_pool_record":
        bad.write_text(pool.read_text() + '{"prompt": "q"}\n')
        pool, error = bad, InputError
    elif case == "bad_target_record":
        bad.write_text('{"prompt": "q", "chosen": "a"}\n')
        targets, error = bad, InputError
    elif case == "adapter_missing":
        ms, error = ModelSettings(model=str(model_dir), adapter=str(tmp_path / "nope"), device="cpu"), ModelError
    else:
        error = ConfigError
    out = tmp_path / "run"
    with pytest.raises(error):
        score_pool(ms, pool, targets, out, ScoreSettings(progress=False,
                                                         modules=["mlp("] if case == "bad_modules_regex" else None))
    assert not called and not any(out.rglob("*"))


def test_failure_before_the_first_chunk_does_not_block_the_corrected_command(tmp_path, model_dir, data,
                                                                              monkeypatch):
    """A run that fails after its .partial/key.json was written but before any score
    chunk was finished leaves nothing behind: the corrected command (other settings) runs."""
    out = tmp_path / "run"

    def fail(*a, **k):
        raise NumericalError("non-finite values (NaN or inf) in the training loss")
    monkeypatch.setattr("prism_select.methods.prism.compute_preference", fail)
    with pytest.raises(NumericalError):
        run(tmp_path, model_dir, *data, out)
    assert not (out / ".partial").exists()
    monkeypatch.undo()
    run(tmp_path, model_dir, *data, out, seed=1)  # other settings: not refused
    assert (out / "run.json").exists()


def test_curvature_cache_reused_only_when_fingerprints_match(tmp_path, model_dir, data):
    a = run(tmp_path, model_dir, *data, tmp_path / "a")
    b = run(tmp_path, model_dir, *data, tmp_path / "b")
    assert a["curvature"]["reused"] is False and b["curvature"]["reused"] is True
    assert scores_of(tmp_path / "a") == scores_of(tmp_path / "b")
    other_pool, _ = make_example(tmp_path / "data2", n_pool=10, n_pairs=3, seed=5)
    c = run(tmp_path, model_dir, other_pool, data[1], tmp_path / "c")
    assert c["curvature"]["reused"] is False and c["curvature"]["path"] != a["curvature"]["path"]
    # A saved curvature whose recorded settings do not match its key is never reused.
    meta = Path(a["curvature"]["path"]) / "curvature.json"
    m = json.loads(meta.read_text())
    m["settings"]["damping_factor"] = 0.5
    meta.write_text(json.dumps(m))
    d = run(tmp_path, model_dir, *data, tmp_path / "d")
    assert d["curvature"]["reused"] is False
    from prism_select.curvature import Curvature
    with pytest.raises(CacheError):
        Curvature.load(Path(a["curvature"]["path"]), expect={"model_fingerprint": "other"})


def test_runs_keep_the_cache_under_cache_max_gb_and_the_cache_command_prunes_it(tmp_path, model_dir, data,
                                                                                 capsys):
    """Fits of two pools under a --cache-max-gb that holds one run's entries (its curvature
    and the split-half check's two half fits) and half another: the second evicts the first
    (least recently used), so the cache never grows past the bound; `prism-select cache`
    lists and prunes it."""
    from prism_select import cache
    a = run(tmp_path, model_dir, *data, tmp_path / "a", rule="split-half")
    first = cache.entries(tmp_path / "cache")
    assert len(first) == 3 and a["curvature"]["path"] in {str(e.path) for e in first}
    size = sum(e.size for e in first)
    other_pool, _ = make_example(tmp_path / "data2", n_pool=10, n_pairs=3, seed=5)
    bound = (size + 0.5 * min(e.size for e in first)) / (1 << 30)
    b = run(tmp_path, model_dir, other_pool, data[1], tmp_path / "b", rule="split-half", cache_max_gb=bound)
    left = cache.entries(tmp_path / "cache")
    assert b["curvature"]["path"] in {str(e.path) for e in left} and len(left) == 3
    assert not {str(e.path) for e in left} & {str(e.path) for e in first}
    assert sum(e.size for e in left) <= bound * (1 << 30)
    assert main(["cache", "list", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "3 entries" in capsys.readouterr().out
    assert main(["cache", "prune", "--max-gb", "0", "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "removed 3 entries" in capsys.readouterr().out and cache.entries(tmp_path / "cache") == []


def test_nan_weights_are_named_at_load(tmp_path, data):
    tok = tiny_tokenizer()
    m = tiny_llama(len(tok), dtype=torch.float32)
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    d = tmp_path / "nanmodel"
    m.save_pretrained(d)
    tok.save_pretrained(d)
    with pytest.raises(ModelError, match=r"non-finite values .* model\.layers\.1\.mlp\.down_proj\.weight"):
        run(tmp_path, d, *data, tmp_path / "run")  # named at load: the weights are the cause
    assert no_outputs(tmp_path / "run")


def test_data_paths_are_never_opened(tmp_path, model_dir, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    pool = tmp_path / "pool.jsonl"
    pool.write_text(json.dumps({"prompt": str(secret), "response": str(secret), "image": str(secret)}) + "\n")
    targets = tmp_path / "t.jsonl"
    targets.write_text(json.dumps({"prompt": str(secret), "chosen": str(secret), "rejected": "no"}) + "\n")
    opened = []
    real_open = builtins.open

    def spy(file, *a, **k):
        opened.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else file)
        return real_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    prepare_inputs(tiny_tokenizer(), pool, targets, max_length=512)
    assert str(secret) not in opened


def test_no_pickle_loading_in_the_package():
    root = Path(__file__).resolve().parents[2] / "prism_select"
    for f in root.rglob("*.py"):
        text = f.read_text()
        assert "import pickle" not in text and "pickle.load" not in text, f
        for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
            assert "weights_only=True" in m.group(1), f"{f}: {m.group(0)}"
        assert "trust_remote_code=True" not in text, f


def test_same_seed_gives_identical_scores_on_cpu(tmp_path, model_dir, data):
    run(tmp_path, model_dir, *data, tmp_path / "a", curvature="ekfac")
    run(tmp_path, model_dir, *data, tmp_path / "b", curvature="ekfac")
    assert scores_of(tmp_path / "a") == scores_of(tmp_path / "b")
    rj = json.loads((tmp_path / "a" / "run.json").read_text())
    # Everything needed to rerun is recorded.
    assert rj["settings"]["seed"] == 0 and rj["inputs"]["pool"] and rj["model"]["settings"]["model"]


def test_ctrl_c_message_says_how_to_resume(tmp_path, model_dir, data, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr("prism_select.run.score_pool", interrupted)
    code = main(["score", "--model", str(model_dir), "--pool", str(data[0]), "--targets", str(data[1]),
                 "--out", str(tmp_path / "run")])
    assert code == 130
    assert "Nothing had finished yet; run the same command again" in capsys.readouterr().err
    (tmp_path / "run" / ".partial" / "scores").mkdir(parents=True)
    assert main(["score", "--model", str(model_dir), "--pool", str(data[0]), "--targets", str(data[1]),
                 "--out", str(tmp_path / "run")]) == 130
    assert f"Finished work is kept in {tmp_path / 'run' / '.partial'}; run the same command" in capsys.readouterr().err


GPU_SCORE_RTOL = 1e-4  # float32 on CUDA: reduction order may differ between runs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_same_seed_gives_equal_scores_on_gpu(tmp_path, model_dir, data):
    def run_cuda(out):
        s = ScoreSettings(max_length=128, batch_size=4, progress=False)
        ms = ModelSettings(model=str(model_dir), dtype="float32", device="cuda", cache_dir=str(tmp_path / out))
        score_pool(ms, *data, tmp_path / out, s, CurvatureSettings(kind="ekfac"))
        return torch.tensor([r["score"] for r in scores_of(tmp_path / out)], dtype=torch.float64)

    a, b = run_cuda("a"), run_cuda("b")
    assert torch.allclose(a, b, rtol=GPU_SCORE_RTOL, atol=GPU_SCORE_RTOL * float(a.abs().max()))


@pytest.mark.parametrize("method,expected", [
    # a small pool: identity curvature in place of the fit (the default rule), whose stage still ends
    ("prism", ["direction", "fit", "scoring"]),
    ("ifguide:harmonic", ["target", "fit", "token_scores"]),
    ("conceptinf", ["concept_vector", "concept_gradient", "fit", "scoring"]),
])
def test_run_json_records_the_host_peak_at_the_end_of_each_stage(tmp_path, model_dir, data, method, expected):
    """The process's resident high-water mark when each stage ended (what says which stage
    set a run's host peak, e.g. one method's of a `compare`); a baseline's own stages too."""
    import resource
    method, _, ranking = method.partition(":")
    summary = run(tmp_path, model_dir, *data, tmp_path / "run", method=method, rule="auto",
                  method_options={"ranking": ranking} if ranking else {})
    stages = summary["host_peak_mib_by_stage"]
    assert list(stages) == expected
    values = list(stages.values())
    assert 0 < values[0] and values == sorted(values)  # a high-water mark only rises
    assert values[-1] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 + 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", ["auto", "heuristic"])  # a small pool: identity in place of the fit; a fit
def test_run_json_records_the_gpu_peak_of_each_planned_stage(tmp_path, model_dir, data, rule):
    s = ScoreSettings(max_length=128, batch_size=4, progress=False)
    ms = ModelSettings(model=str(model_dir), dtype="float32", device="cuda", cache_dir=str(tmp_path / "c"))
    run = score_pool(ms, *data, tmp_path / "run", s, CurvatureSettings(kind="ekfac", damping_rule=rule))
    assert run["curvature_applied"]["kind"] == ("identity" if rule == "auto" else "ekfac")
    assert (run["memory_plan"]["fit"]["stored_bytes"] == 0) == (rule == "auto")  # planned for the applied one
    stages = run["gpu_peak_bytes_by_stage"]
    assert set(stages) == {"direction", "fit", "scoring"}  # the memory plan's stages
    assert all(v > 0 for v in stages.values())
    assert run["gpu_peak_bytes"] >= max(stages.values())
    assert set(run["gpu_alloc_retries_by_stage"]) == set(stages)
    assert all(v >= 0 for v in run["gpu_alloc_retries_by_stage"].values())


def test_a_resumed_run_says_on_the_console_what_it_reuses(tmp_path, model_dir, data, capsys, monkeypatch):
    from prism_select import scoring
    real_save, saved = scoring._save_chunk, []

    def save_then_stop(*a):
        real_save(*a)
        saved.append(1)
        raise KeyboardInterrupt
    argv = ["score", "--model", str(model_dir), "--pool", str(data[0]), "--targets", str(data[1]),
            "--out", str(tmp_path / "run"), "--chunk-size", "2", "--batch-size", "2"]
    monkeypatch.setattr(scoring, "_save_chunk", save_then_stop)
    assert main(argv) == 130
    first = capsys.readouterr().err
    assert "resuming" not in first and "reused" not in first
    monkeypatch.setattr(scoring, "_save_chunk", real_save)
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"resuming the unfinished run in {tmp_path / 'run'}" in err
    assert "reused from" in err and "no fit" in err  # H^-1 g_KL from .partial
    assert "scoring: 2 of" in err and "examples reused from the finished chunks" in err
