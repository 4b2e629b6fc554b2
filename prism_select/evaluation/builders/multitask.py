"""The multi-task pool of the general-selection protocol: GSM8K solutions and BBH examples, with
targets and held-out probes of one or more target tasks."""

from __future__ import annotations

import random
from pathlib import Path

from ...errors import ConfigError, InputError
from .. import carry
from .bbh import bbh_records, read_bbh_dir, task_probes, wrong_answer
from .gsm8k import gsm8k_record, read_gsm8k


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

    The target task ``carry`` is arithmetic, not BBH (:func:`..carry.select_task`): two-digit
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
    pool = bbh + [gsm8k_record(i, rows[i]) for i in order[:n_gsm8k]]
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
