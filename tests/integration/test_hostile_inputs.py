"""Inputs a careless or hostile user can give: each ends in a named error before any
memory runaway or long work, with nothing written and the inputs untouched, or in the
right result. Runs the CLI in-process on a tiny random-init model (no downloads)."""

import json
import os
from pathlib import Path

import pytest
import torch

from prism_select import cli
from prism_select.run.compare import options_for
from prism_select.curvature import CurvatureSettings
from prism_select.data import load_pool
from prism_select.data.tokenize import encode, render
from prism_select.errors import ConfigError, InputError
from prism_select.examples import make_example
from prism_select.run import prepare_inputs
from prism_select.run.preflight import check_before_loading
from prism_select.settings import ScoreSettings

from cli_errors import fails as _fails
from fake_runs import fake_run, write_jsonl_rows
from tiny import save_tiny, tiny_tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    pool, targets = make_example(d / "data", n_pool=8, n_pairs=3)
    return save_tiny(d / "model"), pool, targets


def _score_argv(model, pool, targets, out, *extra):
    return ["score", "--model", str(model), "--pool", str(pool), "--targets", str(targets), "--out", str(out),
            "--device", "cpu", "--dtype", "float32", "--max-length", "128", "--no-progress",
            "--cache-dir", str(Path(out).parent / "cache"), "--damping-rule", "heuristic", *extra]


# --------------------------------------------------------------------------- memory runaways


class _CountingTokenizer:
    """The tiny tokenizer, recording the length of every text it is asked to tokenise."""

    def __init__(self):
        self.tok, self.longest = tiny_tokenizer(), 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)


#: characters tokenised at most for a max_length of 64: a bounded prefix, not the record
TOKENISED_CHARS_BOUND = 64 * 2 * 16 * 4


def test_a_huge_response_is_refused_after_tokenising_a_bounded_prefix():
    tok = _CountingTokenizer()
    with pytest.raises(InputError, match="more than 64 tokens") as e:
        encode(tok, "What is 2+2?", "4" * 400_000, 64, path="pool.jsonl", row=0, line=1)
    assert e.value.line == 1 and e.value.field == "response"
    assert tok.longest <= TOKENISED_CHARS_BOUND


def test_a_huge_prompt_is_cut_from_the_left_as_the_whole_text_would_be():
    tok = _CountingTokenizer()
    prompt = "".join(f"step {i}: add {i % 7}. " for i in range(20_000))
    got = encode(tok, prompt, "The answer is 5.", 64)
    assert tok.longest <= TOKENISED_CHARS_BOUND
    p_text, r_text = render(tok.tok, prompt, "The answer is 5.")
    p_ids = tok.tok(p_text, add_special_tokens=False)["input_ids"]
    r_ids = tok.tok(r_text, add_special_tokens=False)["input_ids"]
    room = 64 - len(r_ids)
    assert got.truncated and got.input_ids == p_ids[-room:] + r_ids and got.response_start == room


def test_a_response_that_fits_is_tokenised_whole():
    tok = tiny_tokenizer()
    text = " ".join(["word"] * 300)  # longer than the first prefix: fits within 4096 tokens
    got = encode(tok, "Repeat.", text, 4096)
    p_text, r_text = render(tok, "Repeat.", text)
    assert got.input_ids[got.response_start:] == tok(r_text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("kind", ["device", "fifo"])
def test_a_pool_that_is_not_a_regular_file_is_refused_before_reading(tmp_path, kind, files, capsys):
    pool = tmp_path / "pool.jsonl"
    if kind == "device":
        pool.symlink_to("/dev/zero")
    else:
        os.mkfifo(pool)  # no writer: opening it would block forever
    with pytest.raises(InputError, match="not a regular file"):
        load_pool(pool)
    model, _, targets = files
    out = tmp_path / "run"
    _fails(_score_argv(model, pool, targets, out), capsys, str(pool), "not a regular file")
    assert not out.exists()
    _, real_pool, _ = files  # select hashes the pool's bytes: never those of a device or a pipe
    run = _fake_run(tmp_path / "scored", real_pool)
    _fails(["select", "--run", run, "--pool", pool, "--keep", "1", "--out", tmp_path / "kept.jsonl"], capsys,
           str(pool), "not a regular file")


# --------------------------------------------------------------------------- silent wrong results


def test_a_pair_whose_responses_tokenise_the_same_is_invalid(tmp_path):
    targets = tmp_path / "targets.jsonl"
    rows = [{"prompt": "Pick one.", "chosen": "It is \u20ac.", "rejected": "It is \u00a5."},  # both <unk>
            {"prompt": "What is 1+1?", "chosen": "3", "rejected": "2"}]
    targets.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pool, _ = make_example(tmp_path / "data", n_pool=4)
    tok = tiny_tokenizer()
    with pytest.raises(InputError, match="tokenise to the same tokens") as e:
        prepare_inputs(tok, pool, targets, max_length=128)
    assert e.value.line == 1 and e.value.field == "rejected" and str(targets) in str(e.value)
    inputs = prepare_inputs(tok, pool, targets, max_length=128, skip_invalid=True)
    assert [p.id for p in inputs.pairs] == [1] and [r.row for r in inputs.invalid] == [0]


@pytest.mark.parametrize("flag, value", [("--damping", "1e300"), ("--damping", "inf"), ("--damping-factor", "1e300")])
def test_a_damping_beyond_float32_is_refused(flag, value, files, tmp_path, capsys):
    field = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=field):
        CurvatureSettings(**{field: float(value)})
    model, pool, targets = files
    _fails(_score_argv(model, pool, targets, tmp_path / "run", flag, value), capsys, f"setting '{field}'")
    assert not (tmp_path / "run").exists()


def test_options_given_to_a_target_direction_are_refused(files, tmp_path, capsys):
    model, pool, targets = files
    with pytest.raises(ConfigError, match="takes no options, got layer"):
        check_before_loading(None, pool, targets, ScoreSettings(method="prism", method_options={"layer": 1}))
    _fails(_score_argv(model, pool, targets, tmp_path / "run", "--option", "layer=1"), capsys,
           "method 'prism' takes no options, got layer")
    assert options_for("prism", {"layer": 1}) == {}  # compare hands a shared option to the baselines only
    assert options_for("vecfilter", {"layer": 1}) == {"layer": 1}


# --------------------------------------------------------------------------- select and report


_jsonl, _fake_run = write_jsonl_rows, fake_run


@pytest.fixture
def scored(tmp_path):
    """A pool without ids (row numbers are its ids), its targets and a finished run over it."""
    pool = _jsonl(tmp_path / "pool.jsonl", [{"prompt": f"q{i}", "response": f"a{i}", "harmful": i < 2}
                                            for i in range(6)])
    targets = _jsonl(tmp_path / "targets.jsonl", [{"prompt": "q", "chosen": "x", "rejected": "y"}])
    return pool, targets, _fake_run(tmp_path / "run", pool, targets)


def test_select_from_another_pool_without_ids_is_refused(scored, tmp_path, capsys):
    pool, _, run = scored
    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": "new", "response": "inserted"}] + rows)
    out = tmp_path / "kept.jsonl"
    _fails(["select", "--run", run, "--pool", other, "--keep", "2", "--out", out, "--allow-other-pool"], capsys,
           "--allow-other-pool needs ids", "row number", str(other))
    assert not out.exists()


@pytest.mark.parametrize("which", ["scores.jsonl", "run.json", "pairs.jsonl", "targets", "run"])
def test_select_never_writes_over_the_runs_files_or_inputs(scored, which, capsys):
    pool, targets, run = scored
    (run / "pairs.jsonl").write_text('{"id": 0, "pi": 0.5}\n')
    out = {"targets": targets, "run": run}.get(which, run / which)
    before = {p: p.read_bytes() for p in [targets, pool, *run.iterdir()]}
    _fails(["select", "--run", run, "--pool", pool, "--keep", "2", "--out", out, "--overwrite"], capsys,
           f"cannot write {out}", "choose another output path")
    assert {p: p.read_bytes() for p in [targets, pool, *run.iterdir()]} == before


@pytest.mark.parametrize("text, needle", [("null", "got null"), ("[1, 2]", "got list"),
                                          ('{"status": "compl', "cannot read run.json"),
                                          ('{"status": "running"}', "status is 'running'")])
def test_select_and_report_refuse_a_run_json_that_is_no_finished_run(scored, tmp_path, text, needle, capsys):
    pool, _, run = scored
    (run / "run.json").write_text(text)
    out = tmp_path / "kept.jsonl"
    _fails(["select", "--run", run, "--pool", pool, "--keep", "2", "--out", out], capsys, str(run / "run.json"),
           needle)
    assert not out.exists()
    if "status" not in needle:  # report shows an unfinished run's scores as they are
        _fails(["report", "--run", run], capsys, str(run / "run.json"))
        assert not (run / "report.html").exists()


def test_select_warns_when_the_run_has_no_pool_fingerprint(scored, tmp_path, capsys):
    pool, _, run = scored
    info = json.loads((run / "run.json").read_text())
    del info["fingerprints"]
    (run / "run.json").write_text(json.dumps(info))
    assert cli.main(["select", "--run", str(run), "--pool", str(pool), "--keep", "2",
                     "--out", str(tmp_path / "kept.jsonl")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "prism-select: warning:" in err and "no fingerprint of the pool file" in err and "record ids only" in err


def test_report_refuses_a_pool_other_than_the_scored_one(scored, tmp_path, monkeypatch, capsys):
    """run.json names the pool by a relative path, as runs did: from another folder, a file
    with other labels at that path gives no AUROC of the wrong labels."""
    pool, _, run = scored
    info = json.loads((run / "run.json").read_text())
    info["inputs"]["pool"] = "pool.jsonl"
    (run / "run.json").write_text(json.dumps(info))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    rows = [json.loads(line) for line in pool.read_text().splitlines()]
    _jsonl(elsewhere / "pool.jsonl", [{**r, "harmful": not r["harmful"]} for r in rows])  # labels flipped
    monkeypatch.chdir(elsewhere)
    _fails(["report", "--run", run, "--label", "harmful"], capsys, "is not the pool file that was scored",
           "pool.jsonl")
    assert not (run / "report.html").exists()
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", "--run", str(run), "--label", "harmful"]) == 0
    assert "<td>1.000</td>" in (run / "report.html").read_text()  # the scored labels: harmful ranked first


def test_report_never_writes_over_an_input_and_leaves_no_images(scored, tmp_path, capsys):
    pool, targets, run = scored
    before = {p: p.read_bytes() for p in (pool, targets)}
    for out in (pool, targets, run / "scores.jsonl", run / "run.json"):
        _fails(["report", "--run", run, "--out", out], capsys, "an input or output of the run")
        _fails(["report", "--run", run, "--out", out, "--overwrite"], capsys, "an input or output of the run")
    assert {p: p.read_bytes() for p in (pool, targets)} == before
    page = tmp_path / "page.html"
    page.write_text("mine")
    _fails(["report", "--run", run, "--out", page], capsys, "already exists", "--overwrite")
    assert page.read_text() == "mine"
    assert cli.main(["report", "--run", str(run), "--out", str(page), "--overwrite"]) == 0
    assert page.read_text().startswith("<!DOCTYPE html>") or "<html" in page.read_text()
    assert not list(tmp_path.rglob("*.png"))


# --------------------------------------------------------------------------- the cache and resumed runs


def _scores_of(out):
    return [json.loads(line) for line in (Path(out) / "scores.jsonl").read_text().splitlines()]


def _curvature_entry(cache, run):
    """The cache entry of ``run``'s fitted curvature."""
    name = Path(json.loads((Path(run) / "run.json").read_text())["curvature"]["path"]).name
    return Path(cache) / "curvature" / name


@pytest.fixture(scope="module")
def reference_run(files, tmp_path_factory):
    """One finished run and the cache holding its fitted curvature (EK-FAC)."""
    d = tmp_path_factory.mktemp("hostile-ref")
    model, pool, targets = files
    assert cli.main(_score_argv(model, pool, targets, d / "ref")) == 0
    return d / "ref", d / "cache"


def _rerun(files, cache, out):
    model, pool, targets = files
    argv = _score_argv(model, pool, targets, out)
    argv[argv.index("--cache-dir") + 1] = str(cache)
    assert cli.main(argv) == 0
    return json.loads((Path(out) / "run.json").read_text())["curvature"]


#: relative gap between a run's scores and the reference run's (same fit, same arithmetic)
SAME_SCORES_RTOL = 1e-5


def _assert_same_scores(a, b):
    for x, y in zip(_scores_of(a), _scores_of(b), strict=True):
        assert x["id"] == y["id"] and x["rank"] == y["rank"]
        assert abs(x["score"] - y["score"]) <= SAME_SCORES_RTOL * max(abs(y["score"]), 1e-12)


def test_a_cached_curvature_changed_in_place_is_fitted_again(files, reference_run, tmp_path):
    import shutil

    ref, cache = reference_run
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine)
    assert _rerun(files, mine, tmp_path / "same")["reused"] is True
    factors = _curvature_entry(mine, ref) / "factors.safetensors"
    data = bytearray(factors.read_bytes())
    header = int.from_bytes(data[:8], "little")
    at = 8 + header + 64  # one float32 of the first tensor's data (fitted in float32)
    value = torch.frombuffer(data[at:at + 4], dtype=torch.float32).item()
    data[at:at + 4] = torch.tensor([value * 64 if value else 1.0], dtype=torch.float32).numpy().tobytes()
    factors.write_bytes(bytes(data))  # same size, one value changed
    assert _rerun(files, mine, tmp_path / "changed")["reused"] is False
    _assert_same_scores(tmp_path / "changed", ref)


def test_a_truncated_curvature_json_is_an_incomplete_entry_fitted_again(files, reference_run, tmp_path, capsys):
    import shutil

    from prism_select import cache as cache_mod

    ref, cache = reference_run
    mine = tmp_path / "cache"
    shutil.copytree(cache, mine)
    meta = _curvature_entry(mine, ref) / "curvature.json"
    meta.write_text(meta.read_text()[:40])
    assert [e.complete for e in cache_mod.entries(mine) if e.path == meta.parent] == [False]
    assert cli.main(["cache", "list", "--cache-dir", str(mine)]) == 0
    assert "(incomplete)" in capsys.readouterr().out
    assert _rerun(files, mine, tmp_path / "again")["reused"] is False
    _assert_same_scores(tmp_path / "again", ref)
    assert [e.complete for e in cache_mod.entries(mine) if e.path == meta.parent] == [True]  # saved again, whole


def test_a_damaged_record_of_an_unfinished_run_is_a_named_error(files, reference_run, tmp_path, capsys):
    ref, cache = reference_run
    model, pool, targets = files
    out = tmp_path / "run"
    (out / ".partial").mkdir(parents=True)
    (out / ".partial" / "key.json").write_text('{"settings": {"meth')
    argv = _score_argv(model, pool, targets, out)
    argv[argv.index("--cache-dir") + 1] = str(cache)
    _fails(argv, capsys, "key.json", "damaged", "--overwrite")
    assert cli.main(argv + ["--overwrite"]) == 0
    _assert_same_scores(out, ref)


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_a_cache_dir_that_cannot_be_written_is_a_named_error(files, tmp_path, kind, capsys, monkeypatch):
    import errno
    import tempfile

    model, pool, targets = files
    cache = tmp_path / "cache"
    if kind == "file":
        cache.write_text("not a folder")
    else:  # a read-only mount, as the OS reports it (a mode-0555 folder is writable for root)
        cache.mkdir()
        mkstemp = tempfile.mkstemp

        def read_only(*args, dir=None, **kw):
            if dir is not None and Path(dir) == cache:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(cache))
            return mkstemp(*args, dir=dir, **kw)
        monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = tmp_path / "run"
    argv = _score_argv(model, pool, targets, out)
    argv[argv.index("--cache-dir") + 1] = str(cache)
    _fails(argv, capsys, "setting 'cache_dir'", str(cache))
    assert not out.exists()


def test_cache_commands_refuse_a_missing_folder_and_an_unknown_kind(tmp_path, capsys):
    _fails(["cache", "list", "--cache-dir", tmp_path / "nowhere"], capsys, "does not exist")
    _fails(["cache", "clear", "--cache-dir", tmp_path, "--kind", "bogus"], capsys, "unknown cache kind 'bogus'",
           "curvature")
    (tmp_path / "file").write_text("x")
    _fails(["cache", "prune", "--cache-dir", tmp_path / "file"], capsys, "is a file")


def test_score_into_an_existing_file_names_the_problem(files, tmp_path, capsys):
    model, pool, targets = files
    out = tmp_path / "run.txt"
    out.write_text("keep me")
    err = _fails(_score_argv(model, pool, targets, out), capsys, "is a file, not a folder")
    assert "File exists" not in err and out.read_text() == "keep me"


def test_a_closed_console_pipe_ends_quietly(tmp_path):
    """``prism-select ... | head -1``: the reader goes away; the command's files are written,
    so it ends with exit 0 and no traceback."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(cli.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "prism_select.cli", "methods"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env)
    p.stdout.close()  # before the command prints a line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_the_next_command_quotes_paths_with_spaces(files, reference_run, tmp_path, capsys):
    import shlex

    model, pool, targets = files
    _, cache = reference_run
    out = tmp_path / "my runs" / "first run"
    argv = _score_argv(model, pool, targets, out)
    argv[argv.index("--cache-dir") + 1] = str(cache)
    assert cli.main(argv) == 0
    nxt = [line for line in capsys.readouterr().out.splitlines() if line.startswith("next: ")][0]
    words = shlex.split(nxt[len("next: "):].split("   (")[0])
    assert words[words.index("--run") + 1] == str(out) and words[words.index("--pool") + 1] == str(pool)


def test_a_pickle_model_that_the_safe_loader_refuses_is_named_without_an_unsafe_fix(tmp_path):
    import argparse

    from safetensors.torch import load_file

    from prism_select.errors import ModelError
    from prism_select.model import ModelSettings, load_model

    d = save_tiny(tmp_path / "model")
    state = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save({**state, "extra": argparse.Namespace(a=1)}, d / "pytorch_model.bin")
    with pytest.raises(ModelError) as e:
        load_model(ModelSettings(model=str(d), device="cpu", cache_dir=str(tmp_path / "cache")))
    text = str(e.value)
    assert "safetensors" in text and "argparse.Namespace" in text and "weights_only=False" not in text
    assert "Fix:" in text


def test_a_model_with_its_own_code_names_the_flag(tmp_path):
    from prism_select.errors import ModelError
    from prism_select.model import ModelSettings, load_model

    d = save_tiny(tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update({"model_type": "mystery", "auto_map": {"AutoConfig": "modeling_mystery.MysteryConfig",
                                                      "AutoModelForCausalLM": "modeling_mystery.Mystery"}})
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError) as e:
        load_model(ModelSettings(model=str(d), device="cpu", cache_dir=str(tmp_path / "cache")))
    assert "--trust-remote-code" in str(e.value) and "trust_remote_code=True" not in str(e.value)


def test_an_input_error_found_after_the_model_loads_leaves_no_out_folder(files, tmp_path, capsys):
    """A response too long for --max-length is found when the pool is tokenised, after the
    model has loaded: the run ends with the named error and no --out folder behind."""
    model, _, targets = files
    pool = _jsonl(tmp_path / "pool.jsonl", [{"prompt": "q", "response": "a"}, {"prompt": "q", "response": "b" * 400}])
    out = tmp_path / "new" / "run"
    argv = _score_argv(model, pool, targets, out)
    argv[argv.index("--cache-dir") + 1] = str(tmp_path / "cache")
    _fails(argv, capsys, str(pool), "line 2", "--max-length")
    assert not out.parent.exists()


def test_compare_refuses_an_option_that_no_compared_method_takes(files, tmp_path, capsys):
    model, pool, targets = files
    out = tmp_path / "cmp"
    _fails(["compare", "--model", model, "--pool", pool, "--targets", targets, "--out", out, "--device", "cpu",
            "--methods", "prism", "random", "--option", "layr=1", "--cache-dir", tmp_path / "cache"], capsys,
           "no method of prism, random takes the option(s) layr")
    assert not out.exists()


def test_scores_that_are_all_equal_are_warned_about(files, reference_run, tmp_path, capsys, monkeypatch):
    from prism_select.run import job

    model, pool, targets = files
    _, cache = reference_run
    n = sum(1 for line in Path(pool).read_text().splitlines() if line.strip())
    monkeypatch.setattr(job, "_method_fn", lambda name: lambda ctx: (torch.zeros(n, dtype=torch.float64), []))
    out = tmp_path / "run"
    argv = _score_argv(model, pool, targets, out)
    argv[argv.index("--cache-dir") + 1] = str(cache)
    assert cli.main(argv) == 0
    assert "prism-select: warning: every score is 0.0" in capsys.readouterr().err
    assert json.loads((out / "run.json").read_text())["warnings"][0].startswith("every score is 0.0")


def test_compare_with_a_cache_dir_that_is_a_file_is_a_named_error(files, tmp_path, capsys):
    model, pool, targets = files
    (tmp_path / "cache").write_text("not a folder")
    out = tmp_path / "cmp"
    _fails(["compare", "--model", model, "--pool", pool, "--targets", targets, "--out", out, "--device", "cpu",
            "--methods", "prism", "random", "--cache-dir", tmp_path / "cache"], capsys, "setting 'cache_dir'")
    assert not out.exists()
