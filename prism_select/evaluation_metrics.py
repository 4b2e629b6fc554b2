"""Ranking metrics of scores against a boolean label field of the pool."""

from __future__ import annotations

from .data.readers import iter_records
from .errors import InputError
from .selection import read_scores


def auroc(scores: list, labels: list) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True = positive);
    ties count one half (the Mann-Whitney statistic)."""
    from sklearn.metrics import roc_auc_score
    return float(roc_auc_score([bool(x) for x in labels], scores))


def labels_by_id(pool_path, label: str) -> dict:
    out = {}
    for row, rec in iter_records(pool_path):
        if label not in rec:
            raise InputError(f"no label field '{label}'", path=pool_path, row=row, field=label,
                             fix="name the boolean label field with --label")
        out[rec.get("id", row)] = bool(rec[label])
    return out


def auroc_from_files(scores_path, pool_path, label: str) -> float:
    labels = labels_by_id(pool_path, label)
    rows = read_scores(scores_path)
    return auroc([r["score"] for r in rows], [labels[r["id"]] for r in rows])
