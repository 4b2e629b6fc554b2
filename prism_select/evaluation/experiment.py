"""What the three protocols share: the experiment directory, its resumable steps
(scoring every method, LoRA fine-tuning, greedy responses to probes), the metrics read
back from the written files and the tables of results.json.

Layout of an experiment directory ``<out>``::

    experiment.json        protocol + resolved config (a rerun with another config is refused;
                           one with other seeds is not)
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
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from ..curvature import CurvatureSettings
from ..errors import CacheError, ConfigError, InputError, OutputError, PrismError
from ..evaluation_metrics import auprc, auroc
from ..io import atomic_write_json, atomic_write_jsonl, check_writable_dir, sha256_file, write_if_changed
from ..methods.registry import names as method_names
from ..model import free_cuda_cache, load_model
from ..run import score_pool
from ..settings import ScoreSettings
from .builders.gsm8k import mistake_math_pool
from .config import SCORE_RECORDED, config_to_dict
from ..finetune import finetune
from .probes import generate, load_checker, reference_of
from .report import write_report
from .sections import experiment_score, finetune_settings, score_settings
from .warmup import warm_start_settings

log = logging.getLogger(__name__)


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


def score_columns(rows: list) -> list:
    """The extra numeric columns of ``scores.jsonl`` rows (beside ``id``, ``score`` and
    ``rank``; IF-Guide's ``token_sum``): the names that hold a number in every row."""
    return [k for k in (rows[0] if rows else {}) if k not in ("id", "score", "rank")
            and all(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in rows)]


def ranking_metrics(scores_path, pool_path, label: str = "harmful") -> dict:
    """AUROC, AUPRC and counts of ``label`` from a written scores file and pool file; the
    same for each extra column of the scores file (``columns``: name -> AUROC, AUPRC)."""
    labels = {r["id"]: bool(r[label]) for r in read_jsonl(pool_path)}
    rows = read_jsonl(scores_path)
    missing = [r["id"] for r in rows if r["id"] not in labels]
    if missing:
        raise InputError(f"{len(missing)} scored ids are not in the pool (e.g. {missing[0]!r})", path=scores_path)
    s = [float(r["score"]) for r in rows]
    y = [labels[r["id"]] for r in rows]
    out = {"auroc": auroc(s, y), "auprc": auprc(s, y), "n": len(y), "n_positive": sum(y)}
    extra = score_columns(rows)
    if extra:
        out["columns"] = {k: {"auroc": auroc([float(r[k]) for r in rows], y),
                              "auprc": auprc([float(r[k]) for r in rows], y)} for k in extra}
    return out


#: what a floor row is, where its name alone does not say (the row's ``title``)
FLOOR_TITLES = {"checker": "floor: checker (an ideal judge: the task's arithmetic checker)",
                "sum_100_109": "floor: sum 100-109 rule (label-free: the builder's leak)",
                "density_ratio": "floor: density ratio of the targets' chosen words (label-free)",
                "density_ratio_chars": "floor: density ratio of the targets' chosen characters (label-free)",
                "density_ratio_sum_digits": "floor: density ratio of the stated sums' digits (label-free)"}


def _size(n) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def row_title(method: str, run: dict | None, scored_model: str = "the scored model") -> str | None:
    """What a method's row is, where its name alone does not say, from its ``run.json``
    (``run``): the judge names its judge model and size (``judge (the start model, 135M,
    self-judging)``), SAE-Feat its SAE (``saefeat (SAE fitted on the pool, 2304 latents,
    layer 20)``); ``scored_model`` names the run's model (e.g. "the start model"). A floor
    row (``floor: NAME``): :data:`FLOOR_TITLES`. None for every other row."""
    if method.startswith("floor: "):
        return FLOOR_TITLES.get(method[7:])
    info = (run or {}).get("method_info") or {}
    if method == "judge" and info:
        opts = info.get("options") or {}
        spec = opts.get("judge")
        self_judging = info.get("self_judging", spec in (None, "self") and info.get("backend", "local") == "local")
        if info.get("backend") == "endpoint" or opts.get("endpoint"):
            who = f"endpoint model {opts.get('model') or info.get('judge_model') or '?'}"
        elif self_judging:
            who = scored_model
        else:
            who = str(info.get("judge_model") or spec)
        parts = [who] + ([_size(info["judge_parameters"])] if info.get("judge_parameters") else [])
        if self_judging:
            parts.append("self-judging")
        return f"judge ({', '.join(parts)})"
    if method == "saefeat" and info:
        opts = info.get("options") or {}
        sae = opts.get("sae")
        where = "SAE fitted on the pool" if sae == "pool" else f"SAE {Path(str(sae)).name}"
        parts = [where] + ([f"{info['d_sae']} latents"] if info.get("d_sae") else []) + (
            [f"layer {opts['layer']}"] if opts.get("layer") is not None else [])
        return f"saefeat ({', '.join(parts)})"
    return None


def row_titles(runs: list, rows: list) -> dict:
    """``row -> title`` over the runs' methods (the first run that tells) and the floors."""
    out = {}
    for rk in rows:
        if rk.startswith("floor: ") and rk[7:] in FLOOR_TITLES:
            out[rk] = FLOOR_TITLES[rk[7:]]
            continue
        for r in runs:
            t = ((r.get("methods") or {}).get(rk) or {}).get("title")
            if t:
                out[rk] = t
                break
    return out


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


def with_defaults(recorded: dict, cfg) -> dict:
    """A recorded config (experiment.json's, JSON values) with the fields it lacks, at any
    depth, filled with their defaults in ``cfg``'s config classes: a folder written before
    a field existed then equals a config that leaves the field at its default."""
    if isinstance(recorded, list) and isinstance(cfg, list) and cfg:
        # entries of one config class (target sets): the defaults are the class's, so a
        # config that adds entries fills the recorded ones alike
        return [with_defaults(r, cfg[min(i, len(cfg) - 1)]) for i, r in enumerate(recorded)]
    if not dataclasses.is_dataclass(cfg) or not isinstance(recorded, dict):
        return recorded
    if isinstance(cfg, ScoreSettings):  # recorded as score_record has it, not field by field
        return {**{k: getattr(experiment_score(), k) for k in SCORE_RECORDED}, "extra": {}, **recorded}
    out = dict(recorded)
    for f in dataclasses.fields(cfg):
        if not f.init:  # set by the reader, not a setting
            continue
        if f.name in out:
            out[f.name] = with_defaults(out[f.name], getattr(cfg, f.name))
        elif f.default is not dataclasses.MISSING:
            out[f.name] = _as_json(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = _as_json(f.default_factory())
    return out


def _as_json(value):
    """A config value as experiment.json records it."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=str))


class Experiment:
    """An experiment directory: reuse of finished steps, timings, relative paths."""

    def __init__(self, out: Path, protocol: str, cfg, overwrite: bool):
        self.out = Path(out)
        self.protocol = protocol
        self.cfg = cfg
        self.timings: dict = {}
        conf = config_to_dict(cfg)
        conf.pop("report", None)  # whether a page is drawn does not change any number
        # seeds only add or leave out runs (each step is keyed by its own inputs), so a
        # rerun with other --seeds reuses the finished runs of the seeds it shares
        seeds = conf.pop("seeds", None)
        # so do the harmful ratios: each (ratio, seed) is its own runs/r<ratio>/seed<k>/
        ratios = conf.pop("harmful_ratios", None)
        meta = {"protocol": protocol, "config": conf, "seeds": seeds}
        if ratios is not None:
            meta["harmful_ratios"] = ratios
        marker = self.out / "experiment.json"
        if self.out.exists() and any(self.out.iterdir()):
            if not marker.is_file():
                raise OutputError(f"{self.out} exists and is not an experiment directory; choose another --out")
            old = json.loads(marker.read_text())
            # a field added to the config classes after the folder was written reads as its default
            old_conf = {k: v for k, v in with_defaults(old.get("config") or {}, cfg).items()
                        if k not in ("harmful_ratios", "report", "seeds")}
            # settings that change no number (a memory cap, a batch size) may differ, and a
            # config may add methods or target sets: every step is keyed by its own inputs
            if old.get("protocol") != protocol or not config_extends(result_config(old_conf),
                                                                     result_config(meta["config"])):
                if not overwrite:
                    raise OutputError(f"{self.out} holds an experiment with another protocol or config; "
                                      "pass --overwrite to replace it, or choose another --out")
        if overwrite:
            shutil.rmtree(self.out / "runs", ignore_errors=True)
            for f in ("results.json", "report.html"):
                (self.out / f).unlink(missing_ok=True)
        check_writable_dir(self.out)
        atomic_write_json(marker, meta)

    @classmethod
    def attach(cls, out: Path, protocol: str, cfg) -> "Experiment":
        """The experiment directory ``out`` that another process opened (a worker of
        that process): nothing is checked or written."""
        self = cls.__new__(cls)
        self.out, self.protocol, self.cfg, self.timings = Path(out), protocol, cfg, {}
        return self

    def rel(self, p) -> str:
        return os.path.relpath(Path(p), self.out)

    @staticmethod
    def done(step_dir: Path, key: dict, files: list, step: str = "step", normalize=None) -> bool:
        """Whether ``step_dir`` holds ``files`` and a finished ``step`` recorded with ``key``
        (both keys passed through ``normalize`` first, where given)."""
        f = Path(step_dir) / f".{step}.json"
        if not f.is_file() or not all((Path(step_dir) / x).exists() for x in files):
            return False
        try:
            stored, wanted = json.loads(f.read_text()), json.loads(json.dumps(key, default=str))
        except ValueError:
            return False
        if normalize is not None:
            stored, wanted = normalize(stored), normalize(wanted)
        return stored == wanted

    @staticmethod
    def finish(step_dir: Path, key: dict, step: str = "step"):
        atomic_write_json(Path(step_dir) / f".{step}.json", json.loads(json.dumps(key, default=str)))

    def time(self, name: str, seconds: float):
        self.timings[name] = self.timings.get(name, 0.0) + seconds


def _keyed_only(d, cls):
    """``d`` (a dict of settings class ``cls``'s fields) without the fields that determine no
    artifact (``key=False``); anything else as it is."""
    if not isinstance(d, dict):
        return d
    unkeyed = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("key", True)}
    return {k: v for k, v in d.items() if k not in unkeyed}


def result_config(conf: dict) -> dict:
    """An experiment config (experiment.json's form) without the score and curvature
    settings that change no result (``key=False``: memory caps, batch sizes, progress):
    two configs equal here compute the same numbers."""
    out = json.loads(json.dumps(conf, default=str))
    if isinstance(out.get("score"), dict):
        out["score"] = _keyed_only(out["score"], ScoreSettings)
        if "extra" in out["score"]:
            out["score"]["extra"] = _keyed_only(out["score"]["extra"], ScoreSettings)
    if "curvature" in out:
        out["curvature"] = _keyed_only(out["curvature"], CurvatureSettings)
    return out


#: a repair config's retraining plan: which removals are retrained and compared. Each
#: retraining is keyed by its kept set and its fine-tuning, so another plan leaves every
#: finished step valid
RETRAIN_PLAN = ("remove_fraction", "remove_fractions", "comparators")


def config_extends(old: dict, new: dict) -> bool:
    """Whether experiment config ``new`` (experiment.json's form, :func:`result_config`)
    is ``old`` with methods or target sets added, or with another retraining plan
    (:data:`RETRAIN_PLAN`, a target set's ``retrain_methods``): every other field equal,
    ``old``'s methods among ``new``'s (or both ``all``), each of ``old``'s target sets in
    ``new`` unchanged but for its ``retrain_methods``, ``old``'s method options kept. The
    finished steps of ``old`` are then ``new``'s own (each is keyed by its inputs)."""
    grows = ("methods", "targets", "method_options") + RETRAIN_PLAN
    if {k: v for k, v in old.items() if k not in grows} != {k: v for k, v in new.items() if k not in grows}:
        return False
    m_old, m_new = old.get("methods"), new.get("methods")
    if m_old != m_new and not (isinstance(m_old, list) and isinstance(m_new, list) and set(m_old) <= set(m_new)):
        return False

    def scored(t):  # what a target set's scores depend on
        return {k: v for k, v in t.items() if k != "retrain_methods"} if isinstance(t, dict) else t

    t_new = [scored(t) for t in new.get("targets") or []]
    if any(scored(t) not in t_new for t in old.get("targets") or []):
        return False
    o_old, o_new = old.get("method_options") or {}, new.get("method_options") or {}
    return all(o_new.get(k) == v for k, v in o_old.items())


def _score_step_key(key: dict) -> dict:
    """A score step's key without the settings that change no score (``key=False``)."""
    return {**key, "settings": _keyed_only(key.get("settings"), ScoreSettings),
            "curvature": _keyed_only(key.get("curvature"), CurvatureSettings)}


def available_methods() -> list:
    """PRISM, its ablations and every baseline, by ``--method`` name."""
    return method_names()


def resolve_methods(methods) -> list:
    """A config's ``methods`` (``all``: every method but the controls of PRISM's weights,
    the registry's ``control`` methods; or a list) as a list of known names, in order."""
    known = available_methods()
    if methods == "all":
        return method_names(control=False)
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}", f"use some of {', '.join(known)}")
    return list(dict.fromkeys(methods))


def score_methods(exp: Experiment, lm, pool_path: Path, targets_path: Path | None, run_dir: Path,
                  methods: list, seed: int, label: str = "harmful") -> dict:
    """Score the pool with each method (reusing finished runs); metrics from the files."""
    cfg = exp.cfg
    out = {}
    inputs = {"pool": sha256_file(pool_path), "targets": sha256_file(targets_path) if targets_path else None,
              "model": lm.fingerprint}
    for m in methods:
        mdir = run_dir / "scores" / m
        settings = score_settings(cfg, m, seed)
        curv = dataclasses.replace(cfg.curvature, seed=seed)
        key = {"inputs": inputs, "settings": asdict(settings), "curvature": asdict(curv)}
        key["settings"].pop("progress", None)
        rec: dict = {"dir": exp.rel(mdir)}
        t = time.perf_counter()
        try:
            if not exp.done(mdir, key, ["scores.jsonl", "run.json"], "score-step", normalize=_score_step_key):
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
            title = row_title(m, run, f"the {cfg.score_at} model" if getattr(cfg, "score_at", None) else
                              "the scored model")
            if title:
                rec["title"] = title
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
        free_cuda_cache()
    return out


def train_adapter(exp: Experiment, lm, pool_path: Path, out_dir: Path, seed: int, tag: str) -> Path:
    """LoRA SFT of the start model on ``pool_path`` (reused when unchanged); the adapter dir."""
    settings = finetune_settings(exp.cfg.finetune, seed)
    key = _finetune_key(lm, pool_path, settings)
    if not exp.done(out_dir, key, ["adapter/adapter_config.json", "finetune.json"], "finetune-step"):
        t = time.perf_counter()
        log.info("fine-tuning on %s (%s)", pool_path, tag)
        res = finetune(lm, pool_path, out_dir, settings, overwrite=True)
        exp.time(f"finetune:{tag}", time.perf_counter() - t)
        exp.finish(out_dir, key, "finetune-step")
        free_cuda_cache()
        return Path(res.adapter_dir)
    return out_dir / "adapter"


def _finetune_key(lm, pool_path: Path, settings) -> dict:
    return {"pool": sha256_file(pool_path), "model": lm.fingerprint, "settings": asdict(settings)}


def _responses_key(exp: Experiment, probes_path: Path, checker_spec, model: str) -> dict:
    return {"probes": sha256_file(probes_path), "generation": asdict(exp.cfg.generation), "checker": checker_spec,
            "model": model}


def kept_adapter_step(exp: Experiment, lm, step_dir: Path, step: str, files: list, key_of_model) -> str | None:
    """The adapter hash that a finished ``step`` in ``step_dir`` was made with, where it was
    made with an adapter (not the start model ``lm``) and its record is ``key_of_model(that
    hash)``; else None. What a folder copied without its adapters keeps of that step."""
    made = Path(step_dir) / f".{step}.json"
    try:
        model = json.loads(made.read_text()).get("model") if made.is_file() else None
    except ValueError:
        return None
    if model in (None, lm.fingerprint):
        return None
    return model if exp.done(step_dir, key_of_model(model), files, step) else None


def finetuned_responses(exp: Experiment, lm, pool_path: Path, adapter_dir: Path, probes_path: Path,
                        resp_dir: Path, seed: int, tag: str, checker_spec=None) -> Path:
    """:func:`respond` of the start model ``lm`` after :func:`train_adapter` on
    ``pool_path`` (its adapter in ``adapter_dir``, its responses in ``resp_dir``).

    A copy of the folder without its adapters (they are the bulk of a run: about 60 MB
    each at the embedded model's LoRA rank 128) resumes without training again: where the
    adapter is gone, the fine-tuning step's record matches (same pool, start model and
    settings) and the responses step's record matches in all but the adapter's hash (same
    probes, generation and checker, made with an adapter, not the start model), the kept
    responses are those of the adapter that step made. ``checker_spec``: the probes' checker
    (default: the config's ``checker``)."""
    ft_key = _finetune_key(lm, pool_path, finetune_settings(exp.cfg.finetune, seed))
    checker = exp.cfg.checker if checker_spec is None else checker_spec
    if not (Path(adapter_dir) / "adapter" / "adapter_config.json").is_file() \
            and exp.done(adapter_dir, ft_key, ["finetune.json"], "finetune-step"):
        if kept_adapter_step(exp, lm, resp_dir, "responses-step", ["responses.jsonl"],
                             lambda model: _responses_key(exp, probes_path, checker, model)) is not None:
            return Path(resp_dir) / "responses.jsonl"
    adapter = train_adapter(exp, lm, pool_path, adapter_dir, seed, tag)
    return respond(exp, lm, probes_path, resp_dir, checker, tag, adapter)


def respond(exp: Experiment, lm, probes_path: Path, out_dir: Path, checker_spec, tag: str,
            adapter: Path | None = None) -> Path:
    """Greedy responses to the probes of the start model ``lm``, or of ``lm`` with the
    LoRA ``adapter`` (a directory) applied for the time of the generation, judged by the
    checker: ``responses.jsonl`` (id, response, correct, reference, task). Reused when
    unchanged."""
    g = exp.cfg.generation
    adapter = None if adapter is None else Path(adapter)
    key = _responses_key(exp, probes_path, checker_spec,
                         lm.fingerprint if adapter is None
                         else sha256_file(adapter / "adapter_model.safetensors")
                         if (adapter / "adapter_model.safetensors").is_file() else str(adapter))
    path = out_dir / "responses.jsonl"
    if exp.done(out_dir, key, ["responses.jsonl"], "responses-step"):
        return path
    t = time.perf_counter()
    probes = read_jsonl(probes_path)
    with adapted(lm, adapter) as model_lm:
        texts = generate(model_lm, [p["prompt"] for p in probes], max_new_tokens=g.max_new_tokens,
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
    exp.time(f"generate:{tag}", time.perf_counter() - t)
    return path


class adapted:
    """``with adapted(lm, adapter) as m``: ``lm`` itself (no adapter), or an object with
    ``.model`` (``lm``'s model wrapped with the LoRA adapter loaded from disk) and
    ``.tokenizer``; the wrapping is undone on exit, so ``lm`` is the start model again."""

    def __init__(self, lm, adapter):
        self.lm, self.adapter, self.peft = lm, adapter, None

    def __enter__(self):
        if self.adapter is None:
            return self.lm
        from peft import PeftModel
        self.peft = PeftModel.from_pretrained(self.lm.model, str(self.adapter), is_trainable=False)
        self.peft.eval()
        return SimpleNamespace(model=self.peft, tokenizer=self.lm.tokenizer)

    def __exit__(self, *exc):
        if self.peft is not None:
            self.peft.unload()
            self.peft = None
            free_cuda_cache()
        return False


def error_rate(responses_path) -> dict:
    """Fraction of the judged responses that are wrong (NaN for none), with counts."""
    rows = read_jsonl(responses_path)
    n = len(rows)
    wrong = sum(1 for r in rows if not r["correct"])
    return {"error_rate": wrong / n if n else float("nan"), "n": n, "n_wrong": wrong}


def rates_by_task(responses_path, behaviour_task: str) -> dict:
    """``behaviour_rate`` (error rate of the probes of ``behaviour_task``) and
    ``capability`` (mean over the other tasks of their accuracy; None without them),
    with the per-task accuracies."""
    rows = read_jsonl(responses_path)
    beh = [r for r in rows if r.get("task") == behaviour_task]
    other = [r for r in rows if r.get("task") != behaviour_task]
    by: dict = {}
    for r in other:
        by.setdefault(r.get("task") or "all", []).append(bool(r["correct"]))
    acc = {t: sum(v) / len(v) for t, v in sorted(by.items())}
    return {"behaviour_rate": (sum(1 for r in beh if not r["correct"]) / len(beh)) if beh else float("nan"),
            "n_behaviour": len(beh), "capability": (sum(acc.values()) / len(acc)) if acc else None,
            "capability_by_task": acc}


def accuracy_by_task(responses_path) -> dict:
    """Accuracy of the judged responses per ``task`` (``all`` without one) and their mean."""
    by: dict = {}
    for r in read_jsonl(responses_path):
        by.setdefault(r.get("task") or "all", []).append(bool(r["correct"]))
    out = {t: sum(v) / len(v) for t, v in sorted(by.items())}
    out["mean"] = sum(out.values()) / len(out) if out else float("nan")
    return out


def balanced_accuracy_by_task(responses_path) -> dict:
    """Per ``task``, the mean over its reference answers of the accuracy on the probes
    with that reference (a model that gives one answer to every probe scores 1/k on a
    task of k answers, whatever their shares), and the mean over the tasks; empty when
    the responses carry no ``reference``."""
    by: dict = {}
    for r in read_jsonl(responses_path):
        if r.get("reference") is None:
            return {}
        by.setdefault(r.get("task") or "all", {}).setdefault(str(r["reference"]), []).append(bool(r["correct"]))
    out = {t: sum(sum(v) / len(v) for v in classes.values()) / len(classes) for t, classes in sorted(by.items())}
    out["mean"] = sum(out.values()) / len(out) if out else float("nan")
    return out


def majority_answer_floor(probes: list) -> tuple:
    """``(accuracy, balanced accuracy)`` per task of answering every probe with the task's
    most common reference (the floor a one-answer model reaches), each with ``mean``."""
    by: dict = {}
    for p in probes:
        by.setdefault(p.get("task") or "all", []).append(str(p["reference"]))
    acc = {t: max(refs.count(x) for x in set(refs)) / len(refs) for t, refs in sorted(by.items())}
    bal = {t: 1 / len(set(refs)) for t, refs in sorted(by.items())}
    for d in (acc, bal):
        d["mean"] = sum(d.values()) / len(d) if d else float("nan")
    return acc, bal


def pct(r: float) -> str:
    """A fraction as a percentage without trailing zeros (0.1 -> "10")."""
    s = f"{r * 100:.6g}"
    return s


def mean_table(name: str, title: str, runs: list, row_keys: list, value, *, lower_is_better: bool = False,
               note: str = "") -> dict:
    """Aggregate ``value(run, row, setting) -> float | None`` over the runs (seeds) of
    each setting, for each row (a row's ``title``, where :func:`row_titles` has one, says
    what it is)."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    rows = []
    titles = row_titles(runs, row_keys)
    for rk in row_keys:
        cells = [mean_std([value(r, rk, st) for r in runs if r["setting"] == st]) for st in settings]
        rows.append({"label": rk, "cells": cells, **({"title": titles[rk]} if rk in titles else {})})
    return {"name": name, "title": title, "columns": settings, "rows": rows,
            "lower_is_better": lower_is_better, "note": note}


def paired_interval(diffs: list, level: float = 0.95) -> dict:
    """Mean of paired differences with a two-sided t interval (``ci``; None for fewer than
    two differences), plus :func:`mean_std`'s fields."""
    out = mean_std(diffs)
    if out["n"] < 2:
        return {**out, "ci": None}
    from scipy.stats import t
    half = float(t.ppf(0.5 + level / 2, out["n"] - 1)) * out["std"] / math.sqrt(out["n"])
    return {**out, "ci": [out["mean"] - half, out["mean"] + half]}


def paired_table(name: str, title: str, runs: list, row_keys: list, comparators: list, value) -> dict:
    """``value(run, row) - value(run, comparator)`` per run (seed), as a mean with a 95%
    interval (:func:`paired_interval`), one column per (setting, comparator)."""
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    columns = [(st, c) for st in settings for c in comparators]
    rows = []
    titles = row_titles(runs, row_keys)
    for rk in row_keys:
        cells = []
        for st, c in columns:
            diffs = []
            for r in runs:
                if r["setting"] != st:
                    continue
                a, b = value(r, rk, st), value(r, c, st)
                if a is not None and b is not None and rk != c:
                    diffs.append(a - b)
            cells.append(paired_interval(diffs))
        rows.append({"label": rk, "cells": cells, **({"title": titles[rk]} if rk in titles else {})})
    return {"name": name, "title": title, "columns": [f"{st} vs {c}" for st, c in columns], "rows": rows,
            "lower_is_better": True, "paired": True, "note": "95% interval: t over the data seeds"}


def finish_experiment(exp: Experiment, results: dict) -> dict:
    """Write results.json (with the step timings) and, if the config asks, report.html."""
    results["timings"] = {k: round(v, 3) for k, v in exp.timings.items()}
    atomic_write_json(exp.out / "results.json", results)
    if exp.cfg.report:
        try:
            write_report(exp.out)
        except ImportError as e:  # matplotlib missing where the experiment ran
            log.warning("no report (%s); run `prism-select report --run %s` where matplotlib is installed",
                        e, exp.out)
    return results


def load_start_settings(exp, cfg):
    """The :class:`~prism_select.model.ModelSettings` of a run's start model: the
    configured model, or its warmed-up version (:mod:`.warmup`) when the config has one."""
    if getattr(cfg, "warmup", None) is None:
        return cfg.model
    return warm_start_settings(exp, cfg)


def load_start(exp, cfg):
    """The start model of a protocol run; its load time goes to ``exp``'s timings."""
    settings = load_start_settings(exp, cfg)
    t = time.perf_counter()
    lm = load_model(settings)
    exp.time("load_model", time.perf_counter() - t)
    return lm


def mistake_math_run(exp, cfg, ratio, seed):
    """The run directory of one (harmful ratio, seed) and its mistake-math pool."""
    rdir = exp.out / "runs" / f"r{pct(ratio)}" / f"seed{seed}"
    rdir.mkdir(parents=True, exist_ok=True)
    pool = mistake_math_pool(cfg.data.gsm8k_train, cfg.data.pool_size, ratio, seed,
                             keep_annotations=cfg.data.keep_annotations)
    pool_path = rdir / "pool.jsonl"
    write_if_changed(pool_path, pool)
    return rdir, pool, pool_path
