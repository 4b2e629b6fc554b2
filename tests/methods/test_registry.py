"""The method registry: every method's options parsed through its dataclass, with named
errors; the facts the settings and the run ask of a method by name."""

import dataclasses
import json

import pytest

from prism_select import preference
from prism_select.errors import ConfigError
from prism_select.methods import get, names, parse_options, register
from prism_select.methods import registry
from prism_select.run.preflight import check_before_loading
from prism_select.settings import DirectionSettings, ScoreSettings

from conftest import PAIRS, POOL, write_inputs

#: a value no option accepts (not JSON: neither text, number, list, mapping nor null)
NO_TYPE = {1, 2}


@pytest.mark.parametrize("name", names())
def test_an_unknown_option_names_the_method_the_key_and_the_known_keys(name):
    with pytest.raises(ConfigError) as e:
        parse_options(name, {"no_such_option": 1})
    text = str(e.value)
    assert f"method {name!r}" in text and "no_such_option" in text, text
    known = get(name).option_names()
    assert all(k in text for k in known), text
    if not known:
        assert "takes no options" in text


@pytest.mark.parametrize("name", names())
def test_every_option_is_typed_and_its_default_parses(name):
    method = get(name)
    default = parse_options(name, {})
    assert default == method.options() and dataclasses.is_dataclass(default)
    assert type(default).__dataclass_params__.frozen
    # the defaults, as a run's method_options would give them, parse to the same options
    assert parse_options(name, registry.options_dict(default)) == default
    for key in method.option_names():
        with pytest.raises(ConfigError, match=f"option {key} must be") as e:
            parse_options(name, {key: NO_TYPE})
        assert e.value.field == key and name in str(e.value)


def test_wrong_types_are_named_errors_and_right_ones_pass():
    with pytest.raises(ConfigError, match="option quantile must be a number, got 'high'"):
        parse_options("ifguide", {"quantile": "high"})
    with pytest.raises(ConfigError, match="option layer must be an integer or null, got True"):
        parse_options("vecfilter", {"layer": True})
    with pytest.raises(ConfigError, match="option score_targets must be true or false"):
        parse_options("judge", {"score_targets": 1})
    assert parse_options("ifguide", {"quantile": 1}).quantile == 1  # an integer is a number
    assert parse_options("less", {"target_modules": ["q_proj"], "checkpoints": "ckpt"}).checkpoints == "ckpt"
    assert parse_options("projdiff", {"responses": {"a": "text"}}).responses == {"a": "text"}
    assert parse_options("ifguide_harmonic", {}).ranking == "harmonic"
    with pytest.raises(ConfigError, match="shuffle_seed must be an integer >= 0"):
        parse_options("prism_shuffled", {"shuffle_seed": -1})


def test_options_are_checked_before_the_model_loads(tmp_path):
    """``--option`` / ``method_options`` of any method is refused by the checks that run
    before the model loads, not by the method once the model is there."""
    pool, targets = write_inputs(tmp_path, POOL, PAIRS)
    for method, opts, match in (("vecfilter", {"layr": 1}, "has no option.*layr: it takes only layer, similarity"),
                                ("less", {"proj_dim": "8192"}, "option proj_dim must be an integer"),
                                ("random", {"seed": 1}, "method 'random' takes no options, got seed")):
        with pytest.raises(ConfigError, match=match):
            check_before_loading(None, pool, targets, ScoreSettings(method=method, method_options=opts))
    check_before_loading(None, pool, targets, ScoreSettings(method="vecfilter", method_options={"layer": 1}))


def test_an_experiment_configs_method_options_are_checked_when_read(tmp_path):
    from prism_select.evaluation.config import load_config
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"question": "1 + 1?", "answer": "2\n#### 2"}) + "\n")
    base = {"data": {"gsm8k_train": str(train)}, "methods": ["ifguide"]}
    with pytest.raises(ConfigError, match=r"method_options\.ifguide.*has no option.*quantil.*quantile"):
        load_config({**base, "method_options": {"ifguide": {"quantil": 0.9}}}, "ranking")
    with pytest.raises(ConfigError, match=r"method_options\.less\.proj_dim.*must be an integer"):
        load_config({**base, "method_options": {"less": {"proj_dim": 1.5}}}, "ranking")
    load_config({**base, "method_options": {"ifguide": {"quantile": 0.9}}}, "ranking")


def test_the_facts_of_prism_and_its_ablations_and_controls():
    assert names(kind="direction") == list(preference.METHODS)
    assert names(given_weights=True) == list(preference.GIVEN_WEIGHTS) == names(control=True)
    assert names(sharded=True) == names(multi_task=True) == ["prism", "equal", "unpaired"]
    assert all(get(n).streams for n in preference.METHODS)
    assert not any(get(n).streams or get(n).sharded for n in names(kind="baseline"))
    assert {n for n in names() if not get(n).needs_pairs} == {"random", "saefeat", "judge"}
    with pytest.raises(ConfigError, match="does not run under --shard fsdp.*use one of prism, equal, unpaired"):
        ScoreSettings(shard="fsdp", method="less")
    with pytest.raises(ConfigError, match="streaming scores only prism, equal, unpaired, prism_shuffled"):
        ScoreSettings(stream=True, method="ifguide")


def test_a_method_registered_in_one_place_is_known_everywhere():
    """What a new method file does, :func:`register`, is all the settings, the run and the
    options parsing need."""
    @dataclasses.dataclass(frozen=True)
    class Opts:
        depth: int = 2

    def fn(ctx):
        raise AssertionError("not run here")

    with pytest.raises(ConfigError, match="unknown method 'extra_test_method'"):
        DirectionSettings(method="extra_test_method")
    register("extra_test_method", options=Opts, description="a test method", needs_pairs=False)(fn)
    try:
        DirectionSettings(method="extra_test_method")
        assert get("extra_test_method").fn is fn and "extra_test_method" in names(kind="baseline")
        assert parse_options("extra_test_method", {"depth": 3}) == Opts(3)
        with pytest.raises(ConfigError, match="takes only depth"):
            parse_options("extra_test_method", {"width": 3})
        with pytest.raises(TypeError, match="already taken"):
            register("extra_test_method", options=Opts, description="again")(fn)
    finally:
        del registry._METHODS["extra_test_method"]
    with pytest.raises(TypeError, match="frozen dataclass"):
        register("bad_options", options=dict, description="x")
