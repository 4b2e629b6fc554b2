"""What each method's top fraction holds, from the run folders of a multitask select
experiment (its fine-tuning finished or not): per seed, target task and
method with a ``scores.jsonl``, the share of the selection from the target task and the
share that answers wrong (``mislabeled`` pool records), whether the task's right records
rank above its wrong ones, whether its records giving the task's most common answer rank
above those giving the second (``by_answer``) and which answers the selection holds, the
split-half check's choice, the method's recorded step times and, once the selection is
fine-tuned, what the model answers the held-out probes (``heldout``: accuracy and the
first words of its responses). Prints a table of the means over the (seed, task)
pairs and writes every row as JSON.

    python experiments/selection_shares.py RUN_DIR [RUN_DIR ...] --fraction 0.05 --json out.json

RUN_DIR: an experiment folder (``runs/seed<k>/<task>/scores/<method>/``, or
``runs/seed<k>/scores/<method>/`` for a run of one target task); a seed, task and method
found in several folders is read from the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

from prism_select.evaluation.experiment import read_jsonl
from prism_select.evaluation_metrics import auroc


def _wrong_among(records: list, task: str) -> float | None:
    """The share of ``records`` of ``task`` that answer wrong (None without any)."""
    of_task = [r for r in records if r.get("task") == task]
    return sum(bool(r.get("mislabeled")) for r in of_task) / len(of_task) if of_task else None


def auroc_of(pos: list, neg: list) -> float:
    """AUROC of the scores ``pos`` over ``neg`` (ties count one half)."""
    return auroc(pos + neg, [True] * len(pos) + [False] * len(neg))


def _by_answer(pool: dict, score: dict, task: str) -> dict | None:
    """AUROC of the task's records giving its most common answer over those giving the
    second (responses compared stripped and lower-cased), or None with fewer than two."""
    by: dict = {}
    for i, r in pool.items():
        if r.get("task") == task:
            by.setdefault(str(r.get("response", "")).strip().lower(), []).append(score[i])
    top = sorted(by, key=lambda k: -len(by[k]))[:2]
    if len(top) < 2:
        return None
    return {"answer": top[0], "over": top[1], "auroc": auroc_of(by[top[0]], by[top[1]])}


def _first_word(text: str) -> str:
    """A response's first word, lower-cased, without trailing punctuation."""
    words = str(text).strip().split()
    return words[0].strip(".,:;!").lower() if words else ""


def heldout_answers(mdir: Path) -> dict | None:
    """A selection's fine-tuned models' held-out responses (``responses.jsonl``, or one per
    fine-tuning seed under ``ft<seed>/``, pooled): their accuracy and how often each first
    word opens a response (None before any fine-tuning finished)."""
    files = [mdir / "responses.jsonl"] if (mdir / "responses.jsonl").is_file() else sorted(mdir.glob("ft*/responses.jsonl"))
    if not files:
        return None
    rows = [r for f in files for r in read_jsonl(f)]
    return {"accuracy": sum(bool(r.get("correct")) for r in rows) / len(rows) if rows else None,
            "first_words": dict(Counter(_first_word(r.get("response", "")) for r in rows).most_common())}


def _score_dirs(sdir: Path) -> list:
    """A seed's method folders: ``<task>/scores/<method>`` per target task, or
    ``scores/<method>`` where the run selected for one task (its seed folder holds it)."""
    return sorted(sdir.glob("scores/*")) if (sdir / "scores").is_dir() else sorted(sdir.glob("*/scores/*"))


def rows_of(run_dirs: list, fraction: float) -> list:
    rows, seen = [], set()
    for d in run_dirs:
        for sdir in sorted(Path(d).glob("runs/seed*")):
            pool = {r["id"]: r for r in read_jsonl(sdir / "pool.jsonl")}
            k = round(fraction * len(pool))
            for mdir in _score_dirs(sdir):
                tdir, method = mdir.parent.parent, mdir.name
                task = tdir.name if tdir != sdir else read_jsonl(sdir / "targets.jsonl")[0]["task"]
                key = (int(sdir.name[4:]), task, method)
                if key in seen or not (mdir / "scores.jsonl").is_file():
                    continue
                seen.add(key)
                ranked = sorted(read_jsonl(mdir / "scores.jsonl"), key=lambda r: r["rank"])
                score = {r["id"]: r["score"] for r in ranked}
                right = [score[i] for i, r in pool.items() if r.get("task") == task and not r.get("mislabeled")]
                wrong = [score[i] for i, r in pool.items() if r.get("task") == task and r.get("mislabeled")]
                top = [pool[r["id"]] for r in ranked[:k]]
                run = json.loads((mdir / "run.json").read_text()) if (mdir / "run.json").is_file() else {}
                check = (run.get("curvature") or {}).get("split_half")
                rows.append({"seed": key[0], "task": task, "method": method, "pool": len(pool), "selected": k,
                             "target_task_share": sum(r.get("task") == task for r in top) / k,
                             "mislabeled_share": sum(bool(r.get("mislabeled")) for r in top) / k,
                             "wrong_among_target_task": _wrong_among(top, task),
                             # does the method rank the task's right records above its wrong ones?
                             "auroc_right_over_wrong": auroc_of(right, wrong) if right and wrong else None,
                             # or by which answer they give?
                             "by_answer": _by_answer(pool, score, task),
                             "answers_selected": dict(Counter(str(r.get("response", "")).strip().lower()
                                                              for r in top if r.get("task") == task)),
                             "pool_wrong_among_target_task": _wrong_among(list(pool.values()), task),
                             "split_half": check,
                             # what the model fine-tuned on the selection answers the task's held-out probes
                             "heldout": heldout_answers(tdir / "selected" / method),
                             "timings_s": {n: round(v, 1) for n, v in (run.get("timings") or {}).items()
                                           if isinstance(v, (int, float))}})
    return sorted(rows, key=lambda r: (r["seed"], r["task"], r["method"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--fraction", type=float, default=0.05)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = rows_of(a.runs, a.fraction)
    pool_wrong = statistics.mean(r["pool_wrong_among_target_task"] for r in rows)
    print(f"the pool's target-task records answering wrong: {pool_wrong:.2f} (mean over the (seed, task) pairs)")
    print("| method | (seed, task) pairs | share of the target task | share answering wrong | "
          "wrong among its target-task records | AUROC, the task's right over its wrong records |")
    print("|---|---|---|---|---|---|")
    for m in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == m]
        share = statistics.mean(r["target_task_share"] for r in mine)
        wrong = statistics.mean(r["mislabeled_share"] for r in mine)
        cond = [r["wrong_among_target_task"] for r in mine if r["wrong_among_target_task"] is not None]
        au = [r["auroc_right_over_wrong"] for r in mine if r["auroc_right_over_wrong"] is not None]
        cells = [f"{statistics.mean(v):.2f}" + (f" ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else "") if v else "-"
                 for v in (cond, au)]
        print(f"| {m} | {len(mine)} | {share:.2f} | {wrong:.2f} | {cells[0]} | {cells[1]} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
