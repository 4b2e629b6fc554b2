"""Turn a run's scores into a data subset: choose ids, then write the kept records.

The subset is written from the pool file itself, not from the parsed examples, so
every original field (metadata, extra columns, the exact chat layout) is kept as it
was; records keep their original order.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .data.readers import (FORMATS, SUFFIXES, detect_format, iter_records, load_arrow_dir, parse_pool_record,
                           record_id)
from .errors import ConfigError, InputError, OutputError
from .io import atomic_open, atomic_write_dir, atomic_write_jsonl, check_path_name, remove_stale_temps, sha256_file
from .selection_rules import Rules, apply_rules, parse_amount  # noqa: F401 (parse_amount re-exported)

Amount = tuple[str, float]  # ("count", N) or ("fraction", f), as parse_amount returns


def read_scores(path: str | os.PathLike) -> list[dict]:
    """Read a ``scores.jsonl`` (``id``, ``score``, ``rank``; rank 1 = highest score).

    Returns the records sorted by rank. Ids and ranks must be unique, scores finite.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError("scores file not found", path=path,
                         fix="point at a finished run directory (score the pool first)")
    out, ids, ranks = [], set(), set()
    for row, rec in iter_records(path):
        rid, score, rank = rec.get("id"), rec.get("score"), rec.get("rank")
        for name, ok in (("id", isinstance(rid, (str, int)) and not isinstance(rid, bool)),
                         ("score", _number(score) and math.isfinite(score)),
                         ("rank", _number(rank) and isinstance(rank, int) and rank >= 1)):
            if not ok:
                raise InputError(f"missing or invalid {name}: got {rec.get(name)!r}", path=path,
                                 row=row, field=name,
                                 fix="use the scores.jsonl written by prism-select score")
        for name, value, seen in (("id", rid, ids), ("rank", rank, ranks)):
            if value in seen:
                raise InputError(f"duplicate {name} {value!r}", path=path, row=row, field=name,
                                 fix="use the scores.jsonl written by prism-select score")
            seen.add(value)
        out.append(rec)
    return sorted(out, key=lambda r: r["rank"])


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def choose(scores: list[dict], keep: str | int | Amount | None = None,
           remove: str | int | Amount | None = None) -> set:
    """Ids to keep: ``keep`` the best-ranked N (or P%), or ``remove`` them and keep the rest.

    ``remove`` is repair mode: the top-scored examples are the harmful ones. A fraction
    becomes ``count = round(fraction * n)`` rounding halves up (not Python's banker's
    rounding, so 2.5 -> 3), and at least 1 for ``keep``. Asking for more than ``n``, or
    a choice that keeps nothing, is a :class:`ConfigError`. Order is by ``rank`` alone,
    which is unique, so ties in score never make the choice ambiguous.
    """
    if (keep is None) == (remove is None):
        raise ConfigError("keep", "give exactly one of keep and remove",
                          "use keep to select the best examples, remove to repair")
    field, amount = ("keep", keep) if keep is not None else ("remove", remove)
    kind, value = amount if isinstance(amount, tuple) else parse_amount(amount, field)
    ranked = [s["id"] for s in sorted(scores, key=lambda s: s["rank"])]
    n = len(ranked)
    count = int(value) if kind == "count" else math.floor(value * n + 0.5)
    if field == "keep" and kind == "fraction" and n:
        count = max(count, 1)
    if count > n:
        raise ConfigError(field, f"asks for {count} examples but only {n} were scored",
                          f"give at most {n}")
    chosen = ranked[:count] if field == "keep" else ranked[count:]
    if not chosen:
        raise ConfigError(field, f"{field} {amount} leaves no examples",
                          "keep at least one example")
    return set(chosen)


class _Matcher:
    """Tracks which kept ids a pass over the pool found; mismatches are InputErrors."""

    def __init__(self, pool: str | os.PathLike, kept_ids: Iterable[Any], fmt: str):
        self.pool, self.wanted, self.found, self.csv = pool, set(kept_ids), set(), fmt == "csv"

    def take(self, rec: dict, row: int) -> bool:
        """Whether to write this record. Records that :func:`load_pool` rejects are never
        taken, so an invalid record cannot share an id with a kept valid one."""
        try:
            rid = record_id(rec, row)
            if rid not in self.wanted:
                return False
            parse_pool_record(rec, row, self.csv)
        except InputError:
            return False
        if rid in self.found:
            raise InputError(f"id {rid!r} occurs twice", path=self.pool, row=row, field="id",
                             fix="make ids unique and score the pool again")
        self.found.add(rid)
        return True

    def finish(self) -> None:
        missing = self.wanted - self.found
        if missing:
            some = sorted(map(repr, missing))[:5]
            raise InputError(f"{len(missing)} selected ids are not in this pool (e.g. "
                             f"{', '.join(some)}): the scores were made from another pool",
                             path=self.pool, fix="pass the pool file that was scored")

    def records(self) -> Iterator[dict]:
        for row, rec in iter_records(self.pool, on_invalid=lambda e: None):
            if self.take(rec, row):
                yield rec
        self.finish()


def write_subset(pool_path: str | os.PathLike, kept_ids: Iterable[Any],
                 out_path: str | os.PathLike, out_format: str | None = None) -> int:
    """Write the pool records whose id is in ``kept_ids`` to ``out_path``; return the count.

    Ids are as in :func:`~prism_select.data.load_pool` (the ``id`` field, else the row
    number). The format is ``out_format``, else the one ``out_path``'s extension names,
    else the pool's own. Same-format Parquet and saved-dataset outputs copy the pool's
    schema/features exactly; cross-format CSV output JSON-encodes non-text values.
    The write is atomic, and nothing is written if any kept id is missing from the pool.
    """
    src = detect_format(pool_path)
    dst = out_format or SUFFIXES.get(Path(out_path).suffix.lower(), src)
    if dst not in FORMATS:
        raise ConfigError("format", f"unknown output format '{dst}'",
                          f"use one of {', '.join(FORMATS)}")
    if Path(out_path).resolve() == Path(pool_path).resolve():
        raise OutputError(f"cannot write {out_path}: it is the pool itself "
                          "(choose another output path)")
    remove_stale_temps(out_path)  # what a killed earlier write of this output left
    match = _Matcher(pool_path, kept_ids, src)
    if src == dst == "parquet":
        return _parquet_subset(pool_path, match, out_path)
    if src == dst == "arrow":
        ds = load_arrow_dir(pool_path)
        rows = [i for i, rec in enumerate(ds.with_format(None)) if match.take(rec, i)]
        match.finish()
        atomic_write_dir(out_path, lambda tmp: ds.select(rows).save_to_disk(str(tmp)))
        return len(rows)
    if dst == "jsonl":
        return atomic_write_jsonl(out_path, match.records(), default=_json_default)
    if dst == "json":
        return _write_json_list(out_path, match.records())
    records = list(match.records())
    if dst == "csv":
        _write_csv(out_path, records, _csv_header(pool_path) if src == "csv" else None)
    elif dst == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = _convert(lambda: pa.Table.from_pylist(records), out_path)
        with atomic_open(out_path, binary=True) as f:
            pq.write_table(table, f)
    else:
        import datasets

        ds = _convert(lambda: datasets.Dataset.from_list(records), out_path)
        atomic_write_dir(out_path, lambda tmp: ds.save_to_disk(str(tmp)))
    return len(records)


def select(run_dir: str | os.PathLike, pool_path: str | os.PathLike,
           out_path: str | os.PathLike, keep: str | int | None = None,
           remove: str | int | None = None, *, overwrite: bool = False,
           allow_other_pool: bool = False, fmt: str | None = None, **rules) -> dict:
    """Choose from ``run_dir/scores.jsonl`` and write the subset; returns a summary.

    The pool must be the one the run scored: its file bytes must match run.json's
    ``fingerprints.pool_file`` (runs written before that key existed: its valid ids must
    be the scored ids, apart from records the run skipped as invalid). Otherwise an
    :class:`InputError` says what differs. ``allow_other_pool`` accepts another pool
    file when every scored id is in it; its records that were not scored are not
    written and are listed in the summary (``unscored``). An existing ``out_path`` is
    an :class:`OutputError` unless ``overwrite``.

    ``rules`` are the other fields of :class:`prism_select.selection_rules.Rules`
    (``min_score``, ``stratify``, ``per_task``, ``dedup``, ``exclude_overlap``,
    ``eval_files``, ...); ``fmt`` a trainer format (``llamafactory``, ``trl``, ``sharegpt``,
    ``alpaca``) or ``jsonl``. Beside ``out_path`` go ``<stem>.decisions.jsonl`` (one
    line per pool record: ``id``, ``decision``, ``reason``, ``score``, ...) and
    ``<stem>.manifest.json`` (sha256 of inputs and outputs, settings, counts per reason).
    """
    for field, value in (("run", run_dir), ("pool", pool_path), ("out", out_path)):
        check_path_name(field, value)
    rule_set = Rules(keep=keep, remove=remove, **rules)
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    scores = read_scores(run_dir / "scores.jsonl")
    detect_format(pool_path)  # a regular file (or saved dataset) before its bytes are hashed
    _check_out(run_dir, run, pool_path, out_path)
    if Path(out_path).exists() and not overwrite:
        raise OutputError(f"{out_path} already exists; pass --overwrite to replace it, "
                          "or choose another --out")
    warnings: list = []
    unscored = check_pool(run_dir, run, pool_path, {s["id"] for s in scores}, allow_other_pool, warnings)
    return apply_rules(run_dir, run, scores, pool_path, out_path, rule_set, write_subset, fmt=fmt, unscored=unscored,
                       warnings=warnings)


def _check_out(run_dir: Path, run: dict, pool_path, out_path) -> None:
    """``out_path`` is none of the inputs: the pool, the run's own files and directory, or
    the target pairs it scored against (``--overwrite`` does not change that)."""
    inputs = run.get("inputs") if isinstance(run.get("inputs"), dict) else {}
    protected = [Path(pool_path), run_dir] + [run_dir / f for f in ("scores.jsonl", "pairs.jsonl", "run.json")]
    protected += [Path(inputs[k]) for k in ("pool", "targets") if isinstance(inputs.get(k), str) and inputs[k]]
    target = Path(out_path).resolve()
    for p in protected:
        if target == p.resolve():
            what = "the pool" if p == Path(pool_path) else f"an input or output of the run in {run_dir}"
            raise OutputError(f"cannot write {out_path}: it is {what}; choose another output path "
                              "(--overwrite never replaces a run's inputs)")


def describe(summary: dict) -> str:
    """One readable line for a :func:`select` summary."""
    s = summary
    how = f"kept the top {s['amount']}" if s["mode"] == "keep" else f"removed the top {s['amount']}"
    if s["amount"].startswith("score >="):
        how = f"kept those with {s['amount']}"
    text = f"wrote {s['kept']} of {s['scored']} scored records to {s['out']} ({how} of {s['pool']})"
    if s.get("unscored"):
        some = ", ".join(map(repr, s["unscored"][:5])) + (", ..." if len(s["unscored"]) > 5 else "")
        text += f"; {len(s['unscored'])} records of this pool were not scored and are left out: {some}"
    return text


def read_run(run_dir: str | os.PathLike, finished: bool = True) -> dict:
    """The JSON object in ``run_dir/run.json``, or an :class:`InputError` naming the file
    (missing, unreadable, not an object, or, with ``finished``, a run whose ``status`` is
    not ``complete``)."""
    run_dir = Path(run_dir)
    path = run_dir / "run.json"
    if not path.is_file():
        raise InputError("not a finished run: run.json is missing", path=run_dir,
                         fix="point --run at the --out directory of a finished `prism-select score`")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read run.json ({e})", path=path,
                         fix="score the pool again; run.json is written by prism-select score") from e
    if not isinstance(run, dict):
        raise InputError(f"expected a JSON object, got {'null' if run is None else type(run).__name__}", path=path,
                         fix="score the pool again; run.json is written by prism-select score")
    if finished and run.get("status", "complete") != "complete":
        raise InputError(f"not a finished run: its status is {run.get('status')!r}, not 'complete'", path=path,
                         field="status", fix="let the run finish (run its score command again to resume it), "
                                             "then select")
    return run


def check_pool(run_dir: Path, run: dict, pool_path, scored: set, allow_other_pool: bool = False,
               warnings: list | None = None) -> list:
    """Check that ``pool_path`` is the pool the run scored (see :func:`select`); return the
    ids of this pool that were not scored (empty unless ``allow_other_pool``). A run
    without the pool file's fingerprint is checked by ids alone, which ``warnings`` says."""
    expected = (run.get("fingerprints") or {}).get("pool_file")
    if expected is not None and sha256_file(pool_path) == expected:
        return []
    if expected is None and warnings is not None:
        warnings.append(f"{run_dir / 'run.json'} holds no fingerprint of the pool file (fingerprints.pool_file): "
                        "the pool was checked by its record ids only, not by its content")
    # rows the run skipped as invalid (e.g. too long to tokenise): never scored. Only
    # meaningful for the scored file itself, i.e. a run without the file fingerprint.
    skipped = set() if expected is not None else {r.get("row") for r in run.get("invalid_records", [])}
    rows, fmt = [], detect_format(pool_path)  # (row, id) of the valid records
    by_row = 0  # valid records without an id field: named by their row number
    for row, rec in iter_records(pool_path, on_invalid=lambda e: None):
        try:
            rows.append((row, parse_pool_record(rec, row, fmt == "csv").id))
        except InputError:
            continue
        by_row += rec.get("id") is None
    here = {rid for _, rid in rows}
    missing = [i for i in scored if i not in here]
    unscored = [rid for row, rid in rows if rid not in scored and row not in skipped]
    if expected is None and not missing and not unscored:
        return []  # a run from before the file fingerprint: the ids agree
    if allow_other_pool and by_row:
        raise InputError(f"--allow-other-pool needs ids: {by_row} records of this pool have no 'id' field, so they "
                         "are matched to the scores by row number, and a record inserted, removed or moved in "
                         "another file would give every later record another one's score", path=pool_path,
                         field="id", fix=f"pass the pool that {run_dir} scored, or give every record an 'id' "
                                         "and score the pool again")
    if allow_other_pool and not missing:
        return unscored
    what = []
    if expected is not None:
        what.append("its file bytes differ from the pool scored (run.json fingerprints.pool_file)")
    if missing:
        what.append(f"{len(missing)} scored ids are not in it (e.g. {_some(missing)})")
    if unscored:
        what.append(f"{len(unscored)} of its ids were not scored (e.g. {_some(unscored)})")
    scored_pool = (run.get("inputs") or {}).get("pool")
    fix = f"pass the pool that {run_dir} scored" + (f" ({scored_pool})" if scored_pool else "")
    if not missing:
        fix += ", or add --allow-other-pool to select from this file (its unscored records are left out)"
    raise InputError(f"not the pool scored in {run_dir}: " + "; ".join(what), path=pool_path, fix=fix)


def _some(ids: list, n: int = 5) -> str:
    return ", ".join(map(repr, sorted(ids, key=repr)[:n]))


def _parquet_subset(pool_path, match: _Matcher, out_path) -> int:
    """Filter record batches so the output keeps the pool's exact Arrow schema."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(pool_path)
    row = n = 0
    with atomic_open(out_path, binary=True) as f:
        with pq.ParquetWriter(f, pf.schema_arrow) as writer:
            for batch in pf.iter_batches():
                mask = []
                for rec in batch.to_pylist():
                    mask.append(match.take(rec, row))
                    row += 1
                if any(mask):
                    writer.write_batch(batch.filter(pa.array(mask)))
                    n += sum(mask)
        match.finish()
    return n


def _json_default(value: Any) -> Any:
    """Dates and decimals from Parquet / datasets become text in JSON outputs."""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    if type(value).__name__ == "Decimal":
        return str(value)
    raise TypeError(f"{type(value).__name__} has no JSON form")


def _dumps(value: Any, path, **kw) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, default=_json_default, **kw)
    except (TypeError, ValueError) as e:
        raise OutputError(f"cannot write {path}: a value has no JSON form ({e}); write "
                          "the subset in the pool's own format instead") from e


def _write_json_list(path, records: Iterable[dict]) -> int:
    """Stream a JSON list, each record indented as ``json.dump(indent=2)`` would."""
    n = 0
    with atomic_open(path) as f:
        f.write("[")
        for rec in records:
            text = _dumps(rec, path, indent=2).replace("\n", "\n  ")  # strings hold no raw \n
            f.write(("," if n else "") + "\n  " + text)
            n += 1
        f.write("\n]\n" if n else "]\n")
    return n


def _csv_header(path) -> list[str]:
    with open(path, encoding="utf-8-sig", newline="") as f:
        return next(csv.reader(f))


def _write_csv(path, records: list[dict], header: list[str] | None) -> None:
    """CSV cells are text: strings are written as they are, nulls as empty cells, other
    values as JSON (so message lists are read back by :func:`load_pool`)."""
    if header is None:
        header = list(dict.fromkeys(k for rec in records for k in rec))

    def cell(v: Any) -> str:
        return v if isinstance(v, str) else "" if v is None else _dumps(v, path)

    with atomic_open(path) as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for rec in records:
            writer.writerow([cell(rec.get(k)) for k in header])


def _convert(build, path):
    try:
        return build()
    except (TypeError, ValueError, ArithmeticError) as e:  # pyarrow errors derive from these
        raise OutputError(f"cannot write {path}: the records do not fit one table schema "
                          f"({type(e).__name__}: {e}); write JSON Lines instead") from e
