"""What a saved curvature is keyed by, field by field (a field left out of the key lets two
runs that differ in it share one fit), and the streaming fit sample pinned to the run's
seed."""

import dataclasses
import json
import random

import pytest
from conftest import POOL

from prism_select import cli
from prism_select.run import inputs as run_inputs
from prism_select.curvature import CurvatureSettings, FitCache, load_or_fit_curvature
from prism_select.curvature.base import FitSettings
from prism_select.curvature.store import curvature_key
from prism_select.data.tokenize import encode, encoded_fingerprint
from prism_select.data.readers import reservoir_sample
from prism_select.io import sha256_json
from prism_select.settings import key_of

from tiny import save_tiny

BASE = dict(settings=FitSettings(kind="ekfac", fisher="empirical", fit_examples=None, seed=0),
            model_fingerprint="m" * 64, pool_fingerprint="p" * 64, layers=["a.q_proj", "a.v_proj"], max_length=128,
            arithmetic="torch.float32")
#: another value of each key field of FitSettings
OTHER_SETTING = {"kind": "kfac", "fisher": "sampled", "fit_examples": 5, "seed": 1}
#: another value of each further argument of curvature_key
OTHER_INPUT = {"model_fingerprint": "n" * 64, "pool_fingerprint": "q" * 64, "layers": ["a.q_proj"],
               "max_length": 64, "arithmetic": "torch.float32+split32"}


def _key(**changes) -> str:
    return sha256_json(curvature_key(**{**BASE, **changes}))


def test_every_key_field_of_the_fit_settings_is_tested():
    keyed = set(key_of(BASE["settings"], FitSettings))
    assert keyed == set(OTHER_SETTING), "give a new key field of FitSettings another value in OTHER_SETTING"


@pytest.mark.parametrize("name", sorted(OTHER_SETTING))
def test_each_fit_setting_changed_alone_gives_another_key(name):
    assert _key(settings=dataclasses.replace(BASE["settings"], **{name: OTHER_SETTING[name]})) != _key()


@pytest.mark.parametrize("name", sorted(OTHER_INPUT))
def test_each_input_of_the_fit_changed_alone_gives_another_key(name):
    assert _key(**{name: OTHER_INPUT[name]}) != _key()


def test_the_fit_batch_size_is_not_in_the_key():
    assert _key(settings=dataclasses.replace(BASE["settings"], batch_size=3)) == _key()


def test_a_fit_on_other_tracked_modules_is_not_reused(model, modules, tok, tmp_path):
    """Through load_or_fit_curvature: the module list it is given reaches the key."""
    encoded = [encode(tok, q, r, 64) for q, r in POOL]
    cache = FitCache(tmp_path / "curvature", "m" * 64, encoded_fingerprint(encoded), 64)
    settings = CurvatureSettings(kind="kfac", batch_size=4)
    fewer = {n: m for n, m in modules.items() if "q_proj" in n}
    assert fewer and len(fewer) < len(modules)
    _, d_all, reused = load_or_fit_curvature(model, modules, encoded, settings, pad_id=tok.pad_token_id, cache=cache)
    assert reused is False and d_all is not None
    cur, d_few, reused = load_or_fit_curvature(model, fewer, encoded, settings, pad_id=tok.pad_token_id, cache=cache)
    assert reused is False and d_few != d_all and sorted(cur.layers) == sorted(fewer)
    _, again, reused = load_or_fit_curvature(model, fewer, encoded, settings, pad_id=tok.pad_token_id, cache=cache)
    assert reused is True and again == d_few


# --------------------------------------------------------------------------- the streaming fit sample


def _algorithm_r(n: int, k: int, seed: int) -> list:
    """Indices of the documented reservoir sample: Algorithm R on random.Random(seed)."""
    rng, kept = random.Random(seed), []
    for i in range(n):
        if len(kept) < k:
            kept.append(i)
        else:
            j = rng.randrange(i + 1)
            if j < k:
                kept[j] = i
    return sorted(kept)


def test_the_reservoir_sample_is_algorithm_r_on_its_seed():
    for seed in (0, 3, 12345):
        assert reservoir_sample(iter(range(500)), 7, seed) == (_algorithm_r(500, 7, seed), 500)


def test_a_streamed_run_fits_on_the_sample_drawn_with_its_seed(tmp_path, monkeypatch):
    """``score --stream --fit-examples 3 --seed 7``: the records its curvature is fitted on
    are the reservoir sample of the run's seed, 7."""
    from prism_select.examples import make_example

    pool, targets = make_example(tmp_path / "data", n_pool=12, n_pairs=2)
    seen = {}
    real = run_inputs.prepare_stream_inputs

    def spy(tokenizer, *a, **kw):
        seen["tok"], seen["inputs"] = tokenizer, real(tokenizer, *a, **kw)
        return seen["inputs"]

    monkeypatch.setattr(run_inputs, "prepare_stream_inputs", spy)
    argv = ["score", "--model", save_tiny(tmp_path / "model"), "--pool", pool, "--targets", targets,
            "--out", tmp_path / "run", "--device", "cpu", "--dtype", "float32", "--max-length", "128", "--no-progress",
            "--stream", "--fit-examples", "3", "--seed", "7", "--curvature", "diagonal",
            "--cache-dir", tmp_path / "cache"]
    assert cli.main([str(a) for a in argv]) == 0
    whole = run_inputs.prepare_inputs(seen["tok"], pool, max_length=128).encoded
    want = [whole[i].input_ids for i in _algorithm_r(len(whole), 3, 7)]
    assert [e.input_ids for e in seen["inputs"].fit_encoded] == want
    assert want != [whole[i].input_ids for i in _algorithm_r(len(whole), 3, 8)]  # the seed matters here
    assert json.loads((tmp_path / "run" / "run.json").read_text())["fit_sample"]["seed"] == 7
