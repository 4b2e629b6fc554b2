"""What each method's removal in a dropped-carry repair experiment takes out of the pool: per
method, the removed records counted by kind (harmful, carry problems answered right, no-carry
problems) and by surface form, beside the probes' own: the records whose question is
phrased as a probe's and those whose answer is written in the probes' answer form. A form is
the text with every number replaced by ``N`` and a final full stop left out. Means over the
data seeds; read from the run folder's kept sets (``<targets>/removal/k<PCT>/<method>/
kept.jsonl``); nothing is trained or scored.

    python experiments/removal_composition.py RUN_DIR [--removal 20] [--targets probes] [--json OUT.json]

A removal that takes few harmful records but repairs more than random's may be taking those
the probes resemble most: the harmful records in the probes' answer form.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prism_select.evaluation.experiment import read_jsonl  # noqa: E402

#: the columns, in the table's order
COLUMNS = ["removed", "harmful", "carry_right", "no_carry", "probe_question", "probe_answer",
           "harmful_probe_question", "harmful_probe_answer"]


def form(text: str) -> str:
    """``text`` with every number as ``N`` and a final full stop left out."""
    return re.sub(r"\d+", "N", text.strip()).rstrip(".")


def probe_forms(probes: list) -> tuple[set, set]:
    """The behaviour probes' question forms and answer forms (their true and harmful answers)."""
    questions = {form(p["prompt"]) for p in probes if "harmful_response" in p}
    answers = {form(p[k]) for p in probes for k in ("true_response", "harmful_response") if k in p}
    return questions, answers


def composition(removed: list, questions: set, answers: set) -> Counter:
    """The counts of one removal (the removed pool records)."""
    c = Counter(removed=len(removed))
    for r in removed:
        q, a = form(r["prompt"]) in questions, form(r["response"]) in answers
        c["probe_question"] += q
        c["probe_answer"] += a
        if r["harmful"]:
            c["harmful"] += 1
            c["harmful_probe_question"] += q
            c["harmful_probe_answer"] += a
        elif r.get("carry"):
            c["carry_right"] += 1
        else:
            c["no_carry"] += 1
    return c


def rows(run_dir: Path, removal: int, targets: str = "probes") -> dict:
    """``method -> {"seeds": [...], column: mean over the seeds}``."""
    per: dict = {}
    for seed_dir in sorted(run_dir.glob("runs/*/seed*")):
        pool = read_jsonl(seed_dir / "pool.jsonl")
        questions, answers = probe_forms(read_jsonl(seed_dir / "probes.jsonl"))
        for kept_path in sorted((seed_dir / targets / "removal" / f"k{removal}").glob("*/kept.jsonl")):
            kept = {r["id"] for r in read_jsonl(kept_path)}
            c = composition([r for r in pool if r["id"] not in kept], questions, answers)
            per.setdefault(kept_path.parent.name, []).append((seed_dir.name, c))
    return {m: {"seeds": [s for s, _ in got], **{k: sum(c[k] for _, c in got) / len(got) for k in COLUMNS}}
            for m, got in per.items()}


def markdown(table: dict, removal: int) -> str:
    head = ("| method (top {r}% removed) | seeds | removed | harmful | carry, right | no carry | "
            "probe question | probe answer form | harmful, probe question | harmful, probe answer form |").format(r=removal)
    lines = [head, "|---" * (len(COLUMNS) + 2) + "|"]
    for m, row in sorted(table.items()):
        lines.append(f"| {m} | {len(row['seeds'])} | " + " | ".join(f"{row[k]:.1f}" for k in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--removal", type=int, default=20, help="the removal's percentage (its k<PCT> folder)")
    ap.add_argument("--targets", default="probes", help="the target set whose removals are read")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    table = rows(a.run_dir, a.removal, a.targets)
    if not table:
        print(f"no removals under {a.run_dir}/runs/*/seed*/{a.targets}/removal/k{a.removal}/", file=sys.stderr)
        return 1
    print(markdown(table, a.removal))
    if a.json:
        a.json.write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
