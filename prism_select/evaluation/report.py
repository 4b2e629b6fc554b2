"""One self-contained HTML page for an experiment directory or a single score run.

``write_report(path)``: ``path`` is an experiment directory (``results.json``, from
:mod:`.protocols`), a ``prism-select compare`` directory (``compare.json``) or a score run
directory (``scores.jsonl`` + ``run.json``, from ``prism-select score``). The page
``<path>/report.html`` holds

* the result tables (methods x settings, mean ± std over seeds, the best value of a
  column in bold) and a per-run summary (pool size, harmful count, pairs, ``pi`` range,
  method errors);
* ROC curves per method, the distribution of ``pi`` over the target pairs (from
  ``pairs.jsonl``, split by the pair ``kind`` when the targets name one), score
  histograms split by label, for the first seed of each setting;
* the top and bottom 10 pool examples of each method (prompt and response excerpts).

Every image is a PNG inlined as a base64 data URI (no file is written beside the page),
and the page links no external file, script or font, so it can be mailed or archived
alone. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from pathlib import Path

from ..data import load_pool
from ..data.readers import iter_records, record_id
from ..errors import InputError, OutputError
from ..evaluation_metrics import auprc, auroc, roc_points
from ..io import atomic_write_text, sha256_file
from ..selection import read_run, read_scores
from ..selection_rules import explain_text, read_decisions

CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em;line-height:1.4}
h1{font-size:1.6em}h2{font-size:1.3em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:2em}
h3{font-size:1.1em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.92em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right;vertical-align:top}
th{background:#f3f3f3}td.l,th.l{text-align:left}
td.best{font-weight:bold;background:#eef7ee}
.note{color:#666;font-size:.9em}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}
.ex td{text-align:left;font-size:.85em;max-width:520px;white-space:pre-wrap;word-break:break-word}
.err{color:#a00}
details{margin:.4em 0}summary{cursor:pointer}
code{background:#f6f6f6;padding:0 .2em}
"""

N_EXAMPLES = 10
EXCERPT = 400


def _esc(x) -> str:
    """``x`` as page text: every value from a run's files goes into the page through this
    (the files travel between people, so any of their strings may hold markup)."""
    return html.escape(str(x), quote=True)


def _fmt(v, digits=3) -> str:
    """A number with ``digits`` decimals, "—" for none or NaN, and any other value as
    escaped text (a file edited by hand may hold a string where a number belongs)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.{digits}f}"
    return _esc(v)


def _cell(c: dict) -> str:
    """A table cell's text, escaped."""
    if not c or c.get("mean") is None:
        return "—"
    s = _fmt(c["mean"])
    if c.get("ci"):  # a paired difference: its 95% interval
        return s + f" [{_fmt(c['ci'][0])}, {_fmt(c['ci'][1])}]"
    if c.get("std") is not None:
        s += f" ± {_fmt(c['std'])}"
    return s


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", str(text)).strip("-").lower() or "x"


def _excerpt(text, n=EXCERPT) -> str:
    if isinstance(text, list) and all(isinstance(m, dict) and "role" in m for m in text):  # chat messages
        text = "\n".join(f"{m['role']}: {m.get('content', '')}" for m in text)
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False)
    return text if len(text) <= n else text[:n] + " …"


def _get(obj, key: str, sub: str):
    """``obj[key][sub]``, or None where either level is missing or not an object."""
    inner = obj.get(key) if isinstance(obj, dict) else None
    return inner.get(sub) if isinstance(inner, dict) else None


def _read_jsonl(path) -> list:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- plots

def _read_json_object(path: Path) -> dict:
    """The JSON object in ``path`` (run.json, compare.json), or an :class:`InputError`
    naming the file: unreadable, truncated or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise InputError(f"cannot read {path.name} ({e})", path=path,
                         fix="pass a directory written by prism-select; if the run was cut short, run it again") from e
    if not isinstance(value, dict):
        raise InputError(f"expected a JSON object, got {type(value).__name__ if value is not None else 'null'}",
                         path=path, fix="pass a directory written by prism-select; if the file was edited, "
                                        "run the command that wrote it again")
    return value


class _Plots:
    """Figures inlined in the page as data URIs."""

    def __init__(self):
        import matplotlib
        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        self.plt = plt
        self.names: list = []

    def img(self, fig, name: str, alt: str) -> str:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        self.plt.close(fig)
        data = buf.getvalue()
        fname = f"report-{_slug(name)}.png"
        k = 2
        while fname in self.names:
            fname = f"report-{_slug(name)}-{k}.png"
            k += 1
        self.names.append(fname)
        b64 = base64.b64encode(data).decode("ascii")
        return f'<img src="data:image/png;base64,{b64}" alt="{_esc(alt)}" title="{_esc(fname)}">'

    def roc(self, curves: dict, title: str, name: str) -> str:
        fig, ax = self.plt.subplots(figsize=(5.2, 4.6))
        for m, (s, y) in curves.items():
            fpr, tpr = roc_points(s, y)
            ax.plot(fpr, tpr, label=f"{m} ({auroc(s, y):.3f})", lw=1.4)
        ax.plot([0, 1], [0, 1], ls="--", c="#999", lw=1)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="lower right")
        return self.img(fig, name, f"ROC curves: {title}")

    def pi_hist(self, groups: dict, title: str, name: str) -> str:
        fig, ax = self.plt.subplots(figsize=(5.2, 3.4))
        bins = [i / 40 for i in range(41)]
        for k, xs in groups.items():
            ax.hist(xs, bins=bins, alpha=0.6, label=f"{k} (n={len(xs)}, {min(xs):.2f}-{max(xs):.2f})")
        ax.set_xlim(0, 1)
        ax.set_xlabel("pi = sigmoid(margin)")
        ax.set_ylabel("target pairs")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        return self.img(fig, name, f"pi distribution: {title}")

    def score_hists(self, per_method: dict, title: str, name: str) -> str:
        n = len(per_method)
        cols = min(4, n)
        rows = math.ceil(n / cols)
        fig, axes = self.plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
        for ax in axes.flat[n:]:
            ax.axis("off")
        for ax, (m, (s, y)) in zip(axes.flat, per_method.items()):
            if y is None:
                ax.hist(s, bins=30, color="#4477aa")
            else:
                pos = [a for a, b in zip(s, y) if b]
                neg = [a for a, b in zip(s, y) if not b]
                lo, hi = min(s), max(s)
                if hi <= lo:
                    hi = lo + 1e-12
                bins = [lo + (hi - lo) * i / 30 for i in range(31)]
                ax.hist(neg, bins=bins, alpha=0.6, color="#4477aa", label=f"not harmful ({len(neg)})", density=True)
                ax.hist(pos, bins=bins, alpha=0.6, color="#cc4444", label=f"harmful ({len(pos)})", density=True)
                ax.legend(fontsize=6)
            ax.set_title(m, fontsize=9)
            ax.tick_params(labelsize=6)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        return self.img(fig, name, f"score histograms: {title}")


# --------------------------------------------------------------------------- pieces

def _table_html(t: dict) -> str:
    cols = t["columns"]
    best = {}
    for j in range(len(cols)):
        vals = [(r["cells"][j] or {}).get("mean") for r in t["rows"]]
        vals = [v for v in vals if v is not None]
        if vals and max(vals) - min(vals) > 1e-12:  # no "best" when every row ties
            best[j] = min(vals) if t.get("lower_is_better") else max(vals)
    out = [f'<h3>{_esc(t["title"])}</h3>', f'<table class="results" id="table-{_esc(t["name"])}">',
           "<tr><th class=l>method</th>" + "".join(f"<th>{_esc(c)}</th>" for c in cols) + "</tr>"]
    for r in t["rows"]:
        tds = []
        for j, c in enumerate(r["cells"]):
            is_best = c and c.get("mean") is not None and j in best and abs(c["mean"] - best[j]) < 1e-12
            n = f' title="n={_esc(c.get("n", 0))}"' if c else ""
            tds.append(f'<td{" class=best" if is_best else ""}{n}>{_cell(c)}</td>')
        out.append(f"<tr><td class=l>{_esc(r.get('title') or r['label'])}</td>{''.join(tds)}</tr>")
    out.append("</table>")
    if t.get("note"):
        out.append(f'<p class="note">{_esc(t["note"])}</p>')
    return "\n".join(out)


def _pool_index(pool_path: Path) -> dict:
    """id -> (prompt, response, raw record) of a pool file in any supported format."""
    items = {e.id: e for e in load_pool(pool_path, skip_invalid=True).items}
    raw = {}
    for row, rec in iter_records(pool_path, on_invalid=lambda e: None):
        try:
            raw[record_id(rec, row)] = rec
        except InputError:
            continue
    return {i: (e.prompt, e.response, raw.get(i, {})) for i, e in items.items()}


def _examples_html(scores: list, pool: dict, label: str | None) -> str:
    ranked = sorted(scores, key=lambda r: r["rank"])
    parts = []
    for title, rows in (("top", ranked[:N_EXAMPLES]), ("bottom", ranked[-N_EXAMPLES:][::-1])):
        body = []
        for r in rows:
            prompt, response, raw = pool.get(r["id"], ("?", "?", {}))
            lab = ""
            if label:
                lab = f"<td>{_esc(raw.get(label, ''))}</td>"
            score = f"{float(r['score']):.4g}"
            body.append(f"<tr><td>{_esc(r['rank'])}</td><td>{_esc(r['id'])}</td><td>{_esc(score)}</td>"
                        f"{lab}<td>{_esc(_excerpt(prompt))}</td><td>{_esc(_excerpt(response))}</td></tr>")
        head = "<tr><th>rank</th><th>id</th><th>score</th>" + (f"<th>{_esc(label)}</th>" if label else "") + \
               "<th class=l>prompt</th><th class=l>response</th></tr>"
        parts.append(f"<h4>{title} {len(rows)}</h4><table class=ex>{head}{''.join(body)}</table>")
    return "\n".join(parts)


def _labels(pool: dict, label: str | None) -> dict | None:
    if not label:
        return None
    if not all(label in raw for _, _, raw in pool.values()):
        return None
    return {i: bool(raw[label]) for i, (_, _, raw) in pool.items()}


def _run_figures(plots: _Plots, base: Path, run: dict, title: str, key: str) -> str:
    """ROC, score histograms and top/bottom examples of one run."""
    pool_path = base / run["pool"]
    if not pool_path.exists():
        return f'<p class="err">pool file {_esc(run["pool"])} is missing</p>'
    pool = _pool_index(pool_path)
    label = run.get("label")
    labels = _labels(pool, label)
    curves, hists, examples = {}, {}, []
    for m, rec in run.get("methods", {}).items():
        if rec.get("status") != "ok":
            continue
        sp = base / rec["dir"] / "scores.jsonl"
        if not sp.is_file():
            continue
        rows = read_scores(sp)
        s = [float(r["score"]) for r in rows]
        if labels is not None:
            y = [labels[r["id"]] for r in rows]
            curves[m] = (s, y)
            hists[m] = (s, y)
        else:
            hists[m] = (s, None)
        examples.append((m, rows))
    out = []
    if curves and any(any(y) for _, y in curves.values()) and any(not all(y) for _, y in curves.values()):
        out.append(plots.roc(curves, title, f"roc-{key}"))
    if hists:
        out.append(plots.score_hists(hists, f"scores: {title}", f"scores-{key}"))
    for i, (m, rows) in enumerate(examples):
        out.append(f"<details{' open' if i == 0 else ''}><summary>top and bottom {N_EXAMPLES} by "
                   f"<b>{_esc(m)}</b> ({_esc(title)})</summary>{_examples_html(rows, pool, label if labels else None)}"
                   "</details>")
    return "\n".join(out)


def _pi_groups(base: Path, runs: list) -> dict:
    groups: dict = {}
    for run in runs:
        rec = (run.get("methods") or {}).get("prism") or next(
            (r for r in (run.get("methods") or {}).values() if r.get("status") == "ok"
             and (base / r["dir"] / "pairs.jsonl").is_file()), None)
        if not rec or rec.get("status") != "ok":
            continue
        pp = base / rec["dir"] / "pairs.jsonl"
        if not pp.is_file():
            continue
        kinds = {}
        if run.get("targets") and (base / run["targets"]).is_file():
            kinds = {t.get("id"): t.get("kind") for t in _read_jsonl(base / run["targets"])}
        for r in _read_jsonl(pp):
            if "pi" in r:
                groups.setdefault(kinds.get(r["id"]) or "pairs", []).append(float(r["pi"]))
    return groups


def _runs_table(runs: list) -> str:
    head = ["setting", "seed", "pool", "harmful", "pairs", "pi min", "pi max", "notes"]
    rows = []
    for r in runs:
        pi = (r.get("pi") or {}).get("all") or {}
        notes = []
        for m, rec in (r.get("methods") or {}).items():
            if rec.get("status") == "error":
                notes.append(f"{m}: {str(rec.get('error', ''))[:300]}")
        if r.get("note"):
            notes.append(r["note"])
        if r.get("n_worsened") is not None:
            notes.append(f"worsened probes {r['n_worsened']}, improved {r.get('n_improved')}")
        rows.append([_esc(r.get("setting")), _esc(r.get("seed")), _esc(r.get("n_pool", "")),
                     _esc(r.get("n_harmful", "")), _esc(r.get("n_pairs", "")), _fmt(pi.get("min")),
                     _fmt(pi.get("max")), _esc("; ".join(map(str, notes)))])
    out = ["<table class=runs><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for row in rows:  # each cell escaped above
        out.append("<tr>" + "".join(f"<td{' class=l' if i in (0, 7) else ''}>{v}</td>"
                                     for i, v in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _page(title: str, body: list) -> str:
    return ("<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
            f"<title>{_esc(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


# --------------------------------------------------------------------------- reports

def _experiment_report(base: Path, plots: _Plots) -> str:
    res = _read_json_object(base / "results.json")
    cfg = res.get("config", {})
    proto = res.get("protocol", "?")
    model = cfg.get("model", {})
    body = [f"<h1>prism-select: {_esc(proto)} experiment</h1>",
            f"<p>model <code>{_esc(model.get('model'))}</code> "
            f"(dtype {_esc(model.get('dtype'))}), seeds {_esc(res.get('seeds'))}, "
            f"curvature <code>{_esc((cfg.get('curvature') or {}).get('kind'))}</code>, "
            f"methods {_esc(', '.join(res.get('methods', [])))}.</p>",
            "<p class=note>Cells: mean ± sample standard deviation over seeds (no ± with one seed); "
            "hover a cell for the number of seeds. Every value is computed from the files of this run.</p>",
            "<h2>Results</h2>"]
    for t in res.get("tables", []):
        body.append(_table_html(t))
    runs = res.get("runs", [])
    body.append("<h2>Runs</h2>")
    body.append(_runs_table(runs))
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    for st in settings:
        st_runs = [r for r in runs if r["setting"] == st]
        first = st_runs[0]
        key = _slug(st)
        body.append(f"<h2>{_esc(st)}</h2>")
        groups = _pi_groups(base, st_runs)
        if groups:
            body.append(plots.pi_hist(groups, f"pi over target pairs, {st} ({len(st_runs)} seed(s))", f"pi-{key}"))
        if first.get("pool"):
            body.append(_run_figures(plots, base, first, f"{st}, seed {first.get('seed')}", key))
    if res.get("timings"):
        body.append("<h2>Timings (s)</h2><table>" + "".join(
            f"<tr><td class=l>{_esc(k)}</td><td>{_fmt(v, 1)}</td></tr>" for k, v in sorted(res["timings"].items()))
            + "</table>")
    return _page(f"prism-select {proto}", body)


def _pool_with_labels(pool_path: Path, label: str | None, body: list, named_in: str, scored: str | None = None):
    """``(pool index, label, labels)`` of a run's pool (``label`` defaults to ``harmful``
    when every record has it), or None after an error line in ``body`` when the pool file
    named in ``named_in`` is not readable here. ``scored``: the sha256 of the pool file
    that was scored; a pool file with other bytes (another pool at a relative path, or
    changed labels) is an :class:`InputError`: its labels are not the scored records'."""
    if not pool_path.is_file():
        body.append(f'<p class="err">the pool file {_esc(pool_path)} named in {named_in} is not readable here</p>')
        return None
    if scored is not None and sha256_file(pool_path) != scored:
        raise InputError(f"is not the pool file that was scored: its bytes differ from {named_in}'s "
                         "fingerprints.pool_file (another file at that path, or records or labels changed since)",
                         path=pool_path, fix="restore the scored pool file at that path, or score this pool again")
    pool = _pool_index(pool_path)
    if label is None and pool and all("harmful" in raw for _, _, raw in pool.values()):
        label = "harmful"
    return pool, label, _labels(pool, label)


def _applied_kind(run: dict):
    """The curvature a run (or a compare) applied; the one asked for where the record
    predates ``curvature_applied``."""
    return ((run.get("curvature_applied") or {}).get("kind")
            or (run.get("curvature_settings") or {}).get("kind"))


def _score_run_report(base: Path, plots: _Plots, label: str | None) -> str:
    run = read_run(base, finished=False)  # an unfinished run's scores are shown as they are
    rows = read_scores(base / "scores.jsonl")
    pool_path = Path(_get(run, "inputs", "pool") or "")
    targets = _get(run, "inputs", "targets") or None
    body = [f"<h1>prism-select score run: {_esc(run.get('method'))}</h1>",
            f"<p>{_esc(_get(run, 'counts', 'pool'))} pool examples, {_esc(_get(run, 'counts', 'pairs'))} target "
            f"pairs, {_esc(_get(run, 'counts', 'invalid') or 0)} skipped; "
            f"model <code>{_esc(_get(run, 'model', 'model'))}</code>; "
            f"curvature <code>{_esc(_applied_kind(run))}</code>; "
            f"{_fmt(_get(run, 'timings', 'total_s') or 0, 1)} s.</p>"]
    got = _pool_with_labels(pool_path, label, body, "run.json", _get(run, "fingerprints", "pool_file"))
    if got is None:
        return _page("prism-select score run", body)
    pool, label, labels = got
    s = [float(r["score"]) for r in rows]
    if labels is not None:
        y = [labels[r["id"]] for r in rows]
        body.append("<h2>Ranking</h2><table class=results id=table-ranking><tr><th class=l>method</th><th>AUROC</th>"
                    f"<th>AUPRC</th><th>positives</th></tr><tr><td class=l>{_esc(run.get('method'))}</td>"
                    f"<td>{_fmt(auroc(s, y))}</td><td>{_fmt(auprc(s, y))}</td><td>{sum(y)} / {len(y)}</td></tr></table>")
        if 0 < sum(y) < len(y):
            body.append(plots.roc({run.get("method", "method"): (s, y)}, f"label '{label}'", "roc"))
    else:
        y = None
    pp = base / "pairs.jsonl"
    if pp.is_file():
        kinds = {}
        if isinstance(targets, str) and Path(targets).is_file() and Path(targets).suffix == ".jsonl":
            kinds = {t.get("id"): t.get("kind") for t in _read_jsonl(targets)}
        groups: dict = {}
        for r in _read_jsonl(pp):
            if "pi" in r:
                groups.setdefault(kinds.get(r["id"]) or "pairs", []).append(float(r["pi"]))
        if groups:
            body.append("<h2>Target pairs</h2>")
            body.append(plots.pi_hist(groups, "pi over target pairs", "pi"))
    body.append("<h2>Scores</h2>")
    body.append(plots.score_hists({run.get("method", "method"): (s, y)}, "score distribution", "scores"))
    body.append(_examples_html(rows, pool, label if labels else None))
    body.append(_selection_html(base))
    return _page("prism-select score run", body)


def _compare_methods(res: dict, path: Path) -> list:
    """compare.json's ``methods``: a list of objects, each naming its run's folder beside
    compare.json by a plain ``method`` name; anything else is an :class:`InputError`."""
    rows = res.get("methods", [])
    fix = "pass a directory written by prism-select compare; if compare.json was edited, run compare again"
    if not isinstance(rows, list):
        raise InputError(f"expected a list, got {type(rows).__name__}", path=path, field="methods", fix=fix)
    for i, r in enumerate(rows):
        name = r.get("method") if isinstance(r, dict) else None
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name.strip(".") == "":
            raise InputError(f"methods[{i}] names no method folder (got {name!r})", path=path,
                             field="methods", fix=fix)
    return rows


def _selection_html(base: Path) -> str:
    """The latest ``select`` of this run (its decisions, as ``prism-select explain`` prints
    them), where one is found beside the run or in the working directory."""
    try:
        decisions = read_decisions(base)
    except (InputError, OSError, ValueError):
        return ""
    return ("<h2>Selection</h2><p>the latest <code>prism-select select</code> of this run "
            "(<code>prism-select explain</code>):</p><pre>" + _esc(explain_text(decisions)) + "</pre>")


def _compare_report(base: Path, plots: _Plots, label: str | None) -> str:
    """A ``prism-select compare`` directory: each method's run side by side (the ranking
    table, ROC curves, score histograms and top/bottom examples from its scores.jsonl)."""
    res = _read_json_object(base / "compare.json")
    rows = _compare_methods(res, base / "compare.json")
    pool_path = Path(res.get("pool", ""))
    body = [f"<h1>prism-select compare: {_esc(', '.join(r['method'] for r in rows))}</h1>",
            f"<p>{_esc(res.get('n_pool'))} pool examples; model <code>{_esc(_get(res, 'model', 'path'))}</code>; "
            f"curvature <code>{_esc(_applied_kind(res))}</code>.</p>"]
    runs = [base / r["method"] / "run.json" for r in rows if (base / r["method"] / "run.json").is_file()]
    scored = (_read_json_object(runs[0]).get("fingerprints") or {}).get("pool_file") if runs else None
    got = _pool_with_labels(pool_path, label or res.get("label"), body, "compare.json", scored)
    if got is None:
        return _page("prism-select compare", body)
    _, label, labels = got
    table = ["<h2>Methods</h2><table class=results id=table-compare><tr><th class=l>method</th><th>wall s</th>"
             + (f"<th>AUROC ({_esc(label)})</th><th>AUPRC</th>" if labels else "") + "</tr>"]
    for r in rows:
        cells = f"<td>{_fmt(r.get('wall_s'), 1)}</td>"
        sp = base / r["method"] / "scores.jsonl"
        if labels and sp.is_file():
            scored = read_scores(sp)
            s, y = [float(x["score"]) for x in scored], [labels[x["id"]] for x in scored]
            cells += f"<td>{_fmt(auroc(s, y))}</td><td>{_fmt(auprc(s, y))}</td>"
        table.append(f"<tr><td class=l>{_esc(r['method'])}</td>{cells}</tr>")
    body.append("".join(table) + "</table>")
    methods = {r["method"]: {"status": "ok", "dir": r["method"]} for r in rows}  # as an experiment's run lists them
    groups = _pi_groups(base, [{"methods": methods,
                                "targets": res["targets"] if str(res.get("targets")).endswith(".jsonl") else None}])
    if groups:
        body.append(plots.pi_hist(groups, "pi over target pairs", "pi"))
    run = {"pool": str(pool_path), "label": label, "methods": methods}
    body.append("<h2>Rankings</h2>")
    body.append(_run_figures(plots, base, run, "compare", "compare"))
    return _page("prism-select compare", body)


def _check_page_path(base: Path, page: Path, default: bool, overwrite: bool) -> None:
    """The page never replaces a run's own files or inputs, and replaces another existing
    file only with ``overwrite`` (its default place, ``<run>/report.html``, is the report's own)."""
    own = [base / n for n in ("scores.jsonl", "pairs.jsonl", "run.json", "compare.json", "results.json")]
    for name in ("run.json", "compare.json"):
        try:
            info = json.loads((base / name).read_text(encoding="utf-8"))
            inputs = info.get("inputs") or info if isinstance(info, dict) else {}
            own += [Path(inputs[k]) for k in ("pool", "targets") if isinstance(inputs.get(k), str) and inputs[k]]
        except (OSError, ValueError, AttributeError):
            pass
    target = page.resolve()
    if page.is_dir() or any(target == p.resolve() for p in own if p.exists()):
        what = "a directory" if page.is_dir() else "an input or output of the run"
        raise OutputError(f"cannot write the report to {page}: it is {what}; choose another --out (e.g. report.html)")
    if page.exists() and not default and not overwrite:
        raise OutputError(f"{page} already exists; pass --overwrite to replace it, or choose another --out")


def write_report(path, *, label: str | None = None, out: str | None = None, overwrite: bool = False) -> Path:
    """Write ``report.html`` for an experiment, compare or score run directory; returns the
    page's path. ``label``: the pool's boolean label field for a score run (default
    ``harmful`` when every record has it). ``out``: the page's path (default
    ``<path>/report.html``); an existing one is replaced only with ``overwrite``, and never
    when it is one of the run's files or inputs."""
    base = Path(path)
    if (base / "results.json").is_file():
        kind = "experiment"
    elif (base / "compare.json").is_file():
        kind = "compare"
    elif (base / "scores.jsonl").is_file() and (base / "run.json").is_file():
        kind = "score"
    else:
        raise InputError("neither an experiment directory (results.json), a compare directory (compare.json) "
                         "nor a finished score run (scores.jsonl + run.json)", path=base,
                         fix="pass the --out directory of `prism-select experiment`, `compare` or `score`")
    page_path = Path(out) if out else base / "report.html"
    _check_page_path(base, page_path, default=not out, overwrite=overwrite)
    plots = _Plots()
    if kind == "experiment":
        text = _experiment_report(base, plots)
    elif kind == "compare":
        text = _compare_report(base, plots, label)
    else:
        text = _score_run_report(base, plots, label)
    atomic_write_text(page_path, text)
    return page_path
