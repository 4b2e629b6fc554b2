"""The paper's evaluation protocols (Sec. 3, App. B and E), small enough to run here.

Three protocols, each a function of a validated config that writes an experiment
directory and returns its results:

``ranking(config, out)``  for every harmful ratio and seed: a GSM8K mistake-math pool
    and target pairs (:mod:`.builders`), scored by every method through
    :func:`prism_select.pipeline.score_pool` (the model is loaded once); AUROC and
    AUPRC of the ``harmful`` flag, computed from the written ``scores.jsonl`` and
    ``pool.jsonl``. Several target variants (e.g. counterfactual pairs alone, and with
    distractor pairs) share each pool.
``repair(config, out)``  App. B: LoRA SFT of the start model on the full pool (the
    ``repair`` preset) -> greedy responses to probes before and after -> target pairs
    ``(probe, chosen = post-SFT response, rejected = pre-SFT response)`` for the probes
    whose verdict got worse (``pair_selection``) -> every method scores the pool at the
    start model (``score_at: start``) or the fine-tuned one (``post``) -> AUROC -> the
    top ``remove_fraction`` (default: the harmful ratio) is removed -> SFT again from
    the same start -> probe error rate. Rows ``Start`` (no SFT) and ``Mixed``
    (unfiltered SFT) come with every setting; ``oracle: true`` adds the removal of
    exactly the harmful records.
``select(config, out)``  App. E: the top ``fraction`` (5%) of a pool by each method
    (and ``random``) for per-task target pairs -> LoRA SFT (``general`` preset) ->
    accuracy on each task's held-out probes; rows ``Start`` and ``Full data``.

Layout of ``<out>``::

    experiment.json        protocol + resolved config (a rerun with another config is refused)
    results.json           every number of the tables, with the files it came from
    report.html            (+ PNG plots) see :mod:`.report`
    runs/<setting>/seed<k>/...   pool.jsonl, targets.jsonl, scores/<method>/..., etc.

Every number in ``results.json`` is computed from files written during the run
(scores read back from ``scores.jsonl``, labels from ``pool.jsonl``, verdicts from
``responses.jsonl``). A finished step is reused when its inputs and settings are
unchanged (``.<step>-step.json`` beside its outputs), so an interrupted experiment resumes
by running the same command again.

Tables show the mean over seeds and, with more than one seed, the sample standard
deviation (``ddof = 1``).

Configs are YAML or JSON; see :func:`load_config` for the layout and the dataclasses
below for every field.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
import traceback
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..curvature import CurvatureSettings
from ..data.tokenize import DEFAULT_MAX_LENGTH
from ..errors import CacheError, ConfigError, InputError, OutputError, PrismError
from ..io import atomic_write_json, atomic_write_jsonl, check_writable_dir, sha256_file
from ..model import ModelSettings
from ..scoring import DEFAULT_CHUNK_SIZE
from . import builders

log = logging.getLogger(__name__)

PROTOCOLS = ("ranking", "repair", "select")
PAIR_SELECTIONS = ("worsened", "wrong_after", "all")
DATA_ROOT_ENV = "PRISM_DATA_ROOT"


# =========================================================================== configs

@dataclass
class ScoreConfig:
    """Scoring settings shared by every method (see :class:`prism_select.pipeline.ScoreSettings`).

    Any other field of ``ScoreSettings`` (e.g. ``skip_invalid``, ``scoring``) may be
    given here too; it is passed through (``extra``). ``method``, ``method_options``,
    ``seed`` and ``overwrite`` are set by the protocol."""

    max_length: int = DEFAULT_MAX_LENGTH
    batch_size: int = 8
    modules: list | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    progress: bool = False
    extra: dict = field(default_factory=dict)


_SCORE_RESERVED = {"method", "method_options", "seed", "overwrite"}


def _score_passthrough() -> set:
    from ..pipeline import ScoreSettings
    return {f.name for f in dataclasses.fields(ScoreSettings)} - _SCORE_RESERVED - \
        {f.name for f in dataclasses.fields(ScoreConfig)}


@dataclass
class GenerationConfig:
    """Greedy generation on probes (see :func:`.probes.generate`)."""

    max_new_tokens: int = 256
    batch_size: int = 32
    max_prompt_tokens: int | None = None
    stop: list | None = None


@dataclass
class FinetuneConfig:
    """A :class:`~prism_select.evaluation.finetune.FinetuneSettings` preset plus
    overrides of single fields (e.g. ``{epochs: 2, max_length: 512}``). The seed is the
    run's seed unless ``overrides`` sets one."""

    preset: str = "repair"
    overrides: dict = field(default_factory=dict)


@dataclass
class MistakeMathConfig:
    """A GSM8K mistake-math pool (see :func:`.builders.mistake_math_pool`)."""

    gsm8k_train: str = ""
    pool_size: int = 300
    keep_annotations: bool = False


@dataclass
class TargetVariant:
    """A target set for the ranking protocol: ``n_counterfactual`` pairs (chosen =
    corrupted solution, rejected = correct) plus ``n_distractors`` pairs (chosen = the
    correct solution's words shuffled). ``methods``: only these methods (default: all
    of the config's)."""

    name: str = "counterfactual"
    n_counterfactual: int = 24
    n_distractors: int = 0
    methods: list | None = None


@dataclass
class ProbeConfig:
    """GSM8K test problems as probes and the checker that judges a response."""

    gsm8k_test: str = ""
    n: int = 48
    checker: Any = "numeric_final_answer"


@dataclass
class BBHConfig:
    """Per-task targets and held-out probes from a BIG-Bench-Hard folder."""

    dir: str = ""
    n_targets_per_task: int = 3
    tasks: list | None = None
    n_heldout_per_task: int | None = None


@dataclass
class CommonConfig:
    """Fields every protocol has.

    model: a :class:`~prism_select.model.ModelSettings` mapping, or just the model
        (``default``, a model directory, a ``.gguf`` file).
    seeds: one run per seed (pools, targets, random baselines, fine-tuning all seeded).
    methods: ``all`` (PRISM, its ablations and every registered baseline) or a list.
    method_options: method name -> its options (``ScoreSettings.method_options``).
    score, curvature: scoring and curvature settings shared by every method.
    on_method_error: ``raise`` (stop) or ``record`` (note the error in results.json,
        show the method as missing, go on with the others).
    data_root: where relative data paths point (see :func:`load_config`).
    report: write report.html at the end (needs matplotlib; skipped with a warning
        when it is missing -- render it later with ``prism-select report``).
    """

    model: ModelSettings = field(default_factory=ModelSettings)
    seeds: list = field(default_factory=lambda: [0])
    methods: Any = field(default_factory=lambda: ["prism", "equal", "unpaired", "random"])
    method_options: dict = field(default_factory=dict)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    curvature: CurvatureSettings = field(default_factory=CurvatureSettings)
    on_method_error: str = "raise"
    data_root: str | None = None
    report: bool = True


@dataclass
class RankingConfig(CommonConfig):
    """data: the mistake-math pool; targets: one or more :class:`TargetVariant`;
    harmful_ratios: fractions of corrupted records (0.01, 0.1, 0.2, 0.5, ...)."""

    data: MistakeMathConfig = field(default_factory=MistakeMathConfig)
    targets: list = field(default_factory=lambda: [TargetVariant()])
    harmful_ratios: list = field(default_factory=lambda: [0.1])


@dataclass
class RepairConfig(CommonConfig):
    """data, harmful_ratios: the pools; probes: GSM8K test problems and their checker;
    finetune: the SFT (``repair`` preset); generation: greedy decoding on the probes.

    pair_selection: which probes give target pairs ``(probe, post, pre)``:
        ``worsened`` (correct before SFT, wrong after: the paper's "behaviour got
        worse"), ``wrong_after`` (wrong after SFT, whatever before) or ``all`` (every
        probe). A probe whose two responses are equal never gives a pair.
    min_pairs, fallback_pair_selection: with fewer than ``min_pairs`` pairs, use the
        fallback selection instead (recorded in the run's ``pair_selection`` and note).
    score_at: score the pool at the ``start`` model or the ``post``-SFT model (its LoRA
        matrices are then the tracked layers).
    remove_fraction: fraction of the pool removed before retraining (default: the
        harmful ratio of the setting).
    retrain: retrain and measure the error rate after each removal.
    oracle: also remove exactly the harmful records (an upper reference row).
    """

    data: MistakeMathConfig = field(default_factory=MistakeMathConfig)
    probes: ProbeConfig = field(default_factory=ProbeConfig)
    harmful_ratios: list = field(default_factory=lambda: [0.1])
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    pair_selection: str = "worsened"
    min_pairs: int = 1
    fallback_pair_selection: str | None = None
    score_at: str = "start"
    remove_fraction: float | None = None
    retrain: bool = True
    oracle: bool = False


@dataclass
class SelectConfig(CommonConfig):
    """pool: the candidate pool (any format prism-select reads); targets + heldout:
    target pairs (with ``task``) and held-out probes (``prompt``, ``reference``,
    ``task``), or ``bbh`` to build both from a BIG-Bench-Hard folder; fraction: the
    budget kept by each method (0.05 = the paper's 5%); finetune: the SFT
    (``general`` preset); checker: judges held-out responses; full_data/start_row: add
    the rows "Full data" (SFT on the whole pool) and "Start" (no SFT)."""

    pool: str = ""
    bbh: BBHConfig | None = None
    targets: str | None = None
    heldout: str | None = None
    fraction: float = 0.05
    finetune: FinetuneConfig = field(default_factory=lambda: FinetuneConfig(preset="general"))
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=64))
    checker: Any = "final_answer"
    full_data: bool = True
    start_row: bool = True


CONFIG_CLASSES = {"ranking": RankingConfig, "repair": RepairConfig, "select": SelectConfig}
_LIST_ITEM_TYPES = {(RankingConfig, "targets"): TargetVariant}


# --------------------------------------------------------------------------- building

_PREFIX = re.compile(r"^setting '[^']*': ")


def _rewrap(e: ConfigError, prefix: str) -> ConfigError:
    msg = _PREFIX.sub("", str(e))
    return ConfigError(f"{prefix}.{e.field}" if prefix else e.field, msg)


def _convert(value, tp, name: str):
    """``value`` as type ``tp`` (from a dataclass annotation); ConfigError names ``name``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, name)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(name, f"invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if tp is ModelSettings and isinstance(value, str):
            value = {"model": value}
        return build_dataclass(tp, value, name)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(name, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(name, f"expected text, got {value!r}")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(name, f"expected a list, got {value!r}")
        return list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(name, f"expected a mapping, got {value!r}")
        return dict(value)
    return value


def build_dataclass(cls, data, name: str = ""):
    """Build dataclass ``cls`` from a mapping, checking names and types; every error
    is a :class:`ConfigError` naming the field (``a.b.c``)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(name or cls.__name__, f"expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    if cls is ScoreConfig:  # other ScoreSettings fields pass through
        passthrough = _score_passthrough()
        extra = {k: v for k, v in data.items() if k in passthrough}
        data = {k: v for k, v in data.items() if k not in passthrough}
        if extra:
            data["extra"] = {**data.get("extra", {}), **extra}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        k = unknown[0]
        raise ConfigError(f"{name}.{k}" if name else k, "unknown setting",
                          f"known settings here: {', '.join(sorted(fields))}")
    kwargs = {}
    for k, v in data.items():
        fname = f"{name}.{k}" if name else k
        item_cls = _LIST_ITEM_TYPES.get((cls, k))
        if item_cls is None and issubclass(cls, RankingConfig) and k == "targets":
            item_cls = TargetVariant
        if item_cls is not None:
            if not isinstance(v, list) or not v:
                raise ConfigError(fname, f"expected a non-empty list, got {v!r}")
            kwargs[k] = [build_dataclass(item_cls, x, f"{fname}[{i}]") for i, x in enumerate(v)]
        else:
            kwargs[k] = _convert(v, hints[k], fname)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise _rewrap(e, name) from None
    except TypeError as e:
        raise ConfigError(name or cls.__name__, str(e)) from None


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def read_config_file(path) -> dict:
    """A YAML (``.yaml``/``.yml``) or JSON config file as a mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", f"{path} does not exist", "pass the path of a YAML or JSON config")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # yaml.YAMLError / json.JSONDecodeError
        raise ConfigError("config", f"{path} is not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping at the top level")
    return data


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
                data_root: str | None = None, base_dir=None):
    """Validate a config for ``protocol`` into its dataclass.

    ``source``: a path (YAML or JSON) or a mapping. The mapping holds the protocol's
    fields at the top level, or sections: ``common`` (merged into each protocol),
    ``ranking`` / ``repair`` / ``select``, and ``smoke`` (overrides applied with
    ``smoke=True``; itself plain or sectioned). ``seeds`` overrides the config's.

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
    cfg = build_dataclass(CONFIG_CLASSES[protocol], data, "")
    _validate(cfg, protocol)
    root = data_root or os.environ.get(DATA_ROOT_ENV) or cfg.data_root
    root = Path(_expand(root)) if root else base_dir
    if not root.is_absolute():
        root = (base_dir / root).resolve() if not (data_root or os.environ.get(DATA_ROOT_ENV)) else root.resolve()
    cfg.data_root = str(root)
    _resolve_paths(cfg, root, base_dir)
    return cfg


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
    if isinstance(cfg, RepairConfig):
        cfg.probes.gsm8k_test = _resolve(cfg.probes.gsm8k_test, root)
    if isinstance(cfg, SelectConfig):
        cfg.pool = _resolve(cfg.pool, root)
        cfg.targets = _resolve(cfg.targets, root)
        cfg.heldout = _resolve(cfg.heldout, root)
        if cfg.bbh is not None:
            cfg.bbh.dir = _resolve(cfg.bbh.dir, root)
    m = cfg.model
    if m.model != "default":
        m.model = _resolve(m.model, base_dir)
    if m.adapter:
        m.adapter = _resolve(m.adapter, base_dir)


def _check_fraction(v, name, allow_zero=False):
    if not isinstance(v, (int, float)) or not ((0 <= v <= 1) if allow_zero else (0 < v <= 1)):
        raise ConfigError(name, f"must be a fraction in {'[0, 1]' if allow_zero else '(0, 1]'}, got {v!r}",
                          "e.g. 0.1 for 10%")


def _validate(cfg, protocol: str):
    if not cfg.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in cfg.seeds):
        raise ConfigError("seeds", f"must be a non-empty list of integers, got {cfg.seeds!r}")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError("seeds", f"lists a seed twice: {cfg.seeds!r}")
    if cfg.on_method_error not in ("raise", "record"):
        raise ConfigError("on_method_error", f"unknown value {cfg.on_method_error!r}", "use raise or record")
    if isinstance(cfg.methods, str):
        if cfg.methods != "all":
            cfg.methods = [cfg.methods]
    elif not isinstance(cfg.methods, list) or not cfg.methods or not all(isinstance(m, str) for m in cfg.methods):
        raise ConfigError("methods", f"must be 'all' or a non-empty list of method names, got {cfg.methods!r}")
    if not isinstance(cfg.method_options, dict) or not all(isinstance(v, dict) for v in cfg.method_options.values()):
        raise ConfigError("method_options", "must map a method name to a mapping of its options",
                          "e.g. {ifguide: {quantile: 0.99}}")
    for k in ("batch_size", "max_length", "chunk_size"):
        if getattr(cfg.score, k) < 1:
            raise ConfigError(f"score.{k}", f"must be >= 1, got {getattr(cfg.score, k)}")
    bad = sorted(set(cfg.score.extra) - _score_passthrough())
    if bad:
        raise ConfigError(f"score.{bad[0]}", "unknown setting")
    try:
        _score_settings(cfg, "prism", 0)
    except ConfigError as e:
        raise _rewrap(e, "score") from None
    except TypeError as e:
        raise ConfigError("score", str(e)) from None
    for name, ratios in (("harmful_ratios", getattr(cfg, "harmful_ratios", None)),):
        if ratios is None:
            continue
        if not ratios:
            raise ConfigError(name, "needs at least one ratio", "e.g. [0.1, 0.5]")
        for i, r in enumerate(ratios):
            _check_fraction(r, f"{name}[{i}]", allow_zero=True)
    if isinstance(cfg, (RankingConfig, RepairConfig)):
        if not cfg.data.gsm8k_train:
            raise ConfigError("data.gsm8k_train", "is required", "the path of GSM8K's train.jsonl")
        if cfg.data.pool_size < 1:
            raise ConfigError("data.pool_size", f"must be >= 1, got {cfg.data.pool_size}")
    if isinstance(cfg, RankingConfig):
        names = [t.name for t in cfg.targets]
        if len(set(names)) != len(names):
            raise ConfigError("targets", f"variant names must differ, got {names}")
        for i, t in enumerate(cfg.targets):
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", t.name):
                raise ConfigError(f"targets[{i}].name", f"{t.name!r} must be letters, digits, '_', '-' or '.'")
            if t.n_counterfactual < 0 or t.n_distractors < 0 or t.n_counterfactual + t.n_distractors < 1:
                raise ConfigError(f"targets[{i}]", "needs at least one pair")
    if isinstance(cfg, RepairConfig):
        if not cfg.probes.gsm8k_test:
            raise ConfigError("probes.gsm8k_test", "is required", "the path of GSM8K's test.jsonl")
        if cfg.probes.n < 1:
            raise ConfigError("probes.n", f"must be >= 1, got {cfg.probes.n}")
        for name in ("pair_selection", "fallback_pair_selection"):
            v = getattr(cfg, name)
            if v not in PAIR_SELECTIONS and not (v is None and name.startswith("fallback")):
                raise ConfigError(name, f"unknown value {v!r}", f"use one of {', '.join(PAIR_SELECTIONS)}")
        if cfg.min_pairs < 1:
            raise ConfigError("min_pairs", f"must be >= 1, got {cfg.min_pairs}")
        if cfg.score_at not in ("start", "post"):
            raise ConfigError("score_at", f"unknown value {cfg.score_at!r}", "use start or post")
        if cfg.remove_fraction is not None:
            _check_fraction(cfg.remove_fraction, "remove_fraction", allow_zero=True)
        from .probes import load_checker
        try:
            load_checker(cfg.probes.checker)
        except ConfigError as e:
            raise _rewrap(e, "probes") from None
    if isinstance(cfg, SelectConfig):
        if not cfg.pool:
            raise ConfigError("pool", "is required", "the candidate pool file")
        _check_fraction(cfg.fraction, "fraction")
        if cfg.bbh is None and not (cfg.targets and cfg.heldout):
            raise ConfigError("targets", "give bbh (a BIG-Bench-Hard folder) or both targets and heldout files")
        if cfg.bbh is not None and (cfg.targets or cfg.heldout):
            raise ConfigError("bbh", "give either bbh or targets + heldout, not both")
        from .probes import load_checker
        load_checker(cfg.checker)
    for sec in ("generation",):
        g = getattr(cfg, sec, None)
        if g is not None and (g.max_new_tokens < 1 or g.batch_size < 1):
            raise ConfigError(f"{sec}", "max_new_tokens and batch_size must be >= 1")
    ft = getattr(cfg, "finetune", None)
    if ft is not None:
        try:
            _finetune_settings(ft, 0)
        except ConfigError as e:
            raise _rewrap(e, "finetune") from None


def config_to_dict(cfg) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


# =========================================================================== metrics

def auroc(scores, labels) -> float:
    """Area under the ROC curve (Mann-Whitney U with mid-ranks for ties); NaN when a
    class is empty. Pure Python, so experiments need no scikit-learn."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    ranks = [0.0] * len(scores)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        mid = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[order[k]] = mid
        i = j + 1
    rpos = sum(r for r, y in zip(ranks, labels) if y)
    return (rpos - pos * (pos + 1) / 2) / (pos * neg)


def auprc(scores, labels) -> float:
    """Average precision (step-wise area under the precision-recall curve, ties
    grouped as one threshold, as scikit-learn's ``average_precision_score``)."""
    pos = sum(1 for y in labels if y)
    if pos == 0:
        return float("nan")
    pairs = sorted(zip(scores, labels), key=lambda t: -t[0])
    tp = fp = 0
    ap, prev_recall = 0.0, 0.0
    i = 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            tp += bool(pairs[j][1])
            fp += not pairs[j][1]
            j += 1
        recall = tp / pos
        ap += (recall - prev_recall) * tp / (tp + fp)
        prev_recall = recall
        i = j
    return ap


def roc_points(scores, labels) -> tuple[list, list]:
    """(false positive rates, true positive rates), thresholds from high to low."""
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    pairs = sorted(zip(scores, labels), key=lambda t: -t[0])
    fpr, tpr, tp, fp, i = [0.0], [0.0], 0, 0, 0
    while i < len(pairs):
        j = i
        while j < len(pairs) and pairs[j][0] == pairs[i][0]:
            tp += bool(pairs[j][1])
            fp += not pairs[j][1]
            j += 1
        fpr.append(fp / neg if neg else 0.0)
        tpr.append(tp / pos if pos else 0.0)
        i = j
    return fpr, tpr


def mean_std(values: list) -> dict:
    """``mean``, ``std`` (sample, ddof 1; None for one value), ``n`` and the values;
    NaN values (undefined metrics) are left out."""
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"mean": None, "std": None, "n": 0, "values": []}
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
    return {"mean": m, "std": sd, "n": len(vals), "values": vals}


def read_jsonl(path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def ranking_metrics(scores_path, pool_path, label: str = "harmful") -> dict:
    """AUROC, AUPRC and counts of ``label`` from a written scores file and pool file."""
    labels = {r["id"]: bool(r[label]) for r in read_jsonl(pool_path)}
    rows = read_jsonl(scores_path)
    missing = [r["id"] for r in rows if r["id"] not in labels]
    if missing:
        raise InputError(f"{len(missing)} scored ids are not in the pool (e.g. {missing[0]!r})", path=scores_path)
    s = [float(r["score"]) for r in rows]
    y = [labels[r["id"]] for r in rows]
    return {"auroc": auroc(s, y), "auprc": auprc(s, y), "n": len(y), "n_positive": sum(y)}


def pi_summary(pairs_path, targets_path=None) -> dict | None:
    """``pi`` over the target pairs of a written pairs.jsonl (min/mean/max, and per
    ``kind`` when the targets file names one)."""
    if not Path(pairs_path).is_file():
        return None
    rows = [r for r in read_jsonl(pairs_path) if "pi" in r]
    if not rows:
        return None
    kinds = {}
    if targets_path and Path(targets_path).is_file():
        kinds = {t.get("id"): t.get("kind") for t in read_jsonl(targets_path)}

    def summ(xs):
        return {"n": len(xs), "min": min(xs), "mean": sum(xs) / len(xs), "max": max(xs)}

    out = {"all": summ([float(r["pi"]) for r in rows])}
    by = {}
    for r in rows:
        k = kinds.get(r["id"])
        if k:
            by.setdefault(k, []).append(float(r["pi"]))
    for k, xs in sorted(by.items()):
        out[k] = summ(xs)
    return out


# =========================================================================== steps

class _Exp:
    """An experiment directory: reuse of finished steps, timings, relative paths."""

    def __init__(self, out: Path, protocol: str, cfg, overwrite: bool):
        self.out = Path(out)
        self.protocol = protocol
        self.cfg = cfg
        self.timings: dict = {}
        conf = config_to_dict(cfg)
        conf.pop("report", None)  # whether a page is drawn does not change any number
        meta = {"protocol": protocol, "config": conf}
        marker = self.out / "experiment.json"
        if self.out.exists() and any(self.out.iterdir()):
            if not marker.is_file():
                raise OutputError(f"{self.out} exists and is not an experiment directory; choose another --out")
            old = json.loads(marker.read_text())
            if old.get("protocol") != protocol or old.get("config") != meta["config"]:
                if not overwrite:
                    raise OutputError(f"{self.out} holds an experiment with another protocol or config; "
                                      "pass --overwrite to replace it, or choose another --out")
        if overwrite:
            shutil.rmtree(self.out / "runs", ignore_errors=True)
            for f in ("results.json", "report.html"):
                (self.out / f).unlink(missing_ok=True)
        check_writable_dir(self.out)
        atomic_write_json(marker, meta)

    def rel(self, p) -> str:
        return os.path.relpath(Path(p), self.out)

    @staticmethod
    def done(step_dir: Path, key: dict, files: list, step: str = "step") -> bool:
        f = Path(step_dir) / f".{step}.json"
        if not f.is_file() or not all((Path(step_dir) / x).exists() for x in files):
            return False
        try:
            return json.loads(f.read_text()) == json.loads(json.dumps(key, default=str))
        except ValueError:
            return False

    @staticmethod
    def finish(step_dir: Path, key: dict, step: str = "step"):
        atomic_write_json(Path(step_dir) / f".{step}.json", json.loads(json.dumps(key, default=str)))

    def time(self, name: str, seconds: float):
        self.timings[name] = self.timings.get(name, 0.0) + seconds


def _write_if_changed(path: Path, records: list) -> str:
    """Write records (JSON Lines) unless the file already holds exactly them; return the sha256."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if not (path.is_file() and sha256_file(path) == digest):
        atomic_write_jsonl(path, records)
    return digest


def available_methods() -> list:
    from ..preference import METHODS
    try:
        from ..baselines import REGISTRY
        extra = list(REGISTRY)
    except ImportError:
        extra = []
    return list(METHODS) + [m for m in extra if m not in METHODS]


def _resolve_methods(methods) -> list:
    known = available_methods()
    if methods == "all":
        return known
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}", f"use some of {', '.join(known)}")
    return list(dict.fromkeys(methods))


def _score_settings(cfg, method: str, seed: int):
    from ..pipeline import ScoreSettings
    s = cfg.score
    return ScoreSettings(method=method, max_length=s.max_length, batch_size=s.batch_size, modules=s.modules,
                         chunk_size=s.chunk_size, overwrite=False, progress=s.progress, seed=seed,
                         method_options=dict(cfg.method_options.get(method, {})), **s.extra)


def _score_methods(exp: _Exp, lm, pool_path: Path, targets_path: Path | None, run_dir: Path, methods: list,
                   seed: int, label: str = "harmful") -> dict:
    """Score the pool with each method (reusing finished runs); metrics from the files."""
    from ..pipeline import score_pool
    cfg = exp.cfg
    out = {}
    inputs = {"pool": sha256_file(pool_path), "targets": sha256_file(targets_path) if targets_path else None,
              "model": lm.fingerprint}
    for m in methods:
        mdir = run_dir / "scores" / m
        settings = _score_settings(cfg, m, seed)
        curv = dataclasses.replace(cfg.curvature, seed=seed)
        key = {"inputs": inputs, "settings": asdict(settings), "curvature": asdict(curv)}
        key["settings"].pop("progress", None)
        rec: dict = {"dir": exp.rel(mdir)}
        t = time.perf_counter()
        try:
            if not exp.done(mdir, key, ["scores.jsonl", "run.json"], "score-step"):
                log.info("scoring %s with %s", pool_path, m)
                # a finished run with other inputs is replaced; an interrupted one resumes
                settings.overwrite = (mdir / "run.json").exists()
                try:
                    score_pool(lm, pool_path, targets_path, mdir, settings, curv)
                except CacheError:  # an interrupted run with other settings: start again
                    settings.overwrite = True
                    score_pool(lm, pool_path, targets_path, mdir, settings, curv)
                exp.finish(mdir, key, "score-step")
            rec["status"] = "ok"
            rec["seconds"] = round(time.perf_counter() - t, 3)
            run = json.loads((mdir / "run.json").read_text())
            rec["run_seconds"] = run.get("timings", {}).get("total_s")
            if label:
                rec.update(ranking_metrics(mdir / "scores.jsonl", pool_path, label))
            rec["pi"] = pi_summary(mdir / "pairs.jsonl", targets_path)
        except Exception as e:  # noqa: BLE001 - recorded per method when asked
            if cfg.on_method_error == "raise" or isinstance(e, KeyboardInterrupt):
                raise
            log.warning("method %s failed: %s", m, e)
            rec.update(status="error", error=f"{type(e).__name__}: {e}",
                       traceback=None if isinstance(e, PrismError) else traceback.format_exc(limit=8))
        exp.time(f"score:{m}", time.perf_counter() - t)
        out[m] = rec
        _free()
    return out


def _free():
    """Return cached GPU memory between steps (a no-op on CPU)."""
    import torch
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def _finetune_settings(ft: FinetuneConfig, seed: int):
    from .finetune import FinetuneSettings
    over = dict(ft.overrides)
    over.setdefault("seed", seed)
    over.setdefault("progress", False)
    return FinetuneSettings.preset(ft.preset, **over)


def _finetune(exp: _Exp, lm, pool_path: Path, out_dir: Path, seed: int, tag: str) -> Path:
    """LoRA SFT of the start model on ``pool_path`` (reused when unchanged); the adapter dir."""
    from .finetune import finetune
    settings = _finetune_settings(exp.cfg.finetune, seed)
    key = {"pool": sha256_file(pool_path), "model": lm.fingerprint, "settings": asdict(settings)}
    if not exp.done(out_dir, key, ["adapter/adapter_config.json", "finetune.json"], "finetune-step"):
        t = time.perf_counter()
        log.info("fine-tuning on %s (%s)", pool_path, tag)
        res = finetune(lm, pool_path, out_dir, settings, overwrite=True)
        exp.time(f"finetune:{tag}", time.perf_counter() - t)
        exp.finish(out_dir, key, "finetune-step")
        _free()
        return Path(res.adapter_dir)
    return out_dir / "adapter"


def _respond(exp: _Exp, lm_or_adapter, probes_path: Path, out_dir: Path, checker_spec, tag: str) -> Path:
    """Greedy responses to the probes (with a loaded model, or the start model plus an
    adapter directory), judged by the checker: ``responses.jsonl`` (id, response,
    correct, reference). Reused when unchanged."""
    from ..model import LoadedModel, load_model
    from .probes import generate, load_checker, reference_of
    g = exp.cfg.generation
    adapter = None if isinstance(lm_or_adapter, LoadedModel) else Path(lm_or_adapter)
    key = {"probes": sha256_file(probes_path), "generation": asdict(g), "checker": checker_spec,
           "model": (lm_or_adapter.fingerprint if adapter is None
                     else sha256_file(adapter / "adapter_model.safetensors")
                     if (adapter / "adapter_model.safetensors").is_file() else str(adapter))}
    path = out_dir / "responses.jsonl"
    if exp.done(out_dir, key, ["responses.jsonl"], "responses-step"):
        return path
    t = time.perf_counter()
    if adapter is None:
        lm = lm_or_adapter
    else:
        lm = load_model(dataclasses.replace(exp.cfg.model, adapter=str(adapter)))
    probes = read_jsonl(probes_path)
    texts = generate(lm, [p["prompt"] for p in probes], max_new_tokens=g.max_new_tokens,
                     batch_size=g.batch_size, max_prompt_tokens=g.max_prompt_tokens, stop=g.stop)
    check = load_checker(checker_spec)
    rows = []
    for p, r in zip(probes, texts):
        row = {"id": p["id"], "response": r, "correct": bool(check(p, r))}
        try:
            row["reference"] = reference_of(p)
        except InputError:
            pass
        if p.get("task"):
            row["task"] = p["task"]
        rows.append(row)
    atomic_write_jsonl(path, rows)
    exp.finish(out_dir, key, "responses-step")
    if adapter is not None:
        del lm
        _free()
    exp.time(f"generate:{tag}", time.perf_counter() - t)
    return path


def error_rate(responses_path) -> dict:
    rows = read_jsonl(responses_path)
    n = len(rows)
    wrong = sum(1 for r in rows if not r["correct"])
    return {"error_rate": wrong / n if n else float("nan"), "n": n, "n_wrong": wrong}


def accuracy_by_task(responses_path) -> dict:
    by: dict = {}
    for r in read_jsonl(responses_path):
        by.setdefault(r.get("task") or "all", []).append(bool(r["correct"]))
    out = {t: sum(v) / len(v) for t, v in sorted(by.items())}
    out["mean"] = sum(out.values()) / len(out) if out else float("nan")
    return out


def _pct(r: float) -> str:
    s = f"{r * 100:.6g}"
    return s


def _table(name: str, title: str, runs: list, row_keys: list, value, *, lower_is_better: bool = False,
           note: str = "") -> dict:
    """Aggregate ``value(run, row, setting) -> float | None`` over the runs (seeds) of
    each setting, for each row."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    rows = []
    for rk in row_keys:
        cells = [mean_std([value(r, rk, st) for r in runs if r["setting"] == st]) for st in settings]
        rows.append({"label": rk, "cells": cells})
    return {"name": name, "title": title, "columns": settings, "rows": rows,
            "lower_is_better": lower_is_better, "note": note}


def _finish(exp: _Exp, results: dict) -> dict:
    results["timings"] = {k: round(v, 3) for k, v in exp.timings.items()}
    atomic_write_json(exp.out / "results.json", results)
    if exp.cfg.report:
        try:
            from .report import write_report
            write_report(exp.out)
        except ImportError as e:  # matplotlib missing where the experiment ran
            log.warning("no report (%s); run `prism-select report --run %s` where matplotlib is installed",
                        e, exp.out)
    return results


def _load_start(exp, cfg):
    """The start model of a protocol run; its load time goes to ``exp``'s timings."""
    from ..model import load_model
    t = time.perf_counter()
    lm = load_model(cfg.model)
    exp.time("load_model", time.perf_counter() - t)
    return lm


def _mistake_math_run(exp, cfg, ratio, seed):
    """The run directory of one (harmful ratio, seed) and its mistake-math pool."""
    rdir = exp.out / "runs" / f"r{_pct(ratio)}" / f"seed{seed}"
    rdir.mkdir(parents=True, exist_ok=True)
    pool = builders.mistake_math_pool(cfg.data.gsm8k_train, cfg.data.pool_size, ratio, seed,
                                      keep_annotations=cfg.data.keep_annotations)
    pool_path = rdir / "pool.jsonl"
    _write_if_changed(pool_path, pool)
    return rdir, pool, pool_path


# =========================================================================== ranking

def ranking(config: RankingConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The ranking protocol (module docstring); returns the content of results.json."""
    cfg = config
    exp = _Exp(out_dir, "ranking", cfg, overwrite)
    methods_all = _resolve_methods(cfg.methods)
    lm = _load_start(exp, cfg)
    runs = []
    for ratio in cfg.harmful_ratios:
        for seed in cfg.seeds:
            rdir, pool, pool_path = _mistake_math_run(exp, cfg, ratio, seed)
            for variant in cfg.targets:
                vdir = rdir / variant.name
                vdir.mkdir(parents=True, exist_ok=True)
                targets = builders.mistake_math_targets(
                    cfg.data.gsm8k_train, variant.n_counterfactual, seed, exclude=pool,
                    n_distractors=variant.n_distractors, keep_annotations=cfg.data.keep_annotations)
                targets_path = vdir / "targets.jsonl"
                _write_if_changed(targets_path, targets)
                methods = _resolve_methods(variant.methods) if variant.methods else methods_all
                res = _score_methods(exp, lm, pool_path, targets_path, vdir, methods, seed)
                runs.append({
                    "setting": f"{variant.name} @ {_pct(ratio)}%", "variant": variant.name,
                    "harmful_ratio": ratio, "seed": seed, "dir": exp.rel(vdir), "pool": exp.rel(pool_path),
                    "targets": exp.rel(targets_path), "label": "harmful", "n_pool": len(pool),
                    "n_harmful": sum(p["harmful"] for p in pool), "n_pairs": len(targets),
                    "n_distractors": variant.n_distractors, "methods": res,
                    "pi": (res.get("prism") or {}).get("pi")})
    row_keys = list(dict.fromkeys(m for r in runs for m in r["methods"]))

    def metric(name):
        return lambda run, m, st: (run["methods"].get(m) or {}).get(name)

    tables = [
        _table("auroc", "Ranking AUROC of the harmful flag (higher is better)", runs, row_keys, metric("auroc")),
        _table("auprc", "Ranking AUPRC of the harmful flag (chance = harmful ratio)", runs, row_keys,
               metric("auprc")),
    ]
    results = {"protocol": "ranking", "config": config_to_dict(cfg), "methods": row_keys,
               "settings": tables[0]["columns"], "seeds": cfg.seeds, "runs": runs, "tables": tables,
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return _finish(exp, results)


# =========================================================================== repair

def _pairs_from_responses(probes: list, pre: list, post: list, mode: str) -> list:
    pre_by = {r["id"]: r for r in pre}
    post_by = {r["id"]: r for r in post}
    pairs = []
    for p in probes:
        a, b = pre_by[p["id"]], post_by[p["id"]]
        if a["response"].strip() == b["response"].strip() or not b["response"].strip():
            continue
        if mode == "worsened" and not (a["correct"] and not b["correct"]):
            continue
        if mode == "wrong_after" and b["correct"]:
            continue
        pairs.append({"id": p["id"], "prompt": p["prompt"], "chosen": b["response"], "rejected": a["response"],
                      "kind": "worsened" if a["correct"] and not b["correct"] else "other"})
    return pairs


def _remove_top(scores_path, pool_path, out_path, count: int) -> dict:
    """Keep the pool minus the ``count`` top-ranked records; written in pool format."""
    from ..selection import choose, read_scores, write_subset
    scores = read_scores(scores_path)
    kept = choose(scores, remove=("count", count)) if count > 0 else {s["id"] for s in scores}
    write_subset(pool_path, kept, out_path)
    written = {r["id"] for r in read_jsonl(out_path)}  # counted from the file just written
    removed = [r["id"] for r in read_jsonl(pool_path) if r["id"] not in written]
    return {"removed": removed, "kept": len(written)}


def repair(config: RepairConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The repair protocol (module docstring); returns the content of results.json."""
    from ..model import load_model
    cfg = config
    exp = _Exp(out_dir, "repair", cfg, overwrite)
    methods = _resolve_methods(cfg.methods)
    lm = _load_start(exp, cfg)
    runs = []
    for ratio in cfg.harmful_ratios:
        for seed in cfg.seeds:
            rdir, pool, pool_path = _mistake_math_run(exp, cfg, ratio, seed)
            probes = builders.gsm8k_probes(cfg.probes.gsm8k_test, cfg.probes.n, seed)
            probes_path = rdir / "probes.jsonl"
            _write_if_changed(probes_path, probes)
            run = {"setting": f"{_pct(ratio)}%", "harmful_ratio": ratio, "seed": seed, "dir": exp.rel(rdir),
                   "pool": exp.rel(pool_path), "probes": exp.rel(probes_path), "label": "harmful",
                   "n_pool": len(pool), "n_harmful": sum(p["harmful"] for p in pool), "n_probes": len(probes),
                   "error_rates": {}, "methods": {}, "removed": {}}
            # 1. pre- and post-SFT responses
            pre = _respond(exp, lm, probes_path, rdir / "start", cfg.probes.checker, "start")
            run["error_rates"]["Start"] = error_rate(pre)["error_rate"]
            mixed_adapter = _finetune(exp, lm, pool_path, rdir / "mixed", seed, "mixed")
            post = _respond(exp, mixed_adapter, probes_path, rdir / "mixed", cfg.probes.checker, "mixed")
            run["error_rates"]["Mixed"] = error_rate(post)["error_rate"]
            # 2. target pairs from the probes whose behaviour changed
            pairs = _pairs_from_responses(probes, read_jsonl(pre), read_jsonl(post), cfg.pair_selection)
            run["pair_selection"] = cfg.pair_selection
            if len(pairs) < cfg.min_pairs and cfg.fallback_pair_selection:
                run["note"] = (f"{len(pairs)} pair(s) from {cfg.pair_selection} probes, fewer than min_pairs "
                               f"{cfg.min_pairs}: pairs from {cfg.fallback_pair_selection} probes used instead")
                run["pair_selection"] = cfg.fallback_pair_selection
                pairs = _pairs_from_responses(probes, read_jsonl(pre), read_jsonl(post),
                                              cfg.fallback_pair_selection)
            targets_path = rdir / "targets.jsonl"
            _write_if_changed(targets_path, pairs)
            run["targets"] = exp.rel(targets_path)
            run["n_pairs"] = len(pairs)
            pre_rows, post_rows = read_jsonl(pre), read_jsonl(post)
            run["n_worsened"] = sum(1 for a, b in zip(pre_rows, post_rows) if a["correct"] and not b["correct"])
            run["n_improved"] = sum(1 for a, b in zip(pre_rows, post_rows) if not a["correct"] and b["correct"])
            n_remove = builders.harmful_count(len(pool), cfg.remove_fraction if cfg.remove_fraction is not None
                                              else ratio)
            run["n_remove"] = n_remove
            if not pairs:
                run["note"] = (f"no probe qualified as a target pair ({run['pair_selection']}): "
                               "nothing to score; methods left out of this setting")
                runs.append(run)
                continue
            # 3. scores at the start (or post-SFT) model
            if cfg.score_at == "post":
                score_lm = load_model(dataclasses.replace(cfg.model, adapter=str(mixed_adapter)))
            else:
                score_lm = lm
            run["methods"] = _score_methods(exp, score_lm, pool_path, targets_path, rdir, methods, seed)
            if score_lm is not lm:
                del score_lm
                _free()
            run["pi"] = (run["methods"].get("prism") or {}).get("pi")
            # 4. filter and retrain
            rows = list(methods)
            if cfg.oracle:
                rows.append("Oracle")
            harmful_ids = {p["id"] for p in pool if p["harmful"]}
            for m in rows:
                if m != "Oracle" and run["methods"].get(m, {}).get("status") != "ok":
                    continue
                mdir = rdir / "retrain" / m
                mdir.mkdir(parents=True, exist_ok=True)
                kept_path = mdir / "kept.jsonl"
                if m == "Oracle":
                    oracle_scores = mdir / "oracle_scores.jsonl"
                    ranked = sorted(pool, key=lambda p: (not p["harmful"], p["id"]))
                    atomic_write_jsonl(oracle_scores, ({"id": p["id"], "score": float(p["harmful"]), "rank": i + 1}
                                                       for i, p in enumerate(ranked)))
                    rem = _remove_top(oracle_scores, pool_path, kept_path, n_remove)
                else:
                    rem = _remove_top(exp.out / run["methods"][m]["dir"] / "scores.jsonl", pool_path, kept_path,
                                      n_remove)
                run["removed"][m] = {"n": len(rem["removed"]),
                                     "harmful": sum(1 for i in rem["removed"] if i in harmful_ids)}
                if not cfg.retrain:
                    continue
                adapter = _finetune(exp, lm, kept_path, mdir, seed, f"retrain:{m}")
                resp = _respond(exp, adapter, probes_path, mdir, cfg.probes.checker, f"retrain:{m}")
                run["error_rates"][m] = error_rate(resp)["error_rate"]
            runs.append(run)
    method_rows = list(dict.fromkeys(m for r in runs for m in r["methods"]))
    err_rows = ["Start", "Mixed"] + method_rows + (["Oracle"] if cfg.oracle else [])

    def auroc_of(run, m, st):
        return (run["methods"].get(m) or {}).get("auroc")

    def err_of(run, m, st):
        return run["error_rates"].get(m)

    def removed_of(run, m, st):
        r = run["removed"].get(m)
        return None if not r or not run["n_harmful"] else r["harmful"] / run["n_harmful"]

    tables = [
        _table("auroc", f"Ranking AUROC of the harmful flag, pairs from {cfg.pair_selection} probes"
               + (f" (else {cfg.fallback_pair_selection})" if cfg.fallback_pair_selection else "")
               + f", scored at the {cfg.score_at} model", runs, method_rows, auroc_of),
        _table("error_rate", "Probe error rate after filtering and retraining (lower is better)", runs,
               err_rows, err_of, lower_is_better=True,
               note="Start: the start model; Mixed: SFT on the unfiltered pool"),
        _table("harmful_removed", "Recall of the removal: harmful records removed / all harmful records",
               runs, method_rows + (["Oracle"] if cfg.oracle else []), removed_of),
    ]
    results = {"protocol": "repair", "config": config_to_dict(cfg), "methods": method_rows,
               "settings": tables[0]["columns"], "seeds": cfg.seeds, "runs": runs, "tables": tables,
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return _finish(exp, results)


# =========================================================================== select

def select(config: SelectConfig, out_dir, *, overwrite: bool = False) -> dict:
    """The general-selection protocol (module docstring); returns results.json's content."""
    from ..selection import choose, read_scores, write_subset
    cfg = config
    exp = _Exp(out_dir, "select", cfg, overwrite)
    methods = _resolve_methods(cfg.methods)
    pool_path = Path(cfg.pool)
    if not pool_path.exists():
        raise InputError("pool file not found", path=pool_path, fix="set 'pool' in the config")
    lm = _load_start(exp, cfg)
    runs = []
    for seed in cfg.seeds:
        sdir = exp.out / "runs" / f"seed{seed}"
        sdir.mkdir(parents=True, exist_ok=True)
        if cfg.bbh is not None:
            targets, heldout = builders.bbh_splits(cfg.bbh.dir, cfg.bbh.n_targets_per_task, seed,
                                                   tasks=cfg.bbh.tasks, n_heldout_per_task=cfg.bbh.n_heldout_per_task)
            targets_path, heldout_path = sdir / "targets.jsonl", sdir / "heldout.jsonl"
            _write_if_changed(targets_path, targets)
            _write_if_changed(heldout_path, heldout)
        else:
            targets_path, heldout_path = Path(cfg.targets), Path(cfg.heldout)
        run = {"setting": "select", "seed": seed, "dir": exp.rel(sdir), "pool": os.path.relpath(pool_path, exp.out),
               "targets": os.path.relpath(targets_path, exp.out), "heldout": os.path.relpath(heldout_path, exp.out),
               "label": None, "accuracy": {}, "n_selected": None}
        run["methods"] = _score_methods(exp, lm, pool_path, targets_path, sdir, methods, seed, label=None)
        if cfg.start_row:
            resp = _respond(exp, lm, heldout_path, sdir / "start", cfg.checker, "start")
            run["accuracy"]["Start"] = accuracy_by_task(resp)
        if cfg.full_data:
            adapter = _finetune(exp, lm, pool_path, sdir / "full", seed, "full")
            resp = _respond(exp, adapter, heldout_path, sdir / "full", cfg.checker, "full")
            run["accuracy"]["Full data"] = accuracy_by_task(resp)
        for m in methods:
            if run["methods"][m].get("status") != "ok":
                continue
            mdir = sdir / "selected" / m
            mdir.mkdir(parents=True, exist_ok=True)
            scores = read_scores(exp.out / run["methods"][m]["dir"] / "scores.jsonl")
            kept = choose(scores, keep=("fraction", cfg.fraction))
            ext = pool_path.suffix if pool_path.is_file() else ""
            subset = mdir / f"subset{ext or '.jsonl'}"
            run["n_selected"] = write_subset(pool_path, kept, subset)
            adapter = _finetune(exp, lm, subset, mdir, seed, f"select:{m}")
            resp = _respond(exp, adapter, heldout_path, mdir, cfg.checker, f"select:{m}")
            run["accuracy"][m] = accuracy_by_task(resp)
        runs.append(run)
    tasks = list(dict.fromkeys(t for r in runs for acc in r["accuracy"].values() for t in acc if t != "mean"))
    columns = tasks + ["mean"]
    row_keys = list(dict.fromkeys(k for r in runs for k in r["accuracy"]))
    ordered = [k for k in ("Start", "Full data") if k in row_keys] + [k for k in row_keys if k not in ("Start", "Full data")]

    def acc(run, m, task):
        return (run["accuracy"].get(m) or {}).get(task)

    table = {"name": "accuracy", "title": f"Held-out accuracy after fine-tuning on the top {_pct(cfg.fraction)}% "
             "(higher is better)", "columns": columns, "lower_is_better": False,
             "note": "Start: no fine-tuning; Full data: fine-tuned on the whole pool",
             "rows": [{"label": k, "cells": [mean_std([acc(r, k, c) for r in runs]) for c in columns]}
                      for k in ordered]}
    results = {"protocol": "select", "config": config_to_dict(cfg), "methods": methods, "settings": columns,
               "seeds": cfg.seeds, "runs": runs, "tables": [table],
               "model": {"fingerprint": lm.fingerprint, **{k: v for k, v in lm.source.items() if k != "versions"}}}
    return _finish(exp, results)


RUNNERS = {"ranking": ranking, "repair": repair, "select": select}


def run_experiment(protocol: str, config_source, out_dir, *, seeds=None, smoke: bool = False,
                   data_root=None, overwrite: bool = False) -> dict:
    """Load and validate the config, then run ``protocol``; returns results.json's content."""
    cfg = load_config(config_source, protocol, smoke=smoke, seeds=seeds, data_root=data_root)
    return RUNNERS[protocol](cfg, out_dir, overwrite=overwrite)
