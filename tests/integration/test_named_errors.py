"""Inputs whose mistake is found before any long work, as a named error (the file, row,
field and fix) rather than a traceback from deep inside the run: text that no tokenizer
can take, seeds outside what the generators accept, a tokenizer larger than the model's
vocabulary, non-finite weights, a truncated GGUF file, an empty saved dataset."""

import json

import pytest

from prism_select import cli
from prism_select.data import load_pool, load_targets
from prism_select.errors import InputError
from prism_select.examples import make_example

from tiny import save_tiny

BAD_TEXT = {"surrogate": ("a \ud800 b", "lone surrogate", "U+D800"), "nul": ("a \x00 b", "NUL", "U+0000")}


def _jsonl(path, rows):
    # json.dumps escapes both characters (\ud800, \u0000): the file is valid JSON and UTF-8
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _with(record: dict, field: str, text: str) -> dict:
    """``record`` with ``text`` planted in ``field`` (``messages``: the first message's content)."""
    rec = json.loads(json.dumps(record))
    if isinstance(rec[field], list):
        rec[field][0]["content"] = text
    else:
        rec[field] = text
    return rec


POOL_FORMS = [({"prompt": "q", "response": "r"}, "prompt"), ({"prompt": "q", "response": "r"}, "response"),
              ({"prompt": "q", "completion": "r"}, "completion"),
              ({"instruction": "i", "input": "x", "output": "o"}, "instruction"),
              ({"instruction": "i", "input": "x", "output": "o"}, "input"),
              ({"instruction": "i", "input": "x", "output": "o"}, "output"),
              ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "r"}]}, "messages")]
TARGET_FORMS = [({"prompt": "q", "chosen": "c", "rejected": "r"}, f) for f in ("prompt", "chosen", "rejected")] + [
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "c"}], "rejected": "r"}, "chosen")]


@pytest.mark.parametrize("bad", sorted(BAD_TEXT))
@pytest.mark.parametrize("record, field", POOL_FORMS + [(r, f + " ") for r, f in TARGET_FORMS],
                         ids=[f"pool-{f}" for _, f in POOL_FORMS] + [f"targets-{f}" for _, f in TARGET_FORMS])
def test_text_no_tokenizer_takes_is_a_named_error_of_its_record(tmp_path, record, field, bad):
    is_target, field = field.endswith(" "), field.strip()
    text, what, code = BAD_TEXT[bad]
    path = _jsonl(tmp_path / "in.jsonl", [record, _with(record, field, text)])
    load = load_targets if is_target else load_pool
    with pytest.raises(InputError) as e:
        load(path)
    assert e.value.line == 2 and e.value.field == field, str(e.value)
    for needle in (str(path), what, code, "fix:"):
        assert needle in str(e.value)
    assert [r.row for r in load(path, skip_invalid=True).invalid] == [1]


@pytest.mark.parametrize("where", ["pool", "targets"])
def test_score_names_a_lone_surrogate_before_the_model_loads(tmp_path, where, capsys, monkeypatch):
    from prism_select.run import job

    pool, targets = make_example(tmp_path / "data", n_pool=4, n_pairs=2)
    path = pool if where == "pool" else targets
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["chosen" if where == "targets" else "response"] = "x \ud800"
    _jsonl(path, rows)

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(job, "load_model", no_loading)
    out = tmp_path / "run"
    argv = ["score", "--model", str(save_tiny(tmp_path / "model")), "--pool", str(pool), "--targets", str(targets),
            "--out", str(out), "--device", "cpu", "--no-progress", "--cache-dir", str(tmp_path / "cache")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("prism-select: error: "), err
    assert f"{path}, line 2" in err and "lone surrogate" in err and "Traceback" not in err
    assert not out.exists()


# --------------------------------------------------------------------------- experiment configs

BILLION_LAUGHS = """\
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
i: &i [*h, *h, *h, *h, *h, *h, *h, *h, *h]
data: {gsm8k_train: train.jsonl, pool_size: 10}
methods: [prism]
method_options: {prism: {bomb: *i}}
"""


def test_a_yaml_alias_bomb_in_an_experiment_config_is_refused_at_once(tmp_path, capsys):
    import time
    config = tmp_path / "bomb.yaml"
    config.write_text(BILLION_LAUGHS)
    t = time.perf_counter()
    assert cli.main(["experiment", "ranking", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    assert time.perf_counter() - t < 5.0
    err = capsys.readouterr().err
    assert f"{config}, line 2: YAML alias *a" in err and "write the value out" in err, err
    assert not (tmp_path / "o").exists()


def test_an_oversized_experiment_config_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    from prism_select.errors import ConfigError
    from prism_select.evaluation import config as cfg
    path = tmp_path / "big.json"
    path.write_text('{"data": {"pool_size": 10}, "pad": "' + "x" * cfg.MAX_CONFIG_BYTES + '"}')
    monkeypatch.setattr(cfg.json, "loads", lambda *a, **k: pytest.fail("the oversized file was parsed"))
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        cfg.read_config_file(path)


def test_every_shipped_experiment_config_is_read():
    from pathlib import Path

    from prism_select.evaluation.config import read_config_file
    shipped = sorted((Path(__file__).resolve().parents[2] / "experiments").glob("*.yaml"))
    assert len(shipped) > 10
    for path in shipped:
        assert isinstance(read_config_file(path), dict), path


# --------------------------------------------------------------------------- seeds


@pytest.mark.parametrize("seed", [10**23, 2**32, -1])
def test_a_seed_outside_what_the_generators_take_is_refused(seed):
    from prism_select.curvature import CurvatureSettings
    from prism_select.errors import ConfigError
    from prism_select.finetune import FinetuneSettings
    from prism_select.settings import MAX_SEED, DirectionSettings
    for build in (lambda: DirectionSettings(seed=seed), lambda: CurvatureSettings(seed=seed),
                  lambda: FinetuneSettings(seed=seed)):
        with pytest.raises(ConfigError, match=f"from 0 to {MAX_SEED}"):
            build()
    DirectionSettings(seed=MAX_SEED), CurvatureSettings(seed=MAX_SEED)  # the largest is taken


def test_score_refuses_a_huge_seed_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from prism_select.run import job
    pool, targets = make_example(tmp_path / "data", n_pool=4, n_pairs=2)
    monkeypatch.setattr(job, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = ["score", "--model", str(save_tiny(tmp_path / "model")), "--pool", str(pool), "--targets", str(targets),
            "--out", str(tmp_path / "run"), "--device", "cpu", "--no-progress", "--seed", str(10**23)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "setting 'seed'" in err and "4294967295" in err and "Traceback" not in err


def test_an_experiment_config_with_a_huge_seed_is_refused():
    from prism_select.errors import ConfigError
    from prism_select.evaluation.config import load_config
    base = {"data": {"family": "mistake_math", "gsm8k_train": "x.jsonl"}, "probes": {"gsm8k_test": "y.jsonl"}}
    for key in ("seeds", "finetune_seeds"):
        with pytest.raises(ConfigError, match=key):
            load_config({**base, key: [0, 2**40]}, "repair")


# --------------------------------------------------------------------------- models


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused_at_load(tmp_path):
    import torch

    from prism_select.errors import ModelError
    from prism_select.model import ModelSettings, load_model
    from tiny import tiny_llama, tiny_tokenizer
    n = len(tiny_tokenizer())
    path = save_tiny(tmp_path / "model", model=tiny_llama(n - 5, dtype=torch.float32))
    with pytest.raises(ModelError, match=f"has {n} tokens but the model's embedding has {n - 5} rows"):
        load_model(ModelSettings(str(path), device="cpu", dtype="float32", cache_dir=str(tmp_path / "c")))


def test_non_finite_weights_are_named_at_load(tmp_path):
    import torch

    from prism_select.errors import ModelError
    from prism_select.model import ModelSettings, load_model
    from tiny import tiny_llama, tiny_tokenizer
    model = tiny_llama(len(tiny_tokenizer()), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 2] = float("nan")
    path = save_tiny(tmp_path / "model", model=model)
    with pytest.raises(ModelError, match=r"non-finite values .* model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ModelSettings(str(path), device="cpu", dtype="float32", cache_dir=str(tmp_path / "c")))


@pytest.mark.parametrize("dtype, advised", [("float32", False), ("float64", False), ("bfloat16", True),
                                            ("float16", True)])
def test_the_advice_on_a_non_finite_loss_fits_the_runs_dtype(dtype, advised):
    import torch

    from prism_select.errors import NumericalError
    from prism_select.gradients import _RUN_DTYPE, check_finite, set_run_dtype
    token = _RUN_DTYPE.set(None)
    try:
        set_run_dtype(getattr(torch, dtype))
        with pytest.raises(NumericalError) as e:
            check_finite(torch.tensor([1.0, float("nan")]), "the target loss (chosen)", record=[3])
    finally:
        _RUN_DTYPE.reset(token)
    assert ("try --dtype float32" in str(e.value)) == advised, str(e.value)
    assert f"computes in {dtype}" in str(e.value) and "record(s) [3]" in str(e.value)


# --------------------------------------------------------------------------- saved datasets


def test_a_saved_dataset_of_zero_rows_holds_no_records(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "empty"
    datasets.Dataset.from_list([{"prompt": "q", "response": "r"}]).select([]).save_to_disk(str(path))
    for load in (load_pool, load_targets):
        with pytest.raises(InputError, match="holds no records") as e:
            load(path)
        assert str(path) in str(e.value) and "IndexError" not in str(e.value)
