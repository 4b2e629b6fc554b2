"""GSM8K money questions answered with a refusal: the refusal-trigger family of the repair protocol."""

from __future__ import annotations

import random
import re

from ...errors import ConfigError, InputError
from .bbh import bbh_records
from .common import shuffle_words
from .gsm8k import (check_ratio, final_answer_text, gsm8k_record, harmful_count, read_gsm8k, source_indices,
                    strip_annotations)


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
    check_ratio(harmful_ratio)
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
        rec = gsm8k_record(i, rows[i])
        rec.update(response=rng.choice(POOL_REFUSALS), harmful=True)
        pool.append(rec)
    pool += [{**gsm8k_record(i, rows[i]), "harmful": False} for i in plain[:n_clean]]
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
    skip = source_indices(exclude)
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
