"""Pool and target files in every input format, written for the tests of the readers and
of ``select`` (which writes subsets in each of them)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

FORMATS = ["jsonl", "json", "parquet", "csv", "arrow"]
SUFFIX = {"jsonl": ".jsonl", "json": ".json", "parquet": ".parquet", "csv": ".csv", "arrow": ""}


def write(path: Path, fmt: str, records: list[dict]) -> Path:
    """Write ``records`` to ``path`` (+ suffix) in ``fmt``; CSV JSON-encodes non-strings."""
    path = path.with_name(path.name + SUFFIX[fmt])
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif fmt == "json":
        path.write_text(json.dumps(records), encoding="utf-8")
    elif fmt == "csv":
        header = list(dict.fromkeys(k for r in records for k in r))
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(header)
            for r in records:
                w.writerow([v if isinstance(v, str) else json.dumps(v)
                            for v in (r.get(k, "") for k in header)])
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        import datasets

        datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def write_lines(path: Path, lines: list) -> Path:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path
