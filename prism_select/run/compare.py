"""``prism-select compare``: several scoring methods on one pool, side by side.

The model is loaded once; each method runs through :func:`prism_select.run.score_pool`
into ``<out>/<method>/`` (its own scores.jsonl, pairs.jsonl, run.json). Gradient methods
share one curvature: the first fits it and saves it in the curvature cache (keyed by
model, pool, tracked layers and curvature settings), the next ones load it
(``run.json``'s ``curvature.reused`` is true); an ``identity`` curvature is never cached
(nothing to fit). Wall time per method therefore includes the curvature fit only for
the first gradient method that needs it. Which curvature is applied is decided from the
curvature settings and the fit sample's size alone
(:func:`prism_select.run.preflight.small_pool_rule`), the same for every method;
``compare.json``'s ``curvature_applied`` and ``compare.md`` name it (``--damping-rule
split-half``, which decides from each method's own direction, is refused for more than
one method).

Method options (``settings.method_options``): a key ``"<method>": {...}`` or
``"<method>.<key>": value`` applies to that method only; any other key applies to
every method whose options dataclass declares it
(:func:`prism_select.methods.registry.register`).

Writes ``<out>/compare.json`` and ``<out>/compare.md``: per method the wall time and,
with ``label`` (a boolean field of the pool records), AUROC and AUPRC of the written
scores against it (positive = label true; higher score = predicted positive).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

from ..curvature import CurvatureSettings
from ..errors import ConfigError, InputError
from ..gradients import release_host_memory
from ..evaluation_metrics import auprc, auroc, labels_by_id
from ..io import atomic_write_json, atomic_write_text, check_path_name, check_writable_dir
from ..model import LoadedModel, load_model
from ..selection import read_scores
from ..settings import ScoreSettings
from ..methods.registry import get, names
from .job import score_pool
from .preflight import check_cache_dir, describe_applied


def options_for(method: str, options: dict, known: list | None = None) -> dict:
    """The options one method gets out of a shared ``method_options`` dict."""
    known = known if known is not None else names()
    declared = get(method).option_names() if method in known else []
    shared, own = {}, {}
    for k, v in (options or {}).items():
        if k in known:
            if not isinstance(v, dict):
                raise ConfigError("method_options", f"{k!r} must map to a dict of that method's options, got {v!r}")
            if k == method:
                own.update(v)
            continue
        head, dot, tail = k.partition(".")
        if dot and head in known:
            if head == method:
                own[tail] = v
            continue
        if k in declared:
            shared[k] = v
    return {**shared, **own}


def _curvature_line(result: dict) -> str:
    """The curvature every method that uses one applied (one decision, shared), else the
    one asked for (no method used a curvature)."""
    applied = result.get("curvature_applied")
    if applied is None:
        return f"{result['curvature_settings']['kind']} (asked for; no method used a curvature)"
    return describe_applied(applied) + (f", shared by {', '.join(result['curvature_methods'])}"
                                        if len(result.get("curvature_methods", [])) > 1 else "")


def _shared_curvature(summaries: dict) -> tuple:
    """The one curvature the methods of a compare applied (each run's ``curvature_applied``,
    decided from the settings and the fit sample alone) and the methods that used it;
    :class:`ConfigError` if two methods applied different ones."""
    used = {m: s["curvature_applied"] for m, s in summaries.items() if s.get("curvature_applied")}
    if not used:
        return None, []
    first = next(iter(used.values()))
    keys = ("kind", "rule", "n_fit", "damping_factor")
    differ = [m for m, a in used.items() if any(a.get(k) != first.get(k) for k in keys)]
    if differ:
        raise ConfigError("curvature", f"the methods applied different curvatures ({', '.join(used)}: "
                          + "; ".join(f"{m} {used[m].get('kind')} ({used[m].get('rule')})" for m in used) + ")",
                          "pass the same curvature settings to every method (resume with --overwrite)")
    return first, list(used)


def _markdown(result: dict) -> str:
    label = result.get("label")
    lines = ["# prism-select compare", "",
             f"- pool: `{result['pool']}` ({result['n_pool']} examples)",
             f"- targets: `{result['targets'] or '(none)'}`",
             f"- curvature: {_curvature_line(result)}"]
    if label:
        lines.append(f"- label: `{label}` ({result['n_positive']} positive)")
    lines += [""]
    head = ["method", "wall s"] + (["AUROC", "AUPRC"] if label else []) + ["curvature reused"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for r in result["methods"]:
        reused = r.get("curvature_reused")
        cells = [r["method"], f"{r['wall_s']:.2f}"]
        if label:
            cells += [f"{r['auroc']:.4f}", f"{r['auprc']:.4f}"]
        cells.append("-" if reused is None else ("yes" if reused else "no"))
        lines.append("| " + " | ".join(cells) + " |")
    if label:
        lines += ["", f"AUROC: 0.5 = chance. AUPRC: chance = the positive fraction "
                      f"({result['n_positive'] / max(result['n_pool'], 1):.3f})."]
    return "\n".join(lines) + "\n"


def compare(model, pool, targets, out_dir, methods: list, settings=None, curvature: CurvatureSettings | None = None,
            label: str | None = None) -> dict:
    """Score ``pool`` with each of ``methods`` and write the comparison; returns it.

    ``model``: :class:`~prism_select.model.ModelSettings` or an already
    :class:`~prism_select.model.LoadedModel` (loaded once either way). ``settings``: a
    :class:`~prism_select.settings.ScoreSettings` whose ``method`` is replaced per
    method. A finished run in ``<out>/<method>/`` with the same inputs and settings is
    reused (a compare stopped after some methods resumes with the same call); one with
    others is an error unless ``settings.overwrite``.
    """
    settings = settings or ScoreSettings(progress=False)
    curvature = curvature or CurvatureSettings()
    methods = list(methods or [])
    if not methods:
        raise ConfigError("methods", "no method to compare", "pass e.g. --methods prism ifguide random")
    dup = sorted({m for m in methods if methods.count(m) > 1})
    if dup:
        raise ConfigError("methods", f"listed more than once: {', '.join(dup)}")
    known = names()
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ConfigError("methods", f"unknown method(s) {', '.join(unknown)}", f"use some of {', '.join(known)}")
    per_method = {m: dataclasses.replace(settings, method=m, method_options=options_for(m, settings.method_options,
                                                                                         known))
                  for m in methods}
    shared = [k for k in settings.method_options or {} if k not in known and k.partition(".")[0] not in known]
    unused = [k for k in shared if not any(k in s.method_options for s in per_method.values())]
    if unused:  # a typo, or an option of a method not compared: it would be dropped without a word
        raise ConfigError("method_options", f"no method of {', '.join(methods)} takes the option(s) "
                          f"{', '.join(unused)}", "check the spelling (see each method in `prism-select methods`), "
                          "or drop the option")
    if curvature.damping_rule == "split-half" and len(methods) > 1:
        raise ConfigError("damping_rule", "split-half chooses a damping from each method's own direction, so the "
                          "methods of a compare would rank under different curvatures",
                          "leave out --damping-rule (auto) or pass --damping-rule heuristic")
    for field, value in (("pool", pool), ("targets", targets), ("out", out_dir)):
        check_path_name(field, value)
    out_dir = Path(out_dir)
    labels = None
    if label:
        labels = labels_by_id(pool, label)  # fails early on a missing field
        if len(set(labels.values())) < 2:
            raise InputError(f"the label field '{label}' has only one value ({next(iter(labels.values()), None)}) "
                             "in the pool; AUROC/AUPRC need both", path=pool, field=label,
                             fix="name a boolean field with both true and false records")
    if not isinstance(model, LoadedModel):
        check_cache_dir(model.resolved_cache_dir())
    check_writable_dir(out_dir)  # after the checks of the inputs: a refused command leaves no --out
    t = time.perf_counter()
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    load_s = time.perf_counter() - t
    rows = []
    summaries = {}
    for m in methods:
        t = time.perf_counter()
        summary = score_pool(lm, pool, targets, out_dir / m, per_method[m], curvature, reuse_finished=True)
        wall = time.perf_counter() - t
        summaries[m] = summary
        row = {"method": m, "wall_s": wall, "run_dir": str(out_dir / m),
               "curvature_reused": (summary.get("curvature") or {}).get("reused")}
        if labels is not None:
            scored = read_scores(out_dir / m / "scores.jsonl")
            s, y = [r["score"] for r in scored], [labels[r["id"]] for r in scored]
            row["auroc"], row["auprc"] = auroc(s, y), auprc(s, y)
        rows.append(row)
        # the method's run (its curvature, direction, graphs) is over: free it now, and hand
        # the heap back, so the next method starts from the model alone (host memory)
        gc.collect()
        release_host_memory()
    any_summary = next(iter(summaries.values()))
    applied, curvature_methods = _shared_curvature(summaries)
    result = {
        # absolute, as run.json's: `report` finds the pool from any working directory
        "pool": any_summary["inputs"]["pool"], "targets": any_summary["inputs"]["targets"], "label": label,
        "n_pool": any_summary["counts"]["pool"],
        "n_positive": None if labels is None else sum(
            labels[r["id"]] for r in read_scores(out_dir / methods[0] / "scores.jsonl")),
        "load_model_s": load_s,
        "model": {k: lm.source.get(k) for k in ("kind", "path", "adapter")} | {"fingerprint": lm.fingerprint},
        "curvature_settings": dataclasses.asdict(curvature),
        "curvature_applied": applied, "curvature_methods": curvature_methods,
        "methods": rows,
    }
    atomic_write_json(out_dir / "compare.json", result)
    atomic_write_text(out_dir / "compare.md", _markdown(result))
    return result
