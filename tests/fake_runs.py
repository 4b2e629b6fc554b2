"""Run folders as ``prism-select score`` writes them, made without scoring: for the tests
of ``select`` and ``report`` on what a run folder holds."""

import json
from pathlib import Path


def write_jsonl_rows(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def fake_run(run: Path, pool: Path, targets: Path | None = None, scores: list | None = None, **extra) -> Path:
    """A finished score run over ``pool`` as score writes it (absolute inputs, the pool
    file's fingerprint); ``scores``: one per pool record (default: the first ranked first);
    ``extra``: run.json keys to add or replace."""
    from prism_select.io import sha256_file
    recs = [json.loads(line) for line in pool.read_text().splitlines() if line.strip()]
    n = len(recs)
    ids = [r.get("id", i) for i, r in enumerate(recs)]
    scores = scores if scores is not None else [float(n - i) for i in range(n)]
    order = sorted(range(n), key=lambda i: -scores[i])
    run.mkdir(parents=True)
    write_jsonl_rows(run / "scores.jsonl", [{"id": ids[i], "score": scores[i], "rank": order.index(i) + 1}
                                            for i in range(n)])
    info = {"status": "complete", "method": "prism", "counts": {"pool": n, "pairs": 1}, "timings": {"total_s": 1.0},
            "inputs": {"pool": str(pool.absolute()), "targets": str(targets.absolute()) if targets else ""},
            "fingerprints": {"pool_file": sha256_file(pool)}, **extra}
    (run / "run.json").write_text(json.dumps(info))
    return run
