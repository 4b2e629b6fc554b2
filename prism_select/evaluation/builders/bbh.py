"""BIG-Bench Hard (BBH) examples as SFT records, target pairs and held-out probes.

:func:`bbh_splits` takes ``n_targets_per_task`` examples per task as target pairs
(as LESS does with 3 per task) and keeps the rest as held-out probes. A target pair
needs a negative: ``chosen`` is the reference answer and ``rejected`` is

* another option letter, when the answer is an option such as ``(B)``;
* another answer from the task's own small answer set (``Yes``/``No``,
  ``True``/``False``, ``valid``/``invalid``, ...; at most 10 distinct answers);
* the number moved by 1-3 (never below zero for a non-negative answer), for integers;
* else (free text: word sorting, Dyck closings) the answer with two adjacent
  differing words swapped, or a one-word answer reversed (``x`` appended when a
  reversal leaves it unchanged).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from ...errors import ConfigError, InputError


_OPTION_LINE = re.compile(r"^\(([A-Z])\)", re.M)
_OPTION_TARGET = re.compile(r"^\(([A-Z])\)$")


def read_bbh_dir(bbh_dir, tasks=None) -> dict:
    """``{task: [examples]}`` of a BIG-Bench-Hard folder (one ``<task>.json`` each)."""
    d = Path(bbh_dir)
    if not d.is_dir():
        raise InputError("BBH folder not found", path=d, fix="point at the folder of <task>.json files")
    files = sorted(d.glob("*.json"))
    available = {f.stem: f for f in files}
    if tasks:
        missing = [t for t in tasks if t not in available]
        if missing:
            raise ConfigError("tasks", f"not in {d}: {', '.join(missing)}",
                              f"available: {', '.join(sorted(available))}")
        available = {t: available[t] for t in tasks}
    out = {}
    for task, f in available.items():
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:
            raise InputError(f"invalid JSON ({e})", path=f) from e
        ex = data.get("examples") if isinstance(data, dict) else None
        if not isinstance(ex, list) or not ex:
            raise InputError("expected {\"examples\": [{\"input\", \"target\"}, ...]}", path=f)
        for i, e in enumerate(ex):
            if not isinstance(e, dict) or not isinstance(e.get("input"), str) or "target" not in e:
                raise InputError("an example needs 'input' and 'target'", path=f, row=i)
        out[task] = ex
    if not out:
        raise InputError("the folder holds no <task>.json file", path=d)
    return out


def wrong_answer(example: dict, answer_set: list, rng: random.Random) -> str:
    """A wrong answer for a BBH example (see the module docstring)."""
    target = str(example["target"]).strip()
    m = _OPTION_TARGET.match(target)
    if m:
        letters = [x for x in _OPTION_LINE.findall(example["input"]) if x != m.group(1)]
        if not letters:
            letters = [chr(c) for c in range(ord("A"), ord("F")) if chr(c) != m.group(1)]
        return f"({rng.choice(sorted(letters))})"
    others = [a for a in answer_set if a != target]
    if 1 <= len(answer_set) <= 10 and others:
        return rng.choice(sorted(others))
    if re.fullmatch(r"-?\d+", target):
        v = int(target)
        d = rng.randint(1, 3) * rng.choice((-1, 1))
        if v >= 0 and v + d < 0:
            d = abs(d)
        return str(v + d)
    words = target.split()
    pairs = [i for i in range(len(words) - 1) if words[i] != words[i + 1]]
    if pairs:
        i = rng.choice(pairs)
        words[i], words[i + 1] = words[i + 1], words[i]
        return " ".join(words)
    rev = target[::-1]
    return rev if rev != target else target + "x"


def bbh_splits(bbh_dir, n_targets_per_task: int = 3, seed: int = 0, *, tasks=None,
               n_heldout_per_task: int | None = None) -> tuple:
    """``(targets, heldout)`` from a BBH folder.

    Per task (seeded): ``n_targets_per_task`` examples become target pairs (``id``,
    ``prompt`` = input, ``chosen`` = reference answer, ``rejected`` = a wrong answer,
    ``task``); the others (at most ``n_heldout_per_task``) are held-out probes
    (``id``, ``prompt``, ``reference``, ``task``). Ids are ``<task>-<index>``.
    """
    if n_targets_per_task < 1:
        raise ConfigError("n_targets_per_task", f"must be >= 1, got {n_targets_per_task}")
    data = read_bbh_dir(bbh_dir, tasks)
    targets, heldout = [], []
    for task in sorted(data):
        ex = data[task]
        rng = random.Random(f"bbh:{seed}:{task}")
        order = list(range(len(ex)))
        rng.shuffle(order)
        if len(order) <= n_targets_per_task:
            raise InputError(f"task {task} has {len(ex)} examples, too few for {n_targets_per_task} "
                             "targets and a held-out split", path=Path(bbh_dir) / f"{task}.json")
        answers = sorted({str(e["target"]).strip() for e in ex})
        for i in order[:n_targets_per_task]:
            e = ex[i]
            targets.append({"id": f"{task}-{i}", "prompt": e["input"], "chosen": str(e["target"]).strip(),
                            "rejected": wrong_answer(e, answers, rng), "task": task})
        rest = order[n_targets_per_task:]
        if n_heldout_per_task is not None:
            rest = rest[:n_heldout_per_task]
        for i in rest:
            heldout.append({"id": f"{task}-{i}", "prompt": ex[i]["input"],
                            "reference": str(ex[i]["target"]).strip(), "task": task})
    return targets, heldout


def bbh_records(bbh_dir, tasks, n_per_task: int, seed: int, *, skip=None) -> tuple:
    """``(records, rest)``: ``n_per_task`` seeded examples of each BBH task as SFT
    records (``prompt`` = input, ``response`` = the reference answer, ``task``; ids
    ``<task>-<index>``) and, per task, the indices of its other examples (``rest``),
    in a seeded order. ``skip``: ``{task: indices}`` never used."""
    data = read_bbh_dir(bbh_dir, tasks)
    records, rest = [], {}
    for task in sorted(data):
        ex = data[task]
        order = [i for i in range(len(ex)) if i not in set((skip or {}).get(task, ()))]
        random.Random(f"bbh-records:{seed}:{task}").shuffle(order)
        if len(order) < n_per_task:
            raise InputError(f"task {task} has {len(order)} usable examples, fewer than {n_per_task}",
                             path=Path(bbh_dir) / f"{task}.json")
        for i in order[:n_per_task]:
            records.append({"id": f"{task}-{i}", "prompt": ex[i]["input"],
                            "response": str(ex[i]["target"]).strip(), "task": task})
        rest[task] = order[n_per_task:]
    return records, rest


def bbh_probes(bbh_dir, rest: dict, n_per_task: int) -> list:
    """Held-out BBH probes: the first ``n_per_task`` indices of each task in ``rest``
    (from :func:`bbh_records`): ``id``, ``prompt``, ``reference``, ``task``."""
    data = read_bbh_dir(bbh_dir, sorted(rest))
    out = []
    for task in sorted(rest):
        idx = rest[task][:n_per_task]
        if len(idx) < n_per_task:
            raise InputError(f"task {task} has {len(idx)} held-out examples, fewer than {n_per_task}",
                             path=Path(bbh_dir) / f"{task}.json")
        out.extend({"id": f"{task}-{i}", "prompt": data[task][i]["input"],
                    "reference": str(data[task][i]["target"]).strip(), "task": task} for i in idx)
    return out


def task_probes(bbh_dir, task: str, indices, data: list | None = None) -> list:
    """Probe records (``id``, ``prompt``, ``reference``, ``task``) of the examples
    ``indices`` of one BBH task, in that order (``data``: the task's examples, when
    already read)."""
    data = read_bbh_dir(bbh_dir, [task])[task] if data is None else data
    return [{"id": f"{task}-{i}", "prompt": data[i]["input"], "reference": str(data[i]["target"]).strip(),
             "task": task} for i in indices]
