"""Ranking metrics of scores against boolean labels: AUROC, AUPRC and ROC points
(scikit-learn's), and their forms read from a scores file and a pool's label field. The
one AUROC of prism-select is :func:`auroc`; Spearman's rank correlation (score list
against score list) is :func:`prism_select.metrics.spearman`.

AUROC counts a positive and a negative record with tied scores as one half (the
Mann-Whitney statistic: the probability that a random positive outscores a random
negative, ties split evenly), so a constant score list gives 0.5, the chance level: the
scores order no pair, and an ordering that was not made cannot count for or against.
AUROC is undefined when a class is empty (no positive or no negative label), AUPRC
without a positive label; either is then NaN, whatever the installed scikit-learn
would do (raise, or warn), so an experiment whose pool has no harmful record (harmful
ratio 0) records NaN instead of stopping, and a table's mean over seeds leaves it out.
"""

from __future__ import annotations

from collections import Counter

from .data.readers import iter_records, record_id
from .errors import InputError, PrismError
from .selection import read_scores

INSTALL_EVAL = "pip install 'prism-select[eval]'"


class MissingDependencyError(PrismError, ImportError):
    """An optional package a metric needs is not installed (an ImportError too, so a
    caller that treats a missing plotting or metrics package as optional still can)."""


def _sklearn_metrics():
    try:
        from sklearn import metrics
    except ImportError as e:
        raise MissingDependencyError(
            "ranking metrics need scikit-learn, one of prism-select's dependencies, which is missing here; "
            "reinstall prism-select (pip install prism-select) or pip install scikit-learn") from e
    return metrics


def _both_classes(labels: list) -> bool:
    pos = sum(1 for y in labels if y)
    return 0 < pos < len(labels)


def auroc(scores: list, labels: list) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive), as
    scikit-learn's ``roc_auc_score``: tied scores count one half (the Mann-Whitney
    statistic). NaN when a class is empty."""
    labels = [bool(x) for x in labels]
    if not _both_classes(labels):
        return float("nan")
    return float(_sklearn_metrics().roc_auc_score(labels, [float(s) for s in scores]))


def auprc(scores: list, labels: list) -> float:
    """Area under the precision-recall curve of ``scores`` for ``labels`` (True =
    positive), as scikit-learn's ``average_precision_score`` (step-wise, tied scores
    one threshold, no interpolation); chance level is the positive fraction. NaN
    without a positive label."""
    labels = [bool(x) for x in labels]
    if not any(labels):
        return float("nan")
    return float(_sklearn_metrics().average_precision_score(labels, [float(s) for s in scores]))


def roc_points(scores: list, labels: list) -> tuple[list, list]:
    """The ROC curve as (false positive rates, true positive rates): (0, 0), then one
    point per distinct score from high to low (scikit-learn's ``roc_curve`` with every
    threshold kept). The rate of an empty class is 0 at every point."""
    labels = [bool(x) for x in labels]
    scores = [float(s) for s in scores]
    if not _both_classes(labels):  # roc_curve would divide by zero (and warn)
        counts = Counter(scores)
        rates, seen = [0.0], 0
        for s in sorted(counts, reverse=True):
            seen += counts[s]
            rates.append(seen / len(scores))
        zeros = [0.0] * len(rates)
        return (zeros, rates) if any(labels) else (rates, zeros)
    fpr, tpr, _ = _sklearn_metrics().roc_curve(labels, scores, drop_intermediate=False)
    return [float(x) for x in fpr], [float(x) for x in tpr]


def as_bool(value, path=None, row=None, field=None) -> bool:
    """A label value as a bool: true/false, 1/0, yes/no (any case) or numbers."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise InputError(f"label value {value!r} is not a boolean", path=path, row=row, field=field,
                     fix="use true/false (or 1/0) in the label field")


def labels_by_id(pool_path, label: str) -> dict:
    out = {}
    for row, rec in iter_records(pool_path):
        if label not in rec:
            raise InputError(f"no label field '{label}'", path=pool_path, row=row, field=label,
                             fix="name the boolean label field with --label")
        out[record_id(rec, row)] = as_bool(rec[label], pool_path, row, label)
    return out


def auroc_from_files(scores_path, pool_path, label: str) -> float:
    labels = labels_by_id(pool_path, label)
    rows = read_scores(scores_path)
    return auroc([r["score"] for r in rows], [labels[r["id"]] for r in rows])


def auprc_from_files(scores_path, pool_path, label: str) -> float:
    labels = labels_by_id(pool_path, label)
    rows = read_scores(scores_path)
    return auprc([r["score"] for r in rows], [labels[r["id"]] for r in rows])
