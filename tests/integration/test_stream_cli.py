"""`prism-select score --stream`: the pool is read a window at a time and the curvature is
fitted on a seeded reservoir sample. On a float64 tiny model it must give the in-memory
run's ids, ranks and scores; it skips, refuses, resumes and samples as documented."""

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import PAIRS, POOL
from tiny import save_tiny, tiny_tokenizer

from prism_select import scoring
from prism_select.cli import main
from prism_select.data.readers import reservoir_sample, scan_pool
from prism_select.errors import ConfigError
from prism_select.run import curvature_provider
from prism_select.run import inputs as run_inputs
from prism_select.settings import STREAM_FIT_EXAMPLES, ScoreSettings

N_POOL = 12
# Streamed and in-memory scores are the same function of the same tokens and the same v;
# other windows change only the batch composition (float64 rounding).
SCORE_RTOL = 1e-10


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("stream")
    save_tiny(d / "model", dtype=torch.float64)
    with open(d / "pool.jsonl", "w") as f:
        for i in range(N_POOL):
            p, r = POOL[i % len(POOL)]
            f.write(json.dumps({"id": f"r{i}", "prompt": p + "!" * (i % 5), "response": r + "." * (i % 3)}) + "\n")
    with open(d / "targets.jsonl", "w") as f:
        for q, c, r in PAIRS:
            f.write(json.dumps({"prompt": q, "chosen": c, "rejected": r}) + "\n")
    return d


def _argv(d, out, pool=None, *extra):
    return ["score", "--model", str(d / "model"), "--pool", str(pool or d / "pool.jsonl"),
            "--targets", str(d / "targets.jsonl"), "--out", str(out), "--cache-dir", str(out) + "-cache",
            "--dtype", "float64", "--device", "cpu", "--no-progress", "--batch-size", "4",
            "--chunk-size", "2", "--max-length", "128", *extra]


def _score(d, out, *extra, pool=None):
    assert main(_argv(d, out, pool, *extra)) == 0
    rows = [json.loads(line) for line in (Path(out) / "scores.jsonl").read_text().splitlines()]
    return rows, json.loads((Path(out) / "run.json").read_text())


def _assert_same_scores(a, b):
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [r["rank"] for r in a] == [r["rank"] for r in b]
    torch.testing.assert_close(torch.tensor([r["score"] for r in a], dtype=torch.float64),
                               torch.tensor([r["score"] for r in b], dtype=torch.float64),
                               rtol=SCORE_RTOL, atol=0)


@pytest.fixture(scope="module")
def in_memory(data, tmp_path_factory):
    return _score(data, tmp_path_factory.mktemp("ref") / "run")


@pytest.mark.parametrize("window", [None, 3], ids=["one-window", "window-3"])
def test_stream_gives_the_in_memory_scores(data, in_memory, tmp_path, window):
    ref, ref_run = in_memory
    extra = ["--stream", "--fit-examples", str(N_POOL)] + (["--stream-window", str(window)] if window else [])
    rows, run = _score(data, tmp_path / "run", *extra)
    _assert_same_scores(rows, ref)
    assert run["stream"] is True and ref_run["stream"] is False
    assert run["counts"] == ref_run["counts"]
    assert run["fit_sample"] == {"valid_records": N_POOL, "requested": N_POOL, "drawn": N_POOL,
                                 "tokenised": N_POOL, "seed": 0, "default_size": False}
    assert run["curvature"]["reused"] is False  # fitted on the streamed sample, not a cached fit
    assert run["fingerprints"]["pool"] != ref_run["fingerprints"]["pool"]  # file bytes, not tokens
    assert run["throughput"]["scores"]["examples"] == N_POOL
    assert not (tmp_path / "run" / ".partial").exists()


def test_default_fit_sample_is_recorded(data, tmp_path):
    _, run = _score(data, tmp_path / "run", "--stream")
    assert run["curvature_settings"]["fit_examples"] == STREAM_FIT_EXAMPLES
    assert run["fit_sample"]["default_size"] is True
    assert run["fit_sample"]["drawn"] == N_POOL


def test_skip_invalid_lists_the_same_rows(data, tmp_path):
    lines = [json.dumps({"prompt": p, "response": r}) for p, r in POOL]
    lines[2] = "{not json"
    lines[5] = json.dumps({"prompt": "no response"})
    lines[6] = json.dumps({"prompt": "too long", "response": "x" * 300})  # cannot fit --max-length 128
    pool = tmp_path / "bad.jsonl"
    pool.write_text("\n".join(lines) + "\n")
    ref, ref_run = _score(data, tmp_path / "ref", "--skip-invalid", pool=pool)
    rows, run = _score(data, tmp_path / "run", "--skip-invalid", "--stream", "--stream-window", "2", pool=pool)
    _assert_same_scores(rows, ref)
    assert [r["id"] for r in rows] == [0, 1, 3, 4, 7]  # ids default to row numbers
    assert sorted(r["row"] for r in run["invalid_records"]) == [2, 5, 6]
    assert sorted(run["invalid_records"], key=lambda r: r["row"]) == \
        sorted(ref_run["invalid_records"], key=lambda r: r["row"])
    assert run["counts"]["invalid"] == 3 and run["counts"]["pool"] == 5
    # without --skip-invalid the streamed run stops at the first bad record, naming it
    assert main(_argv(data, tmp_path / "strict", pool, "--stream")) == 2
    assert not (tmp_path / "strict" / "run.json").exists()


def test_duplicate_ids_refused_before_scoring(data, tmp_path, capsys):
    pool = tmp_path / "dup.jsonl"
    pool.write_text("".join(json.dumps({"id": i % 3 if i < 4 else i, "prompt": p, "response": r}) + "\n"
                            for i, (p, r) in enumerate(POOL)))
    assert main(_argv(data, tmp_path / "run", pool, "--stream")) == 2
    err = capsys.readouterr().err
    assert "dup.jsonl, line 4, field 'id': duplicate id 0: lines 1 and 4" in err
    assert not (tmp_path / "run" / ".partial").exists()


def test_csv_pool_streams_like_in_memory(data, tmp_path):
    pool = tmp_path / "pool.csv"
    with open(pool, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "messages"])
        for i, (p, r) in enumerate(POOL):
            w.writerow([f"c{i}", json.dumps([{"role": "user", "content": p}, {"role": "assistant", "content": r}])])
    ref, _ = _score(data, tmp_path / "ref", pool=pool)
    rows, _ = _score(data, tmp_path / "run", "--stream", "--stream-window", "3", pool=pool)
    _assert_same_scores(rows, ref)


@pytest.mark.parametrize("method", ["random", "less", "ifguide"])
def test_baseline_with_stream_is_a_config_error(data, tmp_path, capsys, method):
    with pytest.raises(ConfigError) as e:
        ScoreSettings(method=method, stream=True)
    assert e.value.field == "stream"
    assert main(_argv(data, tmp_path / "run", None, "--stream", "--method", method)) == 2
    err = capsys.readouterr().err
    assert "setting 'stream'" in err and method in err and "drop --stream" in err
    assert not (tmp_path / "run").exists()


def test_stream_window_must_be_positive():
    with pytest.raises(ConfigError) as e:
        ScoreSettings(stream=True, stream_window=0)
    assert e.value.field == "stream_window"


def test_interrupted_stream_resumes_to_identical_output(data, tmp_path, monkeypatch):
    extra = ["--stream", "--stream-window", "5"]
    _score(data, tmp_path / "ref", *extra)
    out = tmp_path / "run"
    save = scoring._save_chunk
    saved = []

    def save_then_stop(*args):
        save(*args)
        saved.append(args[1])
        if len(saved) == 4:  # in the second window: windows of 5 records, chunks of 2 (3 a window)
            raise KeyboardInterrupt

    monkeypatch.setattr(scoring, "_save_chunk", save_then_stop)
    assert main(_argv(data, out, None, *extra)) == 130
    assert (out / ".partial" / "scores_v.safetensors").exists()
    assert len(list((out / ".partial" / "scores").glob("chunk_*.safetensors"))) == 4
    assert not (out / "scores.jsonl").exists() and not (out / "run.json").exists()

    monkeypatch.setattr(scoring, "_save_chunk", save)
    load, reused = scoring._load_chunk, []

    def counting_load(*args):
        got = load(*args)
        reused.append(got is not None)
        return got

    def no_refit(self):
        raise AssertionError("a resumed run must reuse the saved v, not fit the curvature again")

    monkeypatch.setattr(scoring, "_load_chunk", counting_load)
    monkeypatch.setattr(curvature_provider.CurvatureProvider, "curvature", no_refit)
    assert main(_argv(data, out, None, *extra)) == 0
    assert sum(reused) == 4
    assert (out / "scores.jsonl").read_text() == (tmp_path / "ref" / "scores.jsonl").read_text()
    assert not (out / ".partial").exists()


def test_reservoir_sample_is_seeded_uniform_and_in_order():
    a, n = reservoir_sample(iter(range(1000)), 10, seed=3)
    assert n == 1000 and len(a) == 10 and a == sorted(a)
    assert reservoir_sample(iter(range(1000)), 10, seed=3) == (a, 1000)
    assert reservoir_sample(iter(range(1000)), 10, seed=4)[0] != a
    assert reservoir_sample(iter(range(7)), 10, seed=3) == (list(range(7)), 7)
    assert reservoir_sample(iter(range(7)), 0, seed=3) == ([], 7)
    # every item is kept with probability k / n (here 5/20): within ~6 standard deviations
    hits = [0] * 20
    for seed in range(4000):
        for x in reservoir_sample(range(20), 5, seed)[0]:
            hits[x] += 1
    assert all(abs(h / 4000 - 0.25) < 0.04 for h in hits), hits


def test_scan_pool_sample_depends_only_on_the_seed(data):
    a = scan_pool(data / "pool.jsonl", 5, seed=1)
    b = scan_pool(data / "pool.jsonl", 5, seed=1)
    assert a.count == N_POOL and [e.id for e in a.sample] == [e.id for e in b.sample]
    assert [e.row for e in a.sample] == sorted(e.row for e in a.sample)
    others = {tuple(e.id for e in scan_pool(data / "pool.jsonl", 5, seed=s).sample) for s in range(2, 8)}
    assert len(others) > 1


def test_stream_pool_fingerprint_follows_file_bytes_tokenizer_and_max_length(data, tmp_path, tok):
    from datasets import Dataset

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    text = (data / "pool.jsonl").read_text()
    a.write_text(text)
    b.write_text(text.replace("Blue.", "Blue!"))

    def fp(pool, max_length=128, tokenizer=tok):
        return run_inputs.prepare_stream_inputs(tokenizer, pool, max_length=max_length, fit_examples=4).pool_fingerprint

    assert fp(a) == fp(data / "pool.jsonl")
    assert len({fp(a), fp(b), fp(a, max_length=64), fp(a, tokenizer=tiny_tokenizer(chat_template=False))}) == 4
    ds = tmp_path / "ds"  # a datasets directory: every file is hashed
    Dataset.from_list([json.loads(line) for line in text.splitlines()]).save_to_disk(str(ds))
    inputs = run_inputs.prepare_stream_inputs(tok, ds, max_length=128, fit_examples=4)
    assert inputs.pool_format == "arrow" and inputs.fit_sample["valid_records"] == N_POOL
    assert len(inputs.fit_encoded) == 4 and inputs.pool == [] and inputs.encoded == []
