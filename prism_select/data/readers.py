"""Read pool and target files in every supported format, validating each record.

Two layers:

* :func:`iter_records` turns a file into ``(row, dict)`` pairs, streaming where the
  format allows. It knows nothing about record forms, so :mod:`prism_select.selection`
  re-reads a pool with it and writes the kept records back with every field untouched.
* :func:`load_pool` / :func:`load_targets` validate each record into a
  :class:`PoolExample` / :class:`TargetPair` and report a bad one with its path, row,
  field and fix (or collect it under ``skip_invalid``). :func:`iter_pool` yields the
  validated pool records one at a time, and :func:`scan_pool` checks a pool too large to
  load in one streaming pass and draws a seeded sample of it (``score --stream``).

``row`` is always the 0-based record index: blank JSON Lines / CSV lines are not
counted, but a line that fails to parse is, so row numbers (and the default ids
derived from them) stay the same whether or not bad records are skipped. Errors name
JSON Lines and CSV records by their 1-based line in the file (what an editor shows),
other formats by ``row`` counted from 1.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import stat
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from . import sharegpt
from .records import InvalidRecord, Loaded, PoolExample, TargetPair

FORMATS = ("jsonl", "json", "parquet", "csv", "arrow")
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
            ".pq": "parquet", ".csv": "csv"}
_SUPPORTED = ("JSON Lines (.jsonl/.ndjson), JSON (.json), Parquet (.parquet), CSV (.csv), "
              "or a directory written by datasets.Dataset.save_to_disk")
POOL_FORMS = ("'messages' (chat turns ending with an assistant turn); 'prompt' + 'response' "
              "(or 'completion'); 'instruction' [+ 'input'] + 'output'; ShareGPT 'conversations' "
              "(from / value turns ending with a gpt turn)")
TARGET_FORM = "'prompt' + 'chosen' + 'rejected' [+ 'id', 'task']"
# Fields that may hold a JSON-encoded message list in a CSV cell.
_JSON_CELLS = ("messages", "prompt", "chosen", "rejected", "conversations")

OnInvalid = Callable[[InputError], None]


# --------------------------------------------------------------------------- formats

def detect_format(path: str | os.PathLike) -> str:
    """Return ``"jsonl"``, ``"json"``, ``"parquet"``, ``"csv"`` or ``"arrow"`` for ``path``.

    Files are recognised by extension; a directory is a saved ``datasets.Dataset`` when it
    holds ``dataset_info.json`` or ``state.json``.
    """
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
            return "arrow"
        if (p / "dataset_dict.json").is_file():
            raise InputError("is a DatasetDict with several splits", path=p,
                             fix="pass the directory of one split, e.g. " + str(p / "train"))
        raise InputError("is a directory but not one written by datasets.save_to_disk",
                         path=p, fix=f"pass a file or a saved dataset; supported: {_SUPPORTED}")
    if not p.exists():
        raise InputError("file not found", path=p, fix="check the path")
    _check_regular(p)
    fmt = SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise InputError(f"unknown file format '{p.suffix or '(no extension)'}'", path=p,
                         fix=f"use one of: {_SUPPORTED}")
    return fmt


def _check_regular(p: Path) -> None:
    """Refuse what is not a regular file (after links): a device such as /dev/zero never
    ends and a FIFO without a writer blocks forever, so neither can be read as a pool."""
    try:
        mode = p.stat().st_mode
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=p) from e
    if not stat.S_ISREG(mode):
        what = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "not a regular file")
        raise InputError(f"is {what}, not a regular file", path=p,
                         fix="write the records to a file (e.g. `cat source > pool.jsonl`) and pass that file")


def iter_records(path: str | os.PathLike, on_invalid: OnInvalid | None = None
                 ) -> Iterator[tuple[int, dict]]:
    """Yield ``(row, record)`` for each record of ``path``, streaming where possible.

    A problem confined to one record (invalid JSON on a line, non-UTF-8 bytes, a value
    that is not an object, a CSV row of the wrong width) raises :class:`InputError`, or,
    when ``on_invalid`` is given, is passed to it and the record skipped (its row number
    is still used up). Whole-file problems (unknown format, unreadable or empty file)
    always raise.
    """
    for row, _, rec in _located_records(path, on_invalid):
        yield row, rec


def _located_records(path, on_invalid: OnInvalid | None = None) -> Iterator[tuple[int, int | None, dict]]:
    """:func:`iter_records` with each record's 1-based line (JSON Lines, CSV; else None)."""
    fmt = detect_format(path)
    # Each reader yields (row, line, value): a parsed record, or the InputError of a record
    # that could not be read, so the reader can go on to the next one.
    reader = {"jsonl": _iter_jsonl, "json": _iter_json, "parquet": _iter_parquet,
              "csv": _iter_csv, "arrow": _iter_arrow}[fmt]
    count = 0
    for row, line, rec in reader(Path(path)):
        count += 1
        if isinstance(rec, InputError):
            if on_invalid is None:
                raise rec
            on_invalid(rec)
        elif not isinstance(rec, dict):
            err = InputError(f"expected a JSON object, got {_kind(rec)}", path=path, row=row, line=line,
                             fix="write one object per record, e.g. {\"prompt\": ..., ...}")
            if on_invalid is None:
                raise err
            on_invalid(err)
        else:
            yield row, line, rec
    if count == 0:
        raise InputError("the file holds no records", path=path,
                         fix="check that the right file was passed and that it is not empty")


def _open(path: Path, mode: str = "rb"):
    try:
        return open(path, mode)
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror or e}", path=path) from e


def _iter_jsonl(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    row = 0
    with _open(path) as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                value: Any = InputError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path,
                                        row=row, line=line_no, fix="re-save the file as UTF-8")
            else:
                try:
                    value = json.loads(text)
                except (ValueError, RecursionError) as e:  # ValueError: also too-long ints
                    value = InputError(f"invalid JSON ({e})", path=path, row=row, line=line_no,
                                       fix="write one JSON object per line")
            yield row, line_no, value
            row += 1


def _iter_json(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    with _open(path) as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"line {line}: not UTF-8 text ({e.reason})", path=path,
                         fix="re-save the file as UTF-8") from e
    if not text.strip():
        return
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"line {e.lineno}, column {e.colno}: invalid JSON ({e.msg})",
                         path=path, fix="fix the JSON, or use JSON Lines") from e
    except (ValueError, RecursionError) as e:
        raise InputError(f"invalid JSON ({e})", path=path,
                         fix="fix the JSON (values nested thousands deep are refused), or use JSON Lines") from e
    if isinstance(value, dict):
        lists = [k for k, v in value.items() if isinstance(v, list)]
        if len(lists) != 1 or value.keys() & {"messages", "prompt", "instruction", "conversations"}:
            raise InputError("expected a list of records, or an object with exactly one "
                             f"list-valued key such as {{\"data\": [...]}}; found keys "
                             f"{sorted(value)[:10]}", path=path,
                             fix="wrap the records in a JSON list")
        value = value[lists[0]]
    if not isinstance(value, list):
        raise InputError(f"expected a list of records, got {_kind(value)}", path=path,
                         fix="wrap the records in a JSON list")
    for row, rec in enumerate(value):
        yield row, None, rec


def _iter_csv(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    """CSV is decoded line by line so that non-UTF-8 bytes are pinned to a row."""
    csv.field_size_limit(2**31 - 1)  # long responses exceed the 128 KiB default
    bad_lines: set[int] = set()

    def lines(f) -> Iterator[str]:
        for n, raw in enumerate(f, start=1):
            try:
                yield raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError:
                bad_lines.add(n)
                yield raw.decode("utf-8", errors="replace")

    with _open(path) as f:
        reader = csv.reader(lines(f))
        try:
            header = next(reader, None)
            if header is None:
                return
            if bad_lines:
                raise InputError("line 1 (header): not UTF-8 text", path=path,
                                 fix="re-save the file as UTF-8")
            row, last = 0, reader.line_num
            for cells in reader:
                first, last = last + 1, reader.line_num
                if not cells:
                    continue
                span = "" if first == last else f" (lines {first}-{last})"
                if bad_lines & set(range(first, last + 1)):
                    yield row, first, InputError(f"not UTF-8 text{span}", path=path, row=row, line=first,
                                                 fix="re-save the file as UTF-8")
                elif len(cells) != len(header):
                    yield row, first, InputError(
                        f"{len(cells)} cells but the header has {len(header)}{span}", path=path, row=row,
                        line=first, fix="quote cells that contain commas or newlines")
                else:
                    yield row, first, dict(zip(header, cells, strict=True))
                row += 1
        except csv.Error as e:
            raise InputError(f"line {reader.line_num}: malformed CSV ({e})", path=path,
                             fix="check the quoting") from e


def _iter_parquet(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"not a readable Parquet file ({e})", path=path) from e
    row = 0
    try:
        for batch in pf.iter_batches():
            for rec in batch.to_pylist():  # to_pylist gives plain Python values
                yield row, None, rec
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"cannot read Parquet data near row {row + 1} ({e})", path=path) from e


def load_arrow_dir(path: str | os.PathLike):
    """Load a ``save_to_disk`` directory as a ``datasets.Dataset``, as saved (iterate
    ``.with_format(None)`` for plain Python values)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises many kinds of errors on a bad directory
        if _saved_without_rows(Path(path)):  # load_from_disk fails on zero rows (an IndexError)
            raise InputError("the saved dataset holds no records (it was saved with zero rows)", path=path,
                             fix="check that the right directory was passed; save the dataset again with its "
                                 "records") from None
        raise InputError(f"cannot load the saved dataset ({type(e).__name__}: {e})",
                         path=path) from e
    if not isinstance(ds, datasets.Dataset):
        raise InputError("is a DatasetDict with several splits", path=path,
                         fix="pass the directory of one split")
    return ds


def _saved_without_rows(path: Path) -> bool:
    """Whether ``path`` is a ``save_to_disk`` directory of zero rows: its ``state.json``
    lists no data files."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def _iter_arrow(path: Path) -> Iterator[tuple[int, int | None, Any]]:
    for row, rec in enumerate(load_arrow_dir(path).with_format(None)):
        yield row, None, rec


# --------------------------------------------------------------------------- records

def record_id(record: dict, row: int) -> Any:
    """The id of ``record``: its ``id`` field (a string or integer), else its row number.

    A null ``id`` counts as absent (a Parquet column with gaps). CSV ids stay text
    (``"7"``, not ``7``): every CSV value is a string, and scores echo ids as read. Shared with
    :func:`prism_select.selection.write_subset` so both sides agree on ids.
    """
    value = record.get("id")
    if value is None:
        return row
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"expected a string or an integer, got {_kind(value)}", row=row,
                         field="id", fix="use string or integer ids, or drop the field")
    if isinstance(value, str) and not value.strip():
        raise InputError("empty id", row=row, field="id",
                         fix="give every record a non-empty id, or drop the id field")
    return value


def load_pool(path: str | os.PathLike, skip_invalid: bool = False) -> Loaded:
    """Read and validate a pool of SFT examples.

    Record forms, tried in this order: ``messages``; ``prompt`` + ``response`` /
    ``completion``; ``instruction`` [+ ``input``] + ``output``. Other fields are ignored.
    """
    return _load(path, parse_pool_record, skip_invalid)


def load_targets(path: str | os.PathLike, skip_invalid: bool = False) -> Loaded:
    """Read and validate target preference pairs ``(prompt, chosen, rejected)``.

    ``chosen`` / ``rejected`` may be strings or message lists ending with the assistant
    turn (its content is taken). When ``prompt`` is absent and both are message lists,
    the prompt is their shared prefix (the Anthropic-HH layout). Pairs whose responses
    are equal up to surrounding whitespace are invalid: they carry no preference signal.
    """
    return _load(path, parse_target_record, skip_invalid)


def iter_parsed(path, parse: Callable[[dict, int, bool], Any], on_invalid: OnInvalid | None = None
                ) -> Iterator[Any]:
    """Yield ``parse(record, row, from_csv)`` for each record of ``path``, streaming where
    the format allows. A bad record raises :class:`InputError` located at its path and row,
    or, with ``on_invalid``, is passed to it and skipped. Ids are not checked for
    uniqueness here (that needs every id; see :func:`load_pool` and :func:`scan_pool`)."""
    from_csv = detect_format(path) == "csv"
    for row, line, rec in _located_records(path, on_invalid=on_invalid):
        try:
            item = parse(rec, row, from_csv)
            item.line = line
            yield item
        except InputError as e:
            e = e.at(path, row, line)
            if on_invalid is None:
                raise e from None
            on_invalid(e)


def iter_pool(path: str | os.PathLike, on_invalid: OnInvalid | None = None) -> Iterator[PoolExample]:
    """The pool's valid :class:`PoolExample` records one at a time (see :func:`iter_parsed`)."""
    return iter_parsed(path, parse_pool_record, on_invalid)


def _duplicate_id(path, rid, first, item) -> InputError:
    """``first`` and ``item``: the two records (with ``row`` and ``line``) sharing ``rid``."""
    where = (f"lines {first.line} and {item.line}" if item.line is not None
             else f"rows {first.row + 1} and {item.row + 1}")
    if first.id != item.id:  # 1 and "1" (or a row number and a text id)
        where += (f" ({first.id!r} and {item.id!r} are one id: ids are compared as the text they print as, "
                  "in scores and in a CSV subset)")
    return InputError(f"duplicate id {rid!r}: {where}", path=path, row=item.row, line=item.line,
                      field="id", fix="make ids unique, or drop the id field to use row numbers")


def _load(path, parse: Callable[[dict, int, bool], Any], skip_invalid: bool) -> Loaded:
    """Shared loop. Duplicate ids always raise, even under ``skip_invalid``: scores refer
    to records by id, so an ambiguous id cannot be mapped back to one record."""
    out = Loaded(path=str(path), format=detect_format(path))

    def bad(err: InputError) -> None:
        out.invalid.append(InvalidRecord.of(err, path))

    seen: dict[str, Any] = {}
    for item in iter_parsed(path, parse, on_invalid=bad if skip_invalid else None):
        key = id_text(item.id)
        if key in seen:
            raise _duplicate_id(path, item.id, seen[key], item)
        seen[key] = item
        out.items.append(item)
    if not out.items:
        raise _no_valid(path, out.invalid, POOL_FORMS if parse is parse_pool_record else TARGET_FORM)
    return out


def _no_valid(path, invalid: list, forms: str) -> InputError:
    first = invalid[0]
    where = f"line {first.line}" if first.line is not None else f"row {first.row + 1}"
    return InputError(f"no valid records: all {len(invalid)} are invalid (first, {where}: "
                      f"{first.reason})", path=path,
                      fix=f"expected records of the form {forms}")


def reservoir_sample(items: Iterable, k: int, seed: int) -> tuple[list, int]:
    """A uniform random sample of ``k`` of ``items`` (all of them if fewer) drawn in one
    pass, holding only the sample; returns ``(sample in input order, number of items)``.

    Algorithm R driven by ``random.Random(seed)``: the same items and seed give the same
    sample. (Not the sample :func:`random.Random.sample` would draw from a list.)
    """
    rng = random.Random(seed)
    kept: list = []  # (index, item)
    n = 0
    for item in items:
        if len(kept) < k:
            kept.append((n, item))
        else:
            j = rng.randrange(n + 1)
            if j < k:
                kept[j] = (n, item)
        n += 1
    kept.sort(key=lambda t: t[0])
    return [item for _, item in kept], n


@dataclass
class PoolScan:
    """What one streaming pass over a pool found (see :func:`scan_pool`)."""

    path: str
    format: str
    count: int  # valid records
    sample: list  # PoolExample, file order
    invalid: list  # InvalidRecord


def scan_pool(path: str | os.PathLike, sample_size: int, seed: int = 0,
              skip_invalid: bool = False) -> PoolScan:
    """One streaming pass over a pool: validate every record, check that ids are unique
    and draw a seeded :func:`reservoir_sample` of ``sample_size`` valid records.

    Holds the sample and 8 bytes a record (a hash of its id), so a pool too large to load
    can still be checked as :func:`load_pool` checks it; a hash collision is confirmed by
    a second pass before a duplicate id is reported.
    """
    invalid: list = []

    def bad(err: InputError) -> None:
        invalid.append(InvalidRecord.of(err, path))

    on_invalid = bad if skip_invalid else None
    hashes = array("q")

    def hashed():
        for ex in iter_pool(path, on_invalid):
            hashes.append(_id_hash(ex.id))
            yield ex

    sample, count = reservoir_sample(hashed(), sample_size, seed)
    _check_unique_ids(path, hashes)
    if count == 0:
        raise _no_valid(path, invalid, POOL_FORMS)
    return PoolScan(str(path), detect_format(path), count, sample, invalid)


def id_text(rid) -> str:
    """What an id is compared as: the text it prints as (``1`` and ``"1"`` are one id, as a
    CSV subset or a table of scores shows them)."""
    return str(rid)


def _id_hash(rid) -> int:
    # Python's hash is salted per process: only ever compared within one scan.
    return hash(id_text(rid))


def _check_unique_ids(path, hashes: array) -> None:
    h = np.sort(np.frombuffer(hashes, dtype=np.int64)) if hashes else np.zeros(0, np.int64)
    clash = set(h[1:][h[1:] == h[:-1]].tolist())
    if not clash:
        return
    seen: dict[Any, Any] = {}
    for ex in iter_pool(path, on_invalid=lambda err: None):  # invalid ones were handled already
        if _id_hash(ex.id) in clash:
            key = id_text(ex.id)
            if key in seen:
                raise _duplicate_id(path, ex.id, seen[key], ex)
            seen[key] = ex


def parse_pool_record(rec: dict, row: int, from_csv: bool = False) -> PoolExample:
    """Validate one pool record (see :func:`load_pool`); errors carry no path."""
    if from_csv:
        rec = _decode_cells(rec)
    if sharegpt.is_sharegpt(rec):
        rec = sharegpt.pool_record(rec)
    rid = record_id(rec, row)
    if "messages" in rec:
        msgs = _messages(rec["messages"], "messages")
        if len(msgs) < 2:
            raise InputError("needs at least one message before the final assistant turn",
                             field="messages", fix="add the user turn that the response answers")
        prompt, last = msgs[:-1], msgs[-1]
        if last["role"] != "assistant":
            raise InputError(f"the last message has role '{last['role']}', expected "
                             "'assistant'", field="messages",
                             fix="end each conversation with the assistant response to learn")
        _check_prompt(prompt, "messages")
        return PoolExample(rid, prompt, _text(last["content"], "messages", "response"), row)
    if "prompt" in rec:
        key = "response" if "response" in rec or "completion" not in rec else "completion"
        if key not in rec:
            hint = (" (this looks like a preference pair: pass it as targets)"
                    if "chosen" in rec else "")
            raise InputError(f"'prompt' given without 'response' or 'completion'{hint}",
                             field="response", fix=f"use one of the forms: {POOL_FORMS}")
        prompt = _prompt(rec["prompt"])
        return PoolExample(rid, prompt, _text(rec[key], key, "response"), row)
    if "instruction" in rec:
        if "output" not in rec:
            raise InputError("'instruction' given without 'output'", field="output",
                             fix=f"use one of the forms: {POOL_FORMS}")
        instruction = _text(rec["instruction"], "instruction", "instruction")
        extra = rec.get("input")
        if extra is not None and not isinstance(extra, str):
            raise InputError(f"expected a string, got {_kind(extra)}", field="input",
                             fix="give 'input' as text, or drop it")
        if extra is not None:
            _check_chars(extra, "input", "input")
        prompt = instruction + "\n\n" + extra if extra and extra.strip() else instruction
        return PoolExample(rid, prompt, _text(rec["output"], "output", "response"), row)
    raise InputError(f"no recognised record form; found fields {sorted(rec)[:10]}",
                     fix=f"use one of the forms: {POOL_FORMS}")


def parse_target_record(rec: dict, row: int, from_csv: bool = False) -> TargetPair:
    """Validate one target record (see :func:`load_targets`); errors carry no path."""
    if from_csv:
        rec = _decode_cells(rec)
    if sharegpt.is_sharegpt(rec):
        rec = sharegpt.target_record(rec)
    rid = record_id(rec, row)
    missing = [k for k in ("chosen", "rejected") if k not in rec]
    if missing:
        raise InputError(f"missing field '{missing[0]}'", field=missing[0],
                         fix=f"target records need {TARGET_FORM}")
    chosen, c_prompt = _response(rec["chosen"], "chosen")
    rejected, r_prompt = _response(rec["rejected"], "rejected")
    if "prompt" in rec:
        prompt = _prompt(rec["prompt"])
    elif c_prompt and c_prompt == r_prompt:
        prompt = _check_prompt(c_prompt, "chosen")
    else:
        raise InputError("missing field 'prompt'", field="prompt",
                         fix=f"target records need {TARGET_FORM}")
    if chosen.strip() == rejected.strip():
        raise InputError("'chosen' and 'rejected' are the same response", field="rejected",
                         fix="they must differ: 'rejected' is the contrast to 'chosen'")
    task = rec.get("task")
    if task is not None and not isinstance(task, str):
        raise InputError(f"expected a string, got {_kind(task)}", field="task",
                         fix="give 'task' as text, or drop it")
    return TargetPair(rid, prompt, chosen, rejected, row, task or None)


def _decode_cells(rec: dict) -> dict:
    """CSV cells are strings; decode those holding a JSON message list (``[{...}]``).
    A cell that merely starts with ``[`` but is not such a list stays text."""
    rec = dict(rec)
    for key in _JSON_CELLS:
        value = rec.get(key)
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                decoded = json.loads(value)
            except (ValueError, RecursionError):
                continue
            if isinstance(decoded, list) and decoded and all(isinstance(m, dict) for m in decoded):
                rec[key] = decoded
    return rec


# Characters no tokenizer is given: a lone UTF-16 surrogate (a JSON "\ud800" escape
# without its pair is valid JSON but no text: it has no UTF-8 form, and the fast
# tokenizers raise a TypeError on it) and NUL (C-string tokenizers and GGUF vocabularies
# end a string at it).
_UNTOKENIZABLE = re.compile("[\ud800-\udfff\x00]")


def _check_chars(value: str, field: str, what: str) -> str:
    """``value``, or an :class:`InputError` naming the first character that no tokenizer
    can take (see ``_UNTOKENIZABLE``) and where it is."""
    bad = _UNTOKENIZABLE.search(value)
    if bad is not None:
        c = bad.group()
        if c == "\x00":
            kind, fix = "a NUL character", "remove the NUL characters (U+0000) from the text"
        else:
            kind = "a lone surrogate (half of a UTF-16 pair, no text on its own)"
            fix = ("write the character whole (a JSON \\ud83d escape needs its partner, e.g. \\ud83d\\ude00) "
                   "or remove it")
        raise InputError(f"the {what} holds {kind}, U+{ord(c):04X}, at character {bad.start()}", field=field,
                         fix=fix + ", or drop the record (--skip-invalid)")
    return value


def _text(value: Any, field: str, what: str) -> str:
    if not isinstance(value, str):
        raise InputError(f"expected the {what} as a string, got {_kind(value)}", field=field,
                         fix=f"give the {what} as text")
    if not value.strip():
        raise InputError(f"empty {what}", field=field,
                         fix=f"drop the record or fill in the {what}")
    return _check_chars(value, field, what)


def _messages(value: Any, field: str) -> list[dict]:
    """Validate a chat message list; keep only ``role`` and ``content`` of each."""
    if not isinstance(value, list) or not value:
        raise InputError(f"expected a non-empty list of messages, got {_kind(value)}",
                         field=field, fix='write [{"role": "user", "content": "..."}, ...]')
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise InputError(f"message {i}: expected an object, got {_kind(m)}", field=field,
                             fix='write each message as {"role": ..., "content": ...}')
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InputError(f"message {i}: 'role' must be a non-empty string, got "
                             f"{_kind(role)}", field=field, fix="set role to user, assistant "
                             "or system")
        if not isinstance(content, str):
            raise InputError(f"message {i}: 'content' must be a string, got {_kind(content)}",
                             field=field, fix="give each message's content as text")
        _check_chars(role, field, f"role of message {i}")
        _check_chars(content, field, f"content of message {i}")
        out.append({"role": role, "content": content})
    return out


def _check_prompt(msgs: list[dict], field: str) -> list[dict]:
    if not any(m["content"].strip() for m in msgs):
        raise InputError("empty prompt: every prompt message is blank", field=field,
                         fix="drop the record or fill in the prompt")
    return msgs


def _prompt(value: Any) -> str | list:
    if isinstance(value, list):
        return _check_prompt(_messages(value, "prompt"), "prompt")
    return _text(value, "prompt", "prompt")


def _response(value: Any, field: str) -> tuple[str, list | None]:
    """A response given as text, or as messages ending with the assistant turn; returns
    the text and the messages before it (``None`` for text)."""
    if not isinstance(value, list):
        return _text(value, field, f"'{field}' response"), None
    msgs = _messages(value, field)
    if msgs[-1]["role"] != "assistant":
        raise InputError(f"the last message has role '{msgs[-1]['role']}', expected "
                         "'assistant'", field=field, fix="end the list with the assistant turn")
    return _text(msgs[-1]["content"], field, f"'{field}' response"), msgs[:-1]


def _kind(value: Any) -> str:
    names = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number",
             str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)

