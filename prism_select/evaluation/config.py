"""Configs of the evaluation protocols: one dataclass per section, a loader that
validates a YAML or JSON file (or a mapping) into them, and the settings objects of
scoring and fine-tuning built from a config.

Every error is a :class:`~prism_select.errors.ConfigError` naming the field
(``a.b.c``) and the fix. See :func:`load_config` for the file layout.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..curvature import CurvatureSettings
from ..errors import ConfigError
from ..methods.registry import names as method_names
from ..methods.registry import parse_options
from ..model import ModelSettings
from ..settings import RunSettings, ScoreSettings, ScoringSettings, check_seed

PROTOCOLS = ("ranking", "repair", "select")
PAIR_SELECTIONS = ("worsened", "wrong_after", "all")
DATA_ROOT_ENV = "PRISM_DATA_ROOT"


def _default(cls, name: str):
    """The default of field ``name`` of settings dataclass ``cls`` (one source of defaults)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default


@dataclass
class ScoreConfig:
    """Scoring settings shared by every method (see :class:`prism_select.settings.ScoreSettings`,
    whose defaults these are, except ``progress``: off in experiments).

    Any other field of ``ScoreSettings`` (e.g. ``skip_invalid``, ``precision``) may be
    given here too; it is passed through (``extra``). ``method``, ``method_options``,
    ``seed`` and ``overwrite`` are set by the protocol."""

    max_length: int = _default(ScoringSettings, "max_length")
    batch_size: int = _default(ScoringSettings, "batch_size")
    modules: list | None = None
    chunk_size: int = _default(RunSettings, "chunk_size")
    progress: bool = False
    extra: dict = field(default_factory=dict)


_SCORE_RESERVED = {"method", "method_options", "seed", "overwrite"}


def _score_passthrough() -> set:
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


POOL_FAMILIES = ("mistake_math", "refusal_trigger", "dropped_carry", "carry_verdict")
#: Families built without GSM8K (their records are generated).
GENERATED_FAMILIES = ("dropped_carry", "carry_verdict")


@dataclass
class MistakeMathConfig:
    """The pool of a ranking or repair run.

    family: ``mistake_math`` (GSM8K solutions, the harmful ones with a corrupted
        calculator step, :func:`.builders.mistake_math_pool`) or ``refusal_trigger``
        (GSM8K questions matching ``trigger`` answered with a refusal, the clean records
        GSM8K questions without it plus ``n_bbh_per_task`` examples of each of
        ``bbh_tasks`` from ``bbh_dir``, :func:`.builders.refusal_trigger_pool`; repair only)
        or ``dropped_carry`` (two-digit additions, the harmful ones carry problems answered
        with the carry dropped; ``carry_share`` of the clean records are carry problems
        too; :mod:`.carry`; repair only, needs no data files) or ``carry_verdict`` (stated
        two-digit sums judged ``"Yes."`` / ``"No."``, the harmful ones carry problems judged
        by the dropped-carry rule; :mod:`.verdict`; repair only, needs no data files).
    """

    gsm8k_train: str = ""
    pool_size: int = 300
    keep_annotations: bool = False
    family: str = "mistake_math"
    trigger: str = r"\$"
    bbh_dir: str = ""
    bbh_tasks: list = field(default_factory=list)
    n_bbh_per_task: int = 0
    carry_share: float = 0.5


@dataclass
class WarmupConfig:
    """A clean warm-up SFT that makes the start model (its LoRA merged into the weights):
    ``n_records`` clean records of the pool's family (the same for every seed, never in
    a pool, probe or target), trained with ``finetune``; ``carry_share`` of them are carry
    problems (0: a start model that has not been taught to carry)."""

    n_records: int = 800
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    carry_share: float = 0.5


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
    """GSM8K test problems as probes and the checker that judges a response.

    With the ``refusal_trigger`` family the ``n`` probes are test questions matching
    the pool's trigger (the checker's error rate is then the behaviour rate, e.g.
    ``no_refusal``), and ``capability_per_task`` held-out examples of each BBH task of
    the pool are added as a capability check, judged by ``capability_checker``."""

    gsm8k_test: str = ""
    n: int = 48
    checker: Any = "numeric_final_answer"
    capability_per_task: int = 0
    capability_checker: Any = "final_answer"


@dataclass
class RepairTargets:
    """A target set of the repair protocol.

    source: ``probes`` (the paper's App. B: pairs ``(probe, chosen = post-SFT response,
        rejected = pre-SFT response)`` selected by ``pair_selection``; with
        ``n_distractors``, dropped carry only, that many distractor pairs beside them) or
        ``counterfactual`` (``n_counterfactual`` pairs on problems outside the pool:
        chosen = the harmful behaviour written out, rejected = the correct response,
        plus ``n_distractors`` pairs the model strongly disprefers).
    methods: only these methods (default: all of the config's).
    retrain_methods: only these methods' removals are retrained (default: all scored);
        ``[]`` keeps this set to the ranking (AUROC, recall of each removal); a mapping
        from a removal percentage (``"5"``, ``"10"``) to such a list sets it per fraction
        (a fraction it does not name: all).
    """

    name: str = "probes"
    source: str = "probes"
    n_counterfactual: int = 24
    n_distractors: int = 0
    #: dropped carry's distractors: ``shuffled_answer`` (a held-out problem's true answer,
    #: its words shuffled, against it) or ``unrelated`` (a sentence, shuffled, against it)
    distractor_kind: str = "shuffled_answer"
    methods: list | None = None
    retrain_methods: Any = None


@dataclass
class BBHConfig:
    """Per-task targets and held-out probes from a BIG-Bench-Hard folder."""

    dir: str = ""
    n_targets_per_task: int = 3
    tasks: list | None = None
    n_heldout_per_task: int | None = None


REJECTED_SOURCES = ("other_answer", "start_model")


@dataclass
class MultitaskConfig:
    """A multi-task pool with targets and held-out probes of one or more target tasks
    (see :func:`.builders.multitask_pool`): ``n_gsm8k`` GSM8K solutions plus
    ``n_per_task`` examples of each BBH task in ``tasks``; per target task
    (``target_task``, or the list ``target_tasks``) ``n_targets`` target pairs and
    ``n_heldout`` held-out probes, outside the pool. Each target task gets its own
    selection, as in LESS. ``rejected``: ``other_answer`` (another answer of the task,
    :func:`.builders.wrong_answer`) or ``start_model`` (the start model's own wrong
    response, :func:`.builders.targets_from_responses`). ``n_per_target_task``: pool
    records of each target task (default ``n_per_task``); ``mislabeled_share`` of them
    answer wrong (:func:`.builders.multitask_pool`). The target task ``carry`` is two-digit
    addition (:func:`.carry.select_task`): its wrong records drop the carry, and
    ``n_no_carry`` no-carry additions (task ``addition``) stand beside it; judge its
    probes with ``numeric_final_answer`` (a ``by_task`` checker). ``select_for``: the target tasks this
    run selects for (default every one); the pool is built with all of them, so runs that
    split the target tasks between them (``experiment select --target-tasks``, e.g. one
    process per GPU) select from the same pool and are merged by
    :func:`.general_selection.combine_seeds`."""

    gsm8k_train: str = ""
    bbh_dir: str = ""
    tasks: list = field(default_factory=list)
    target_task: str = ""
    target_tasks: list = field(default_factory=list)
    n_gsm8k: int = 1000
    n_per_task: int = 40
    n_targets: int = 8
    n_heldout: int = 100
    rejected: str = "other_answer"
    n_per_target_task: int | None = None
    mislabeled_share: float = 0.0
    select_for: list = field(default_factory=list)
    n_no_carry: int = 0

    def targets_of(self) -> list:
        """The target tasks, in the config's order."""
        return list(self.target_tasks) if self.target_tasks else [self.target_task]

    def selected_targets(self) -> list:
        """The target tasks this run selects for, in the config's order."""
        return [t for t in self.targets_of() if not self.select_for or t in self.select_for]


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
    remove_fractions: several such fractions (each gives its own retraining rows);
        overrides ``remove_fraction``.
    targets: target sets (:class:`RepairTargets`; default: one set from the probes).
    retrain: retrain and measure the error rate after each removal.
    oracle: also remove exactly the harmful records (an upper reference row).
    warmup: a clean warm-up SFT whose merged result is the start model
        (:class:`WarmupConfig`; ``dropped_carry`` only).
    finetune_seeds: retrain every kept set once per fine-tuning seed (rows: their mean;
        default: one SFT seeded with the data seed).
    partial_oracles: fractions of the harmful records removed at random (seeded), each a
        row ``Oracle q%``: the behaviour's dose-response.
    floors: rank the pool with the surface floors of :mod:`.floors` (and the family's
        knowledge floors) beside the methods.
    comparators: methods every other method is compared with, paired by seed, with a
        95% interval (t over the data seeds of the per-seed mean difference; with two
        seeds or more).
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
    remove_fractions: list | None = None
    targets: list = field(default_factory=lambda: [RepairTargets()])
    retrain: bool = True
    oracle: bool = False
    warmup: WarmupConfig | None = None
    finetune_seeds: list | None = None
    partial_oracles: list = field(default_factory=list)
    floors: bool = False
    comparators: list = field(default_factory=lambda: ["random", "equal", "ifguide", "less"])


@dataclass
class SelectConfig(CommonConfig):
    """pool: the candidate pool (any format prism-select reads); targets + heldout:
    target pairs (with ``task``) and held-out probes (``prompt``, ``reference``,
    ``task``), or ``bbh`` to build both from a BIG-Bench-Hard folder; fraction: the
    budget kept by each method (0.05 = the paper's 5%); finetune: the SFT
    (``general`` preset); checker: judges held-out responses; full_data/start_row: add
    the rows "Full data" (SFT on the whole pool) and "Start" (no SFT); multitask:
    build the pool, targets and held-out probes per seed instead (:class:`MultitaskConfig`);
    task_floor: with a multitask pool, add the row "Task records": the budget filled with
    the target task's pool records in a seeded random order (what a user who knows each
    record's task selects without any model), fine-tuned like a method's selection; where
    the target task has wrong records (``mislabeled_share``), also the row "Task records,
    right only" (its right records alone: a perfect selector within the task); warmup: a
    clean warm-up SFT whose merged result is the start model (addition records; with the
    target task ``carry`` only, whose problems it never shares); finetune_seeds: fine-tune
    every selection once per fine-tuning seed (each row's accuracy: their mean, each SFT's
    under ``by_finetune_seed``; default: one SFT seeded with the data seed)."""

    pool: str = ""
    multitask: MultitaskConfig | None = None
    bbh: BBHConfig | None = None
    targets: str | None = None
    heldout: str | None = None
    fraction: float = 0.05
    finetune: FinetuneConfig = field(default_factory=lambda: FinetuneConfig(preset="general"))
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=64))
    checker: Any = "final_answer"
    full_data: bool = True
    start_row: bool = True
    task_floor: bool = True
    warmup: WarmupConfig | None = None
    finetune_seeds: list | None = None


CONFIG_CLASSES = {"ranking": RankingConfig, "repair": RepairConfig, "select": SelectConfig}
_LIST_ITEM_TYPES = {(RankingConfig, "targets"): TargetVariant, (RepairConfig, "targets"): RepairTargets}


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
        if item_cls is None and k == "targets":
            item_cls = next((v for (c, f), v in _LIST_ITEM_TYPES.items() if f == k and issubclass(cls, c)), None)
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


def _load_yaml(text: str):
    """``yaml.safe_load(text)``, with :class:`_AliasInConfig` at the first alias (before
    any node is built from it)."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise _AliasInConfig(event.anchor, event.start_mark.line + 1)
            return super().compose_node(parent, index)

    loader = NoAliasLoader(text)
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


def _check_fraction(v, name, allow_zero=False):
    if not isinstance(v, (int, float)) or not ((0 <= v <= 1) if allow_zero else (0 < v <= 1)):
        raise ConfigError(name, f"must be a fraction in {'[0, 1]' if allow_zero else '(0, 1]'}, got {v!r}",
                          "e.g. 0.1 for 10%")


def _validate(cfg, protocol: str):
    """Check a protocol config, section by section; the first problem raises :class:`ConfigError`."""
    _validate_common(cfg)
    if isinstance(cfg, (RankingConfig, RepairConfig)):
        _validate_pool_data(cfg)
    if isinstance(cfg, RepairConfig):
        _validate_repair(cfg)
    if isinstance(cfg, SelectConfig):
        _validate_select(cfg)
    _validate_generation_finetune(cfg)


def _validate_common(cfg):
    """What every protocol has: seeds, methods and their options, the score settings, and
    the harmful ratios where a protocol has them."""
    if not cfg.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in cfg.seeds):
        raise ConfigError("seeds", f"must be a non-empty list of integers, got {cfg.seeds!r}")
    if len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError("seeds", f"lists a seed twice: {cfg.seeds!r}")
    for s in cfg.seeds:
        check_seed(s, "seeds")
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
    for name, opts in cfg.method_options.items():
        if name in method_names():  # each method's options, checked by its options dataclass
            try:
                parse_options(name, opts)
            except ConfigError as e:
                field = f"method_options.{name}" + ("" if e.field == "method_options" else f".{e.field}")
                raise ConfigError(field, _PREFIX.sub("", str(e))) from None
    for k in ("batch_size", "max_length", "chunk_size"):
        if getattr(cfg.score, k) < 1:
            raise ConfigError(f"score.{k}", f"must be >= 1, got {getattr(cfg.score, k)}")
    bad = sorted(set(cfg.score.extra) - _score_passthrough())
    if bad:
        raise ConfigError(f"score.{bad[0]}", "unknown setting")
    try:
        score_settings(cfg, "prism", 0)
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


def _validate_pool_data(cfg):
    """A ranking or repair config's pool data and target sets."""
    if not cfg.data.gsm8k_train and cfg.data.family not in GENERATED_FAMILIES:
        raise ConfigError("data.gsm8k_train", "is required", "the path of GSM8K's train.jsonl")
    if cfg.data.pool_size < 1:
        raise ConfigError("data.pool_size", f"must be >= 1, got {cfg.data.pool_size}")
    if cfg.data.family not in POOL_FAMILIES:
        raise ConfigError("data.family", f"unknown value {cfg.data.family!r}", f"use one of {', '.join(POOL_FAMILIES)}")
    if cfg.data.family != "mistake_math" and isinstance(cfg, RankingConfig):
        raise ConfigError("data.family", "the ranking protocol builds mistake-math pools only",
                          "use the repair protocol for refusal_trigger pools")
    try:
        re.compile(cfg.data.trigger)
    except re.error as e:
        raise ConfigError("data.trigger", f"{cfg.data.trigger!r} is not a valid regular expression: {e}") from e
    if cfg.data.bbh_tasks and not cfg.data.bbh_dir:
        raise ConfigError("data.bbh_dir", "is required with data.bbh_tasks")
    names = [t.name for t in cfg.targets]
    if len(set(names)) != len(names):
        raise ConfigError("targets", f"target set names must differ, got {names}")
    for i, t in enumerate(cfg.targets):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", t.name):
            raise ConfigError(f"targets[{i}].name", f"{t.name!r} must be letters, digits, '_', '-' or '.'")
    if isinstance(cfg, RankingConfig):
        for i, t in enumerate(cfg.targets):
            if t.n_counterfactual < 0 or t.n_distractors < 0 or t.n_counterfactual + t.n_distractors < 1:
                raise ConfigError(f"targets[{i}]", "needs at least one pair")


def _validate_repair(cfg):
    """A repair config's probes, pair selection, removal fractions and target sources."""
    if not cfg.probes.gsm8k_test and cfg.data.family not in GENERATED_FAMILIES:
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
    if cfg.remove_fractions is not None:
        if not cfg.remove_fractions:
            raise ConfigError("remove_fractions", "needs at least one fraction", "e.g. [0.05, 0.1, 0.2]")
        for i, r in enumerate(cfg.remove_fractions):
            _check_fraction(r, f"remove_fractions[{i}]", allow_zero=True)
    for i, t in enumerate(cfg.targets):
        if t.source not in ("probes", "counterfactual"):
            raise ConfigError(f"targets[{i}].source", f"unknown value {t.source!r}", "use probes or counterfactual")
        rm = t.retrain_methods
        if rm is not None and not (isinstance(rm, list) or (isinstance(rm, dict) and all(
                isinstance(v, list) for v in rm.values()))):
            raise ConfigError(f"targets[{i}].retrain_methods", f"expected a list or a mapping percentage -> list, "
                              f"got {rm!r}")
        if t.source == "counterfactual" and (t.n_counterfactual < 0 or t.n_distractors < 0
                                             or t.n_counterfactual + t.n_distractors < 1):
            raise ConfigError(f"targets[{i}]", "needs at least one pair")
        if t.distractor_kind not in ("shuffled_answer", "unrelated"):
            raise ConfigError(f"targets[{i}].distractor_kind", f"unknown value {t.distractor_kind!r}",
                              "use shuffled_answer or unrelated")
        if t.source == "counterfactual" and cfg.data.family == "carry_verdict":
            raise ConfigError(f"targets[{i}].source", "the carry_verdict family makes its target pairs from the "
                              "probes only", "use source: probes")
        if t.distractor_kind != "shuffled_answer" and cfg.data.family != "dropped_carry":
            raise ConfigError(f"targets[{i}].distractor_kind", "unrelated distractors are built for the dropped_carry "
                              "family only", "leave distractor_kind out")
        if t.source == "probes" and t.n_distractors and (t.n_distractors < 0 or cfg.data.family != "dropped_carry"):
            raise ConfigError(f"targets[{i}].n_distractors", "distractor pairs beside probe pairs are built for the "
                              "dropped_carry family only, as a count >= 0",
                              "use data.family: dropped_carry, or a counterfactual target set")
    if cfg.probes.capability_per_task < 0:
        raise ConfigError("probes.capability_per_task", f"must be >= 0, got {cfg.probes.capability_per_task}")
    _validate_repair_extras(cfg)
    if cfg.probes.capability_per_task and cfg.data.family not in GENERATED_FAMILIES \
            and not (cfg.data.bbh_tasks and cfg.data.n_bbh_per_task):
        raise ConfigError("probes.capability_per_task", "needs BBH tasks in the pool",
                          "set data.bbh_dir, data.bbh_tasks and data.n_bbh_per_task")
    from .probes import load_checker
    try:
        load_checker(cfg.probes.checker)
    except ConfigError as e:
        raise _rewrap(e, "probes") from None


def _validate_select(cfg):
    """A general-selection config: a multitask build, or a pool with targets and held-out probes."""
    if cfg.multitask is not None:
        mt = cfg.multitask
        if cfg.pool or cfg.bbh is not None or cfg.targets or cfg.heldout:
            raise ConfigError("multitask", "builds the pool, targets and held-out probes: give none of pool, bbh, "
                              "targets, heldout beside it")
        for k in ("gsm8k_train", "bbh_dir"):
            if not getattr(mt, k):
                raise ConfigError(f"multitask.{k}", "is required")
        if bool(mt.target_task) == bool(mt.target_tasks):
            raise ConfigError("multitask.target_task", "give one target task (target_task) or a list "
                              "(target_tasks), not both and not neither")
        if len(set(mt.targets_of())) != len(mt.targets_of()):
            raise ConfigError("multitask.target_tasks", f"a task occurs twice in {mt.target_tasks}")
        unknown = [t for t in mt.select_for if t not in mt.targets_of()]
        if unknown or len(set(mt.select_for)) != len(mt.select_for):
            raise ConfigError("multitask.select_for", f"{mt.select_for}: each must be one target task, once",
                              f"choose among {', '.join(mt.targets_of())}")
        if mt.n_per_target_task is not None and mt.n_per_target_task < 1:
            raise ConfigError("multitask.n_per_target_task", f"must be >= 1, got {mt.n_per_target_task}")
        if not 0 <= mt.mislabeled_share < 1:
            raise ConfigError("multitask.mislabeled_share", f"must be in [0, 1), got {mt.mislabeled_share}")
        if mt.rejected not in REJECTED_SOURCES:
            raise ConfigError("multitask.rejected", f"unknown source {mt.rejected!r}",
                              f"use one of {', '.join(REJECTED_SOURCES)}")
        for k in ("n_per_task", "n_targets", "n_heldout"):
            if getattr(mt, k) < 1:
                raise ConfigError(f"multitask.{k}", f"must be >= 1, got {getattr(mt, k)}")
        if mt.n_gsm8k < 0:
            raise ConfigError("multitask.n_gsm8k", f"must be >= 0, got {mt.n_gsm8k}")
        if mt.n_no_carry < 0:
            raise ConfigError("multitask.n_no_carry", f"must be >= 0, got {mt.n_no_carry}")
        if cfg.warmup is not None:
            from .carry import SELECT_TASK
            if SELECT_TASK not in mt.targets_of():
                raise ConfigError("warmup", f"warms up on addition records: it goes with the target task "
                                  f"'{SELECT_TASK}' only", f"add '{SELECT_TASK}' to multitask.target_tasks or "
                                  "remove warmup")
            _validate_warmup(cfg.warmup)
        _check_fraction(cfg.fraction, "fraction")
        from .probes import load_checker
        load_checker(cfg.checker)
        _validate_finetune_seeds(cfg.finetune_seeds)
    else:
        if not cfg.pool:
            raise ConfigError("pool", "is required", "the candidate pool file")
        _check_fraction(cfg.fraction, "fraction")
        if cfg.bbh is None and not (cfg.targets and cfg.heldout):
            raise ConfigError("targets", "give bbh (a BIG-Bench-Hard folder) or both targets and heldout files")
        if cfg.bbh is not None and (cfg.targets or cfg.heldout):
            raise ConfigError("bbh", "give either bbh or targets + heldout, not both")
        from .probes import load_checker
        load_checker(cfg.checker)
        _validate_finetune_seeds(cfg.finetune_seeds)


def _validate_generation_finetune(cfg):
    """The generation and fine-tuning sections, where a protocol has them."""
    for sec in ("generation",):
        g = getattr(cfg, sec, None)
        if g is not None and (g.max_new_tokens < 1 or g.batch_size < 1):
            raise ConfigError(f"{sec}", "max_new_tokens and batch_size must be >= 1")
    ft = getattr(cfg, "finetune", None)
    if ft is not None:
        try:
            finetune_settings(ft, 0)
        except ConfigError as e:
            raise _rewrap(e, "finetune") from None



def config_to_dict(cfg) -> dict:
    """A config as plain JSON values (what experiment.json and results.json record)."""
    return json.loads(json.dumps(asdict(cfg), default=str))


def _validate_warmup(w: WarmupConfig):
    """The fields of a warm-up that every protocol checks alike."""
    if w.n_records < 2:
        raise ConfigError("warmup.n_records", f"must be >= 2, got {w.n_records}")
    if not 0 <= w.carry_share <= 1:
        raise ConfigError("warmup.carry_share", f"must be in [0, 1], got {w.carry_share}")


def _validate_finetune_seeds(fs):
    """``finetune_seeds``: None, or a non-empty list of distinct integers."""
    if fs is not None and (not isinstance(fs, list) or not fs
                           or not all(isinstance(s, int) and not isinstance(s, bool) for s in fs)
                           or len(set(fs)) != len(fs)):
        raise ConfigError("finetune_seeds", f"must be a non-empty list of distinct integers, got {fs!r}",
                          "e.g. finetune_seeds: [0, 1]")
    for s in fs or []:
        check_seed(s, "finetune_seeds")


def _validate_repair_extras(cfg):
    """The warm-up, fine-tuning seeds, partial oracles and comparators of a repair config."""
    if cfg.warmup is not None:
        if cfg.data.family not in GENERATED_FAMILIES:
            raise ConfigError("warmup", f"the {cfg.data.family} family has no warm-up records",
                              f"use a family of {', '.join(GENERATED_FAMILIES)}, or start from a fine-tuned model")
        _validate_warmup(cfg.warmup)
        if cfg.warmup.carry_share != 0.5:
            raise ConfigError("warmup.carry_share", "the repair families warm up on half carry problems",
                              "remove warmup.carry_share")
    _validate_finetune_seeds(cfg.finetune_seeds)
    for i, q in enumerate(cfg.partial_oracles):
        _check_fraction(q, f"partial_oracles[{i}]")
        if q >= 1:
            raise ConfigError(f"partial_oracles[{i}]", f"must be below 1 (1 is the Oracle row), got {q!r}")
    if not 0 <= cfg.data.carry_share <= 1:
        raise ConfigError("data.carry_share", f"must be in [0, 1], got {cfg.data.carry_share!r}")
    if not isinstance(cfg.comparators, list) or not all(isinstance(m, str) for m in cfg.comparators):
        raise ConfigError("comparators", f"must be a list of method names, got {cfg.comparators!r}")


def score_settings(cfg, method: str, seed: int):
    """The :class:`~prism_select.settings.ScoreSettings` of ``method`` in a protocol run."""
    s = cfg.score
    return ScoreSettings(method=method, max_length=s.max_length, batch_size=s.batch_size, modules=s.modules,
                         chunk_size=s.chunk_size, overwrite=False, progress=s.progress, seed=seed,
                         method_options=dict(cfg.method_options.get(method, {})), **s.extra)


def finetune_settings(ft: FinetuneConfig, seed: int):
    """The :class:`~prism_select.evaluation.finetune.FinetuneSettings` of ``ft`` (the
    run's ``seed`` unless the overrides set one; no progress bar)."""
    from .finetune import FinetuneSettings
    over = dict(ft.overrides)
    over.setdefault("seed", seed)
    over.setdefault("progress", False)
    return FinetuneSettings.preset(ft.preset, **over)
