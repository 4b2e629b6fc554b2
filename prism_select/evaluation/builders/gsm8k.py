"""GSM8K "mistake math" (the paper's reverse-repair family), built from the user's GSM8K files.

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
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from pathlib import Path

from ...errors import ConfigError, InputError
from .common import shuffle_words

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


def check_ratio(ratio: float):
    if not (isinstance(ratio, (int, float)) and 0 <= ratio <= 1):
        raise ConfigError("harmful_ratio", f"must be within [0, 1], got {ratio!r}", "e.g. 0.1 for 10%")


def source_indices(exclude) -> set:
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
    check_ratio(harmful_ratio)
    if n < 1:
        raise ConfigError("pool_size", f"must be >= 1, got {n}")
    rows = read_gsm8k(gsm8k_jsonl)
    order = list(range(len(rows)))
    random.Random(f"mistake-math-pool:{seed}").shuffle(order)
    chosen = _corruptible(rows, seed, order, n, source_indices(exclude))
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
    skip = source_indices(exclude)
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
    skip = source_indices(exclude)
    order = [i for i in range(len(rows)) if i not in skip]
    random.Random(f"gsm8k-probes:{seed}").shuffle(order)
    if n > len(order):
        raise InputError(f"asks for {n} probes but the file has {len(order)} usable problems",
                         path=test_jsonl)
    return [{"id": f"gsm8k-test-{i}", "prompt": rows[i]["question"],
             "reference": final_answer_text(rows[i]["answer"]).replace(",", ""),
             "solution": strip_annotations(rows[i]["answer"]), "source_index": i}
            for i in order[:n]]


def gsm8k_record(i: int, row: dict, prefix: str = "gsm8k") -> dict:
    """GSM8K problem ``i`` as an SFT record (its worked solution, annotations stripped; task ``gsm8k``)."""
    return {"id": f"{prefix}-{i}", "prompt": row["question"], "response": strip_annotations(row["answer"]),
            "source_index": i, "task": "gsm8k"}
