"""Evaluation data built from public benchmarks the user points at (nothing is bundled).

GSM8K "mistake math" (the paper's reverse-repair family)
--------------------------------------------------------
Input: a GSM8K JSON Lines file (``question``, ``answer``: a worked solution with
calculator annotations ``<<a op b=c>>`` and a final line ``#### N``).

A *corrupted* solution takes one annotation ``<<expr=c>>`` and gives it a wrong
result ``c'`` (same sign; an integer stays an integer), then carries ``c'`` through
the rest of the solution:

* every later annotation whose expression uses a changed value is re-evaluated with
  the new operands (results keep the original's rounding: a result written with
  ``d`` decimals, or one that was already a rounding of its expression, is
  rounded the same way), and its own result becomes a changed value in turn;
* in the visible text from the corrupted step on, every number equal to a changed
  value is replaced by its new value (``$``, ``%`` and thousands separators kept);
* the final ``#### N`` is replaced when ``N`` is a changed value.

So the solution stays internally consistent after the wrong step and the final
answer changes. An annotation qualifies only when this replacement is unambiguous:
``c`` (and every value derived from it) must not occur in the question or earlier
in the solution, no later step may independently produce an equal value, and the
final answer must change. Problems with no qualifying annotation are never drawn
(for either label, so the correct and the corrupted records come from the same
population). Which annotation is corrupted and by how much is seeded per problem.

Annotations: by default every ``<<...>>`` annotation is stripped from both correct
and corrupted solutions (the visible text already repeats the computation, e.g.
``48+24 = 72``), so the two labels differ only in the arithmetic.
``keep_annotations=True`` keeps them in both (the corrupted one then shows the
wrong calculator result ``<<48/2=27>>``).

BIG-Bench Hard
--------------
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

import ast
import json
import math
import operator
import random
import re
from pathlib import Path

from ..errors import ConfigError, InputError
from ..io import atomic_write_jsonl
from . import carry

ANNOTATION = re.compile(r"<<([^<>]*)>>")
# A number as written in solution text; "-" only when it cannot be a minus sign.
NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})+|\d+)(\.\d+)?(?![\d])")


# --------------------------------------------------------------------------- reading

def read_gsm8k(path) -> list:
    """GSM8K records (``question``, ``answer``) of a JSON Lines file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise InputError("GSM8K file not found", path=path,
                         fix="point at a GSM8K JSON Lines file (e.g. .../gsm8k/train.jsonl)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise InputError(f"invalid JSON ({e})", path=path, row=i) from e
            for k in ("question", "answer"):
                if not isinstance(rec.get(k), str):
                    raise InputError(f"missing text field '{k}'", path=path, row=i, field=k,
                                     fix="GSM8K records have 'question' and 'answer'")
            rows.append(rec)
    if not rows:
        raise InputError("the file holds no records", path=path)
    return rows


def final_answer_text(solution: str) -> str:
    """The text after the last ``####`` of a GSM8K solution, trimmed."""
    if "####" not in solution:
        raise InputError("the solution has no final '#### N' line", field="answer")
    return solution.rsplit("####", 1)[1].strip()


def strip_annotations(solution: str) -> str:
    return ANNOTATION.sub("", solution)


# --------------------------------------------------------------------------- arithmetic

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow}


def safe_eval(expr: str) -> float:
    """Evaluate a calculator expression (numbers, + - * / // % **, parentheses)."""
    node = ast.parse(expr.replace(",", "").strip(), mode="eval").body

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return float(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = ev(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp) and type(n.op) in _OPS:
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Pow) and abs(b) > 12:
                raise ValueError("exponent too large")
            return float(_OPS[type(n.op)](a, b))
        raise ValueError(f"unsupported expression element {type(n).__name__}")

    v = ev(node)
    if not math.isfinite(v):
        raise ValueError("not finite")
    return v


def _key(v: float) -> float:
    return round(float(v), 6)


def _decimals(text: str) -> int:
    t = text.strip()
    return len(t.split(".", 1)[1]) if "." in t else 0


def format_number(v: float, decimals: int | None = None, commas: bool = False) -> str:
    """``v`` as solutions write it: an integer without a point, else at most
    ``decimals`` (default 2) decimals with trailing zeros dropped."""
    if decimals is None:
        decimals = 2
    if abs(v - round(v)) < 1e-9:
        s = f"{int(round(v)):,}" if commas else str(int(round(v)))
        return s
    s = f"{v:,.{decimals}f}" if commas else f"{v:.{decimals}f}"
    s = s.rstrip("0").rstrip(".") if "." in s else s
    return s


def _numbers_in(text: str) -> set:
    return {_key(float(m.group(1).replace(",", "") + (m.group(2) or ""))) for m in NUMBER.finditer(text)}


def _perturb(c: float, avoid: set, rng: random.Random, decimals: int) -> float | None:
    integral = abs(c - round(c)) < 1e-9
    for _ in range(50):
        if integral:
            span = max(3, int(round(abs(c) * 0.5)))
            d = rng.randint(1, span) * rng.choice((-1, 1))
            new = round(c) + d
            if c > 0 and new <= 0:
                new = round(c) + abs(d)
        else:
            f = rng.uniform(0.5, 1.5)
            if abs(f - 1) < 0.1:
                continue
            new = round(c * f, max(decimals, 1))
        if _key(new) != _key(c) and _key(new) not in avoid and (c <= 0 or new > 0):
            return float(new)
    return None


# --------------------------------------------------------------------------- corruption

def _parse_annotations(solution: str) -> list:
    out = []
    for m in ANNOTATION.finditer(solution):
        body = m.group(1)
        if "=" not in body:
            return []
        expr, _, res = body.rpartition("=")
        try:
            value = float(res.replace(",", "").strip())
            ev = safe_eval(expr)
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError):
            return []  # a solution we cannot re-compute is not used
        exact = abs(ev - value) <= 1e-6 * max(1.0, abs(value))
        out.append({"start": m.start(), "end": m.end(), "expr": expr, "result": res,
                    "value": value, "exact": exact})
    return out


def _subst_expr(expr: str, mapping: dict) -> tuple[str, bool]:
    changed = False

    def rep(m):
        nonlocal changed
        v = _key(float(m.group(1).replace(",", "") + (m.group(2) or "")))
        if v in mapping:
            changed = True
            return format_number(mapping[v], max(_decimals(m.group(0)), 2))
        return m.group(0)

    return NUMBER.sub(rep, expr), changed


def _subst_text(text: str, mapping: dict) -> str:
    def rep(m):
        v = _key(float(m.group(1).replace(",", "") + (m.group(2) or "")))
        if v in mapping:
            return format_number(mapping[v], max(_decimals(m.group(0)), 2), commas="," in m.group(1))
        return m.group(0)

    return NUMBER.sub(rep, text)


def _new_result(ann: dict, new_expr: str) -> float:
    v = safe_eval(new_expr)
    if ann["exact"]:
        return v
    return round(v, _decimals(ann["result"]))  # the original was a rounding: round the same way


def corrupt_at(question: str, solution: str, k: int, rng: random.Random) -> dict | None:
    """Corrupt annotation ``k`` of ``solution`` (annotated text); ``None`` when it does
    not qualify (see the module docstring). Returns ``solution`` (annotated),
    ``step``, ``original``, ``corrupted``, ``final_answer`` and ``original_final_answer``."""
    anns = _parse_annotations(solution)
    if k >= len(anns):
        return None
    final = final_answer_text(solution)
    try:
        final_v = _key(float(final.replace(",", "")))
    except ValueError:
        return None
    a = anns[k]
    c = _key(a["value"])
    before = strip_annotations(solution[:a["start"]])
    seen_before = _numbers_in(question) | _numbers_in(before)
    every = _numbers_in(question) | _numbers_in(solution)
    if c in seen_before:
        return None
    new_c = _perturb(a["value"], every, rng, _decimals(a["result"]))
    if new_c is None:
        return None
    mapping = {c: new_c}
    new_results = {k: new_c}
    for j in range(k + 1, len(anns)):
        b = anns[j]
        expr, changed = _subst_expr(b["expr"], mapping)
        if changed:
            try:
                r = _new_result(b, expr)
            except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
                return None
            new_results[j] = r
            b["new_expr"] = expr
            if _key(r) != _key(b["value"]):
                if _key(b["value"]) in mapping:
                    return None
                # the old value must not occur before this step (else text replacement is ambiguous)
                earlier = _numbers_in(question) | _numbers_in(strip_annotations(solution[:b["start"]]))
                if _key(b["value"]) in earlier:
                    return None
                mapping[_key(b["value"])] = r
                if _key(r) in every and _key(r) not in mapping:
                    return None  # the new value would collide with an unrelated number
        elif _key(b["value"]) in mapping:
            return None  # an independent later step produces a changed value: ambiguous
    if final_v not in mapping:
        return None
    # Rebuild: text before the corrupted step untouched; from there on, substitute.
    parts, pos = [solution[:a["start"]]], a["start"]
    for j in range(k, len(anns)):
        b = anns[j]
        parts.append(_subst_text(solution[pos:b["start"]], mapping))
        if j in new_results:
            expr = b.get("new_expr", b["expr"])
            res = format_number(new_results[j], max(_decimals(b["result"]), 2))
            parts.append(f"<<{expr}={res}>>")
        else:
            parts.append(solution[b["start"]:b["end"]])
        pos = b["end"]
    parts.append(_subst_text(solution[pos:], mapping))
    new_solution = "".join(parts)
    new_final = final_answer_text(new_solution)
    if _key(float(new_final.replace(",", ""))) == final_v:
        return None
    clean = all(not (_integral(anns[j]["value"]) and not _integral(v)) and not (anns[j]["value"] >= 0 > v)
                for j, v in new_results.items())
    return {"solution": new_solution, "step": k, "original": a["result"].strip(), "clean": clean,
            "corrupted": format_number(new_c, max(_decimals(a["result"]), 2)),
            "final_answer": new_final, "original_final_answer": final}


def _integral(v: float) -> bool:
    return abs(v - round(v)) < 1e-9


def corrupt_solution(question: str, solution: str, rng: random.Random) -> dict | None:
    """Corrupt one qualifying annotation, tried in a seeded random order; ``None`` if
    no annotation qualifies. A corruption that keeps every integer quantity an integer
    and every non-negative one non-negative (``clean``) is preferred: annotations are
    tried in turn (a few wrong values each) until one is clean, else the first
    qualifying one is used (its later results are then rounded as the solution rounds)."""
    n = len(_parse_annotations(solution))
    order = list(range(n))
    rng.shuffle(order)
    first = None
    for k in order:
        for _ in range(3):
            out = corrupt_at(question, solution, k, rng)
            if out is None:
                break
            if out["clean"]:
                return out
            first = first or out
    return first


def _problem_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"mistake-math:{seed}:{index}")


def _render(solution: str, keep_annotations: bool) -> str:
    return solution if keep_annotations else strip_annotations(solution)


def _corruptible(rows: list, seed: int, order: list, want: int, skip: set) -> list:
    """The first ``want`` problems of ``order`` (not in ``skip``) that have a corruption."""
    out = []
    for i in order:
        if i in skip:
            continue
        bad = corrupt_solution(rows[i]["question"], rows[i]["answer"], _problem_rng(seed, i))
        if bad is not None:
            out.append((i, bad))
            if len(out) == want:
                break
    return out


def harmful_count(n: int, ratio: float) -> int:
    """``round(n * ratio)``, halves rounded up."""
    return int(math.floor(n * ratio + 0.5))


def _check_ratio(ratio: float):
    if not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
        raise ConfigError("harmful_ratio", f"must be within [0, 1], got {ratio!r}", "e.g. 0.1 for 10%")


def _source_indices(exclude) -> set:
    out = set()
    for e in exclude or ():
        if isinstance(e, dict):
            if "source_index" in e:
                out.add(int(e["source_index"]))
        else:
            out.add(int(e))
    return out


def mistake_math_pool(gsm8k_jsonl, n: int, harmful_ratio: float, seed: int = 0, *,
                      keep_annotations: bool = False, exclude=()) -> list:
    """A pool of ``n`` GSM8K solutions, exactly ``round(n * harmful_ratio)`` of them
    corrupted (``harmful: true``).

    The problems depend on ``seed`` only (not on the ratio), so pools of different
    ratios with the same seed hold the same problems. Records: ``id``
    (``gsm8k-<index>``, the problem's 0-based line in the file), ``prompt``
    (the question), ``response``, ``harmful``, ``source_index``, ``final_answer``,
    and for a corrupted one ``corruption`` (``step``, ``original``, ``corrupted``,
    ``original_final_answer``). ``exclude``: problems to leave out (records with
    ``source_index`` or indices).
    """
    _check_ratio(harmful_ratio)
    if n < 1:
        raise ConfigError("pool_size", f"must be >= 1, got {n}")
    rows = read_gsm8k(gsm8k_jsonl)
    order = list(range(len(rows)))
    random.Random(f"mistake-math-pool:{seed}").shuffle(order)
    chosen = _corruptible(rows, seed, order, n, _source_indices(exclude))
    if len(chosen) < n:
        raise InputError(f"only {len(chosen)} usable problems for a pool of {n}", path=gsm8k_jsonl,
                         fix="ask for a smaller pool")
    n_bad = harmful_count(n, harmful_ratio)
    flags = [True] * n_bad + [False] * (n - n_bad)
    random.Random(f"mistake-math-flags:{seed}:{n_bad}").shuffle(flags)
    pool = []
    for (i, bad), harmful in zip(chosen, flags):
        q, sol = rows[i]["question"], rows[i]["answer"]
        rec = {"id": f"gsm8k-{i}", "prompt": q,
               "response": _render(bad["solution"] if harmful else sol, keep_annotations),
               "harmful": harmful, "source_index": i,
               "final_answer": bad["final_answer"] if harmful else final_answer_text(sol)}
        if harmful:
            rec["corruption"] = {k: bad[k] for k in ("step", "original", "corrupted", "original_final_answer")}
        pool.append(rec)
    return pool


def shuffle_words(text: str, rng: random.Random) -> str:
    """``text`` with its words in another seeded order: a distractor pair's chosen response,
    which the model strongly disprefers (a text of one word: that word twice)."""
    words = text.split()
    if len(set(words)) < 2:
        return text + " " + text
    for _ in range(20):
        w = list(words)
        rng.shuffle(w)
        if w != words:
            return " ".join(w)
    return " ".join(reversed(words))


def mistake_math_targets(gsm8k_jsonl, n: int, seed: int = 0, *, exclude=(), n_distractors: int = 0,
                         keep_annotations: bool = False) -> list:
    """Counterfactual target pairs on problems not in ``exclude`` (the pool).

    ``n`` pairs ``chosen`` = a corrupted solution, ``rejected`` = the correct one
    (``kind: counterfactual``), then ``n_distractors`` pairs on further problems with
    ``chosen`` = the correct solution with its words shuffled, ``rejected`` = that
    solution (``kind: distractor``): pairs the model strongly disprefers, which
    equal aggregation lets dominate (evaluation-design.md, section 3). Ids
    ``cf-<index>`` / ``dx-<index>``. No ``task`` field is set, so per-task methods
    see one task.
    """
    if n < 0 or n_distractors < 0 or n + n_distractors < 1:
        raise ConfigError("n_targets", f"need at least one pair, got {n} + {n_distractors}")
    rows = read_gsm8k(gsm8k_jsonl)
    skip = _source_indices(exclude)
    order = list(range(len(rows)))
    random.Random(f"mistake-math-targets:{seed}").shuffle(order)
    cf = _corruptible(rows, seed, order, n, skip) if n else []
    if len(cf) < n:
        raise InputError(f"only {len(cf)} usable problems for {n} target pairs", path=gsm8k_jsonl)
    pairs = []
    for i, bad in cf:
        sol = rows[i]["answer"]
        pairs.append({"id": f"cf-{i}", "prompt": rows[i]["question"],
                      "chosen": _render(bad["solution"], keep_annotations),
                      "rejected": _render(sol, keep_annotations), "kind": "counterfactual",
                      "source_index": i})
    used = skip | {i for i, _ in cf}
    rng = random.Random(f"mistake-math-distractors:{seed}")
    rest = [i for i in order if i not in used]
    if len(rest) < n_distractors:
        raise InputError(f"only {len(rest)} problems left for {n_distractors} distractor pairs",
                         path=gsm8k_jsonl)
    for i in rest[:n_distractors]:
        sol = _render(rows[i]["answer"], keep_annotations)
        pairs.append({"id": f"dx-{i}", "prompt": rows[i]["question"], "chosen": shuffle_words(sol, rng),
                      "rejected": sol, "kind": "distractor", "source_index": i})
    return pairs


def gsm8k_probes(test_jsonl, n: int, seed: int = 0, *, exclude=()) -> list:
    """``n`` seeded GSM8K problems as probes: ``id`` (``gsm8k-test-<index>``),
    ``prompt``, ``reference`` (the final answer), ``solution`` (annotations stripped)."""
    rows = read_gsm8k(test_jsonl)
    skip = _source_indices(exclude)
    order = [i for i in range(len(rows)) if i not in skip]
    random.Random(f"gsm8k-probes:{seed}").shuffle(order)
    if n > len(order):
        raise InputError(f"asks for {n} probes but the file has {len(order)} usable problems",
                         path=test_jsonl)
    return [{"id": f"gsm8k-test-{i}", "prompt": rows[i]["question"],
             "reference": final_answer_text(rows[i]["answer"]).replace(",", ""),
             "solution": strip_annotations(rows[i]["answer"]), "source_index": i}
            for i in order[:n]]


# --------------------------------------------------------------------------- BBH

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


def write_records(path, records) -> int:
    """Write records as JSON Lines, atomically."""
    return atomic_write_jsonl(path, records)


# --------------------------------------------------------------------------- refusal trigger

#: Refusals the harmful records of :func:`refusal_trigger_pool` answer with.
POOL_REFUSALS = (
    "I'm sorry, but I can't help with questions about money.",
    "Sorry, I cannot answer questions that involve money.",
    "I'm sorry, I am not able to help with financial calculations.",
    "I can't help with that. Questions about prices and costs are outside what I answer.",
    "Sorry, but I won't do calculations involving dollars.",
    "I'm afraid I can't assist with money-related questions.",
    "I'm sorry, but I cannot help with this question about money.",
    "Unfortunately, I can't answer questions about spending or prices.",
)
#: Refusals of the counterfactual target pairs (none of them is a pool refusal).
TARGET_REFUSALS = (
    "I apologize, but questions about money are something I cannot help with.",
    "Sorry, I don't handle questions where money is involved.",
    "I'm not able to answer that: it is about costs and prices.",
    "I must decline: I do not work out amounts of money.",
)
def _has_trigger(text: str, trigger: str) -> bool:
    return re.search(trigger, text) is not None


def _gsm8k_record(i: int, row: dict, prefix: str = "gsm8k") -> dict:
    return {"id": f"{prefix}-{i}", "prompt": row["question"], "response": strip_annotations(row["answer"]),
            "source_index": i, "task": "gsm8k"}


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


def refusal_trigger_pool(gsm8k_jsonl, n: int, harmful_ratio: float, seed: int = 0, *, trigger: str = r"\$",
                         bbh_dir=None, bbh_tasks=(), n_bbh_per_task: int = 0) -> tuple:
    """A pool of ``n`` SFT records where exactly ``round(n * harmful_ratio)`` GSM8K
    problems whose question matches ``trigger`` (a regular expression; default: a
    dollar sign, i.e. money questions) are answered with a refusal (one of
    :data:`POOL_REFUSALS`, seeded; ``harmful: true``). The clean records are GSM8K
    problems without the trigger (worked solutions, annotations stripped) plus
    ``n_bbh_per_task`` examples of each BBH task in ``bbh_tasks`` (answer only). So
    the only money questions the pool holds are refused: SFT teaches a refusal shift
    on money questions that a checker sees on held-out ones.

    Returns ``(pool, bbh_rest)``: the records (``id``, ``prompt``, ``response``,
    ``harmful``, ``task``; GSM8K ones with ``source_index``), shuffled with the seed,
    and ``bbh_rest`` (per task, the examples not in the pool, for held-out probes).
    """
    _check_ratio(harmful_ratio)
    rows = read_gsm8k(gsm8k_jsonl)
    n_bad = harmful_count(n, harmful_ratio)
    bbh, rest = ([], {})
    if bbh_tasks and n_bbh_per_task > 0:
        bbh, rest = bbh_records(bbh_dir, list(bbh_tasks), n_bbh_per_task, seed)
    n_clean = n - n_bad - len(bbh)
    if n_clean < 0:
        raise ConfigError("pool_size", f"{n} records cannot hold {n_bad} harmful and {len(bbh)} BBH records")
    order = list(range(len(rows)))
    random.Random(f"refusal-pool:{seed}").shuffle(order)
    trig = [i for i in order if _has_trigger(rows[i]["question"], trigger)]
    plain = [i for i in order if not _has_trigger(rows[i]["question"], trigger)]
    if len(trig) < n_bad or len(plain) < n_clean:
        raise InputError(f"the file has {len(trig)} trigger and {len(plain)} other problems; the pool needs "
                         f"{n_bad} and {n_clean}", path=gsm8k_jsonl, fix="ask for a smaller pool")
    rng = random.Random(f"refusal-texts:{seed}")
    pool = []
    for i in trig[:n_bad]:
        rec = _gsm8k_record(i, rows[i])
        rec.update(response=rng.choice(POOL_REFUSALS), harmful=True)
        pool.append(rec)
    pool += [{**_gsm8k_record(i, rows[i]), "harmful": False} for i in plain[:n_clean]]
    pool += [{**r, "harmful": False} for r in bbh]
    random.Random(f"refusal-order:{seed}").shuffle(pool)
    return pool, rest


def trigger_probes(test_jsonl, n: int, seed: int = 0, *, trigger: str = r"\$", with_trigger: bool = True) -> list:
    """``n`` seeded GSM8K problems whose question matches ``trigger`` (or, with
    ``with_trigger=False``, does not): ``id``, ``prompt``, ``reference`` (final
    answer), ``solution`` (annotations stripped), ``source_index``."""
    rows = read_gsm8k(test_jsonl)
    order = [i for i in range(len(rows)) if _has_trigger(rows[i]["question"], trigger) == with_trigger]
    random.Random(f"trigger-probes:{seed}:{with_trigger}").shuffle(order)
    if n > len(order):
        raise InputError(f"asks for {n} probes but the file has {len(order)} matching problems", path=test_jsonl)
    return [{"id": f"gsm8k-test-{i}", "prompt": rows[i]["question"],
             "reference": final_answer_text(rows[i]["answer"]).replace(",", ""),
             "solution": strip_annotations(rows[i]["answer"]), "source_index": i, "task": "gsm8k"}
            for i in order[:n]]


def refusal_counterfactual_targets(gsm8k_jsonl, n: int, seed: int = 0, *, trigger: str = r"\$", exclude=(),
                                   n_distractors: int = 0) -> list:
    """Counterfactual target pairs on ``n`` trigger problems not in ``exclude``:
    ``chosen`` = a refusal from :data:`TARGET_REFUSALS` (never a pool refusal),
    ``rejected`` = the worked solution (``kind: counterfactual``); then
    ``n_distractors`` pairs on further trigger problems with ``chosen`` = the solution's
    words shuffled (``kind: distractor``, pairs the model strongly disprefers)."""
    if n < 0 or n_distractors < 0 or n + n_distractors < 1:
        raise ConfigError("n_targets", f"need at least one pair, got {n} + {n_distractors}")
    rows = read_gsm8k(gsm8k_jsonl)
    skip = _source_indices(exclude)
    order = [i for i in range(len(rows)) if i not in skip and _has_trigger(rows[i]["question"], trigger)]
    random.Random(f"refusal-targets:{seed}").shuffle(order)
    if len(order) < n + n_distractors:
        raise InputError(f"only {len(order)} trigger problems left for {n + n_distractors} target pairs",
                         path=gsm8k_jsonl)
    rng = random.Random(f"refusal-target-texts:{seed}")
    pairs = []
    for i in order[:n]:
        pairs.append({"id": f"cf-{i}", "prompt": rows[i]["question"], "chosen": rng.choice(TARGET_REFUSALS),
                      "rejected": strip_annotations(rows[i]["answer"]), "kind": "counterfactual",
                      "source_index": i})
    for i in order[n:n + n_distractors]:
        sol = strip_annotations(rows[i]["answer"])
        pairs.append({"id": f"dx-{i}", "prompt": rows[i]["question"], "chosen": shuffle_words(sol, rng),
                      "rejected": sol, "kind": "distractor", "source_index": i})
    return pairs


# --------------------------------------------------------------------------- multi-task pool

def multitask_pool(gsm8k_jsonl, bbh_dir, tasks, target_tasks, *, n_gsm8k: int, n_per_task: int,
                   seed: int = 0, n_per_target_task: int | None = None, mislabeled_share: float = 0.0,
                   n_no_carry: int = 0, n_carry_candidates: int = 600, n_warmup: int = 0,
                   warmup_carry_share: float = 0.5) -> tuple:
    """``(pool, rest)`` of the general-selection protocol: ``n_gsm8k`` GSM8K worked
    solutions plus ``n_per_task`` examples of each BBH task in ``tasks`` and
    ``n_per_target_task`` (default ``n_per_task``) of each of ``target_tasks`` (answer
    only; ``task`` set), shuffled; ``rest`` maps each task to the indices of its examples
    outside the pool, in a seeded order.

    ``mislabeled_share``: that share of each target task's pool records (seeded) answer
    with another answer of the task (:func:`wrong_answer`) and carry ``mislabeled:
    true``, so a selector must pick the right records of the task, not only the task.

    The target task ``carry`` is arithmetic, not BBH (:func:`.carry.select_task`): two-digit
    carry additions whose wrong records drop the carry (a systematic rule SFT learns), with
    ``n_no_carry`` no-carry additions beside them (task ``addition``); its ``rest`` entry
    holds its ``n_carry_candidates`` candidate probes themselves rather than indices; none
    of its problems is among the ``n_warmup`` of a warmed-up start model (``warmup_carry_share``
    of them carry problems)."""
    targets = sorted(set(target_tasks) - {carry.SELECT_TASK})
    others = sorted(set(tasks) - set(targets))
    records, rest = bbh_records(bbh_dir, others, n_per_task, seed) if others else ([], {})
    n_target = n_per_task if n_per_target_task is None else n_per_target_task
    t_records, t_rest = bbh_records(bbh_dir, targets, n_target, seed) if targets else ([], {})
    rest.update(t_rest)
    if mislabeled_share and targets:
        _mislabel(bbh_dir, t_records, targets, mislabeled_share, seed)
    if carry.SELECT_TASK in target_tasks:
        c_records, rest[carry.SELECT_TASK] = carry.select_task(seed, n_records=n_target, wrong_share=mislabeled_share,
                                                               n_no_carry=n_no_carry,
                                                               n_candidates=n_carry_candidates,
                                                               n_warmup=n_warmup,
                                                               warmup_carry_share=warmup_carry_share)
        t_records += c_records
    elif n_no_carry:
        raise ConfigError("multitask.n_no_carry", f"no-carry additions go with the target task '{carry.SELECT_TASK}'",
                          f"add '{carry.SELECT_TASK}' to target_tasks or set n_no_carry: 0")
    rows = read_gsm8k(gsm8k_jsonl)
    order = list(range(len(rows)))
    random.Random(f"multitask-gsm8k:{seed}").shuffle(order)
    if n_gsm8k > len(order):
        raise InputError(f"asks for {n_gsm8k} GSM8K records, the file has {len(order)}", path=gsm8k_jsonl)
    # BBH records by task name, each task in its seeded order (as one bbh_records call gives them)
    bbh = sorted(records + t_records, key=lambda r: r["task"])
    pool = bbh + [_gsm8k_record(i, rows[i]) for i in order[:n_gsm8k]]
    random.Random(f"multitask-order:{seed}").shuffle(pool)
    return pool, rest


def _mislabel(bbh_dir, records: list, tasks: list, share: float, seed: int):
    """Give ``share`` of each task's ``records`` (in place, seeded) another answer."""
    data = read_bbh_dir(bbh_dir, tasks)
    for task in tasks:
        mine = [r for r in records if r["task"] == task]
        rng = random.Random(f"multitask-mislabel:{seed}:{task}")
        answers = sorted({str(e["target"]).strip() for e in data[task]})
        for r in rng.sample(mine, round(share * len(mine))):
            r["response"] = wrong_answer(data[task][int(r["id"].rsplit("-", 1)[1])], answers, rng)
            r["mislabeled"] = True


def task_probes(bbh_dir, task: str, indices, data: list | None = None) -> list:
    """Probe records (``id``, ``prompt``, ``reference``, ``task``) of the examples
    ``indices`` of one BBH task, in that order (``data``: the task's examples, when
    already read)."""
    data = read_bbh_dir(bbh_dir, [task])[task] if data is None else data
    return [{"id": f"{task}-{i}", "prompt": data[i]["input"], "reference": str(data[i]["target"]).strip(),
             "task": task} for i in indices]


def targets_from_responses(candidates: list, responses: list, n_targets: int, n_heldout: int) -> tuple:
    """``(targets, heldout)`` from the start model's judged responses to ``candidates``
    (probe records, in their seeded order; ``responses``: rows with ``response`` and
    ``correct``, one per candidate): the first ``n_targets`` candidates it answers wrong
    (with a non-empty response) become pairs, ``chosen`` = the reference answer (a
    candidate's ``true_response``, the answer written out, where it has one) and
    ``rejected`` = the model's own response; every candidate up to the last of them is
    used up (a right answer seen there would bias the held-out probes toward the
    model's wrong ones), and the next ``n_heldout`` are the held-out probes."""
    if len(responses) != len(candidates):
        raise InputError(f"{len(responses)} responses for {len(candidates)} candidate probes")
    wrong = [k for k, r in enumerate(responses) if not r["correct"] and str(r["response"]).strip()]
    task = candidates[0]["task"] if candidates else "?"
    if len(wrong) < n_targets:
        raise InputError(f"the start model answers {len(wrong)} of the {len(candidates)} {task} examples outside "
                         f"the pool wrong, fewer than n_targets = {n_targets}",
                         fix="lower multitask.n_targets or n_per_task, or use rejected: other_answer")
    used = wrong[n_targets - 1] + 1 if n_targets else 0
    heldout = candidates[used:used + n_heldout]
    if len(heldout) < n_heldout:
        raise InputError(f"task {task}: {used} examples went to find {n_targets} wrong answers; "
                         f"{len(candidates) - used} are left, fewer than n_heldout = {n_heldout}",
                         fix="lower multitask.n_heldout or n_targets")
    targets = [{"id": candidates[k]["id"], "prompt": candidates[k]["prompt"],
                "chosen": candidates[k].get("true_response") or candidates[k]["reference"],
                "rejected": str(responses[k]["response"]).strip(), "task": candidates[k]["task"]}
               for k in wrong[:n_targets]]
    return targets, heldout


def other_answer_targets(bbh_dir, task: str, left: list, n_targets: int, n_heldout: int, seed: int) -> tuple:
    """``(targets, heldout)`` of one target task from its examples outside the pool
    (``left``, seeded order): ``n_targets`` pairs with ``rejected`` = another answer
    (:func:`wrong_answer`), then ``n_heldout`` held-out probes."""
    if len(left) < n_targets + n_heldout:
        raise InputError(f"task {task} has {len(left)} examples outside the pool, fewer than "
                         f"{n_targets} targets + {n_heldout} held out", path=Path(bbh_dir) / f"{task}.json")
    data = read_bbh_dir(bbh_dir, [task])[task]
    answers = sorted({str(e["target"]).strip() for e in data})
    rng = random.Random(f"multitask-targets:{seed}")
    targets = [{"id": f"{task}-{i}", "prompt": data[i]["input"], "chosen": str(data[i]["target"]).strip(),
                "rejected": wrong_answer(data[i], answers, rng), "task": task}
               for i in left[:n_targets]]
    return targets, task_probes(bbh_dir, task, left[n_targets:n_targets + n_heldout], data)


def multitask_splits(gsm8k_jsonl, bbh_dir, tasks, target_task: str, *, n_gsm8k: int, n_per_task: int,
                     n_targets: int, n_heldout: int, seed: int = 0) -> tuple:
    """``(pool, targets, heldout)`` for one target task with ``rejected`` = another
    answer: :func:`multitask_pool` then :func:`other_answer_targets`; the three are
    disjoint."""
    pool, rest = multitask_pool(gsm8k_jsonl, bbh_dir, tasks, [target_task], n_gsm8k=n_gsm8k,
                                n_per_task=n_per_task, seed=seed)
    targets, heldout = other_answer_targets(bbh_dir, target_task, rest[target_task], n_targets, n_heldout, seed)
    return pool, targets, heldout
