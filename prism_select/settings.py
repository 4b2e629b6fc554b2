"""Settings of a scoring run, one validated dataclass per stage.

Stage                    Class                         Determines
model                    :class:`~prism_select.model.ModelSettings`   the loaded model
direction                :class:`DirectionSettings`     the target direction (method, its options, seed)
fit                      :class:`~prism_select.curvature.FitSettings`  the fitted curvature factors
preconditioning          :class:`~prism_select.curvature.PreconditionSettings`  damping and shrinkage of H
scoring                  :class:`ScoringSettings`       what is scored and how (length, layers, batch)
run                      :class:`RunSettings`           chunks, resume, streaming, progress, cache bound
execution                :class:`ExecutionSettings`     precision, CUDA graphs, sharding, memory cap

Each stage checks its own fields once, in ``__post_init__``, raising
:class:`~prism_select.errors.ConfigError` (field, problem, fix). :class:`ScoreSettings`
(direction + scoring + run + execution) and
:class:`~prism_select.curvature.CurvatureSettings` (fit + preconditioning) are the flat
forms that callers and the CLI pass: one object holding every field of its stages
(they inherit them), which also checks what involves two stages. :func:`part` gives one
stage's own object.

A field's metadata (:func:`setting`) is the one source of its CLI option (flag, help,
choices, group; :func:`prism_select.cli.add_settings`) and says whether the field
belongs in the key of the artifact its stage produces (:func:`key_of`): a setting that
does not change the artifact (a batch size, a progress bar, a memory cap) is not in its
key, so changing it reuses the cache or resumes the run.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any

from .errors import ConfigError
from .methods import registry as methods

GiB = 1 << 30

# ----------------------------------------------------------------------------- choices
# The values a field accepts, and their checks, stand here at the ground floor: the
# modules that act on them (preference, precision, graphs, sharding, scoring, data)
# import them from here, so the settings import nothing they configure. The methods and
# their facts are the registry's (:mod:`prism_select.methods.registry`, which imports
# nothing of the package but the errors).

#: arithmetic of a half-precision model while scoring (:mod:`prism_select.runtime.precision`)
PRECISIONS = ("model", "residual32", "split32")
#: CUDA graphs (:mod:`prism_select.runtime.graphs`)
GRAPH_MODES = ("auto", "on", "off")
#: multi-GPU sharding of the model (:mod:`prism_select.runtime.sharding`)
SHARDS = ("none", "fsdp")
#: when a sharded K-FAC / EK-FAC fit's statistics reach the layers' owners
#: (``--fsdp-sums``; ``sums`` of :class:`prism_select.curvature.fit.FitLayout`):
#: every step, once per pass, or as the memory plan finds room (auto)
FSDP_SUMS = ("auto", "step", "pass")
#: whether each decoder block keeps its gathered weights from its forward to its backward
#: (``--fsdp-keep-gathered``, :func:`prism_select.runtime.sharding.weights_gathered`): as the memory
#: plan finds room, or always / never
KEEP_GATHERED = ("auto", "on", "off")
#: tokens per example; a longer prompt is cut from the left (:mod:`prism_select.data.tokenize`)
DEFAULT_MAX_LENGTH = 2048
#: examples per resumable chunk, at most (``--chunk-size``; :mod:`prism_select.scoring`)
DEFAULT_CHUNK_SIZE = 1024
DEFAULT_BATCH_SIZE = 8
DEFAULT_STREAM_WINDOW = 65_536
# Under ``stream`` the curvature is fitted on a seeded sample of this many valid pool
# records when ``FitSettings.fit_examples`` is not set (a fit costs about three
# forward+backward passes over its examples; 10K is minutes on one GPU at 1B parameters).
STREAM_FIT_EXAMPLES = 10_000


def check_precision(value: str) -> None:
    """ConfigError naming ``precision`` unless ``value`` is one of :data:`PRECISIONS`."""
    if value not in PRECISIONS:
        raise ConfigError("precision", f"unknown value {value!r}", f"use one of {', '.join(PRECISIONS)}")


def check_graph_mode(mode: str) -> None:
    """ConfigError naming ``cuda_graphs`` unless ``mode`` is one of :data:`GRAPH_MODES`."""
    if mode not in GRAPH_MODES:
        raise ConfigError("cuda_graphs", f"unknown value {mode!r}", f"use one of {', '.join(GRAPH_MODES)}")


def check_shard(shard: str, method: str) -> None:
    """Refuse a sharded run the code cannot do, naming the field and the fix."""
    if shard not in SHARDS:
        raise ConfigError("shard", f"unknown value {shard!r}", f"use one of {', '.join(SHARDS)}")
    if shard == "none":
        return
    if not methods.get(method).sharded:
        raise ConfigError("shard", f"method {method!r} does not run under --shard fsdp",
                          f"use one of {', '.join(methods.names(sharded=True))}, or leave --shard out")


def setting(default=MISSING, *, help: str, default_factory=MISSING, flag: str | None = None,
            choices=None, metavar: str | None = None, parse=None, group: str | None = None,
            key: bool = True, cli: bool = True):
    """A settings field with what the CLI and the artifact keys need to know of it.

    help: the option's help text (the CLI shows the default after it).
    flag: the option's name (default ``--`` + the field name with ``-`` for ``_``); a
        bool field defaulting to True becomes ``--no-<name>`` unless ``flag`` is given.
    choices: the values the CLI accepts. metavar: the value's name in the help.
    parse: turns the option's text into the field's value where the annotation's type
        does not (applied after parsing, so its ConfigError is reported like any other).
    group: the help section the option appears in (default: its stage's).
    key: whether the field determines its stage's artifact (:func:`key_of`).
    cli: False leaves the field off the command line (library and configs only).
    """
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "parse": parse,
            "group": group, "key": key, "cli": cli}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


_FIELD_PREFIX = re.compile(r"^setting '[^']*': ")


def message_of(error: ConfigError) -> str:
    """``error``'s text without the field it names: the problem and the fix."""
    return _FIELD_PREFIX.sub("", str(error))


def within(error: ConfigError, path: str) -> ConfigError:
    """``error`` naming its field under ``path`` (``score`` + ``batch_size`` ->
    ``score.batch_size``), its message and fix kept."""
    return ConfigError(f"{path}.{error.field}" if path else error.field, message_of(error))


def convert(value, tp, name: str):
    """A config value (YAML or JSON) as type ``tp``, a field's annotation: ``bool``,
    ``int`` (a whole float is taken), ``float``, ``str``, ``list``, ``dict``, a union
    (``None`` where it allows it; else the first type that takes the value) or ``Any``;
    a :class:`ConfigError` names ``name``. Other types pass the value through."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(value, a, name)
            except ConfigError as e:
                errors.append(e)
        raise errors[0] if errors else ConfigError(name, f"invalid value {value!r}")
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


def from_mapping(cls, data, path: str, *, exclude=(), **defaults):
    """Settings dataclass ``cls`` from a config section ``data`` (a mapping of field
    names to YAML or JSON values) found at ``path`` (``score``, ``curvature``).

    Each value is read through its field's :func:`setting` metadata, as the CLI reads an
    option: ``parse`` on a text value, then the annotation's type (:func:`convert`),
    then ``choices``; the dataclass checks the rest itself (``__post_init__``). Fields in
    ``exclude`` may not be given; ``defaults`` replace the class's own. Every error is a
    :class:`ConfigError` naming ``path.field``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in exclude}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}", "unknown setting",
                          f"known settings here: {', '.join(sorted(fields))}")
    hints = typing.get_type_hints(cls)
    kwargs = dict(defaults)
    for name, value in data.items():
        meta, where = fields[name].metadata, f"{path}.{name}"
        try:
            if meta.get("parse") is not None and isinstance(value, str):
                value = meta["parse"](value)
        except ConfigError as e:
            raise ConfigError(where, message_of(e)) from None
        value = convert(value, hints[name], where)
        choices = meta.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(where, f"unknown value {value!r}", f"use one of {', '.join(map(str, choices))}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise within(e, path) from None


def key_of(obj, cls=None) -> dict:
    """The fields of stage ``cls`` (default: ``obj``'s class) that determine its artifact,
    with ``obj``'s values: what a cache or run key holds of these settings."""
    cls = cls or type(obj)
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(cls) if f.metadata.get("key", True)}


def part(obj, cls):
    """Stage ``cls``'s own object with ``obj``'s values of its fields (``obj`` holds them all,
    e.g. a :class:`ScoreSettings` for :class:`RunSettings`)."""
    return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})


def _plain(value):
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _finite(value, field: str, *, low: float, inclusive: bool = True, fix: str | None = None):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value < float("inf") and (
        value >= low if inclusive else value > low)
    if not ok:
        raise ConfigError(field, f"must be a finite number {'>=' if inclusive else '>'} {low}, got {value!r}", fix)


#: the largest seed: every generator a run seeds takes 0 ... MAX_SEED (numpy's legacy
#: ``np.random.seed``, which ``transformers.set_seed`` calls for a fine-tune, takes no more;
#: ``torch.Generator.manual_seed`` takes up to 2**64 - 1)
MAX_SEED = 2**32 - 1


def check_seed(value, field: str = "seed") -> None:
    """A :class:`ConfigError` unless ``value`` is a whole number in ``[0, MAX_SEED]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise ConfigError(field, f"must be a whole number from 0 to {MAX_SEED} (2**32 - 1), got {value!r}",
                          "pass a seed such as 0, 1 or 12345: the random generators take no other")


def _int(value, field: str, *, low: int, fix: str | None = None):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(field, f"must be >= {low}, got {value!r}", fix)


@dataclass
class DirectionSettings:
    """The target direction: which method scores the pool, with which options and seed."""

    method: str = setting("prism", help="prism, equal, unpaired, the controls prism_shuffled and equal_top_half, "
                          "or a baseline (see `prism-select methods`)")
    method_options: dict = setting(default_factory=dict, cli=False,
                                   help="the method's options (the CLI's --option KEY=VALUE), parsed into its "
                                        "options dataclass (prism_select.methods.parse_options) before the model "
                                        "loads; recorded in run.json")
    seed: int = setting(0, help="seeds every random choice of the run")
    # not a key field: the run key names the target sets themselves (``tasks``), which
    # this decides, so runs and caches made before it stay valid
    combine_tasks: bool = setting(False, key=False, help="one direction from every target pair, whatever its task (default: "
                                  "each task of the targets, a file's stem or its records' 'task', its own "
                                  "direction and score column, all in one pass)")

    def __post_init__(self):
        methods.get(self.method)  # a ConfigError naming the known methods
        if not isinstance(self.method_options, dict):
            raise ConfigError("method_options", f"must be a mapping, got {self.method_options!r}")
        check_seed(self.seed)


@dataclass
class ScoringSettings:
    """What is scored and how: example length, tracked layers and batch size.

    scores_from_fit: see :meth:`prism_select.run.scorer.Scorer.score_direction` (the demo sets it).
    """

    max_length: int = setting(DEFAULT_MAX_LENGTH, help="tokens per example; a longer prompt is cut from the left")
    batch_size: int = setting(DEFAULT_BATCH_SIZE, key=False, help="examples per forward/backward")
    modules: list | None = setting(None, metavar="REGEX",
                                   help="track only linear layers whose name matches one of these regexes "
                                        "(if not given: every linear layer of the decoder blocks; with --adapter, "
                                        "its LoRA matrices)")
    # not a key field: it changes scores at float rounding only, and a run resumed after its
    # fit scores with the model whatever it says
    scores_from_fit: bool = setting(False, key=False,
                                    help="on the CPU, when the EK-FAC fit covers the whole pool with the empirical "
                                         "Fisher: the exact scores formed by the fit from its spilled layer inputs and "
                                         "gradients, without a scoring pass over the model (the same scores to float "
                                         "rounding; "
                                         "a run resumed after its fit scores with the model, so not bit for bit)")

    def __post_init__(self):
        if not isinstance(self.scores_from_fit, bool):
            raise ConfigError("scores_from_fit", f"must be true or false, got {self.scores_from_fit!r}")
        _int(self.max_length, "max_length", low=2)
        _int(self.batch_size, "batch_size", low=1)
        if self.modules is not None and (not isinstance(self.modules, (list, tuple))
                                         or not all(isinstance(m, str) for m in self.modules)):
            raise ConfigError("modules", f"must be a list of regular expressions, got {self.modules!r}",
                              "pass e.g. --modules 'mlp' 'self_attn\\.(q|v)_proj'")


@dataclass
class RunSettings:
    """The run's bookkeeping: resumable chunks, streaming, skipped records, progress, cache bound."""

    chunk_size: int = setting(DEFAULT_CHUNK_SIZE, help="examples per resumable chunk, at most (on the CPU a chunk "
                              "also ends after about a minute's work, so an interrupted run keeps it)")
    skip_invalid: bool = setting(False, help="skip malformed records (listed in run.json)")
    overwrite: bool = setting(False, key=False, help="replace an existing run in --out")
    progress: bool = setting(True, key=False, help="no progress bars and no stage lines on the console (-v still logs the stages)")
    stream: bool = setting(False, group="streaming (pools too large to load)",
                           help="read and score the pool a window at a time (host memory flat in pool size; "
                                f"prism, equal, unpaired only); the curvature is fitted on a seeded sample of "
                                f"--fit-examples valid records ({STREAM_FIT_EXAMPLES} if not given)")
    stream_window: int = setting(DEFAULT_STREAM_WINDOW, metavar="N", group="streaming (pools too large to load)",
                                 help="records read and tokenised at a time under --stream")
    cache_max_gb: float | None = setting(None, key=False, metavar="GB",
                                         help="bound on the cache directory (least recently used entries are "
                                              "evicted; a larger artifact is used from memory, not cached); "
                                              "if not given: the free disk space")

    def __post_init__(self):
        _int(self.chunk_size, "chunk_size", low=1)
        _int(self.stream_window, "stream_window", low=1)
        for name in ("skip_invalid", "overwrite", "progress", "stream"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.cache_max_gb is not None:
            _finite(self.cache_max_gb, "cache_max_gb", low=0, fix="pass e.g. --cache-max-gb 50, or leave it out")

    @property
    def cache_max_bytes(self) -> int | None:
        return None if self.cache_max_gb is None else int(self.cache_max_gb * (1 << 30))


def format_size(b: float) -> str:
    """A byte count in binary units (``"512 B"``, ``"11.0 GiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1024
    return f"{b:.1f} TiB"


def parse_bytes(text, what: str = "max_gpu_memory") -> int | None:
    """``"70GiB"``, ``"70GB"``, ``"70G"`` or a plain number of GiB -> bytes (None -> None)."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        value = float(text) * GiB
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g|mib|mb|m)?\s*", str(text).lower())
        if not m:
            raise ConfigError(what, f"cannot read {text!r} as a memory size", "write e.g. 70GiB, 70GB or 70")
        unit = m.group(2) or "gib"
        scale = {"gib": GiB, "g": GiB, "gb": 10 ** 9, "mib": 1 << 20, "m": 1 << 20, "mb": 10 ** 6}[unit]
        value = float(m.group(1)) * scale
    if not value > 0:
        raise ConfigError(what, f"must be > 0, got {text!r}")
    return int(value)


@dataclass
class ExecutionSettings:
    """How the arithmetic runs; none of these but ``precision`` changes the scores (beyond
    the rounding of half-precision kernels, which ``deterministic`` fixes).

    precision (half-precision models): model (as loaded); residual32 carries the residual
    stream (token embeddings, residual additions, norms) in float32 while matmuls and
    attention stay in the model's dtype; split32 computes every activation in float32, the
    linear layers as two half-precision GEMMs on a hi/lo split of their input, and the
    target direction and the curvature fit run in the same arithmetic
    (:mod:`prism_select.runtime.precision`). cuda_graphs: :mod:`prism_select.runtime.graphs`. shard:
    :mod:`prism_select.runtime.sharding`; fsdp_sums: ``sums`` of
    :class:`prism_select.curvature.fit.FitLayout`, chosen by the memory plan under auto;
    fsdp_keep_gathered: :func:`prism_select.runtime.sharding.weights_gathered`, likewise.
    deterministic: :func:`prism_select.runtime.execution.make_deterministic`.
    max_gpu_memory: bytes (a text such as ``"70GiB"`` is read as a size), the cap of the
    memory plan (:mod:`prism_select.plan`).
    """

    precision: str = setting("model", choices=PRECISIONS,
                             help="arithmetic of a bf16/fp16 model while scoring: model (as loaded); residual32 "
                                  "(residual stream in float32, matmuls unchanged); split32 (float32 activations, "
                                  "each linear layer as two half-precision GEMMs on a hi/lo split: float32-accurate "
                                  "scores on tensor cores; the target direction and the curvature fit run in the "
                                  "same arithmetic)")
    cuda_graphs: str = setting("auto", choices=GRAPH_MODES,
                               help="capture each padded batch shape once and replay it (auto: on for CUDA devices "
                                    "and models below 1B parameters)")
    shard: str = setting("none", choices=SHARDS,
                         help="under torchrun: none (every rank holds the whole model and scores a share of the "
                              "pool) or fsdp (the model, the target direction and v sharded over the ranks with "
                              "FSDP2, for models that do not fit one GPU; prism/equal/unpaired, exact scoring)")
    fsdp_sums: str = setting("auto", key=False, choices=FSDP_SUMS,
                             help="under --shard fsdp with K-FAC/EK-FAC, when each rank's statistics of a layer "
                                  "reach the rank that owns it: step (every step: a rank holds only its share of "
                                  "the fit's sums), pass (each rank sums every layer of a fit group through a "
                                  "pass, sent once at its end: far fewer transfers, a whole group's sums on every "
                                  "rank), auto (pass where the memory plan finds room for it, else step)")
    fsdp_keep_gathered: str = setting("auto", key=False, choices=KEEP_GATHERED,
                                      help="under --shard fsdp, each decoder block keeps the weights it gathers "
                                           "for its forward until its backward (one all-gather per step instead "
                                           "of two, a whole model on every rank at the end of each forward): "
                                           "auto (where the memory plan finds room for it), on, off")
    deterministic: bool = setting(False, help="deterministic kernels (torch.use_deterministic_algorithms, cuBLAS's "
                                               "fixed workspace): the same run on the same kind of GPU and software "
                                               "gives the same scores bit for bit; kernels that add in varying "
                                               "order (attention's backward) run slower ones")
    max_gpu_memory: int | None = setting(None, key=False, metavar="SIZE", parse=parse_bytes,
                                         help="cap on the GPU memory the run plans to use, e.g. 70GiB (if not "
                                              "given: the device's); the memory plan groups the curvature fit and "
                                              "lowers batch sizes to fit it")

    def __post_init__(self):
        check_precision(self.precision)
        check_graph_mode(self.cuda_graphs)
        for name, allowed in (("shard", SHARDS), ("fsdp_sums", FSDP_SUMS), ("fsdp_keep_gathered", KEEP_GATHERED)):
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(name, f"unknown value {value!r}", f"use one of {', '.join(allowed)}")
        if isinstance(self.max_gpu_memory, str):
            self.max_gpu_memory = parse_bytes(self.max_gpu_memory)
        if self.max_gpu_memory is not None and (isinstance(self.max_gpu_memory, bool) or not (
                isinstance(self.max_gpu_memory, (int, float)) and self.max_gpu_memory > 0)):
            raise ConfigError("max_gpu_memory", f"must be > 0 bytes, got {self.max_gpu_memory}",
                              "pass e.g. --max-gpu-memory 70GiB, or leave it out")
        if self.max_gpu_memory is not None:
            self.max_gpu_memory = int(self.max_gpu_memory)


#: the stages a ScoreSettings holds, in the order of its fields
SCORE_STAGES = ("DirectionSettings", "ScoringSettings", "RunSettings", "ExecutionSettings")


@dataclass
class ScoreSettings(ExecutionSettings, RunSettings, ScoringSettings, DirectionSettings):
    """How to score a pool: the fields of :class:`DirectionSettings`,
    :class:`ScoringSettings`, :class:`RunSettings` and :class:`ExecutionSettings` in one
    object (``part(settings, RunSettings)`` gives one stage). Each stage checks its own
    fields; this checks the combinations: sharding and streaming by method, sharding
    with precision."""

    def __post_init__(self):
        for stage in (DirectionSettings, ScoringSettings, RunSettings, ExecutionSettings):
            stage.__post_init__(self)
        check_shard(self.shard, self.method)
        if self.shard == "fsdp" and self.precision != "model":
            raise ConfigError("precision", f"--precision {self.precision} does not run under --shard fsdp",
                              "leave --precision out (model), or leave --shard out")
        if self.stream and not methods.get(self.method).streams:
            streamed = methods.names(kind="direction")
            raise ConfigError("stream", f"method {self.method!r} needs the whole pool in memory; streaming "
                              f"scores only {', '.join(streamed)}",
                              f"drop --stream, or use --method {' / '.join(streamed)}")

    def run_key(self) -> dict:
        """The settings that determine a run's scores and its resumable ``.partial`` state
        (direction, scoring, run and execution fields marked as key fields)."""
        return key_of(self)
