"""What a run checks and decides before its long work: the inputs, options and cache
folder before the model loads (:func:`check_before_loading`), the curvature the run
applies (:func:`small_pool_rule`), the memory plan (:func:`plan_run`) and the disk a
transient plan's saved direction needs (:func:`check_disk_for_v`)."""

from __future__ import annotations

import logging
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import torch

from ..runtime import distributed, sharding
from ..curvature import CurvatureSettings
from ..curvature import support
from ..curvature.base import DEFAULT_DAMPING_FACTOR, DEFAULT_SHRINKAGE
from ..curvature.fit import fit_indices
from ..data import load_pool, load_targets
from ..data.readers import detect_format
from ..data.records import Loaded
from ..errors import ConfigError, OutOfResourceError, OutputError
from ..runtime.layers import layer_shape
from ..io import check_writable_dir
from ..model import LoadedModel, ModelSettings, check_adapter_dir
from ..plan import ExampleSize, MemoryPlan, PlanError, Shards, make_plan, measure_example_bytes
from ..runtime.memory import cap_device_memory, device_memory, held_elsewhere_note, host_share_bytes
from ..settings import ScoreSettings
from ..tasks import check_stems, name_tasks, target_paths, task_groups
from ..methods import registry as methods
from ..methods.prism import _check_task_method
from .curvature_provider import damping_rule_of
from .inputs import Inputs

log = logging.getLogger(__name__)

#: the small-pool rule (``--damping-rule auto``, the default): an EK-FAC fit on fewer
#: examples that no damping option shapes is not fitted, and the run ranks with identity
#: curvature (``v = g``). On the 60-record pools of seven families measured before the
#: rule was fixed (39 pools, embedded 135M model, CPU and H200;
#: benchmarks/results/small_pools_rule_cpu.md) EK-FAC at every damping of the ladder
#: 0.1-100 x the mean eigenvalue ranked more than 0.02 AUROC below identity on some pool
#: (up to 0.16, GSM8K mistakes); on the 300-record pools measured (four families, 11
#: pools) plain EK-FAC was never more than 0.012 below identity and up to 0.12 above it
SMALL_FIT_EXAMPLES = 300


def small_pool_rule(cs: CurvatureSettings, n_fit: int) -> tuple[CurvatureSettings, dict]:
    """The curvature a run applies, decided from its settings and the size of its fit
    sample alone (so every method of a ``compare`` applies the same one), and the
    record of that decision for ``run.json`` (``curvature_applied``): under the default
    ``--damping-rule auto`` an EK-FAC fit on fewer than :data:`SMALL_FIT_EXAMPLES`
    examples that none of ``--damping``, ``--damping-factor``, ``--damping-noise``,
    ``--shrinkage`` shapes becomes identity curvature (no fit); any other settings are
    applied as given."""
    plain = (cs.damping is None and cs.damping_factor == DEFAULT_DAMPING_FACTOR and not cs.damping_noise
             and cs.shrinkage == DEFAULT_SHRINKAGE)
    record = {"requested": cs.kind, "kind": cs.kind, "n_fit": n_fit,
              "rule": damping_rule_of(cs) if cs.kind != "identity" else "none"}
    if cs.damping_rule == "split-half" and n_fit < support.MIN_FIT_EXAMPLES:
        raise ConfigError("damping_rule", f"split-half fits EK-FAC on two halves of the fit sample and compares their "
                          f"rankings; the fit sample has {n_fit} example(s), fewer than {support.MIN_FIT_EXAMPLES}",
                          "leave out --damping-rule (auto ranks a small pool with identity curvature), or pass "
                          "--curvature identity")
    if cs.damping_rule == "auto" and cs.kind == "ekfac" and plain and n_fit < SMALL_FIT_EXAMPLES:
        record.update(kind="identity", rule="small-pool", identity_below=SMALL_FIT_EXAMPLES)
        return replace(cs, kind="identity"), record
    return cs, record


def describe_applied(applied: dict) -> str:
    """One line naming the curvature a run applied and why (the summary line, compare.md)."""
    kind, n = applied.get("kind"), applied.get("n_fit")
    if applied.get("rule") == "small-pool":
        return (f"identity (the small-pool rule: the fit sample has {n} examples, fewer than "
                f"{applied.get('identity_below')}; --damping-rule heuristic fits EK-FAC anyway)")
    damping = applied.get("damping") or {}
    if kind == "identity":
        return "identity" + (" (the split-half check: its halves agreed at no damping)"
                             if applied.get("rule") == "split-half" else "")
    how = f", damping factor {applied['damping_factor']:g}" if applied.get("damping_factor") is not None else ""
    if damping:
        how += f", damping {damping.get('min'):.3g}-{damping.get('max'):.3g}"
    return f"{kind} ({applied.get('rule')}{how}, fitted on {n} examples)"


def fit_size(inputs: Inputs, cs: CurvatureSettings) -> int:
    """The number of examples the curvature is fitted on."""
    pool = inputs.encoded if inputs.fit_encoded is None else inputs.fit_encoded
    return len(fit_indices(len(pool), cs))



def plan_run(lm: LoadedModel, modules: dict, inputs: Inputs, settings: ScoreSettings,
             curvature: CurvatureSettings, directions: int = 1) -> MemoryPlan:
    """The run's memory plan (:mod:`prism_select.plan`), from one measured example of the
    longest length among the pool, the fit sample and the target pairs; logged.
    ``directions``: the target sets scored together (each its own ``v``)."""
    examples = list(inputs.encoded) + list(inputs.fit_encoded or []) + list(inputs.chosen) + list(inputs.rejected)
    longest = max(examples, key=lambda e: len(e.input_ids)) if examples else None
    nbytes = 0
    cap_device_memory(lm.device, settings.max_gpu_memory)
    sharded = sharding.is_sharded(lm.model)
    fixed = None  # device bytes a step holds whatever its batch size: FSDP's gathered weights
    if longest is not None and lm.device.type == "cuda":
        nbytes = measure_example_bytes(lm.model, longest, lm.tokenizer.pad_token_id, lm.device)
        if sharded:  # two points: per example, and the weights FSDP gathers for every step
            two = measure_example_bytes(lm.model, longest, lm.tokenizer.pad_token_id, lm.device, copies=2)
            per = max(two - nbytes, 0)
            fixed = torch.cuda.memory_allocated(lm.device) + max(nbytes - per, 0)
            nbytes = per
    head = lm.model.get_output_embeddings() if hasattr(lm.model, "get_output_embeddings") else None
    vocab = head.out_features if isinstance(head, torch.nn.Linear) else len(lm.tokenizer)
    gpu_total = host = None
    elsewhere = 0
    if lm.device.type == "cuda":  # what other processes hold now is not the run's to plan with
        gpu_total, elsewhere = device_memory(lm.device)
    if distributed.active():
        # one plan on every rank: the ranks split the same fit batches and run the same
        # collectives, so each plans for the largest measurement and the smallest memory
        if lm.device.type == "cuda":
            mine = fixed if fixed is not None else torch.cuda.memory_allocated(lm.device)
            fixed = max(distributed.gather_values(mine))
            gpu_total = min(distributed.gather_values(gpu_total))
        nbytes = max(distributed.gather_values(nbytes))
        host = min(distributed.gather_values(host_share_bytes()))
    try:
        example = ExampleSize(nbytes, len(longest.input_ids) if longest is not None else 1, vocab)
        shards = Shards(distributed.world() if sharded else 1, settings.fsdp_sums, settings.fsdp_keep_gathered,
                        sum(p.numel() * p.element_size() for p in lm.model.parameters()) if sharded else None)
        plan = make_plan(lm.model, modules, kind=curvature.kind, device=lm.device, batch_size=settings.batch_size,
                         fit_batch_size=curvature.batch_size, example=example,
                         max_gpu_memory=settings.max_gpu_memory, weights=fixed, gpu_total=gpu_total,
                         host_available=host, shards=shards, directions=directions)
    except PlanError as e:
        note = held_elsewhere_note(lm.device, elsewhere)
        if not note:
            raise
        raise PlanError(str(e) + note) from None
    if distributed.is_main():
        log.info("%s", plan.describe())
        if settings.progress and (plan.bounded and (len(plan.fit_groups) > 1 or plan.notes)):
            print(plan.describe(), file=sys.stderr)
    return plan


#: free disk kept beside the saved ``v`` of a transient plan (score chunks, run.json, logs)
DISK_MARGIN_BYTES = 1 << 30


def check_disk_for_v(plan: MemoryPlan | None, modules: dict, dtype: torch.dtype, out_dir: Path,
                     shards: int = 1) -> None:
    """Before a transient plan's fit: its preconditioned direction ``v`` (the tracked
    weights' size in ``dtype``; this rank's ``1 / shards`` under FSDP) is saved in
    ``<out>/.partial`` group by group, and a run whose disk cannot hold it would stop only
    after the whole fit. Raises :class:`OutOfResourceError` (``disk``) in seconds instead;
    what earlier processes of this run saved there counts as written."""
    if plan is None or plan.curvature_store != "transient" or not plan.fit_groups:
        return
    size = torch.tensor([], dtype=dtype).element_size()
    need = sum(o * i for o, i in map(layer_shape, modules.values())) * size // max(shards, 1)
    partial = Path(out_dir) / ".partial"
    saved = sum(f.stat().st_size for f in partial.glob("*_v_group*.safetensors")) if partial.is_dir() else 0
    free = shutil.disk_usage(out_dir).free
    if free + saved < need + DISK_MARGIN_BYTES:
        raise OutOfResourceError(
            "disk", f"the fit saves the preconditioned direction ({need / 2**30:.1f} GiB) group by group in "
            f"{partial}, and {out_dir}'s filesystem has {free / 2**30:.1f} GiB free", "free disk space there "
            "(e.g. prism-select cache prune, if the cache shares that disk) or pass an --out on a larger disk",
            "nothing had started yet")


def check_before_loading(model: ModelSettings | LoadedModel, pool_path, targets_path,
                         settings: ScoreSettings) -> Loaded | None:
    """What can be checked without the model, so that a mistake fails in a second rather
    than after the model has loaded: the device and adapter directory, that the input
    files exist in a supported format, that the method has the target pairs it needs,
    and every record of the targets and (unless ``settings.stream``) of the pool.
    Returns the read pool (None under ``stream``, whose own pass reads it)."""
    method = methods.get(settings.method)
    if targets_path is None and method.needs_pairs:
        raise ConfigError("targets", f"method {settings.method!r} needs target pairs", "pass --targets FILE")
    methods.parse_options(settings.method, settings.method_options)  # unknown keys, wrong types
    for pattern in settings.modules or []:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError("modules", f"{pattern!r} is not a regular expression ({e})",
                              "pass e.g. --modules 'mlp' 'self_attn\\.(q|v)_proj'") from None
    if isinstance(model, ModelSettings):
        check_cache_dir(model.resolved_cache_dir())
        model.resolved_device()
        if model.adapter is not None:
            check_adapter_dir(Path(model.adapter).expanduser().resolve())
    detect_format(pool_path)
    paths = target_paths(targets_path)
    multi = methods.names(multi_task=True)
    if len(paths) > 1 and not method.multi_task and not settings.combine_tasks:
        raise ConfigError("targets", f"method {settings.method!r} scores one target set; several --targets files "
                          f"are scored by {', '.join(multi)}",
                          "pass one --targets file (its records' 'task' field groups the pairs), --combine-tasks "
                          f"(the files' pairs as one set, each pair's task its file's stem), or use --method "
                          f"{' / '.join(multi)}")
    check_stems(paths)
    pairs = []
    for path in paths:
        pairs += name_tasks(load_targets(path, skip_invalid=settings.skip_invalid).items, path, len(paths) > 1)
    _check_task_method(task_groups(pairs), settings)
    return None if settings.stream else load_pool(pool_path, skip_invalid=settings.skip_invalid)


def check_cache_dir(root: Path) -> None:
    """The cache (``--cache-dir``) is a folder this process can create and write in: the
    fitted curvature and converted models are saved there. Raises :class:`ConfigError`."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ConfigError("cache_dir", f"{root} is a file, not a folder",
                          "pass --cache-dir a folder (it is created if missing), or move the file away")
    try:
        check_writable_dir(root)
    except OutputError as e:
        raise ConfigError("cache_dir", f"{root} cannot be written: {e.__cause__.strerror or e.__cause__}"
                          if isinstance(e.__cause__, OSError) else str(e),
                          "pass --cache-dir a writable folder (or set PRISM_SELECT_CACHE)") from None

