"""What every scoring method gets: :class:`RunContext`, the run's model, inputs,
settings and records, holding its parts: the stage meter (:mod:`.meter`), the curvature
provider (:mod:`.curvature_provider`) and the scorer (:mod:`.scorer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..curvature import CurvatureSettings
from ..runtime.execution import ExecutionContext
from ..runtime.execution import resolve as resolve_execution
from ..model import LoadedModel
from ..plan import MemoryPlan
from ..settings import ScoreSettings
from .curvature_provider import CurvatureProvider
from .inputs import Inputs
from .meter import StageMeter
from .scorer import Scorer


@dataclass
class RunContext:
    """Everything a scoring method needs; gradient methods share ``curvature()``.

    The methods that take a direction (:attr:`score_direction`, :attr:`score_tasks`,
    :attr:`precondition`, :attr:`last_use`) are the parts' own bound methods, so that no
    frame of the context keeps a reference to a direction its part releases."""

    lm: LoadedModel
    modules: dict
    inputs: Inputs
    settings: ScoreSettings
    curvature_settings: CurvatureSettings
    out_dir: Path
    timings: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    streamed: dict | None = None  # under stream: what score_stream returned, and the file it wrote
    #: per-candidate numbers a method reports beside its score (name -> one value per pool
    #: record, in pool order), written as extra fields of ``scores.jsonl``; not under stream
    columns: dict = field(default_factory=dict)
    #: device, precision, CUDA graphs, process group, memory plan, kernels (resolved once;
    #: from ``settings`` and the model when not given)
    execution: ExecutionContext | None = None
    #: the target sets, ``[(task, [pair indices])]`` (:func:`prism_select.run.run_tasks`); empty: one set
    tasks: list = field(default_factory=list)
    #: the stage accounting (timings and memory peaks, :class:`~prism_select.run.meter.StageMeter`)
    meter: StageMeter = field(init=False, repr=False, compare=False)
    #: the run's curvature (:class:`~prism_select.run.curvature_provider.CurvatureProvider`)
    curvatures: CurvatureProvider = field(init=False, repr=False, compare=False)
    #: the pool's scoring (:class:`~prism_select.run.scorer.Scorer`)
    scorer: Scorer = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.execution is None:
            self.execution = resolve_execution(self.settings, self.lm.model, self.lm.device)
        self.meter = StageMeter(self.timings, self.info, self.lm.device)
        self.curvatures = CurvatureProvider(self)
        self.scorer = Scorer(self, self.curvatures)

    @property
    def task_names(self) -> list:
        """The named target sets' names, in order (empty for one unnamed set)."""
        return [t for t, _ in self.tasks if t is not None]

    @property
    def plan(self) -> MemoryPlan | None:
        """Where each stage keeps what (:mod:`prism_select.plan`)."""
        return self.execution.plan

    @property
    def pad_id(self) -> int:
        return self.lm.tokenizer.pad_token_id

    def scoring_batch(self) -> int:
        """The scoring batch: the memory plan's (it may have lowered the settings'). A
        method whose passes over the pool hold what a scoring step holds (one batch's
        activations and logits, V beside the weights; IF-Guide's token scores) uses it too."""
        plan = self.plan
        return plan.scoring["batch_size"] if plan is not None and plan.scoring else self.settings.batch_size

    def direction_batch(self) -> int:
        """The target pairs' batch: the memory plan's (it may have lowered the settings')."""
        plan = self.plan
        return plan.direction["batch_size"] if plan is not None and plan.direction else self.settings.batch_size

    def end_stage(self, stage: str, started: float) -> None:
        """A baseline's own stage is over (:meth:`StageMeter.end_stage`)."""
        self.meter.end_stage(stage, started)

    def stage_peak(self, stage: str) -> None:
        """A stage's memory peaks recorded (:meth:`StageMeter.stage_peak`)."""
        self.meter.stage_peak(stage)

    def curvature(self):
        """The run's one curvature object, fitted (or loaded from the cache) on first use
        (:meth:`CurvatureProvider.curvature`)."""
        return self.curvatures.curvature()

    @property
    def precondition(self):
        """``v = H^-1 direction`` (:meth:`CurvatureProvider.precondition`)."""
        return self.curvatures.precondition

    @property
    def last_use(self):
        """``H^-1 direction`` at the last use of both (:meth:`CurvatureProvider.last_use`)."""
        return self.curvatures.last_use

    @property
    def score_direction(self):
        """``g_z . H^-1 direction`` for every pool example, resumable (:meth:`Scorer.score_direction`)."""
        return self.scorer.score_direction

    @property
    def score_tasks(self):
        """The pool scored along each target set's direction in one pass (:meth:`Scorer.score_tasks`)."""
        return self.scorer.score_tasks
