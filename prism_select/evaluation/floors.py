"""Surface floors: how far rules that read the text, not the model, rank the harmful records.

A testbed is evidence about a selector only where such rules fail. Each floor scores every
pool record and is judged by the AUROC of the harmful flag, like a method:

``keyword``   the best single rule "the prompt (or the response) holds this word or word
              pair" or "... does not hold it", over every word and word pair that at
              least :data:`MIN_COUNT` records hold. The rule is chosen with the labels, so
              this floor is optimistic: no user could pick it without knowing the answer.
``length``    the best of the prompt's, the response's and their joint length in
              characters and in words, long-first or short-first (chosen with the labels too).
``neighbour`` similarity to the target responses: TF-IDF vectors of word 1-2 grams of
              each record's prompt and response, the highest cosine to a target pair's
              ``chosen`` minus the highest to a ``rejected`` (both sides of the pair, as the
              gradient methods see them); ``neighbour_chosen`` is the first term alone.

``density_ratio``        label-free, what a practitioner with the target pairs would try
``density_ratio_chars``  first: how much likelier a record's response is under the targets'
              ``chosen`` responses than under the pool's responses, as unigram models
              with add-one smoothing over the union vocabulary, the mean log ratio over
              the response's units (:func:`density_ratio_scores`): words and punctuation
              (``density_ratio``) or characters (``density_ratio_chars``). No rule is
              chosen with the labels.

A family may add knowledge floors (rules that need to know the task, such as an
arithmetic checker): :func:`floors` takes them as ``extra`` functions of a record, or of
the pool and the targets (:func:`with_targets`: a function ``(records, targets) -> scores``,
e.g. a density ratio over the units a task's answers are made of).
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter

from ..evaluation_metrics import auroc

MIN_COUNT = 2  # a word held by one record is an identifier, not a rule
_WORD = re.compile(r"\w+|[^\w\s]")


def _grams(text: str) -> set:
    words = _WORD.findall(text.lower())
    return set(words) | {f"{a} {b}" for a, b in zip(words, words[1:])}


def _both_ways(scores: list, labels: list) -> float:
    a = auroc(scores, labels)
    return max(a, 1 - a)


def keyword_floor(records: list, labels: list) -> dict:
    """The best presence rule over the words and word pairs of prompt and response."""
    n_pos = sum(labels)
    n_neg = len(labels) - n_pos
    best = {"auroc": 0.5, "rule": None}
    for field in ("prompt", "response"):
        holders: dict = {}
        for i, r in enumerate(records):
            for g in sorted(_grams(_text(r[field]))):  # sorted: a tie goes to the same rule in every process
                holders.setdefault(g, []).append(i)
        for g, idx in holders.items():
            if len(idx) < MIN_COUNT:
                continue
            tpr = sum(1 for i in idx if labels[i]) / n_pos
            fpr = sum(1 for i in idx if not labels[i]) / n_neg
            a = 0.5 + (tpr - fpr) / 2  # AUROC of a 0/1 score
            if max(a, 1 - a) > best["auroc"]:
                best = {"auroc": max(a, 1 - a), "rule": f"{field} {'holds' if a >= 0.5 else 'lacks'} {g!r}"}
    return best


def length_floor(records: list, labels: list) -> dict:
    """The best length rule (characters or words of prompt, response or both)."""
    best = {"auroc": 0.5, "rule": None}
    for field, unit in itertools.product(("prompt", "response", "both"), ("chars", "words")):
        def size(r):
            text = _text(r["prompt"]) + " " + r["response"] if field == "both" else _text(r[field])
            return len(text) if unit == "chars" else len(text.split())
        a = _both_ways([size(r) for r in records], labels)
        if a > best["auroc"]:
            best = {"auroc": a, "rule": f"{field} length in {unit}"}
    return best


def neighbour_scores(records: list, targets: list) -> tuple[list, list]:
    """Per record: (highest cosine to a ``chosen`` minus highest to a ``rejected``, highest
    to a ``chosen``), TF-IDF of word 1-2 grams fitted on the pool and the targets."""
    from sklearn.feature_extraction.text import TfidfVectorizer

    def text(prompt, response):
        return _text(prompt) + "\n" + response

    docs = [text(r["prompt"], r["response"]) for r in records]
    pos = [text(t["prompt"], t["chosen"]) for t in targets]
    neg = [text(t["prompt"], t["rejected"]) for t in targets]
    vec = TfidfVectorizer(ngram_range=(1, 2), token_pattern=r"(?u)\b\w+\b").fit(docs + pos + neg)
    d, p, n = vec.transform(docs), vec.transform(pos), vec.transform(neg)
    to_pos = (d @ p.T).max(axis=1).toarray().ravel()
    to_neg = (d @ n.T).max(axis=1).toarray().ravel()
    return [float(x) for x in to_pos - to_neg], [float(x) for x in to_pos]


def words(text: str) -> list:
    """A response's words and punctuation marks, lower-cased (the ``density_ratio`` units)."""
    return _WORD.findall(text.lower())


def density_ratio_scores(records: list, targets: list, units=words) -> list:
    """Per record: the mean over its response's ``units`` ``u`` of ``log p_T(u) - log p_P(u)``,
    ``p_T`` the unigram model of the targets' ``chosen`` responses and ``p_P`` that of the
    pool's responses, each ``(count(u) + 1) / (n + V)`` (add-one smoothing, ``V`` the units
    seen in either); 0 for a response without units. Label-free."""
    pool_units = [units(r["response"]) for r in records]
    t_counts = Counter(u for t in targets for u in units(t["chosen"]))
    p_counts = Counter(u for us in pool_units for u in us)
    vocab = len(set(t_counts) | set(p_counts))
    n_t, n_p = sum(t_counts.values()), sum(p_counts.values())

    def ratio(u):
        return math.log((t_counts[u] + 1) / (n_t + vocab)) - math.log((p_counts[u] + 1) / (n_p + vocab))
    return [sum(ratio(u) for u in us) / len(us) if us else 0.0 for us in pool_units]


def with_targets(fn):
    """Mark ``fn(records, targets) -> scores`` as an ``extra`` floor that reads the target
    pairs (run only when :func:`floors` has them)."""
    fn.needs_targets = True
    return fn


def floors(records: list, targets: list | None, label: str = "harmful", extra: dict | None = None) -> dict:
    """Every floor's AUROC (and its rule) on ``records`` labelled by ``label``; the
    neighbour and density-ratio floors need ``targets`` (pairs); ``extra``: name ->
    record -> score, or (:func:`with_targets`) name -> (records, targets) -> scores."""
    labels = [bool(r[label]) for r in records]
    out = {"keyword": keyword_floor(records, labels), "length": length_floor(records, labels)}
    if targets:
        contrast, chosen = neighbour_scores(records, targets)
        out["neighbour"] = {"auroc": auroc(contrast, labels), "rule": "TF-IDF cosine to chosen minus to rejected"}
        out["neighbour_chosen"] = {"auroc": auroc(chosen, labels), "rule": "TF-IDF cosine to chosen"}
        out["density_ratio"] = {"auroc": auroc(density_ratio_scores(records, targets), labels),
                                "rule": "label-free: mean log density ratio of the response's words, targets' "
                                        "chosen against the pool (add-one smoothing)"}
        out["density_ratio_chars"] = {"auroc": auroc(density_ratio_scores(records, targets, list), labels),
                                      "rule": "label-free: the same over the response's characters"}
    for name, fn in (extra or {}).items():
        if getattr(fn, "needs_targets", False):
            if not targets:
                continue
            scores = fn(records, targets)
        else:
            scores = [fn(r) for r in records]
        out[name] = {"auroc": auroc(scores, labels), "rule": fn.__doc__.strip().splitlines()[0]
                     if fn.__doc__ else name}
    return out


def _text(prompt) -> str:
    """A prompt's text (chat messages joined)."""
    if isinstance(prompt, list):
        return "\n".join(str(m.get("content", "")) for m in prompt)
    return str(prompt)
