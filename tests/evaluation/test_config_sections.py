"""An experiment config's sections: ``score`` is a ScoreSettings and ``curvature`` a
CurvatureSettings, read through their fields' ``setting()`` metadata as the CLI reads its
options; every other section validates itself (``validate()``)."""

from __future__ import annotations

import pytest

from prism_select.curvature import CurvatureSettings
from prism_select.errors import ConfigError
from prism_select.evaluation.config import config_to_dict, load_config
from prism_select.evaluation.sections import (MistakeMathConfig, MultitaskConfig, ProbeConfig, RepairConfig,
                                              SelectConfig, WarmupConfig)
from prism_select.settings import GiB, ScoreSettings, from_mapping

BASE = {"data": {"gsm8k_train": "g.jsonl"}}


def _error(source, protocol="ranking") -> ConfigError:
    with pytest.raises(ConfigError) as e:
        load_config(source, protocol)
    return e.value


def test_the_score_section_is_the_score_settings_of_every_method():
    cfg = load_config({**BASE, "score": {"batch_size": 4, "max_gpu_memory": "2GiB", "precision": "residual32"}},
                      "ranking")
    assert isinstance(cfg.score, ScoreSettings)
    assert (cfg.score.batch_size, cfg.score.max_gpu_memory, cfg.score.precision) == (4, 2 * GiB, "residual32")
    assert cfg.score.progress is False  # off in experiments unless given
    assert load_config({**BASE, "score": {"progress": True}}, "ranking").score.progress is True
    # experiment.json records the section as the file gave it
    assert config_to_dict(cfg)["score"]["extra"] == {"max_gpu_memory": "2GiB", "precision": "residual32"}


@pytest.mark.parametrize("key", ["method", "seed", "method_options", "overwrite"])
def test_the_fields_the_protocol_sets_are_refused_in_the_score_section(key):
    e = _error({**BASE, "score": {key: 1}})
    assert e.field == f"score.{key}" and "unknown setting" in str(e)


@pytest.mark.parametrize("section, value, field, text", [
    ("score", {"batch_size": 0}, "score.batch_size", "must be >= 1"),
    ("score", {"batch_size": "many"}, "score.batch_size", "expected an integer"),
    ("score", {"precision": "fp8"}, "score.precision", "use one of model, residual32, split32"),
    ("score", {"max_gpu_memory": "lots"}, "score.max_gpu_memory", "cannot read 'lots' as a memory size"),
    ("curvature", {"kind": "exact"}, "curvature.kind", "use one of ekfac, kfac, diagonal, identity"),
    ("curvature", {"damping_rule": "guess"}, "curvature.damping_rule", "use one of auto, heuristic, split-half"),
    ("curvature", {"batch_size": 0}, "curvature.batch_size", "must be >= 1"),
])
def test_a_bad_score_or_curvature_value_names_its_yaml_path(section, value, field, text):
    e = _error({**BASE, section: value})
    assert e.field == field and text in str(e), str(e)


def test_curvature_text_values_are_parsed_as_the_cli_parses_them():
    cfg = load_config({**BASE, "curvature": {"shrinkage": "0.25", "damping": 1}}, "ranking")
    assert isinstance(cfg.curvature, CurvatureSettings)
    assert cfg.curvature.shrinkage == 0.25 and cfg.curvature.damping == 1.0
    assert isinstance(cfg.curvature.damping, float)
    assert load_config({**BASE, "curvature": {"shrinkage": "auto"}}, "ranking").curvature.shrinkage == "auto"


def test_from_mapping_reads_a_settings_section_through_its_field_metadata():
    s = from_mapping(ScoreSettings, {"chunk_size": 8.0, "cuda_graphs": "off"}, "score", progress=False)
    assert (s.chunk_size, s.cuda_graphs, s.progress) == (8, "off", False) and isinstance(s.chunk_size, int)
    with pytest.raises(ConfigError, match="setting 'score.cuda_graphs': unknown value 'never'"):
        from_mapping(ScoreSettings, {"cuda_graphs": "never"}, "score")
    with pytest.raises(ConfigError, match="setting 'curvature.nope': unknown setting"):
        from_mapping(CurvatureSettings, {"nope": 1}, "curvature")
    with pytest.raises(ConfigError, match="setting 'score': expected a mapping"):
        from_mapping(ScoreSettings, [1], "score")


def test_each_section_validates_itself():
    with pytest.raises(ConfigError, match="setting 'warmup.n_records': must be >= 2"):
        WarmupConfig(n_records=1).validate()
    with pytest.raises(ConfigError, match="setting 'multitask.bbh_dir': is required"):
        MultitaskConfig(gsm8k_train="g.jsonl").validate()
    with pytest.raises(ConfigError, match="setting 'data.pool_size': must be >= 1"):
        MistakeMathConfig(gsm8k_train="g.jsonl", pool_size=0).validate(ranking=False)
    repair = RepairConfig(data=MistakeMathConfig(gsm8k_train="g.jsonl"), probes=ProbeConfig())
    with pytest.raises(ConfigError, match="setting 'probes.gsm8k_test': is required"):
        repair.validate()
    RepairConfig(data=MistakeMathConfig(gsm8k_train="g.jsonl"), probes=ProbeConfig(gsm8k_test="t.jsonl")).validate()
    with pytest.raises(ConfigError, match="setting 'pool': is required"):
        SelectConfig().validate()


CONFIG_YAML = """\
common:
  model: default
  score: {max_length: 64, batch_size: 8}
ranking:
  data:
    gsm8k_train: g.jsonl
  curvature:
    kind: exact
  targets:
    - {name: a}
    - {name: "b c"}
smoke:
  ranking:
    score: {batch_size: 0}
"""


def test_a_field_error_of_a_config_file_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(CONFIG_YAML)
    e = _error(path)
    assert e.field == "curvature.kind" and f"{path}, line 8: unknown value 'exact'" in str(e), str(e)
    with pytest.raises(ConfigError, match=r"score\.batch_size': .*c\.yaml, line 14: must be >= 1") as e:
        load_config(path, "ranking", smoke=True)  # the smoke section's value, which overrides common's
    path.write_text(CONFIG_YAML.replace("kind: exact", "kind: ekfac"))
    with pytest.raises(ConfigError, match=r"targets\[1\]\.name': .*c\.yaml, line 11: 'b c' must be"):
        load_config(path, "ranking")
    # a field the file leaves out: the section above it; a seed list given as an argument: not the file's
    path.write_text(CONFIG_YAML.replace("    gsm8k_train: g.jsonl\n", "    pool_size: 10\n").replace("exact", "ekfac"))
    with pytest.raises(ConfigError, match=r"data\.gsm8k_train': .*c\.yaml, line 5: is required"):
        load_config(path, "ranking")
    with pytest.raises(ConfigError, match=r"setting 'seeds': lists a seed twice"):
        load_config(path, "ranking", seeds=[0, 0])
    json_path = tmp_path / "c.json"
    json_path.write_text('{"data": {"gsm8k_train": "g.jsonl"}, "score": {"batch_size": 0}}')
    with pytest.raises(ConfigError, match=r"score\.batch_size': .*c\.json: must be >= 1"):
        load_config(json_path, "ranking")
