"""The run's inputs: the pool and the target pairs, read, validated and tokenised
(:func:`prepare_inputs`), or under ``--stream`` the pool validated in one streaming pass
and only the curvature's fit sample tokenised (:func:`prepare_stream_inputs`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..runtime import distributed
from ..data import load_pool, load_targets
from ..data.readers import scan_pool
from ..data.records import InvalidRecord, Loaded
from ..data.tokenize import DEFAULT_MAX_LENGTH, encode, encoded_fingerprint, tokenizer_fingerprint
from ..errors import InputError
from ..io import sha256_file, sha256_json
from ..settings import STREAM_FIT_EXAMPLES, ScoreSettings
from ..tasks import check_stems, name_tasks, target_paths


@dataclass
class Inputs:
    """A pool and target pairs, read, validated and tokenised."""

    pool: list  # PoolExample
    encoded: list  # Encoded, aligned with pool
    pairs: list  # TargetPair
    chosen: list  # Encoded (q, y+)
    rejected: list  # Encoded (q, y-)
    invalid: list  # InvalidRecord
    truncated: dict  # {"pool": n, "targets": n}
    pool_path: str = ""
    targets_path: str = ""  # the one target file ("" with none or several: targets_paths)
    targets_paths: list = field(default_factory=list)  # every target file, in order
    pool_format: str = ""
    pool_fingerprint: str = ""  # names the pool in the run key and run.json
    # Under stream (``pool`` and ``encoded`` stay empty): the curvature's fit sample
    # (Encoded) and how it was drawn. ``fit_encoded`` None: fit on ``encoded``.
    fit_encoded: list | None = None
    fit_sample: dict | None = None


def _encode_all(tokenizer, items, fields, max_length, path, skip_invalid, invalid, check=None):
    """``items`` that tokenise (and pass ``check(item, encodings, path)``), with their
    encodings; the others raise, or under ``skip_invalid`` join ``invalid``."""
    kept, encs = [], []
    for item in items:
        try:
            enc = [encode(tokenizer, item.prompt, getattr(item, f), max_length, path=path,
                          row=item.row, line=item.line, field=f) for f in fields]
            if check is not None:
                check(item, enc, path)
            encs.append(enc)
            kept.append(item)
        except InputError as exc:
            if not skip_invalid:
                raise
            invalid.append(InvalidRecord.of(exc, path))
    return kept, encs


def _distinct_tokens(pair, enc, path) -> None:
    """A pair whose two responses tokenise to the same ids (text that differs only in
    characters the vocabulary lacks, which all become its unknown token) has a margin and
    a direction of exactly zero: every score would be 0 and the ranking the pool's order."""
    chosen, rejected = enc
    if chosen.input_ids == rejected.input_ids:
        raise InputError("'chosen' and 'rejected' differ as text but tokenise to the same tokens (characters "
                         "outside the tokenizer's vocabulary become one unknown token), so the pair carries no "
                         "preference", path=path, row=pair.row, line=pair.line, field="rejected",
                         fix="make the responses differ in characters the model's tokenizer knows, or drop the "
                             "pair (--skip-invalid skips it)")


def _with_targets(tokenizer, targets_path, max_length: int, skip_invalid: bool, *, invalid: list,
                  truncated_pool: int, **pool_fields) -> Inputs:
    """Inputs of an already read pool, with the target pairs read and tokenised."""
    pairs, chosen, rejected = [], [], []
    paths = target_paths(targets_path)
    check_stems(paths)
    for path in paths:  # several files: each its own task (tasks.name_tasks)
        tg = load_targets(path, skip_invalid=skip_invalid)
        invalid += tg.invalid
        kept, penc = _encode_all(tokenizer, name_tasks(tg.items, path, len(paths) > 1), ["chosen", "rejected"],
                                 max_length, path, skip_invalid, invalid, check=_distinct_tokens)
        if not kept:
            raise InputError("no valid target pair left", path=path)
        pairs += kept
        chosen += [c for c, _ in penc]
        rejected += [r for _, r in penc]
    truncated = {"pool": truncated_pool,
                 "targets": sum(c.truncated or r.truncated for c, r in zip(chosen, rejected))}
    return Inputs(pairs=pairs, chosen=chosen, rejected=rejected, invalid=invalid, truncated=truncated,
                  targets_path=str(paths[0]) if len(paths) == 1 else "",
                  targets_paths=[str(p) for p in paths], **pool_fields)


def prepare_inputs(tokenizer, pool_path, targets_path=None, *, max_length: int = DEFAULT_MAX_LENGTH,
                   skip_invalid: bool = False, pool: Loaded | None = None) -> Inputs:
    """Read and tokenise the pool and (optionally) the target pairs. ``pool``: the pool
    as :func:`prism_select.data.load_pool` already read it (not read again)."""
    pool = pool if pool is not None else load_pool(pool_path, skip_invalid=skip_invalid)
    invalid = list(pool.invalid)
    examples, enc = _encode_all(tokenizer, pool.items, ["response"], max_length, pool_path,
                                skip_invalid, invalid)
    encoded = [e[0] for e in enc]
    inputs = _with_targets(tokenizer, targets_path, max_length, skip_invalid, pool=examples, encoded=encoded,
                           invalid=invalid, truncated_pool=sum(e.truncated for e in encoded),
                           pool_path=str(pool_path), pool_format=pool.format,
                           pool_fingerprint=encoded_fingerprint(encoded))
    if not examples:
        raise InputError("no valid pool record left", path=pool_path)
    return inputs


def prepare_stream_inputs(tokenizer, pool_path, targets_path=None, *, max_length: int = DEFAULT_MAX_LENGTH,
                          skip_invalid: bool = False, fit_examples: int = STREAM_FIT_EXAMPLES,
                          seed: int = 0) -> Inputs:
    """The inputs of a streamed run, without the pool in memory.

    One streaming pass (:func:`prism_select.data.readers.scan_pool`) validates the pool,
    checks its ids and draws a seeded sample of ``fit_examples`` valid records; only
    the sample is tokenised (``fit_encoded``: the curvature's fit set). The pool is
    named by the sha256 of its file bytes (every file of a datasets directory), the
    tokenizer and ``max_length``. ``pool`` and ``encoded`` stay empty; ``invalid`` and
    ``truncated`` count the targets only: the scoring pass reports the pool's.
    """
    scan = scan_pool(pool_path, fit_examples, seed=seed, skip_invalid=skip_invalid)
    _, enc = _encode_all(tokenizer, scan.sample, ["response"], max_length, pool_path, skip_invalid, [])
    if not enc:
        raise InputError(f"none of the {len(scan.sample)} records sampled to fit the curvature can be "
                         f"tokenised within max_length={max_length}", path=pool_path,
                         fix="raise --max-length or --fit-examples")
    fingerprint = sha256_json({"file_sha256": sha256_file(pool_path), "max_length": max_length,
                               "tokenizer": tokenizer_fingerprint(tokenizer)})
    return _with_targets(tokenizer, targets_path, max_length, skip_invalid, pool=[], encoded=[], invalid=[],
                         truncated_pool=0, pool_path=str(pool_path), pool_format=scan.format,
                         pool_fingerprint=fingerprint, fit_encoded=[e[0] for e in enc],
                         fit_sample={"valid_records": scan.count, "requested": fit_examples,
                                     "drawn": len(scan.sample), "tokenised": len(enc), "seed": seed})


def read_inputs(lm, pool_path, targets_path, settings: ScoreSettings, curvature, pool, timings: dict):
    """The run's inputs, tokenised: the whole pool, or under ``--stream`` the fit sample only."""
    t = time.perf_counter()
    if settings.stream:
        inputs = prepare_stream_inputs(lm.tokenizer, pool_path, targets_path, max_length=settings.max_length,
                                       skip_invalid=settings.skip_invalid, fit_examples=curvature.fit_examples,
                                       seed=curvature.seed)
    else:
        inputs = prepare_inputs(lm.tokenizer, pool_path, targets_path, max_length=settings.max_length,
                                skip_invalid=settings.skip_invalid, pool=pool)
    timings["read_inputs_s"] = time.perf_counter() - t
    distributed.say(f"inputs read in {timings['read_inputs_s']:.1f} s", settings.progress)
    return inputs

