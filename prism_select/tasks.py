"""Target sets: which target pairs form which task, for a run that scores several at once.

A run's targets are one file or several (``score --targets A.jsonl B.jsonl``). A
*task* is one target set: the records of a file that carry no ``task`` field form the
task named by the file's stem (``A`` for ``A.jsonl``); records that carry ``task`` form
the task they name. A direction method (prism, equal, unpaired) gives each task its own
``pi``, ``g_KL`` and ``v = H^-1 g_KL``, all preconditioned by the run's one curvature and
all scored in the same forward and backward of each pool batch
(:meth:`prism_select.run.scorer.Scorer.score_tasks`). ``scores.jsonl`` then carries
``scores`` (``{task: score}``) and ``ranks`` (``{task: rank}``) beside ``score`` and
``rank``, which are the first task's.

One file whose records carry no ``task`` is one unnamed target set: the run and its
files are as without this module.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from .errors import ConfigError, InputError


def target_paths(targets) -> list:
    """``targets`` (None, one path, or a list of paths) as a list of paths."""
    if targets is None:
        return []
    if isinstance(targets, (str, os.PathLike)):
        return [targets]
    paths = list(targets)
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise ConfigError("targets", f"expected file paths, got {p!r}", "pass --targets FILE [FILE ...]")
    return paths


def check_stems(paths: list) -> None:
    """Several target files name their tasks by their stems: two files with one stem are
    refused (their pairs would silently form one task)."""
    seen: dict = {}
    for p in paths:
        stem = Path(p).stem
        if stem in seen:
            raise ConfigError("targets", f"{seen[stem]} and {p} are both task {stem!r} (a file's task is its stem)",
                              "rename one of the files, or give its records a 'task' field")
        seen[stem] = p


def name_tasks(pairs: list, path, several_files: bool) -> list:
    """``pairs`` of one target file with their task: the record's own, or (of several
    files) the file's stem. Within a file, either every record carries ``task`` or none
    does (an :class:`InputError` names the first record that breaks the rule)."""
    named = [p for p in pairs if p.task is not None]
    if named and len(named) != len(pairs):
        first = next(p for p in pairs if p.task is None)
        raise InputError(f"some target pairs carry 'task' and this one does not, so its target set is unknown "
                         f"({len(named)} of {len(pairs)} carry it)", path=path, row=first.row, line=first.line,
                         field="task", fix="give every record of the file a 'task', or none")
    if named or not several_files:
        return list(pairs)
    stem = Path(path).stem
    return [dataclasses.replace(p, task=stem) for p in pairs]


def task_groups(pairs: list) -> list:
    """``[(task, [pair indices])]`` in the order the tasks first appear; one group
    ``(None, all)`` when no pair names a task."""
    groups: dict = {}
    for i, p in enumerate(pairs):
        groups.setdefault(p.task, []).append(i)
    return list(groups.items()) if pairs else []
