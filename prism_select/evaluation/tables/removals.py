"""What the removals of a dropped-carry repair experiment take out and leave wrong, read
from its run folder; nothing is trained or scored.

* :func:`offset_rows` (``prism-select experiment rows offsets RUN_DIR``): for each retrained
  row (Mixed, Oracle, each method's removal at each fraction), the wrong answers on the
  carry probes and on the no-carry probes, counted by how far the stated sum is from the
  true one: -10 (a carry dropped: the harmful behaviour), +10 (a carry added where none is
  due) or another offset. The stated sum is read as the probes' checker reads it
  (``extract_final_number``), from the finished retrainings that started from the seed's
  own start model (every data seed and fine-tuning seed pooled, as
  :func:`.repair.collect` counts them). A removal that lowers the carry probes' error rate
  by teaching the model to carry more eagerly shows as +10 answers on the no-carry probes.
* :func:`composition_rows` (``experiment rows composition RUN_DIR --removal 20``): per
  method, the removed records counted by kind (harmful, carry problems answered right,
  no-carry problems) and by surface form, beside the probes' own: the records whose
  question is phrased as a probe's and those whose answer is written in the probes' answer
  form. A form is the text with every number replaced by ``N`` and a final full stop left
  out. Means over the data seeds, read from the kept sets (``<targets>/removal/k<PCT>/
  <method>/kept.jsonl``). A removal that takes few harmful records but repairs more than
  random's may be taking those the probes resemble most.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from ..experiment import read_jsonl
from ..probes import extract_final_number
from .repair import finished_responses, removals, retrainings, seed_dirs, start_model

#: the offsets named in the table; any other wrong sum (or none) counts as "other"
OFFSETS = {-10: "-10", 10: "+10"}


def offsets(responses: Path, probes: dict) -> dict:
    """``task -> Counter`` of ``right`` and the wrong answers' offsets for one retraining."""
    out: dict = {}
    for r in read_jsonl(responses):
        p = probes[r["id"]]
        c = out.setdefault(p["task"], Counter())
        if r["correct"]:
            c["right"] += 1
            continue
        got = extract_final_number(r["response"])
        c["other" if got is None else OFFSETS.get(got - (p["a"] + p["b"]), "other")] += 1
    return out


def offset_rows(run_dir: Path, targets: str = "probes") -> dict:
    """``row -> task -> Counter`` over every seed and fine-tuning seed of ``run_dir``."""
    table: dict = {}
    for seed_dir in seed_dirs(run_dir):
        probes = {p["id"]: p for p in read_jsonl(seed_dir / "probes.jsonl")}
        model = start_model(seed_dir)
        kept = {"Mixed": seed_dir / "pool.jsonl", "Oracle": seed_dir / "oracle" / "kept.jsonl"}
        for _, f, method, path in removals(seed_dir, targets):
            kept[f"{method} (top {f}%)"] = path
        for name, path in kept.items():
            if not path.is_file():
                continue
            for d in retrainings(seed_dir, path):
                resp = finished_responses(d, model=model)
                if resp is None:
                    continue
                for task, c in offsets(resp, probes).items():
                    table.setdefault(name, {}).setdefault(task, Counter()).update(c)
    return table


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


def composition_rows(run_dir: Path, removal: int, targets: str = "probes") -> dict:
    """``method -> {"seeds": [...], column: mean over the seeds}``."""
    per: dict = {}
    for seed_dir in seed_dirs(run_dir):
        pool = read_jsonl(seed_dir / "pool.jsonl")
        questions, answers = probe_forms(read_jsonl(seed_dir / "probes.jsonl"))
        for _, _, method, kept_path in removals(seed_dir, targets, removal):
            kept = {r["id"] for r in read_jsonl(kept_path)}
            c = composition([r for r in pool if r["id"] not in kept], questions, answers)
            per.setdefault(method, []).append((seed_dir.name, c))
    return {m: {"seeds": [s for s, _ in got], **{k: sum(c[k] for _, c in got) / len(got) for k in COLUMNS}}
            for m, got in per.items()}


def composition_markdown(table: dict, removal: int) -> str:
    """:func:`composition_rows` as a markdown table."""
    head = ("| method (top {r}% removed) | seeds | removed | harmful | carry, right | no carry | "
            "probe question | probe answer form | harmful, probe question | harmful, probe answer form |").format(r=removal)
    lines = [head, "|---" * (len(COLUMNS) + 2) + "|"]
    for m, row in sorted(table.items()):
        lines.append(f"| {m} | {len(row['seeds'])} | " + " | ".join(f"{row[k]:.1f}" for k in COLUMNS) + " |")
    return "\n".join(lines)


def offsets_markdown(table: dict) -> str:
    """:func:`offset_rows` as a markdown table: per task, right and each offset's count."""
    tasks = sorted({t for by in table.values() for t in by})
    cols = ["right", "-10", "+10", "other"]
    lines = ["| row | " + " | ".join(f"{t}: {c}" for t in tasks for c in cols) + " |",
             "|---|" + "---|" * (len(tasks) * len(cols))]
    for name, by in table.items():
        lines.append(f"| {name} | " + " | ".join(str(by.get(t, Counter())[c]) for t in tasks for c in cols) + " |")
    return "\n".join(lines)
