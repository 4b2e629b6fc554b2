"""The sections of an experiment config: one dataclass each, which validates itself.

A section whose fields have checks of their own has a ``validate()``; a protocol config
(:class:`RankingConfig`, :class:`RepairConfig`, :class:`SelectConfig`) calls its sections'
and checks what depends on two of them (the probes' files on the pool's family) in its own
``validate()``. The ``model``, ``score`` and ``curvature`` sections are settings objects
themselves (:class:`~prism_select.model.ModelSettings`,
:class:`~prism_select.settings.ScoreSettings`, :class:`~prism_select.curvature.CurvatureSettings`),
which check their fields on construction. Every error is a
:class:`~prism_select.errors.ConfigError` naming the field (``a.b.c``) and the fix;
:mod:`.config` reads a file into these classes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ..curvature import CurvatureSettings
from ..errors import ConfigError
from ..methods.registry import names as method_names
from ..methods.registry import parse_options
from ..model import ModelSettings
from ..settings import ScoreSettings, check_seed, message_of, within
from .carry import SELECT_TASK
from ..finetune import FinetuneSettings
from .probes import load_checker

PAIR_SELECTIONS = ("worsened", "wrong_after", "all")
#: the fields of :class:`~prism_select.settings.ScoreSettings` each protocol run sets itself
#: (:func:`score_settings`); an experiment's ``score`` section gives any other
SCORE_RESERVED = ("method", "method_options", "seed", "overwrite")


def experiment_score(**fields) -> ScoreSettings:
    """An experiment's ``score`` section: :class:`~prism_select.settings.ScoreSettings`
    with its defaults, except ``progress`` (off in experiments), and ``fields``."""
    return ScoreSettings(**{"progress": False, **fields})


@dataclass
class GenerationConfig:
    """Greedy generation on probes (see :func:`.probes.generate`)."""

    max_new_tokens: int = 256
    batch_size: int = 32
    max_prompt_tokens: int | None = None
    stop: list | None = None

    def validate(self, path: str = "generation"):
        if self.max_new_tokens < 1 or self.batch_size < 1:
            raise ConfigError(path, "max_new_tokens and batch_size must be >= 1")


@dataclass
class FinetuneConfig:
    """A :class:`~prism_select.finetune.FinetuneSettings` preset plus
    overrides of single fields (e.g. ``{epochs: 2, max_length: 512}``). The seed is the
    run's seed unless ``overrides`` sets one."""

    preset: str = "repair"
    overrides: dict = field(default_factory=dict)

    def validate(self, path: str = "finetune"):
        try:
            finetune_settings(self, 0)
        except ConfigError as e:
            raise within(e, path) from None


POOL_FAMILIES = ("mistake_math", "refusal_trigger", "dropped_carry", "carry_verdict")
#: Families built without GSM8K (their records are generated).
GENERATED_FAMILIES = ("dropped_carry", "carry_verdict")


@dataclass
class MistakeMathConfig:
    """The pool of a ranking or repair run.

    family: ``mistake_math`` (GSM8K solutions, the harmful ones with a corrupted
        calculator step, :func:`.builders.gsm8k.mistake_math_pool`) or ``refusal_trigger``
        (GSM8K questions matching ``trigger`` answered with a refusal, the clean records
        GSM8K questions without it plus ``n_bbh_per_task`` examples of each of
        ``bbh_tasks`` from ``bbh_dir``, :func:`.builders.trigger.refusal_trigger_pool`; repair only)
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

    def validate(self, *, ranking: bool):
        """The pool's own fields (``ranking``: a ranking config's, mistake-math pools only)."""
        if not self.gsm8k_train and self.family not in GENERATED_FAMILIES:
            raise ConfigError("data.gsm8k_train", "is required", "the path of GSM8K's train.jsonl")
        if self.pool_size < 1:
            raise ConfigError("data.pool_size", f"must be >= 1, got {self.pool_size}")
        if self.family not in POOL_FAMILIES:
            raise ConfigError("data.family", f"unknown value {self.family!r}", f"use one of {', '.join(POOL_FAMILIES)}")
        if self.family != "mistake_math" and ranking:
            raise ConfigError("data.family", "the ranking protocol builds mistake-math pools only",
                              "use the repair protocol for refusal_trigger pools")
        try:
            re.compile(self.trigger)
        except re.error as e:
            raise ConfigError("data.trigger", f"{self.trigger!r} is not a valid regular expression: {e}") from e
        if self.bbh_tasks and not self.bbh_dir:
            raise ConfigError("data.bbh_dir", "is required with data.bbh_tasks")


@dataclass
class WarmupConfig:
    """A clean warm-up SFT that makes the start model (its LoRA merged into the weights):
    ``n_records`` clean records of the pool's family (the same for every seed, never in
    a pool, probe or target), trained with ``finetune``; ``carry_share`` of them are carry
    problems (0: a start model that has not been taught to carry)."""

    n_records: int = 800
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    carry_share: float = 0.5

    def validate(self):
        """The fields every protocol checks alike."""
        if self.n_records < 2:
            raise ConfigError("warmup.n_records", f"must be >= 2, got {self.n_records}")
        if not 0 <= self.carry_share <= 1:
            raise ConfigError("warmup.carry_share", f"must be in [0, 1], got {self.carry_share}")


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

    def validate(self, path: str):
        if self.n_counterfactual < 0 or self.n_distractors < 0 or self.n_counterfactual + self.n_distractors < 1:
            raise ConfigError(path, "needs at least one pair")


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

    def validate(self, path: str, family: str):
        """This target set's fields, for a pool of ``family``."""
        if self.source not in ("probes", "counterfactual"):
            raise ConfigError(f"{path}.source", f"unknown value {self.source!r}", "use probes or counterfactual")
        rm = self.retrain_methods
        if rm is not None and not (isinstance(rm, list) or (isinstance(rm, dict) and all(
                isinstance(v, list) for v in rm.values()))):
            raise ConfigError(f"{path}.retrain_methods", f"expected a list or a mapping percentage -> list, "
                              f"got {rm!r}")
        if self.source == "counterfactual" and (self.n_counterfactual < 0 or self.n_distractors < 0
                                                or self.n_counterfactual + self.n_distractors < 1):
            raise ConfigError(path, "needs at least one pair")
        if self.distractor_kind not in ("shuffled_answer", "unrelated"):
            raise ConfigError(f"{path}.distractor_kind", f"unknown value {self.distractor_kind!r}",
                              "use shuffled_answer or unrelated")
        if self.source == "counterfactual" and family == "carry_verdict":
            raise ConfigError(f"{path}.source", "the carry_verdict family makes its target pairs from the "
                              "probes only", "use source: probes")
        if self.distractor_kind != "shuffled_answer" and family != "dropped_carry":
            raise ConfigError(f"{path}.distractor_kind", "unrelated distractors are built for the dropped_carry "
                              "family only", "leave distractor_kind out")
        if self.source == "probes" and self.n_distractors and (self.n_distractors < 0 or family != "dropped_carry"):
            raise ConfigError(f"{path}.n_distractors", "distractor pairs beside probe pairs are built for the "
                              "dropped_carry family only, as a count >= 0",
                              "use data.family: dropped_carry, or a counterfactual target set")


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
    (see :func:`.builders.multitask.multitask_pool`): ``n_gsm8k`` GSM8K solutions plus
    ``n_per_task`` examples of each BBH task in ``tasks``; per target task
    (``target_task``, or the list ``target_tasks``) ``n_targets`` target pairs and
    ``n_heldout`` held-out probes, outside the pool. Each target task gets its own
    selection, as in LESS. ``rejected``: ``other_answer`` (another answer of the task,
    :func:`.builders.bbh.wrong_answer`) or ``start_model`` (the start model's own wrong
    response, :func:`.builders.multitask.targets_from_responses`). ``n_per_target_task``: pool
    records of each target task (default ``n_per_task``); ``mislabeled_share`` of them
    answer wrong (:func:`.builders.multitask.multitask_pool`). The target task ``carry`` is two-digit
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

    def validate(self):
        for k in ("gsm8k_train", "bbh_dir"):
            if not getattr(self, k):
                raise ConfigError(f"multitask.{k}", "is required")
        if bool(self.target_task) == bool(self.target_tasks):
            raise ConfigError("multitask.target_task", "give one target task (target_task) or a list "
                              "(target_tasks), not both and not neither")
        if len(set(self.targets_of())) != len(self.targets_of()):
            raise ConfigError("multitask.target_tasks", f"a task occurs twice in {self.target_tasks}")
        unknown = [t for t in self.select_for if t not in self.targets_of()]
        if unknown or len(set(self.select_for)) != len(self.select_for):
            raise ConfigError("multitask.select_for", f"{self.select_for}: each must be one target task, once",
                              f"choose among {', '.join(self.targets_of())}")
        if self.n_per_target_task is not None and self.n_per_target_task < 1:
            raise ConfigError("multitask.n_per_target_task", f"must be >= 1, got {self.n_per_target_task}")
        if not 0 <= self.mislabeled_share < 1:
            raise ConfigError("multitask.mislabeled_share", f"must be in [0, 1), got {self.mislabeled_share}")
        if self.rejected not in REJECTED_SOURCES:
            raise ConfigError("multitask.rejected", f"unknown source {self.rejected!r}",
                              f"use one of {', '.join(REJECTED_SOURCES)}")
        for k in ("n_per_task", "n_targets", "n_heldout"):
            if getattr(self, k) < 1:
                raise ConfigError(f"multitask.{k}", f"must be >= 1, got {getattr(self, k)}")
        if self.n_gsm8k < 0:
            raise ConfigError("multitask.n_gsm8k", f"must be >= 0, got {self.n_gsm8k}")
        if self.n_no_carry < 0:
            raise ConfigError("multitask.n_no_carry", f"must be >= 0, got {self.n_no_carry}")


@dataclass
class CommonConfig:
    """Fields every protocol has.

    model: a :class:`~prism_select.model.ModelSettings` mapping, or just the model
        (``default``, a model directory, a ``.gguf`` file).
    seeds: one run per seed (pools, targets, random baselines, fine-tuning all seeded).
    methods: ``all`` (PRISM, its ablations and every registered baseline) or a list.
    method_options: method name -> its options (``ScoreSettings.method_options``).
    score: the :class:`~prism_select.settings.ScoreSettings` shared by every method (any
        field but ``method``, ``method_options``, ``seed`` and ``overwrite``, which the
        protocol sets; ``progress`` off unless given).
    curvature: the :class:`~prism_select.curvature.CurvatureSettings` shared by every method.
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
    score: ScoreSettings = field(default_factory=experiment_score)
    curvature: CurvatureSettings = field(default_factory=CurvatureSettings)
    on_method_error: str = "raise"
    data_root: str | None = None
    report: bool = True
    #: the ``score`` section as the config file gave it (its values as written: what
    #: experiment.json records, :func:`.config.score_record`); set by the reader
    score_given: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def validate(self):
        """What every protocol has: seeds, methods and their options (``score`` and
        ``curvature`` checked themselves when they were built)."""
        if not self.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds):
            raise ConfigError("seeds", f"must be a non-empty list of integers, got {self.seeds!r}")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError("seeds", f"lists a seed twice: {self.seeds!r}")
        for s in self.seeds:
            check_seed(s, "seeds")
        if self.on_method_error not in ("raise", "record"):
            raise ConfigError("on_method_error", f"unknown value {self.on_method_error!r}", "use raise or record")
        if isinstance(self.methods, str):
            if self.methods != "all":
                self.methods = [self.methods]
        elif not isinstance(self.methods, list) or not self.methods or not all(
                isinstance(m, str) for m in self.methods):
            raise ConfigError("methods", f"must be 'all' or a non-empty list of method names, got {self.methods!r}")
        if not isinstance(self.method_options, dict) or not all(isinstance(v, dict)
                                                                for v in self.method_options.values()):
            raise ConfigError("method_options", "must map a method name to a mapping of its options",
                              "e.g. {ifguide: {quantile: 0.99}}")
        for name, opts in self.method_options.items():
            if name in method_names():  # each method's options, checked by its options dataclass
                try:
                    parse_options(name, opts)
                except ConfigError as e:
                    field = f"method_options.{name}" + ("" if e.field == "method_options" else f".{e.field}")
                    raise ConfigError(field, message_of(e)) from None


@dataclass
class RankingConfig(CommonConfig):
    """data: the mistake-math pool; targets: one or more :class:`TargetVariant`;
    harmful_ratios: fractions of corrupted records (0.01, 0.1, 0.2, 0.5, ...)."""

    data: MistakeMathConfig = field(default_factory=MistakeMathConfig)
    targets: list = field(default_factory=lambda: [TargetVariant()])
    harmful_ratios: list = field(default_factory=lambda: [0.1])

    def validate(self):
        super().validate()
        _check_ratios(self.harmful_ratios)
        self.data.validate(ranking=True)
        _check_target_names(self.targets)
        for i, t in enumerate(self.targets):
            t.validate(f"targets[{i}]")


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

    def validate(self):
        super().validate()
        _check_ratios(self.harmful_ratios)
        self.data.validate(ranking=False)
        _check_target_names(self.targets)
        family = self.data.family
        if not self.probes.gsm8k_test and family not in GENERATED_FAMILIES:
            raise ConfigError("probes.gsm8k_test", "is required", "the path of GSM8K's test.jsonl")
        if self.probes.n < 1:
            raise ConfigError("probes.n", f"must be >= 1, got {self.probes.n}")
        for name in ("pair_selection", "fallback_pair_selection"):
            v = getattr(self, name)
            if v not in PAIR_SELECTIONS and not (v is None and name.startswith("fallback")):
                raise ConfigError(name, f"unknown value {v!r}", f"use one of {', '.join(PAIR_SELECTIONS)}")
        if self.min_pairs < 1:
            raise ConfigError("min_pairs", f"must be >= 1, got {self.min_pairs}")
        if self.score_at not in ("start", "post"):
            raise ConfigError("score_at", f"unknown value {self.score_at!r}", "use start or post")
        if self.remove_fraction is not None:
            check_fraction(self.remove_fraction, "remove_fraction", allow_zero=True)
        if self.remove_fractions is not None:
            if not self.remove_fractions:
                raise ConfigError("remove_fractions", "needs at least one fraction", "e.g. [0.05, 0.1, 0.2]")
            for i, r in enumerate(self.remove_fractions):
                check_fraction(r, f"remove_fractions[{i}]", allow_zero=True)
        for i, t in enumerate(self.targets):
            t.validate(f"targets[{i}]", family)
        if self.probes.capability_per_task < 0:
            raise ConfigError("probes.capability_per_task", f"must be >= 0, got {self.probes.capability_per_task}")
        self._validate_extras()
        if self.probes.capability_per_task and family not in GENERATED_FAMILIES \
                and not (self.data.bbh_tasks and self.data.n_bbh_per_task):
            raise ConfigError("probes.capability_per_task", "needs BBH tasks in the pool",
                              "set data.bbh_dir, data.bbh_tasks and data.n_bbh_per_task")
        try:
            load_checker(self.probes.checker)
        except ConfigError as e:
            raise within(e, "probes") from None
        self.generation.validate()
        self.finetune.validate()

    def _validate_extras(self):
        """The warm-up, fine-tuning seeds, partial oracles and comparators."""
        if self.warmup is not None:
            if self.data.family not in GENERATED_FAMILIES:
                raise ConfigError("warmup", f"the {self.data.family} family has no warm-up records",
                                  f"use a family of {', '.join(GENERATED_FAMILIES)}, or start from a fine-tuned model")
            self.warmup.validate()
            if self.warmup.carry_share != 0.5:
                raise ConfigError("warmup.carry_share", "the repair families warm up on half carry problems",
                                  "remove warmup.carry_share")
        _check_finetune_seeds(self.finetune_seeds)
        for i, q in enumerate(self.partial_oracles):
            check_fraction(q, f"partial_oracles[{i}]")
            if q >= 1:
                raise ConfigError(f"partial_oracles[{i}]", f"must be below 1 (1 is the Oracle row), got {q!r}")
        if not 0 <= self.data.carry_share <= 1:
            raise ConfigError("data.carry_share", f"must be in [0, 1], got {self.data.carry_share!r}")
        if not isinstance(self.comparators, list) or not all(isinstance(m, str) for m in self.comparators):
            raise ConfigError("comparators", f"must be a list of method names, got {self.comparators!r}")


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

    def validate(self):
        super().validate()
        if self.multitask is not None:
            if self.pool or self.bbh is not None or self.targets or self.heldout:
                raise ConfigError("multitask", "builds the pool, targets and held-out probes: give none of pool, "
                                  "bbh, targets, heldout beside it")
            self.multitask.validate()
            if self.warmup is not None:
                if SELECT_TASK not in self.multitask.targets_of():
                    raise ConfigError("warmup", f"warms up on addition records: it goes with the target task "
                                      f"'{SELECT_TASK}' only", f"add '{SELECT_TASK}' to multitask.target_tasks or "
                                      "remove warmup")
                self.warmup.validate()
            check_fraction(self.fraction, "fraction")
        else:
            if not self.pool:
                raise ConfigError("pool", "is required", "the candidate pool file")
            check_fraction(self.fraction, "fraction")
            if self.bbh is None and not (self.targets and self.heldout):
                raise ConfigError("targets", "give bbh (a BIG-Bench-Hard folder) or both targets and heldout files")
            if self.bbh is not None and (self.targets or self.heldout):
                raise ConfigError("bbh", "give either bbh or targets + heldout, not both")
        load_checker(self.checker)
        _check_finetune_seeds(self.finetune_seeds)
        self.generation.validate()
        self.finetune.validate()


#: the protocol configs, by protocol name
CONFIG_CLASSES = {"ranking": RankingConfig, "repair": RepairConfig, "select": SelectConfig}


def check_fraction(v, name, allow_zero=False):
    """A :class:`ConfigError` naming ``name`` unless ``v`` is a fraction in (0, 1] (``allow_zero``: [0, 1])."""
    if not isinstance(v, (int, float)) or not ((0 <= v <= 1) if allow_zero else (0 < v <= 1)):
        raise ConfigError(name, f"must be a fraction in {'[0, 1]' if allow_zero else '(0, 1]'}, got {v!r}",
                          "e.g. 0.1 for 10%")


def _check_ratios(ratios: list):
    """``harmful_ratios``: at least one, each a fraction in [0, 1]."""
    if not ratios:
        raise ConfigError("harmful_ratios", "needs at least one ratio", "e.g. [0.1, 0.5]")
    for i, r in enumerate(ratios):
        check_fraction(r, f"harmful_ratios[{i}]", allow_zero=True)


def _check_target_names(targets: list):
    """Target set names: distinct, and each usable as a folder name."""
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ConfigError("targets", f"target set names must differ, got {names}")
    for i, t in enumerate(targets):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", t.name):
            raise ConfigError(f"targets[{i}].name", f"{t.name!r} must be letters, digits, '_', '-' or '.'")


def _check_finetune_seeds(fs):
    """``finetune_seeds``: None, or a non-empty list of distinct integers."""
    if fs is not None and (not isinstance(fs, list) or not fs
                           or not all(isinstance(s, int) and not isinstance(s, bool) for s in fs)
                           or len(set(fs)) != len(fs)):
        raise ConfigError("finetune_seeds", f"must be a non-empty list of distinct integers, got {fs!r}",
                          "e.g. finetune_seeds: [0, 1]")
    for s in fs or []:
        check_seed(s, "finetune_seeds")


def score_settings(cfg: CommonConfig, method: str, seed: int) -> ScoreSettings:
    """The :class:`~prism_select.settings.ScoreSettings` of ``method`` in a protocol run:
    the config's ``score`` section with the method, its options and the run's seed."""
    return dataclasses.replace(cfg.score, method=method, seed=seed, overwrite=False,
                               method_options=dict(cfg.method_options.get(method, {})))


def finetune_settings(ft: FinetuneConfig, seed: int) -> FinetuneSettings:
    """The :class:`~prism_select.finetune.FinetuneSettings` of ``ft`` (the
    run's ``seed`` unless the overrides set one; no progress bar)."""
    over = dict(ft.overrides)
    over.setdefault("seed", seed)
    over.setdefault("progress", False)
    return FinetuneSettings.preset(ft.preset, **over)
