"""The reader of experiment configs: a YAML or JSON file (or a mapping) into the
protocol's config dataclass (:mod:`.sections`), each section through its dataclass's
fields (the ``model``, ``score`` and ``curvature`` sections through the settings' own
field metadata, :func:`prism_select.settings.from_mapping`), then validated by the config
itself (``validate()``). Also the record of a config that experiment.json and
results.json hold (:func:`config_to_dict`).

Every error is a :class:`~prism_select.errors.ConfigError` naming the field
(``a.b.c``) and the fix. See :func:`load_config` for the file layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import asdict
from pathlib import Path

import yaml

from ..curvature import CurvatureSettings
from ..errors import ConfigError
from ..model import ModelSettings
from ..settings import ScoreSettings, convert, from_mapping, message_of, within
from .sections import (CONFIG_CLASSES, SCORE_RESERVED, CommonConfig, RankingConfig, RepairConfig, RepairTargets,
                       SelectConfig, TargetVariant)

PROTOCOLS = ("ranking", "repair", "select")
DATA_ROOT_ENV = "PRISM_DATA_ROOT"

_LIST_ITEM_TYPES = {(RankingConfig, "targets"): TargetVariant, (RepairConfig, "targets"): RepairTargets}
#: the ``score`` fields that experiment.json records by name (the others under ``extra``)
SCORE_RECORDED = ("max_length", "batch_size", "modules", "chunk_size", "progress")
#: the sections that are settings objects of a scoring run, read as the CLI reads their
#: options (:func:`prism_select.settings.from_mapping`): class -> its arguments there
_SETTINGS_SECTIONS = {ScoreSettings: {"exclude": SCORE_RESERVED, "progress": False}, CurvatureSettings: {},
                      ModelSettings: {}}


# --------------------------------------------------------------------------- building


def _convert(value, tp, name: str):
    """``value`` as type ``tp`` (from a dataclass annotation); ConfigError names ``name``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if sections:
            return _convert(value, sections[0], name)
    if dataclasses.is_dataclass(tp):
        if tp is ModelSettings and isinstance(value, str):
            value = {"model": value}
        if tp in _SETTINGS_SECTIONS:
            return from_mapping(tp, value, name, **_SETTINGS_SECTIONS[tp])
        return build_dataclass(tp, value, name)
    return convert(value, tp, name)


def build_dataclass(cls, data, name: str = ""):
    """Build dataclass ``cls`` from a mapping, checking names and types; every error
    is a :class:`ConfigError` naming the field (``a.b.c``)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(name or cls.__name__, f"expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{name}.{k}" if name else k, "unknown setting",
                          f"known settings here: {', '.join(sorted(fields))}")
    kwargs = {}
    for k, v in data.items():
        fname = f"{name}.{k}" if name else k
        item_cls = _LIST_ITEM_TYPES.get((cls, k))
        if item_cls is None and k == "targets":
            item_cls = next((v for (c, f), v in _LIST_ITEM_TYPES.items() if f == k and issubclass(cls, c)), None)
        if item_cls is not None:
            if not isinstance(v, list) or not v:
                raise ConfigError(fname, f"expected a non-empty list, got {v!r}")
            kwargs[k] = [build_dataclass(item_cls, x, f"{fname}[{i}]") for i, x in enumerate(v)]
        else:
            kwargs[k] = _convert(v, hints[k], fname)
    try:
        obj = cls(**kwargs)
    except ConfigError as e:
        raise within(e, name) from None
    except TypeError as e:
        raise ConfigError(name or cls.__name__, str(e)) from None
    if isinstance(obj, CommonConfig) and isinstance(data.get("score"), dict):
        obj.score_given = dict(data["score"])
    return obj


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


# A config is a few KiB of settings (the shipped ones are under 5 KiB); a file past this
# is no config, and reading it whole would only cost memory.
MAX_CONFIG_BYTES = 1 << 20


def read_config_file(path) -> dict:
    """A YAML (``.yaml``/``.yml``) or JSON config file as a mapping. A file over
    ``MAX_CONFIG_BYTES`` and a YAML alias (``*name``, which repeats an anchored node:
    nested aliases multiply, so a few lines can stand for billions of nodes) are refused
    with a :class:`ConfigError`; write each value out instead."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"{path} does not exist", "pass the path of a YAML or JSON config")
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("config", f"{path} is larger than {MAX_CONFIG_BYTES} bytes: not an experiment config",
                          "pass the experiment's YAML or JSON config (a few KiB of settings)")
    is_yaml = path.suffix.lower() in (".yaml", ".yml")
    try:
        text = raw.decode("utf-8")
        data = _load_yaml(text) if is_yaml else json.loads(text)
    except _AliasInConfig as e:
        raise ConfigError("config", f"{path}, line {e.line}: YAML alias *{e.anchor} (aliases are not read: "
                          "nested ones can expand a few lines into billions of values)",
                          "write the value out where the alias stands") from None
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError / UnicodeDecodeError
        raise ConfigError("config", f"{path} is not valid {'YAML' if is_yaml else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping at the top level")
    return data


class _AliasInConfig(Exception):
    def __init__(self, anchor: str, line: int):
        super().__init__(anchor, line)
        self.anchor, self.line = anchor, line


class _NoAliasLoader(yaml.SafeLoader):
    """YAML's safe loader, raising :class:`_AliasInConfig` at the first alias."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasInConfig(event.anchor, event.start_mark.line + 1)
        return super().compose_node(parent, index)


def _load_yaml(text: str):
    """``yaml.safe_load(text)``, with :class:`_AliasInConfig` at the first alias (before
    any node is built from it)."""
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _section(raw: dict, protocol: str) -> dict:
    sectioned = any(k in raw for k in ("common", *PROTOCOLS, "smoke"))
    if not sectioned:
        return dict(raw)
    extra = sorted(set(raw) - {"common", *PROTOCOLS, "smoke"})
    if extra:
        raise ConfigError(extra[0], "unknown top-level section",
                          "a sectioned config holds common, ranking, repair, select and smoke")
    if protocol not in raw and "common" not in raw:
        raise ConfigError(protocol, f"the config has no '{protocol}' section")
    return _deep_merge(raw.get("common") or {}, raw.get(protocol) or {})


def load_config(source, protocol: str, *, smoke: bool = False, seeds: list | None = None,
                data_root: str | None = None, base_dir=None, target_tasks: list | None = None,
                harmful_ratios: list | None = None):
    """Validate a config for ``protocol`` into its dataclass.

    ``source``: a path (YAML or JSON) or a mapping. The mapping holds the protocol's
    fields at the top level, or sections: ``common`` (merged into each protocol),
    ``ranking`` / ``repair`` / ``select``, and ``smoke`` (overrides applied with
    ``smoke=True``; itself plain or sectioned). ``seeds`` overrides the config's;
    ``target_tasks`` sets a multitask select config's ``select_for``; ``harmful_ratios``
    overrides a ranking or repair config's.

    Relative data paths (``gsm8k_train``, ``gsm8k_test``, ``pool``, ``targets``,
    ``heldout``, ``bbh.dir``) are resolved against ``data_root``: the argument, else
    ``$PRISM_DATA_ROOT``, else the config's ``data_root`` (itself relative to the
    config file), else the config file's folder. ``$VARS`` and ``~`` are expanded.
    A model path is resolved against the config file's folder.
    """
    if protocol not in PROTOCOLS:
        raise ConfigError("protocol", f"unknown protocol {protocol!r}", f"use one of {', '.join(PROTOCOLS)}")
    if isinstance(source, (str, os.PathLike)):
        base_dir = Path(source).resolve().parent
        raw = read_config_file(source)
    elif isinstance(source, dict):
        raw = source
    else:
        raise ConfigError("config", f"expected a path or a mapping, got {type(source).__name__}")
    base_dir = Path(base_dir or os.getcwd())
    data = _section(raw, protocol)
    if smoke:
        if "smoke" not in raw:
            raise ConfigError("smoke", "the config has no 'smoke' section")
        sm = raw["smoke"] or {}
        sm = _section(sm, protocol) if any(k in sm for k in ("common", *PROTOCOLS)) else sm
        data = _deep_merge(data, sm)
    if seeds is not None:
        data["seeds"] = list(seeds)
    if target_tasks is not None:
        if protocol != "select" or not isinstance(data.get("multitask"), dict):
            raise ConfigError("target_tasks", "only a select config with a multitask pool has target tasks",
                              "leave --target-tasks out")
        data["multitask"] = {**data["multitask"], "select_for": list(target_tasks)}
    if harmful_ratios is not None:
        if protocol == "select":
            raise ConfigError("harmful_ratios", "a select config has no harmful ratios",
                              "leave --harmful-ratios out")
        data["harmful_ratios"] = list(harmful_ratios)
    try:
        cfg = build_dataclass(CONFIG_CLASSES[protocol], data, "")
        cfg.validate()
    except ConfigError as e:
        if not isinstance(source, (str, os.PathLike)):
            raise
        given = {k for k, v in (("seeds", seeds), ("harmful_ratios", harmful_ratios),
                                ("multitask.select_for", target_tasks)) if v is not None}
        raise _located(e, Path(source), protocol, smoke, given) from None
    root = data_root or os.environ.get(DATA_ROOT_ENV) or cfg.data_root
    root = Path(_expand(root)) if root else base_dir
    if not root.is_absolute():
        root = (base_dir / root).resolve() if not (data_root or os.environ.get(DATA_ROOT_ENV)) else root.resolve()
    cfg.data_root = str(root)
    _resolve_paths(cfg, root, base_dir)
    return cfg


_FIELD_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def _located(error: ConfigError, path: Path, protocol: str, smoke: bool, given: set) -> ConfigError:
    """``error`` (a field of the config file ``path``) with the file and, in a YAML file,
    the line of the field's key where the file gives it (else of the nearest section
    above it that it gives; the sections a run merges are searched as they override one
    another: smoke, then the protocol's, then common). A field set by an argument
    (``given``: ``seeds``, ...) is not located in the file."""
    field = error.field
    if field == "config" or any(field == g or field.startswith((g + ".", g + "[")) for g in given):
        return error
    keys = [int(i) if i else k for k, i in _FIELD_PART.findall(field)]
    lines = _key_lines(path) if path.suffix.lower() in (".yaml", ".yml") else {}
    order = ([("smoke", protocol), ("smoke", "common"), ("smoke",)] if smoke else []) + [(protocol,), ("common",), ()]
    line = None
    for n in range(len(keys), 0, -1):  # the whole field first, then each section above it
        line = next((lines[b + tuple(keys[:n])] for b in order if b + tuple(keys[:n]) in lines), None)
        if line is not None:
            break
    where = f"{path}, line {line}" if line is not None else str(path)
    return ConfigError(field, f"{where}: {message_of(error)}")


def _key_lines(path: Path) -> dict:
    """``{(key, key, index, ...): line}`` of every mapping key and list item of a YAML
    file (lines from 1); empty where it cannot be read."""
    try:
        loader = _NoAliasLoader(path.read_text(encoding="utf-8"))
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except (OSError, UnicodeDecodeError, yaml.YAMLError, _AliasInConfig):
        return {}
    out = {}

    def walk(node, keys):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    out[keys + (k.value,)] = k.start_mark.line + 1
                    walk(v, keys + (k.value,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                out[keys + (i,)] = v.start_mark.line + 1
                walk(v, keys + (i,))

    walk(root, ())
    return out


def _expand(p: str) -> str:
    return os.path.expanduser(os.path.expandvars(p))


def _resolve(p: str | None, root: Path) -> str | None:
    if not p:
        return p
    q = Path(_expand(p))
    return str(q if q.is_absolute() else (root / q).resolve())


def _resolve_paths(cfg, root: Path, base_dir: Path):
    if isinstance(cfg, (RankingConfig, RepairConfig)):
        cfg.data.gsm8k_train = _resolve(cfg.data.gsm8k_train, root)
        cfg.data.bbh_dir = _resolve(cfg.data.bbh_dir, root)
    if isinstance(cfg, RepairConfig):
        cfg.probes.gsm8k_test = _resolve(cfg.probes.gsm8k_test, root)
    if isinstance(cfg, SelectConfig):
        cfg.pool = _resolve(cfg.pool, root)
        if cfg.multitask is not None:
            cfg.multitask.gsm8k_train = _resolve(cfg.multitask.gsm8k_train, root)
            cfg.multitask.bbh_dir = _resolve(cfg.multitask.bbh_dir, root)
        cfg.targets = _resolve(cfg.targets, root)
        cfg.heldout = _resolve(cfg.heldout, root)
        if cfg.bbh is not None:
            cfg.bbh.dir = _resolve(cfg.bbh.dir, root)
    m = cfg.model
    if m.model != "default":
        m.model = _resolve(m.model, base_dir)
    if m.adapter:
        m.adapter = _resolve(m.adapter, base_dir)


def score_record(cfg) -> dict:
    """A config's ``score`` section as experiment.json and results.json record it:
    ``max_length``, ``batch_size``, ``modules``, ``chunk_size`` and ``progress`` as read,
    and under ``extra`` every other field the config gave, as it gave it (``65GiB``)."""
    extra = {k: v for k, v in cfg.score_given.items() if k not in SCORE_RECORDED}
    return {**{k: getattr(cfg.score, k) for k in SCORE_RECORDED}, "extra": extra}


def config_to_dict(cfg) -> dict:
    """A config as plain JSON values (what experiment.json and results.json record)."""
    out = asdict(cfg)
    out.pop("score_given", None)
    if isinstance(cfg, CommonConfig):
        out["score"] = score_record(cfg)
    return json.loads(json.dumps(out, default=str))
