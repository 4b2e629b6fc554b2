"""The model's own responses ``y'`` (for ProjDiff), sampled once and cached.

Sampling: plain ancestral sampling at temperature 1 (no top-k / top-p, whatever the
model's generation config says; each token by inverse-CDF sampling, :func:`draw_tokens`), from the prompt exactly as it is encoded for scoring
(chat template, left truncation), at most ``max_new_tokens`` tokens, stopping at (and
dropping) the first special token (EOS, end-of-turn, ...). Each prompt draws from its
own ``torch.Generator`` seeded with a hash of the run seed and the cache key, so a
response does not depend on the order or draws of the other prompts. Prompts are
sampled in left-padded batches with the KV cache (``max_new_tokens`` forwards).

Cache: an entry of :mod:`prism_select.cache` per model,
``<cache_dir>/generations/<model fingerprint[:16]>/responses.jsonl`` (its marker
``generations.json`` is written when the entry is made, so ``cache list``, ``prune`` and
``--cache-max-gb`` see it), one line per response: ``key`` (sha256 of model fingerprint,
prompt token ids and the generation settings), ``prompt_sha`` (sha256 of the prompt ids), ``settings``, ``response`` (text,
special tokens dropped) and ``n_tokens``. Lines are appended as they are made, so an
interrupted run keeps its work; a response is reused only when its ``key`` matches.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import cache
from ..errors import CacheError
from ..io import atomic_write_json, sha256_json

SAMPLER = "ancestral-inverse-cdf-v2"


def stop_ids(tokenizer, model) -> list:
    """EOS ids of the tokenizer and generation config, and every special token id."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gc = getattr(model, "generation_config", None)
    eos = getattr(gc, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(x) for x in eos)
    return sorted(ids)


def generation_settings(max_new_tokens: int, seed: int, stops: list) -> dict:
    return {"sampler": SAMPLER, "temperature": 1.0, "max_new_tokens": int(max_new_tokens), "seed": int(seed),
            "stop_ids": list(stops)}


def generation_key(model_fingerprint: str, prompt_ids: list, settings: dict) -> str:
    return sha256_json({"model": model_fingerprint, "prompt_ids": list(prompt_ids), "settings": settings})


def cache_path(cache_dir, model_fingerprint: str) -> Path:
    return Path(cache_dir) / "generations" / model_fingerprint[:16] / "responses.jsonl"


def _open_entry(path: Path, model_fingerprint: str) -> None:
    """Make the cache entry holding ``path`` complete (its marker), or mark it used now."""
    marker = path.parent / cache.MARKERS["generations"]
    if marker.is_file():
        cache.touch(path.parent)
        return
    try:
        cache.claim(path.parent)
        atomic_write_json(marker, {"model": model_fingerprint})
    except OSError as e:
        raise CacheError(f"cannot write the generation cache {path.parent}: {e.strerror or e}") from e


@contextmanager
def _writing(entry: Path):
    """The entry's write lock (:func:`prism_select.cache.writing`); a cache folder that
    cannot hold it is a :class:`~prism_select.errors.CacheError`."""
    try:
        lock = cache.writing(entry)
        lock.__enter__()
    except OSError as e:
        raise CacheError(f"cannot write the generation cache {entry}: {e.strerror or e}") from e
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def read_cache(path: Path) -> dict:
    """``key -> record``; a damaged line (an interrupted write) is skipped."""
    out = {}
    if not path.exists():
        return out
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
                out[rec["key"]] = rec
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return out


def append_cache(path: Path, rec: dict):
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+", encoding="utf-8") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() > 0:  # make sure a damaged last line stays on its own
                f.seek(f.tell() - 1)
                last = f.read(1)
                f.seek(0, os.SEEK_END)
                if last != "\n":
                    f.write("\n")
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
    except OSError as e:
        raise CacheError(f"cannot write the generation cache {path}: {e.strerror or e}") from e


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the KV cache ``cache`` (``past_key_values`` before)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        params = inspect.signature(base.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _returned_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def draw_tokens(probs: torch.Tensor, generators: list) -> list:
    """One token per row of ``probs`` (``(B, V)``, rows summing to 1), by inverse-CDF
    sampling: row ``i`` draws one uniform ``u`` from ``generators[i]`` (a CPU generator)
    and takes the first token whose cumulative probability passes ``u`` (times the row's
    total, against rounding). The search runs where ``probs`` lie, so only the ``B``
    uniforms and indices cross to the host; a token of probability 0 is never drawn."""
    u = torch.tensor([float(torch.rand((), generator=g, dtype=torch.float64)) for g in generators],
                     dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1).tolist()


def sample_responses(model, prompts: list, max_new_tokens: int, stops: list, generators: list,
                     pad_id: int) -> list:
    """Token ids sampled after each prompt (stop token excluded), a batch at a time.

    Prompts are left-padded (explicit position ids keep every real token at its own
    position); each row draws from its own generator, so a response does not depend on
    the other prompts' draws (only, through float rounding of the batched forward, on
    the batch's padding).
    """
    device = next(model.parameters()).device
    stop = set(stops)
    kw = _cache_kwarg(model)
    B, L = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(list(p))
        attn[i, L - len(p):] = 1
    ids, attn = ids.to(device), attn.to(device)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = [[] for _ in prompts]
    done = [False] * B
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            o = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, **{kw: past})
            past = _returned_cache(o)
            drawn = draw_tokens(torch.softmax(o.logits[:, -1].double(), dim=-1), generators)
            nxt = []
            for i in range(B):
                tok = pad_id
                if not done[i]:
                    t = drawn[i]
                    if t in stop:
                        done[i] = True
                    else:
                        out[i].append(t)
                        tok = t
                nxt.append(tok)
            if all(done):
                break
            ids = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
            pos = pos[:, -1:] + 1
    return out


def own_responses(lm, encoded: list, *, max_new_tokens: int, seed: int, cache_dir, progress: bool = False,
                  batch_size: int = 32) -> tuple:
    """``y'`` text for every encoded example (its prompt part), cached; sampled
    ``batch_size`` prompts at a time.

    Returns ``(responses, {"generated": n, "reused": n, "cache": path})``. The cache entry's
    write lock (:func:`prism_select.cache.writing`) is held from reading the entry to the last
    response written.
    """
    stops = stop_ids(lm.tokenizer, lm.model)
    settings = generation_settings(max_new_tokens, seed, stops)
    path = cache_path(cache_dir, lm.fingerprint)
    with _writing(path.parent):  # eviction skips the entry; a second writer waits, then reuses
        _open_entry(path, lm.fingerprint)
        done = read_cache(path)
        keys = [generation_key(lm.fingerprint, e.input_ids[: e.response_start], settings) for e in encoded]
        todo = sorted({k: i for i, k in enumerate(keys) if k not in done}.values(),
                      key=lambda i: encoded[i].response_start)  # similar prompt lengths batch together
        pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
        bar = tqdm(total=len(todo), desc="own responses (ProjDiff)", unit="ex", leave=False, disable=not progress)
        for s in range(0, len(todo), batch_size):
            idx = todo[s:s + batch_size]
            prompts = [encoded[i].input_ids[: encoded[i].response_start] for i in idx]
            gens = [torch.Generator().manual_seed(int(hashlib.sha256(f"{seed}|{keys[i]}".encode()).hexdigest()[:15],
                                                      16)) for i in idx]
            for i, p, ids in zip(idx, prompts, sample_responses(lm.model, prompts, max_new_tokens, stops, gens, pad)):
                rec = {"key": keys[i], "prompt_sha": sha256_json(list(p)), "settings": settings,
                       "response": lm.tokenizer.decode(ids, skip_special_tokens=True), "n_tokens": len(ids)}
                append_cache(path, rec)
                done[keys[i]] = rec
            bar.update(len(idx))
        bar.close()
    out = [done[k]["response"] for k in keys]
    return out, {"generated": len(todo), "reused": len(keys) - len(todo), "cache": str(path)}
