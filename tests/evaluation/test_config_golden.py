"""Every shipped experiment config (``experiments/*.yaml``) loads into the same settings:
the :class:`~prism_select.settings.ScoreSettings` of each of its methods, its
:class:`~prism_select.curvature.CurvatureSettings` and the config record that
experiment.json holds, against the values in ``config_golden.json``.

``python tests/evaluation/test_config_golden.py --write`` rewrites the fixture from the
code as it is (run it only where a config's settings are meant to change).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import pytest

from prism_select.errors import ConfigError
from prism_select.evaluation.config import config_to_dict, load_config, read_config_file
from prism_select.evaluation.experiment import resolve_methods
from prism_select.evaluation.sections import score_settings

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
GOLDEN = Path(__file__).with_name("config_golden.json")
#: the data root every config is loaded with, so the resolved paths do not depend on the machine
DATA_ROOT = "/data-root"
PROTOCOLS = ("ranking", "repair", "select")


def _variants(path: Path):
    """(protocol, smoke) of every protocol section ``path`` holds, and the smoke runs of each."""
    raw = read_config_file(path)
    for protocol in PROTOCOLS:
        for smoke in (False, True):
            if smoke and "smoke" not in raw:
                continue
            try:
                cfg = load_config(path, protocol, smoke=smoke, data_root=DATA_ROOT)
            except ConfigError:
                continue  # a config without this protocol's section
            yield f"{protocol}{'/smoke' if smoke else ''}", cfg


def _record(cfg) -> dict:
    """What the fixture holds of one loaded config."""
    methods = list(dict.fromkeys(resolve_methods(cfg.methods) + list(cfg.method_options)))
    seed = cfg.seeds[0]
    base = dataclasses.asdict(score_settings(cfg, "prism", seed))
    per_method = {m: dataclasses.asdict(score_settings(cfg, m, seed)) for m in methods}
    conf = config_to_dict(cfg)
    score_record = conf.pop("score")
    text = json.dumps(conf, sort_keys=True, default=str).replace(str(EXPERIMENTS), "<experiments>")
    return {"score_settings": base,
            "method_options": {m: s["method_options"] for m, s in per_method.items()},
            "curvature": dataclasses.asdict(cfg.curvature),
            "score_record": score_record,
            "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def _all_records() -> dict:
    return {p.name: dict((k, _record(cfg)) for k, cfg in _variants(p)) for p in sorted(EXPERIMENTS.glob("*.yaml"))}


def test_every_shipped_config_gives_its_recorded_settings(monkeypatch):
    monkeypatch.delenv("PRISM_DATA_ROOT", raising=False)
    golden = json.loads(GOLDEN.read_text())
    now = _all_records()
    assert sorted(now) == sorted(golden)
    assert sum(len(v) for v in golden.values()) > 40
    for name, variants in golden.items():
        assert sorted(now[name]) == sorted(variants), name
        for key, want in variants.items():
            got = now[name][key]
            for field in ("score_settings", "method_options", "curvature", "score_record", "config_sha256"):
                assert got[field] == want[field], (name, key, field)


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(json.dumps(_all_records(), indent=1, sort_keys=True) + "\n")
