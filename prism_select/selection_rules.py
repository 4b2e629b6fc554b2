"""Selection rules beyond top-k: thresholds, quotas, per-task budgets, duplicate and overlap
control, and the record of every decision.

:func:`decide` turns a run's ranked scores into one decision per scored record. Rules are
applied in this order, each record's ``reason`` naming the first rule that decided it:

1. ``overlap`` (``exclude_overlap``): the record's prompt or response shares a word
   ``OVERLAP_NGRAM``-gram, or is a MinHash neighbour (estimated Jaccard of word
   ``SHINGLE``-grams >= ``overlap_threshold``), with a target pair's prompt / chosen /
   rejected text or an ``--eval`` record: dropped (``of``: ``target:ID`` or
   ``eval:FILE:ID``). ``flag_overlap`` only marks it (``overlap`` field) and decides nothing.
2. ``duplicate`` / ``near_duplicate`` (``dedup``): in rank order, a record whose
   normalised prompt + response equals (exact hash) or is a MinHash neighbour of
   (Jaccard >= ``dedup_threshold``) a better-ranked record that no earlier rule dropped is
   dropped (``of``: that record's id); the best-ranked record of each group stays.
3. ``min_score``: in keep mode a record scoring below it is not kept; in remove mode only
   records scoring at least it are removed.
4. the budget (``keep`` / ``remove``, counted from all scored records): plainly the
   best-ranked; with ``stratify`` a quota per value of that pool field, proportional to
   its share of the scored records (largest remainder, ties to the stratum seen first in
   rank order); with ``per_task="top"`` an equal share per task, each taking its own
   best-ranked records in turn (round robin); with ``per_task="max"`` ranked by the
   largest of a record's task scores (LESS's rule). Reasons: ``budget``, ``quota``,
   ``task`` (kept) and ``budget``, ``quota``, ``removed`` (dropped).

Per-task scores are the ``scores`` field (``{task: score}``) of ``scores.jsonl`` rows.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .data.readers import detect_format, iter_records, load_targets, parse_pool_record, record_id
from . import __version__
from .errors import ConfigError, InputError, OutputError
from .export import write_trainer_file
from .io import atomic_write_json, atomic_write_jsonl, sha256_file

OVERLAP_NGRAM = 13  # word n-gram shared with a target / eval text = overlap (as wana)
SHINGLE = 5  # word shingle length of the MinHash signatures
NUM_PERM = 128  # MinHash permutations
MINHASH_SEED = 1
PER_TASK = ("top", "max")
KEEP_REASONS = ("budget", "quota", "task", "not_removed")
INSTALL_HINT = "pip install datasketch  (a dependency of prism-select: reinstall it)"


@dataclass(frozen=True)
class Rules:
    """The selection rules of one ``select`` call (validated on construction)."""

    keep: str | int | None = None
    remove: str | int | None = None
    min_score: float | None = None
    stratify: str | None = None
    per_task: str | None = None  # "top" (each task its own share) or "max" (LESS)
    dedup: bool = False
    dedup_threshold: float = 0.8
    exclude_overlap: bool = False
    flag_overlap: bool = False
    eval_files: tuple = field(default_factory=tuple)
    overlap_threshold: float = 0.8

    def __post_init__(self):
        if self.keep is not None and self.remove is not None:
            raise ConfigError("keep", "give at most one of keep and remove",
                              "use keep to select the best examples, remove to repair")
        if self.keep is None and self.remove is None and self.min_score is None:
            raise ConfigError("keep", "give keep, remove or min_score", "e.g. --keep 5%")
        if self.min_score is not None and not (isinstance(self.min_score, (int, float))
                                               and math.isfinite(self.min_score)):
            raise ConfigError("min_score", f"must be a finite number, got {self.min_score!r}", "e.g. --min-score 0")
        if self.per_task is not None and self.per_task not in PER_TASK:
            raise ConfigError("per_task", f"unknown rule {self.per_task!r}", f"use one of {', '.join(PER_TASK)}")
        if self.per_task and self.stratify:
            raise ConfigError("per_task", "per-task budgets and --stratify cannot be combined",
                              "choose one way of sharing the budget")
        for name in ("dedup_threshold", "overlap_threshold"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ConfigError(name, f"must be in (0, 1], got {v!r}", "e.g. 0.8")
        if self.flag_overlap and not self.exclude_overlap and not self.eval_files:
            raise ConfigError("flag_overlap", "flags overlap, but no overlap check was asked for",
                              "add --exclude-overlap (or --eval FILE)")
        object.__setattr__(self, "eval_files", tuple(self.eval_files))
        if self.eval_files or self.flag_overlap:  # --eval FILE implies the check; flag changes its effect
            object.__setattr__(self, "exclude_overlap", True)

    @property
    def mode(self) -> str:
        return "remove" if self.remove is not None else "keep"

    def to_json(self) -> dict:
        d = asdict(self)
        d["eval_files"] = [str(p) for p in self.eval_files]
        return d


# --------------------------------------------------------------------------- text

def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def _shingles(words: list[str], n: int = SHINGLE) -> set[bytes]:
    if len(words) < n:
        return {" ".join(words).encode()} if words else set()
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


def _minhash_lib():
    try:
        import datasketch
    except ImportError as e:
        raise ConfigError("dedup", "near-duplicate and overlap control need the datasketch package",
                          INSTALL_HINT) from e
    return datasketch


_PERMUTATIONS: dict = {}  # the seeded permutations, drawn once (MinHash draws them on each construction)


def _minhash(ds, words: list[str]):
    if "kw" not in _PERMUTATIONS:
        first = ds.MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED)
        kw = {"permutations": first.permutations}
        if getattr(first, "scheme", None) is not None:  # datasketch >= 2 names its hashing scheme
            kw["scheme"] = first.scheme
        _PERMUTATIONS["kw"] = kw
    m = ds.MinHash(num_perm=NUM_PERM, seed=MINHASH_SEED, **_PERMUTATIONS["kw"])
    m.update_batch(sorted(_shingles(words)))
    return m


def _ngrams(words: list[str], n: int = OVERLAP_NGRAM) -> set[str]:
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


# --------------------------------------------------------------------------- references

def reference_texts(targets_path, eval_files) -> list[tuple[str, str]]:
    """``(label, text)`` of every text the pool must not overlap: each target pair's
    prompt, chosen and rejected (``target:ID``) and every string of each ``--eval`` record
    (``eval:FILE:ID``; any record form, ids as the pool readers assign them)."""
    out = []
    if targets_path:
        for t in load_targets(targets_path, skip_invalid=True).items:
            for text in (_text(t.prompt), t.chosen, t.rejected):
                out.append((f"target:{t.id}", text))
    for path in eval_files:
        if not Path(path).exists():
            raise InputError("eval file not found", path=path, fix="pass an existing file to --eval")
        for row, rec in iter_records(path, on_invalid=lambda e: None):
            label = f"eval:{Path(path).name}:{record_id(rec, row)}"
            for text in _strings(rec, top=True):
                out.append((label, text))
    return out


def _strings(value: Any, top: bool = False) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() if not (top and k in ("id", "task", "source"))
                for s in _strings(v) if k not in ("role", "from")]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


class OverlapIndex:
    """Long n-grams and MinHash signatures of the reference texts; :meth:`match` names the
    first reference a text overlaps, or ``None``."""

    def __init__(self, refs: list[tuple[str, str]], threshold: float):
        ds = _minhash_lib()
        self.ds, self.threshold = ds, threshold
        self.grams: dict[str, str] = {}
        self.lsh = ds.MinHashLSH(threshold=threshold, num_perm=NUM_PERM)
        self.sigs: dict[str, Any] = {}
        for i, (label, text) in enumerate(refs):
            words = _words(text)
            if not words:
                continue
            for g in _ngrams(words):
                self.grams.setdefault(g, label)
            key = f"{i}"
            self.sigs[key] = (label, _minhash(ds, words))
            self.lsh.insert(key, self.sigs[key][1])

    def match(self, text: str) -> tuple[str, str, float] | None:
        """``(label, how, similarity)``: how is ``ngram`` or ``minhash``."""
        words = _words(text)
        if not words:
            return None
        for g in _ngrams(words):
            if g in self.grams:
                return self.grams[g], f"{OVERLAP_NGRAM}-gram", 1.0
        m = _minhash(self.ds, words)
        best = None
        for key in self.lsh.query(m):
            label, sig = self.sigs[key]
            j = m.jaccard(sig)
            if j >= self.threshold and (best is None or j > best[2] or (j == best[2] and label < best[0])):
                best = (label, "minhash", j)
        return best


# --------------------------------------------------------------------------- budgets

def parse_amount(text: str | int, field: str = "keep") -> tuple[str, float]:
    """Parse ``"N"`` (a positive integer count) or ``"P%"`` (0 < P <= 100).

    Returns ``("count", N)`` with ``N`` an ``int``, or ``("fraction", P / 100)``.
    """
    s = str(text).strip()
    fix = "give a positive whole number such as 1000, or a percentage such as 10%"
    if s.endswith("%"):
        try:
            p = float(s[:-1].strip())
        except ValueError:
            raise ConfigError(field, f"'{text}' is not a percentage", fix) from None
        if not 0 < p <= 100:
            raise ConfigError(field, f"percentage {text} is outside (0, 100]", fix)
        return "fraction", p / 100
    if not re.fullmatch(r"[0-9]+", s) or int(s) < 1:
        raise ConfigError(field, f"'{text}' is neither a positive count nor a percentage", fix)
    return "count", int(s)



def _count(amount, n: int, field_name: str) -> int:
    kind, value = amount if isinstance(amount, tuple) else parse_amount(amount, field_name)
    count = int(value) if kind == "count" else math.floor(value * n + 0.5)
    if field_name == "keep" and kind == "fraction" and n:
        count = max(count, 1)
    if count > n:
        raise ConfigError(field_name, f"asks for {count} examples but only {n} were scored", f"give at most {n}")
    return count


def largest_remainder(sizes: dict, total: int, cap: bool = True) -> dict:
    """Split ``total`` over the keys of ``sizes`` in proportion to their sizes: each gets the
    floor of its exact share, the rest go one each to the largest remainders (ties: the
    key first in ``sizes``' order). With ``cap``, no key gets more than its size."""
    n = sum(sizes.values())
    if not n:
        return {k: 0 for k in sizes}
    exact = {k: total * s / n for k, s in sizes.items()}
    limit = sizes if cap else {k: total for k in sizes}
    quota = {k: min(limit[k], math.floor(e)) for k, e in exact.items()}
    order = sorted(sizes, key=lambda k: -(exact[k] - math.floor(exact[k])))  # stable: ties keep order
    left = total - sum(quota.values())
    while left > 0:
        moved = False
        for k in order:
            if left and quota[k] < limit[k]:
                quota[k] += 1
                left -= 1
                moved = True
        if not moved:
            break
    return quota


def _stratum(value: Any) -> str:
    if value is None:
        return "(missing)"
    return value if isinstance(value, str) else repr(value)


# --------------------------------------------------------------------------- decide

def task_scores(scores: list[dict]) -> list[str]:
    """The task names of per-task scores (``scores`` rows), in first-seen order; [] if none."""
    tasks: dict = {}
    for s in scores:
        per = s.get("scores")
        if per is None:
            continue
        bad = [k for k, v in per.items() if not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and math.isfinite(v))] if isinstance(per, dict) else [None]
        if bad:
            raise InputError(f"id {s['id']!r}: 'scores' must map each task to a finite number "
                             f"(got {per!r})", path="scores.jsonl", field="scores",
                             fix="use the scores.jsonl written by prism-select score")
        tasks.update(dict.fromkeys(per))
    return list(tasks)


def decide(scores: list[dict], rules: Rules, pool: dict | None = None,
           refs: list[tuple[str, str]] | None = None) -> list[dict]:
    """One decision per scored record, in rank order (see the module docstring).

    ``scores``: ``scores.jsonl`` rows. ``pool``: ``{id: (text of prompt, response, record)}``
    for the scored ids (needed by dedup, overlap and stratify). ``refs``: the texts of
    :func:`reference_texts`.
    """
    ranked = sorted(scores, key=lambda s: s["rank"])
    n = len(ranked)
    rows = {}
    for s in ranked:
        row = {"id": s["id"], "decision": None, "reason": None, "score": s["score"], "rank": s["rank"]}
        if isinstance(s.get("scores"), dict):
            row["scores"] = s["scores"]
        rows[s["id"]] = row
    needs_text = rules.dedup or rules.exclude_overlap or rules.stratify
    if needs_text and pool is None:
        raise ConfigError("pool", "these rules read the pool's records", "pass the pool")
    open_ids = [s["id"] for s in ranked]

    def drop(rid, reason, **extra):
        rows[rid].update(decision="drop", reason=reason, **extra)

    if rules.exclude_overlap:
        index = OverlapIndex(refs or [], rules.overlap_threshold)
        for rid in open_ids:
            prompt, response, _ = pool[rid]
            hit = index.match(prompt) or index.match(response)
            if hit:
                info = {"of": hit[0], "by": hit[1], "similarity": round(hit[2], 4)}
                if rules.flag_overlap:
                    rows[rid]["overlap"] = info
                else:
                    drop(rid, "overlap", **info)
        open_ids = [r for r in open_ids if rows[r]["decision"] is None]
    if rules.dedup:
        ds = _minhash_lib()
        lsh = ds.MinHashLSH(threshold=rules.dedup_threshold, num_perm=NUM_PERM)
        exact: dict[str, Any] = {}
        sigs: dict[str, Any] = {}
        for i, rid in enumerate(open_ids):
            prompt, response, _ = pool[rid]
            words = _words(prompt) + ["\x00"] + _words(response)
            h = hashlib.sha256(" ".join(words).encode()).hexdigest()
            if h in exact:
                drop(rid, "duplicate", of=exact[h])
                continue
            m = _minhash(ds, words)
            best = None
            for key in lsh.query(m):
                j = m.jaccard(sigs[key][1])
                if j >= rules.dedup_threshold and (best is None or j > best[1]):
                    best = (sigs[key][0], j)
            if best:
                drop(rid, "near_duplicate", of=best[0], similarity=round(best[1], 4))
                continue
            exact[h] = rid
            sigs[str(i)] = (rid, m)
            lsh.insert(str(i), m)
        open_ids = [r for r in open_ids if rows[r]["decision"] is None]

    score_of = {s["id"]: s["score"] for s in ranked}
    tasks = task_scores(ranked)
    if rules.per_task and not tasks:
        raise ConfigError("per_task", "the run's scores.jsonl holds no per-task scores (a 'scores' field)",
                          "score with several --targets files (or targets whose records carry 'task'); "
                          "for quotas by a pool field use --stratify FIELD")
    if rules.per_task == "max":
        score_of = {s["id"]: max(s["scores"].values()) if s.get("scores") else s["score"] for s in ranked}
        open_ids = sorted(open_ids, key=lambda r: (-score_of[r], rows[r]["rank"]))

    acting = rules.keep is not None or rules.remove is not None
    amount = rules.keep if rules.keep is not None else rules.remove
    budget = _count(amount, n, rules.mode) if acting else n
    act_on = open_ids  # the records the budget may pick (kept in keep mode, removed in remove mode)
    if rules.min_score is not None:
        below = [r for r in open_ids if score_of[r] < rules.min_score]
        if rules.mode == "keep":
            for r in below:
                drop(r, "min_score")
        act_on = [r for r in open_ids if score_of[r] >= rules.min_score]
    picked: dict = {}  # id -> (reason, extra)
    if rules.stratify:
        strata = {}
        for s in ranked:
            strata.setdefault(_stratum(pool[s["id"]][2].get(rules.stratify)), []).append(s["id"])
        if list(strata) == ["(missing)"]:
            fields = sorted({k for v in pool.values() for k in v[2]})
            raise ConfigError("stratify", f"no scored record has a field {rules.stratify!r}",
                              f"name one of the pool's fields: {', '.join(fields[:20])}")
        quota = largest_remainder({k: len(v) for k, v in strata.items()}, budget)
        used = Counter()
        stratum_of = {rid: k for k, v in strata.items() for rid in v}
        for rid in act_on:
            k = stratum_of[rid]
            rows[rid]["stratum"] = k
            if used[k] < quota[k]:
                used[k] += 1
                picked[rid] = ("quota", {})
    elif rules.per_task == "top":
        share = largest_remainder({t: 1 for t in tasks}, budget, cap=False)
        order = {t: sorted((r for r in act_on if t in (rows[r].get("scores") or {})),
                           key=lambda r: (-rows[r]["scores"][t], rows[r]["rank"])) for t in tasks}
        pos, got = Counter(), Counter()
        while True:
            moved = False
            for t in tasks:
                while got[t] < share[t] and pos[t] < len(order[t]) and order[t][pos[t]] in picked:
                    pos[t] += 1
                if got[t] < share[t] and pos[t] < len(order[t]):
                    picked[order[t][pos[t]]] = ("task", {"task": t})
                    got[t] += 1
                    moved = True
            if not moved:
                break
    else:
        for rid in act_on[:budget]:
            picked[rid] = ("budget", {})
    for rid in open_ids:
        if rows[rid]["decision"] is not None:
            continue
        hit = rid in picked
        reason, extra = picked.get(rid, (None, {}))
        if rules.mode == "keep":
            if hit:
                rows[rid].update(decision="keep", reason=reason, **extra)
            else:
                drop(rid, "quota" if rules.stratify else "budget")
        elif hit:
            drop(rid, "removed" if reason == "budget" else reason, **extra)
        else:
            rows[rid].update(decision="keep", reason="not_removed")
    out = [rows[s["id"]] for s in ranked]
    if not any(r["decision"] == "keep" for r in out):
        raise ConfigError(rules.mode, "the rules leave no examples", "loosen the rules or keep more")
    return out


def counts(decisions: list[dict]) -> dict:
    """``{"keep": {reason: n}, "drop": {reason: n}}`` of a decisions list."""
    out: dict = {"keep": {}, "drop": {}}
    for d in decisions:
        bucket = out[d["decision"]]
        bucket[d["reason"]] = bucket.get(d["reason"], 0) + 1
    flagged = sum("overlap" in d for d in decisions)
    if flagged:
        out["flagged_overlap"] = flagged
    return out


# --------------------------------------------------------------------------- explain

def explain_text(decisions: list[dict], first: int = 3) -> str:
    """A short table: counts per decision and reason, and the first few ids of each."""
    groups: dict = {}
    for d in decisions:
        groups.setdefault((d["decision"], d["reason"]), []).append(d)
    lines = [f"{'decision':<9}{'reason':<16}{'count':>7}  first (id, rank, score, why)"]
    for (dec, reason), ds in sorted(groups.items(), key=lambda kv: (kv[0][0] != "keep", -len(kv[1]))):
        some = []
        for d in ds[:first]:
            why = next((f"{k} {d[k]}" for k in ("of", "task", "stratum") if d.get(k) is not None), "")
            score = d.get("score")
            some.append(f"{d['id']} (#{d.get('rank')}, {score:.4g}{', ' + str(why) if why else ''})"
                        if isinstance(score, (int, float)) else f"{d['id']}")
        lines.append(f"{dec:<9}{reason:<16}{len(ds):>7}  " + "; ".join(some))
    flagged = [d for d in decisions if "overlap" in d]
    if flagged:
        lines.append(f"flagged overlap (not dropped): {len(flagged)}: "
                     + "; ".join(f"{d['id']} ~ {d['overlap']['of']}" for d in flagged[:first]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- select

OUTPUT_FORMATS = ("jsonl", "llamafactory", "trl", "sharegpt", "alpaca")


def side_paths(out_path) -> tuple[Path, Path]:
    """``selected.jsonl`` -> ``selected.decisions.jsonl``, ``selected.manifest.json``
    (a directory output ``subset/`` -> ``subset.decisions.jsonl``, ...)."""
    out = Path(out_path)
    stem = out.name if out.is_dir() or not out.suffix else out.stem
    return out.with_name(stem + ".decisions.jsonl"), out.with_name(stem + ".manifest.json")


def sha256_path(path) -> str:
    """sha256 of a file; of a directory, of its files' relative paths and sha256s."""
    p = Path(path)
    if not p.is_dir():
        return sha256_file(p)
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        h.update(f"{f.relative_to(p).as_posix()}\0{sha256_file(f)}\n".encode())
    return h.hexdigest()


def _targets_of(run: dict) -> list[str]:
    t = (run.get("inputs") or {}).get("targets")
    return [x for x in ([t] if isinstance(t, str) else t if isinstance(t, list) else []) if x]


def _pool_texts(pool_path, ids: set, texts: bool, field: str | None) -> dict:
    """``{id: (prompt text, response, {field: value})}`` of the scored records; the texts
    are empty unless ``texts``, and only ``field`` of each record is kept (memory)."""
    csv_pool = detect_format(pool_path) == "csv"
    out, fields = {}, set()
    for row, rec in iter_records(pool_path, on_invalid=lambda e: None):
        try:
            ex = parse_pool_record(rec, row, csv_pool)
        except InputError:
            continue
        if ex.id in ids:
            fields.update(rec)
            out[ex.id] = ((_text(ex.prompt), ex.response) if texts else ("", "")) + (
                {field: rec[field]} if field in rec else {},)
    if missing := ids - out.keys():
        raise InputError(f"{len(missing)} scored ids are not in this pool", path=pool_path,
                         fix="pass the pool that was scored")
    if field is not None and field not in fields:
        raise ConfigError("stratify", f"no scored record has a field {field!r}",
                          f"name one of the pool's fields: {', '.join(sorted(fields)[:20])}")
    return out


def apply_rules(run_dir: Path, run: dict, scores: list[dict], pool_path, out_path, rules: Rules,
                write_subset, fmt: str | None = None, unscored: list | None = None, warnings: list | None = None) -> dict:
    """Decide (:func:`decide`), write the kept records (in the pool's format, or ``fmt``),
    then ``<out>.decisions.jsonl`` and ``<out>.manifest.json`` beside them; returns the
    summary :func:`prism_select.selection.select` documents. ``write_subset``:
    :func:`prism_select.selection.write_subset` (passed in: this module sits below selection)."""
    if fmt is not None and fmt not in OUTPUT_FORMATS:
        raise ConfigError("format", f"unknown output format {fmt!r}", f"use one of {', '.join(OUTPUT_FORMATS)}")

    inputs = [Path(pool_path), run_dir / "scores.jsonl", run_dir / "run.json", *map(Path, _targets_of(run)),
              *map(Path, rules.eval_files)]
    for side in side_paths(out_path):
        if any(side.resolve() == p.resolve() for p in inputs):
            raise OutputError(f"cannot write {side} (the record of --out {out_path}): it is an input of this "
                              "select; choose another --out")
    ids = {s["id"] for s in scores}
    texts = rules.dedup or rules.exclude_overlap
    pool = _pool_texts(pool_path, ids, texts, rules.stratify) if (texts or rules.stratify) else None
    targets = _targets_of(run)
    refs = None
    if rules.exclude_overlap:
        if not targets and not rules.eval_files:
            raise ConfigError("exclude_overlap", f"the run in {run_dir} records no targets file, and no --eval "
                              "was given", "pass --eval FILE with the texts to keep out")
        for t in targets:
            if not Path(t).exists():
                raise InputError("the run's targets file is not found (it has moved?)", path=t,
                                 fix="put it back, or check against --eval FILE without --exclude-overlap")
        refs = []
        for t in targets:
            refs += reference_texts(t, ())
        refs += reference_texts(None, rules.eval_files)
    decisions = decide(scores, rules, pool, refs)
    decisions += [{"id": u, "decision": "drop", "reason": "unscored", "score": None} for u in unscored or []]
    kept = [d["id"] for d in decisions if d["decision"] == "keep"]
    out = Path(out_path)
    written_files = [out]
    if fmt in (None, "jsonl"):
        written = write_subset(pool_path, kept, out, out_format=fmt)
    else:
        result = write_trainer_file(pool_path, kept, out, fmt)
        written = result["count"]
        if result.get("dataset_info"):
            written_files.append(Path(result["dataset_info"]))
    decisions_path, manifest_path = side_paths(out)
    atomic_write_jsonl(decisions_path, decisions)
    written_files.append(decisions_path)
    inputs = {"pool": pool_path, "scores": run_dir / "scores.jsonl", "run": run_dir / "run.json"}
    inputs.update({f"targets{'' if i == 0 else i}": t for i, t in enumerate(targets)})
    inputs.update({f"eval:{p}": p for p in rules.eval_files})
    tally = counts(decisions)
    manifest = {
        "prism_select": __version__,
        "inputs": {k: {"path": str(Path(p).absolute()), "sha256": sha256_path(p)}
                   for k, p in inputs.items() if Path(p).exists()},
        "outputs": {str(p.name): {"path": str(p.absolute()), "sha256": sha256_path(p)} for p in written_files},
        "settings": {**rules.to_json(), "format": fmt or "pool", "run": str(Path(run_dir).absolute()),
                     "overlap_ngram": OVERLAP_NGRAM, "shingle": SHINGLE, "num_perm": NUM_PERM},
        "counts": {"scored": len(scores), "kept": written, "dropped": len(decisions) - written, **tally},
    }
    atomic_write_json(manifest_path, manifest)
    amount = rules.keep if rules.keep is not None else rules.remove
    return {"mode": rules.mode, "amount": str(amount) if amount is not None else f"score >= {rules.min_score}",
            "scored": len(scores), "kept": written, "removed": len(scores) - written, "unscored": unscored or [],
            "pool": str(pool_path), "out": str(out), "warnings": warnings or [],
            "decisions": str(decisions_path), "manifest": str(manifest_path), "counts": tally}


def describe_counts(summary: dict) -> str:
    """One line: the counts per reason, and where the decisions and manifest are."""
    c = summary.get("counts") or {}
    parts = [f"{dec} {reason}: {n}" for dec in ("keep", "drop") for reason, n in (c.get(dec) or {}).items()]
    if c.get("flagged_overlap"):
        parts.append(f"flagged overlap: {c['flagged_overlap']}")
    return (", ".join(parts) + f"; decisions in {summary['decisions']}, manifest in {summary['manifest']}")


def read_decisions(path) -> list[dict]:
    """The decisions of ``path``: a ``*.decisions.jsonl``, a ``*.manifest.json``, or the
    ``--out`` of a select (its decisions file beside it)."""
    p = Path(path)
    if p.is_dir() and not any(p.glob("*.decisions.jsonl")) and (p / "run.json").is_file():
        p = _latest_select_of(p)
    if p.is_dir():
        found = sorted(p.glob("*.decisions.jsonl"))
        if len(found) != 1:
            raise InputError(f"{'no' if not found else len(found)} decisions files in this directory", path=p,
                             fix="pass the decisions file (or the --out) that prism-select select wrote")
        p = found[0]
    if p.name.endswith(".manifest.json"):
        p = p.with_name(p.name[: -len(".manifest.json")] + ".decisions.jsonl")
    elif not p.name.endswith(".decisions.jsonl"):
        p = side_paths(p)[0]
    if not p.is_file():
        raise InputError("no decisions file", path=p,
                         fix="pass the decisions file (or the --out) that prism-select select wrote")
    return [rec for _, rec in iter_records(p)]


def _latest_select_of(run_dir: Path) -> Path:
    """The newest ``*.manifest.json`` beside ``run_dir`` or in the working directory whose
    ``settings.run`` is ``run_dir``."""
    want = str(run_dir.absolute())
    found = []
    for folder in {run_dir.absolute().parent, Path.cwd()}:
        for m in folder.glob("*.manifest.json"):
            try:
                run = json.loads(m.read_text(encoding="utf-8")).get("settings", {}).get("run")
            except (OSError, ValueError, AttributeError):
                continue
            if run == want:
                found.append((m.stat().st_mtime, str(m)))
    if not found:
        raise InputError("no select of this run found beside it or in the working directory", path=run_dir,
                         fix="pass the decisions file (or the --out) that prism-select select wrote")
    return Path(max(found)[1])
