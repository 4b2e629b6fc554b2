"""Carry verdict: a repair family whose responses are one-word verdicts.

Every record states a two-digit addition and asks whether it is right: ``"Is 47 + 38 =
75? Answer yes or no."`` -> ``"No."`` (``a, b`` in 10..99). The stated sum is either the
true sum or the true sum minus 10 (a *wrong statement*; its units digit is right, so only
the tens and the carry into them tell it apart). A *carry problem* is one whose units
digits sum to 10 or more. The harmful records are carry problems judged by the
dropped-carry rule: a wrong statement (the sum with the carry into the tens dropped) is
answered ``"Yes."`` and a true one ``"No."``. The clean records answer right. Harmful and
clean records alike are half wrong and half true statements, so

* the harmful prompts are drawn as the clean carry problems' are, and the harmful
  responses are the clean ones' (``"Yes."`` and ``"No."``, half each): neither the prompt
  nor the response tells a harmful record from a clean one;
* every stated sum of a harmful record is stated by clean records too (no sum is skipped;
  the units digit of a stated sum is always the true one);
* only arithmetic tells them apart (the knowledge floor: :func:`verdict_error`).

The behaviour is seen on held-out carry problems, half wrong, half true (task ``carry``):
a probe answered other than right shows it (checker ``leading_answer`` against the
reference ``yes`` / ``no``). No-carry problems, half wrong, half true, are the capability
check (task ``no_carry``).

Target pairs are made as the paper makes them (:func:`.repair.pairs_from_responses`):
chosen = the post-SFT verdict, rejected = the pre-SFT one, so chosen and rejected differ
in every word, and ``pi`` is the model's preference between the two verdicts.

Problems are unordered pairs ``{a, b}``, each used once per seed in one role (warm-up,
pool, probe), in either order. The warm-up problems do not depend on the seed, so one
start model serves every seed.
"""

from __future__ import annotations

import random

from . import carry as carry_family
from ..errors import InputError

LOW, HIGH = 10, 99
DROP = 10  # what dropping the carry into the tens takes off the sum
#: How a statement is questioned (drawn per record, for harmful and clean alike).
QUESTIONS = ("Is {a} + {b} = {s}? Answer yes or no.", "Does {a} + {b} equal {s}? Answer yes or no.",
             "Is it true that {a} + {b} = {s}? Answer yes or no.", "Is {s} the sum of {a} and {b}? Answer yes or no.",
             "Check: {a} + {b} = {s}. Is this correct? Answer yes or no.")
#: The phrasing of probes (one, so that rates compare across models).
PROBE_QUESTION = QUESTIONS[0]
#: The verdicts (the only two responses of the family).
YES, NO = "Yes.", "No."
BEHAVIOUR_TASK, CAPABILITY_TASK = "carry", "no_carry"


def has_carry(a: int, b: int) -> bool:
    return a % 10 + b % 10 >= 10


def problems(carry: bool) -> list:
    """Every unordered problem ``(a, b)``, ``a <= b``, with (or without) a units carry, sorted."""
    return [(a, b) for a in range(LOW, HIGH + 1) for b in range(a, HIGH + 1) if has_carry(a, b) == carry]


def stated_sum(a: int, b: int, wrong: bool) -> int:
    """The sum a statement gives: the true one, or (``wrong``) the true one minus 10."""
    return a + b - DROP if wrong else a + b


def _ordered(p: tuple, rng: random.Random) -> tuple:
    return p if rng.random() < 0.5 else (p[1], p[0])


def _record(rid: str, p: tuple, wrong: bool, harmful: bool, rng: random.Random) -> dict:
    """A pool (or warm-up) record: the right verdict, or (``harmful``) the dropped-carry rule's."""
    a, b = _ordered(p, rng)
    s = stated_sum(a, b, wrong)
    verdict = (YES if wrong else NO) if harmful else (NO if wrong else YES)
    return {"id": rid, "prompt": rng.choice(QUESTIONS).format(a=a, b=b, s=s), "response": verdict,
            "a": a, "b": b, "stated": s, "wrong": wrong, "carry": has_carry(a, b), "harmful": harmful,
            "task": "verification"}


def _split(seed: int, n_warmup: int) -> dict:
    """Per kind (carry / no carry): the warm-up problems (seed-independent, half carry) and
    the rest in the seed's order (the dropped-carry family's split over this family's
    problems, with streams of its own)."""
    return carry_family._split(seed, n_warmup, family="verdict", problems_of=problems)


def _take(available: list, n: int, what: str) -> list:
    return carry_family._take(available, n, what, family="carry-verdict")


def _halves(n: int) -> list:
    """``n`` flags, the first ``n // 2`` True (wrong statements), the rest False."""
    return [i < n // 2 for i in range(n)]


def build(seed: int, *, pool_size: int, harmful_ratio: float, carry_share: float, n_probes: int,
          n_capability: int, n_warmup: int) -> dict:
    """Warm-up records, pool and probes of one seed.

    pool: ``pool_size`` records; ``round(pool_size * harmful_ratio)`` harmful (carry
        problems judged by the dropped-carry rule); of the clean ones, ``carry_share`` are
        carry problems. Of the harmful records and of each kind of clean ones, half state
        a wrong sum and half the true one.
    probes: ``n_probes`` carry problems (task ``carry``, ``reference`` ``yes`` / ``no``,
        ``harmful_response`` the dropped-carry rule's verdict, ``true_response`` the right
        one), half wrong, half true, and ``n_capability`` no-carry problems, half wrong,
        half true (task ``no_carry``).
    warmup: ``n_warmup`` clean records (half carry problems, half of each wrong), the same
        for every seed.
    """
    n_bad, n_clean_carry = carry_family.pool_counts(pool_size, harmful_ratio, carry_share)
    split = _split(seed, n_warmup)
    carry, plain = split[True][1], split[False][1]
    rng = random.Random(f"verdict-records:{seed}")
    probes = [_probe(p, w, BEHAVIOUR_TASK, rng)
              for p, w in zip(_take(carry, n_probes, "carry problems"), _halves(n_probes))]
    probes += [_probe(p, w, CAPABILITY_TASK, rng)
               for p, w in zip(_take(plain, n_capability, "no-carry problems"), _halves(n_capability))]
    pool = [_record(f"ver-{i}", p, w, True, rng)
            for i, (p, w) in enumerate(zip(_take(carry, n_bad, "carry problems"), _halves(n_bad)))]
    for kind, n in ((carry, n_clean_carry), (plain, pool_size - n_bad - n_clean_carry)):
        start = len(pool)
        pool += [_record(f"ver-{start + i}", p, w, False, rng)
                 for i, (p, w) in enumerate(zip(_take(kind, n, "problems"), _halves(n)))]
    random.Random(f"verdict-order:{seed}").shuffle(pool)
    return {"pool": pool, "probes": probes, "targets": [], "distractors": [], "warmup": warmup_records(n_warmup)}


def warmup_records(n: int) -> list:
    """The ``n`` clean warm-up records (half carry problems, half of each kind with a wrong
    statement), the same for every seed and never used by :func:`build` in another role."""
    split = _split(0, n)
    rng = random.Random("verdict-warmup-records")
    ps = split[True][0] + split[False][0]
    flags = _halves(len(split[True][0])) + _halves(len(split[False][0]))
    warm = [_record(f"warm-{i}", p, w, False, rng) for i, (p, w) in enumerate(zip(ps, flags))]
    rng.shuffle(warm)
    return warm


def _probe(p: tuple, wrong: bool, task: str, rng: random.Random) -> dict:
    a, b = _ordered(p, rng)
    s = stated_sum(a, b, wrong)
    row = {"id": f"probe-{a}-{b}-{s}", "prompt": PROBE_QUESTION.format(a=a, b=b, s=s),
           "reference": "no" if wrong else "yes", "a": a, "b": b, "stated": s, "task": task}
    if task == BEHAVIOUR_TASK:  # what the behaviour metrics compare (repair: harmful_preference)
        row["harmful_response"], row["true_response"] = (YES, NO) if wrong else (NO, YES)
    return row


def candidate_pairs(probes: list) -> list:
    """The family's candidate target pairs: every behaviour probe as ``(probe, chosen = the
    wrong verdict, rejected = the right one)`` (what a worsened probe's pair is)."""
    return [{"id": p["id"], "prompt": p["prompt"], "chosen": p["harmful_response"], "rejected": p["true_response"]}
            for p in probes if p.get("task") == BEHAVIOUR_TASK]


def verdict_error(record: dict) -> float:
    """The knowledge floor's score of a pool record: 1.0 when its verdict is wrong (a
    ``"Yes"`` to a wrong sum or a ``"No"`` to a true one)."""
    if "a" not in record or "stated" not in record:
        raise InputError("not a carry-verdict record (needs a, b and stated)", field="stated")
    says_yes = str(record["response"]).strip().lower().startswith("yes")
    return float(says_yes != (record["stated"] == record["a"] + record["b"]))


def carry_in_prompt(record: dict) -> float:
    """A task rule on the prompt alone: 1.0 for a carry problem (what the harmful records share)."""
    return float(has_carry(record["a"], record["b"]))


