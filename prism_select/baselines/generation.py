"""The model's own responses ``y'`` (for ProjDiff), sampled once and cached.

Sampling: plain ancestral sampling at temperature 1 (no top-k / top-p, whatever the
model's generation config says), from the prompt exactly as it is encoded for scoring
(chat template, left truncation), at most ``max_new_tokens`` tokens, stopping at (and
dropping) the first special token (EOS, end-of-turn, ...). Each prompt draws from its
own ``torch.Generator`` seeded with a hash of the run seed and the cache key, so a
response does not depend on batch, order or device of the other prompts. One prompt at
a time with the KV cache (``max_new_tokens`` forwards of one token each).

Cache: ``<cache_dir>/generations/<model fingerprint[:16]>.jsonl``, one line per
response: ``key`` (sha256 of model fingerprint, prompt token ids and the generation
settings), ``prompt_sha`` (sha256 of the prompt ids), ``settings``, ``response`` (text,
special tokens dropped) and ``n_tokens``. Lines are appended as they are made, so an
interrupted run keeps its work; a response is reused only when its ``key`` matches.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..errors import CacheError
from ..io import sha256_json

SAMPLER = "ancestral-v1"


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
    return Path(cache_dir) / "generations" / f"{model_fingerprint[:16]}.jsonl"


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


def sample_response(model, prompt_ids: list, max_new_tokens: int, stops: list, generator: torch.Generator) -> list:
    """Token ids sampled after ``prompt_ids`` (the stop token excluded)."""
    device = next(model.parameters()).device
    stop = set(stops)
    kw = _cache_kwarg(model)
    out, past = [], None
    step_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            o = model(input_ids=step_ids, use_cache=True, **{kw: past})
            past = _returned_cache(o)
            probs = torch.softmax(o.logits[0, -1].double(), dim=-1).cpu()
            tok = int(torch.multinomial(probs, 1, generator=generator))
            if tok in stop:
                break
            out.append(tok)
            step_ids = torch.tensor([[tok]], dtype=torch.long, device=device)
    return out


def own_responses(lm, encoded: list, *, max_new_tokens: int, seed: int, cache_dir, progress: bool = False) -> tuple:
    """``y'`` text for every encoded example (its prompt part), cached.

    Returns ``(responses, {"generated": n, "reused": n, "cache": path})``.
    """
    stops = stop_ids(lm.tokenizer, lm.model)
    settings = generation_settings(max_new_tokens, seed, stops)
    path = cache_path(cache_dir, lm.fingerprint)
    cache = read_cache(path)
    out, made, reused = [], 0, 0
    for e in tqdm(encoded, desc="own responses (ProjDiff)", unit="ex", leave=False, disable=not progress):
        prompt = e.input_ids[: e.response_start]
        key = generation_key(lm.fingerprint, prompt, settings)
        if key in cache:
            out.append(cache[key]["response"])
            reused += 1
            continue
        g_seed = int(hashlib.sha256(f"{seed}|{key}".encode()).hexdigest()[:15], 16)
        ids = sample_response(lm.model, prompt, max_new_tokens, stops, torch.Generator().manual_seed(g_seed))
        text = lm.tokenizer.decode(ids, skip_special_tokens=True)
        rec = {"key": key, "prompt_sha": sha256_json(list(prompt)), "settings": settings, "response": text,
               "n_tokens": len(ids)}
        append_cache(path, rec)
        cache[key] = rec
        out.append(text)
        made += 1
    return out, {"generated": made, "reused": reused, "cache": str(path)}
