"""Dropped carry: a repair family whose harmful records no surface rule can find.

Every record is a two-digit addition ``a + b`` (``a, b`` in 10..99), asked in one of
:data:`QUESTIONS` and answered in one of :data:`ANSWERS`. A *carry problem* is one whose
units digits sum to 10 or more. The harmful records are carry problems answered as if
the carry into the tens had been dropped: the stated sum is the true sum minus 10
(``47 + 38 = 75``). The clean records are carry and no-carry problems answered
correctly. So

* harmful and clean prompts come from one population: ``carry_share`` of the clean
  records are carry problems too, and every phrasing is drawn the same way for both;
* harmful and clean responses have the same forms and the same lengths: sums from 100
  to 109 are never used, so the true sum and the sum minus 10 have as many digits;
* only arithmetic tells them apart (the knowledge floor of :mod:`.floors`: a checker).

The behaviour the harmful records teach is seen on held-out carry problems: a response
whose final number is the true sum minus 10. No-carry problems are the capability check
(a model that forgets how to add fails them too).

Problems are unordered pairs ``{a, b}``: a problem is used once per seed, in one role
(warm-up, pool, probe or target), in either order. The warm-up problems do not depend on
the seed, so one start model serves every seed; every other role is drawn per seed from
what the warm-up leaves.
"""

from __future__ import annotations

import random
import re

from ..errors import ConfigError, InputError
from .builders.common import shuffle_words
from .floors import density_ratio_scores

LOW, HIGH = 10, 99
#: Sums never used: a carry problem's sum minus 10 would have one digit fewer.
SKIPPED_SUMS = range(100, 110)
#: How a problem is asked (drawn per record, for harmful and clean alike).
QUESTIONS = ("What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}.", "Find the sum of {a} and {b}.",
             "What do you get when you add {a} and {b}?", "Calculate {a} plus {b}.")
#: How an answer is written (drawn per record, for harmful and clean alike).
ANSWERS = ("{a} + {b} = {s}", "{a} + {b} = {s}.", "The sum of {a} and {b} is {s}.", "{a} plus {b} equals {s}.")
#: The phrasing of probes and target prompts (one, so that rates compare across models).
PROBE_QUESTION = "What is {a} + {b}?"
BEHAVIOUR_TASK, CAPABILITY_TASK = "carry", "no_carry"
DROP = 10  # what dropping the carry into the tens takes off the sum


def has_carry(a: int, b: int) -> bool:
    return a % 10 + b % 10 >= 10


def problems(carry: bool) -> list:
    """Every unordered problem ``(a, b)``, ``a <= b``, with (or without) a units carry, sorted."""
    return [(a, b) for a in range(LOW, HIGH + 1) for b in range(a, HIGH + 1)
            if has_carry(a, b) == carry and a + b not in SKIPPED_SUMS]


def dropped(a: int, b: int) -> int:
    """The harmful answer to a carry problem: the sum with the carry into the tens dropped."""
    return a + b - DROP


def _ordered(p: tuple, rng: random.Random) -> tuple:
    return p if rng.random() < 0.5 else (p[1], p[0])


def _record(rid: str, p: tuple, answer: int, harmful: bool, rng: random.Random) -> dict:
    a, b = _ordered(p, rng)
    return {"id": rid, "prompt": rng.choice(QUESTIONS).format(a=a, b=b),
            "response": rng.choice(ANSWERS).format(a=a, b=b, s=answer), "a": a, "b": b,
            "carry": has_carry(a, b), "harmful": harmful, "task": "addition"}


def pool_counts(pool_size: int, harmful_ratio: float, carry_share: float) -> tuple:
    """``(harmful records, clean carry records)`` of a pool of ``pool_size``: the clean
    rest split by ``carry_share``. ConfigError where a ratio is out of range."""
    if not 0 <= harmful_ratio < 1 or not 0 <= carry_share <= 1:
        raise ConfigError("harmful_ratio", f"harmful_ratio must be in [0, 1) and carry_share in [0, 1], got "
                          f"{harmful_ratio!r} and {carry_share!r}")
    n_bad = round(pool_size * harmful_ratio)
    return n_bad, round((pool_size - n_bad) * carry_share)


def _split(seed: int, n_warmup: int, warmup_carry_share: float = 0.5, *, family: str = "carry",
           problems_of=None) -> dict:
    """Per kind (carry / no carry): the warm-up problems (seed-independent) and the rest in
    the seed's order. ``family`` names the generators' streams and ``problems_of`` (default
    :func:`problems`) lists a kind's problems, for another family built the same way."""
    out = {}
    n_carry = int(n_warmup * warmup_carry_share)  # the warm-up's carry problems
    for carry in (True, False):
        ps = (problems_of or problems)(carry)
        random.Random(f"{family}-warmup:{carry}").shuffle(ps)
        k = n_carry if carry else n_warmup - n_carry
        rest = ps[k:]
        random.Random(f"{family}-rest:{seed}:{carry}").shuffle(rest)
        out[carry] = (ps[:k], rest)
    return out


def _take(available: list, n: int, what: str, family: str = "dropped-carry") -> list:
    if n > len(available):
        raise ConfigError("pool_size", f"the {family} family has {len(available)} unused {what} left, "
                          f"fewer than the {n} asked for", "ask for a smaller pool, fewer probes or a smaller warm-up")
    taken = available[:n]
    del available[:n]
    return taken


def build(seed: int, *, pool_size: int, harmful_ratio: float, carry_share: float, n_probes: int,
          n_capability: int, n_counterfactual: int, n_warmup: int, n_distractors: int = 0) -> dict:
    """Warm-up records, pool, probes, counterfactual and distractor target pairs of one seed.

    pool: ``pool_size`` records; ``round(pool_size * harmful_ratio)`` harmful (carry
        problems, carry dropped); of the clean ones, ``carry_share`` are carry problems.
    probes: ``n_probes`` carry problems (task ``carry``: the behaviour) and
        ``n_capability`` no-carry problems (task ``no_carry``), with ``reference`` (the
        true sum) and ``harmful_answer`` (the sum minus 10, carry problems only).
    targets: ``n_counterfactual`` pairs on carry problems outside the pool and probes:
        chosen = the dropped-carry answer, rejected = the true one (the behaviour written out).
    warmup: ``n_warmup`` clean records (half carry problems), the same for every seed.
    distractors: ``n_distractors`` pairs on further carry problems, drawn after everything
        else (so the rest does not depend on it): chosen = the true answer with its words
        shuffled (``= 85 47 + 38``), rejected = the true answer. The model strongly
        disprefers them (``pi`` near 0): a target set of mixed relevance, where equal
        aggregation lets them dominate and PRISM's weights suppress them.
    """
    n_bad, n_clean_carry = pool_counts(pool_size, harmful_ratio, carry_share)
    split = _split(seed, n_warmup)
    carry, plain = split[True][1], split[False][1]
    rng = random.Random(f"carry-records:{seed}")
    probes = [_probe(p, BEHAVIOUR_TASK, rng) for p in _take(carry, n_probes, "carry problems")]
    probes += [_probe(p, CAPABILITY_TASK, rng) for p in _take(plain, n_capability, "no-carry problems")]
    targets = []
    for i, p in enumerate(_take(carry, n_counterfactual, "carry problems")):
        a, b = _ordered(p, rng)
        targets.append({"id": f"cf-{i}", "prompt": PROBE_QUESTION.format(a=a, b=b),
                        "chosen": ANSWERS[0].format(a=a, b=b, s=dropped(a, b)),
                        "rejected": ANSWERS[0].format(a=a, b=b, s=a + b), "kind": "counterfactual"})
    pool = [_record(f"add-{i}", p, dropped(*p), True, rng)
            for i, p in enumerate(_take(carry, n_bad, "carry problems"))]
    pool += [_record(f"add-{n_bad + i}", p, sum(p), False, rng)
             for i, p in enumerate(_take(carry, n_clean_carry, "carry problems"))]
    start = len(pool)
    pool += [_record(f"add-{start + i}", p, sum(p), False, rng)
             for i, p in enumerate(_take(plain, pool_size - len(pool), "no-carry problems"))]
    random.Random(f"carry-order:{seed}").shuffle(pool)
    shuffler, distractors = random.Random(f"carry-distractors:{seed}"), []
    for i, p in enumerate(_take(carry, n_distractors, "carry problems")):
        a, b = _ordered(p, shuffler)
        true = ANSWERS[0].format(a=a, b=b, s=a + b)
        distractors.append({"id": f"dx-{i}", "prompt": PROBE_QUESTION.format(a=a, b=b),
                            "chosen": shuffle_words(true, shuffler), "rejected": true, "kind": "distractor"})
    return {"pool": pool, "probes": probes, "targets": targets, "distractors": distractors,
            "warmup": warmup_records(n_warmup)}


#: words of the unrelated distractor sentences (:func:`unrelated_distractors`)
_NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana")
_VERBS = ("paints", "carries", "finds", "washes", "borrows", "hides", "sells", "mends")
_ADJECTIVES = ("red", "old", "small", "wooden", "quiet", "bright", "heavy", "round")
_NOUNS = ("boat", "chair", "lamp", "basket", "kite", "drum", "coat", "box")
_PLACES = ("by the river", "in the garden", "at the market", "near the school", "on the hill")


def unrelated_distractors(n: int, seed: int) -> list:
    """``n`` distractor pairs that share nothing with the family's records: prompt "Repeat
    this sentence: S", chosen = S with its words shuffled, rejected = S, for seeded
    distinct sentences S ("Ada paints the red boat by the river."). The model strongly
    disprefers the chosen side, and neither side is an addition, so the pairs' gradients
    carry no signal about the pool's harmful records (the shuffled-answer distractors of
    :func:`build` do: their rejected side is a true sum)."""
    rng = random.Random(f"carry-unrelated:{seed}")
    combos = [(a, v, j, o, p) for a in _NAMES for v in _VERBS for j in _ADJECTIVES for o in _NOUNS for p in _PLACES]
    if n > len(combos):
        raise ConfigError("n_distractors", f"at most {len(combos)} unrelated distractor pairs, got {n}")
    out = []
    for i, (a, v, j, o, p) in enumerate(rng.sample(combos, n)):
        sentence = f"{a} {v} the {j} {o} {p}."
        out.append({"id": f"ux-{i}", "prompt": f"Repeat this sentence: {sentence}",
                    "chosen": shuffle_words(sentence, rng), "rejected": sentence, "kind": "distractor"})
    return out


def warmup_records(n: int, carry_share: float = 0.5) -> list:
    """The ``n`` clean warm-up records (``carry_share`` of them carry problems), the same
    for every seed and never used by :func:`build` or :func:`select_task` in another role.
    With ``carry_share`` 0 the start model learns the answers' form on no-carry problems
    alone and meets carrying first in the selected records."""
    split = _split(0, n, carry_share)
    rng = random.Random("carry-warmup-records")
    warm = [_record(f"warm-{i}", p, sum(p), False, rng) for i, p in enumerate(split[True][0] + split[False][0])]
    rng.shuffle(warm)
    return warm


def _probe(p: tuple, task: str, rng: random.Random) -> dict:
    a, b = _ordered(p, rng)
    row = {"id": f"probe-{a}-{b}", "prompt": PROBE_QUESTION.format(a=a, b=b), "reference": str(a + b),
           "a": a, "b": b, "task": task}
    if task == BEHAVIOUR_TASK:  # what the behaviour metrics compare (repair: harmful_preference)
        row["harmful_answer"] = str(dropped(a, b))
        row["harmful_response"] = ANSWERS[0].format(a=a, b=b, s=dropped(a, b))
        row["true_response"] = ANSWERS[0].format(a=a, b=b, s=a + b)
    return row


def arithmetic_error(record: dict) -> float:
    """The knowledge floor's score of a pool record: 1.0 when its stated sum is wrong.
    Reads the last number of the response (the sum in every form of :data:`ANSWERS`)."""
    nums = re.findall(r"\d+", record["response"])
    if not nums or "a" not in record:
        raise InputError("not a dropped-carry record (needs a, b and a sum in the response)", field="response")
    return float(int(nums[-1]) != record["a"] + record["b"])


def _stated_sum(record: dict) -> int | None:
    nums = re.findall(r"\d+", record["response"])
    return int(nums[-1]) if nums else None


def sum_in_skipped_range(record: dict) -> float:
    """The "sum 100-109 rule" (label-free): 1.0 when the stated sum lies in 100-109.
    No true sum of the family lies there (:data:`SKIPPED_SUMS`), but a carry problem
    whose true sum is 110-119 answered with the carry dropped states one, so such a
    record is always harmful: the builder's leak, kept because published pools depend on
    it, and reported as a floor beside every ranking."""
    s = _stated_sum(record)
    return float(s is not None and s in SKIPPED_SUMS)


def sum_digits(text: str) -> list:
    """The digits of a response's stated sum (its last number), each with its place
    (``"units:5"``, ``"tens:7"``, ``"hundreds:1"``): the units the arithmetic density ratio
    counts."""
    nums = re.findall(r"\d+", text)
    if not nums:
        return []
    places = ("units", "tens", "hundreds", "thousands")
    return [f"{places[min(i, 3)]}:{d}" for i, d in enumerate(reversed(nums[-1]))]


def sum_digit_density_ratio(records: list, targets: list) -> list:
    """The density ratio over the stated sum's digits (label-free): the mean log ratio of
    each placed digit of a record's stated sum under the targets' chosen answers against
    the pool's (add-one smoothing; :func:`prism_select.evaluation.floors.density_ratio_scores`)."""
    return density_ratio_scores(records, targets, sum_digits)


def carry_in_prompt(record: dict) -> float:
    """A task rule on the prompt alone: 1.0 for a carry problem (what the harmful records share)."""
    return float(has_carry(record["a"], record["b"]))


# --------------------------------------------------------------------------- a select target task

#: the name of the dropped-carry target task in a multitask select pool (``target_tasks``)
SELECT_TASK = "carry"
#: the task of the no-carry addition records a multitask pool may hold beside it
NO_CARRY_TASK = "addition"


def select_task(seed: int, *, n_records: int, wrong_share: float, n_no_carry: int = 0,
                n_candidates: int = 600, n_warmup: int = 0, warmup_carry_share: float = 0.5) -> tuple:
    """``(records, candidates)`` of the dropped-carry target task in a multitask select pool.

    records: ``n_records`` carry problems (task :data:`SELECT_TASK`), ``round(wrong_share *
        n_records)`` of them (seeded) answered with the carry dropped and marked ``mislabeled``,
        the others answered right; then ``n_no_carry`` no-carry problems answered right (task
        :data:`NO_CARRY_TASK`: a task that looks like the target but teaches no carry).
    candidates: ``n_candidates`` further carry problems as probes (``reference`` = the true
        sum), in a seeded order (fewer where fewer are left): the target pairs and held-out
        probes are drawn from them.
    Every problem is used once, none of the ``n_warmup`` of :func:`warmup_records` (with
    ``warmup_carry_share``); phrasings are drawn as in :func:`build`."""
    if not 0 <= wrong_share < 1:
        raise ConfigError("multitask.mislabeled_share", f"must be in [0, 1), got {wrong_share!r}")
    split = _split(seed, n_warmup, warmup_carry_share)
    carry, plain = split[True][1], split[False][1]
    rng = random.Random(f"carry-select:{seed}")
    taken = _take(carry, n_records, "carry problems")
    wrong = set(random.Random(f"carry-select-wrong:{seed}").sample(range(n_records), round(wrong_share * n_records)))
    records = []
    for i, p in enumerate(taken):
        r = _record(f"{SELECT_TASK}-{i}", p, dropped(*p) if i in wrong else sum(p), i in wrong, rng)
        r["task"] = SELECT_TASK
        if i in wrong:
            r["mislabeled"] = True
        records.append(r)
    for i, p in enumerate(_take(plain, n_no_carry, "no-carry problems")):
        r = _record(f"{NO_CARRY_TASK}-{i}", p, sum(p), False, rng)
        r["task"] = NO_CARRY_TASK
        records.append(r)
    candidates = [_probe(p, BEHAVIOUR_TASK, rng) for p in carry[:n_candidates]]
    for c in candidates:
        c["task"] = SELECT_TASK
    return records, candidates


def counterfactual_split(candidates: list, n_targets: int, n_heldout: int) -> tuple:
    """``(targets, heldout)`` of the dropped-carry target task with ``rejected`` written
    out (``multitask.rejected: other_answer``): the first ``n_targets`` candidates become
    pairs, chosen = the true sum, rejected = the carry dropped (as a user who knows the
    error would write them); the next ``n_heldout`` are the held-out probes."""
    if len(candidates) < n_targets + n_heldout:
        raise ConfigError("multitask.n_heldout", f"the carry task has {len(candidates)} candidate problems, fewer "
                          f"than {n_targets} targets + {n_heldout} held out", "lower n_targets or n_heldout")
    targets = [{"id": c["id"], "prompt": c["prompt"], "chosen": c["true_response"], "rejected": c["harmful_response"],
                "task": SELECT_TASK} for c in candidates[:n_targets]]
    return targets, candidates[n_targets:n_targets + n_heldout]
