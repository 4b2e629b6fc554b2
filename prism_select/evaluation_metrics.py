"""Ranking metrics of scores against a boolean label field of the pool."""

from __future__ import annotations

from .data.readers import iter_records, record_id
from .errors import InputError
from .selection import read_scores


def auroc(scores: list, labels: list) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive);
    ties count one half (the Mann-Whitney statistic)."""
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score([bool(x) for x in labels], scores))


def spearman(a: list, b: list) -> float:
    """Spearman rank correlation (ties ranked in input order: meant for continuous
    scores); NaN when either side is constant."""
    import torch

    def ranks(x):
        x = torch.as_tensor(x, dtype=torch.float64)
        r = torch.empty_like(x)
        r[torch.argsort(x, stable=True)] = torch.arange(len(x), dtype=torch.float64)
        return r - r.mean()

    if len(set(map(float, a))) < 2 or len(set(map(float, b))) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    return float((ra @ rb) / (ra.norm() * rb.norm()))


def auprc(scores: list, labels: list) -> float:
    """Area under the precision-recall curve of ``scores`` for ``labels`` (True =
    positive), as sklearn's average precision (step-wise, no interpolation); chance
    level is the positive fraction."""
    from sklearn.metrics import average_precision_score
    return float(average_precision_score([bool(x) for x in labels], scores))


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
