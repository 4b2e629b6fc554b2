"""Probing a model: batched greedy generation and answer checkers.

Generation
----------
:func:`generate` renders each prompt the way training renders it (the tokenizer's
chat template with ``add_generation_prompt=True`` when there is one, else the plain
prompt text, exactly as :mod:`prism_select.data.tokenize` does), left-pads a batch,
and decodes greedily (``do_sample=False``, one beam). Prompts are processed longest
first (less padding); the answers come back in input order. Greedy decoding is
deterministic for a given model, dtype, device and ``batch_size``; on a GPU the
batch composition can still move a near-tie between two tokens, so compare runs
made with the same ``batch_size``.

Checkers
--------
A checker is any callable ``(record, response) -> bool`` (True = correct), where
``record`` is the probe record (a dict with ``prompt`` and, for the built-ins, a
``reference`` answer; ``answer`` or ``target`` are accepted as its name too).

Built-ins (:data:`BUILTIN_CHECKERS`):

``exact_match``           the whole response equals the reference after trimming,
                          collapsing white space, case-folding and dropping one
                          trailing period.
``numeric_final_answer``  GSM8K style: the number after the last ``####``, else the
                          first number after the last "the answer is", else the last
                          number in the response, compared numerically with the
                          reference (``1,000`` = ``1000`` = ``1000.0``; ``$`` and ``%``
                          ignored).
``final_answer``          BIG-Bench-Hard style: the text after the last "the answer
                          is" (else the last non-empty line), up to the end of its
                          sentence, compared with the reference as ``exact_match``
                          does; an option reference such as ``(B)`` also matches
                          ``B`` or ``(B) text``.
``leading_answer``        the response opens with the reference (normalised as
                          ``exact_match`` does), followed by its end or a character
                          that is not a letter or digit (``No, the sentence ...``
                          answers ``no``): short-answer tasks whose model explains
                          after answering.
``no_refusal``            the response is not a refusal (:func:`is_refusal`: no
                          apology or "can't / cannot / won't / unable / not able /
                          decline / afraid" in its first 120 characters); needs no
                          reference. Its error rate is a refusal rate.
``by_task``               needs ``checkers`` (task -> checker spec) and optional
                          ``default``: each probe is judged by its ``task``'s checker.
``regex``                 needs ``pattern`` (and optional ``flags``, e.g. ``"i"``):
                          the last match's first group (or the whole match) in the
                          response, compared with the reference; with
                          ``compare: match`` a response is correct when the pattern
                          matches at all (no reference needed).

:func:`load_checker` takes a built-in name, a dict ``{"name": ..., **options}``, or
``"module:function"``. **User code is imported only in that last case**, that is,
only when the experiment's config names a module itself; the module must be
importable (on ``sys.path``). With options, ``module:function`` is called with them
and must return the checker (a factory); without, the function is the checker.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable
from typing import Protocol

import torch
from tqdm.auto import tqdm

from ..data.tokenize import _as_messages, _plain_prompt, has_chat_template
from ..errors import ConfigError, InputError


# --------------------------------------------------------------------------- generation

def render_prompt_ids(tokenizer, prompt) -> list:
    """Token ids of ``prompt`` as training renders it, ending where the response starts."""
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(_as_messages(prompt), tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(_plain_prompt(prompt), add_special_tokens=True)["input_ids"]
    if not ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        ids = [start]
    return list(ids)


def _stop_ids(model, tokenizer) -> list:
    ids = []
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   tokenizer.eos_token_id):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    # ChatML-style templates end a turn with <|im_end|>; stop there too when it is a token.
    if has_chat_template(tokenizer) and "<|im_end|>" in (tokenizer.chat_template or ""):
        tid = tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.append(tid)
    return sorted(set(int(i) for i in ids))


def _cut_at_stop(text: str, stop: list | None) -> str:
    if not stop:
        return text
    cut = min((text.find(s) for s in stop if s and s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def generate(lm, prompts: list, max_new_tokens: int = 256, batch_size: int = 16, *,
             max_prompt_tokens: int | None = None, stop: list | None = None,
             progress: bool = False) -> list:
    """Greedy responses of ``lm`` (a :class:`~prism_select.model.LoadedModel`, or any
    object with ``.model`` and ``.tokenizer``) to ``prompts`` (text or chat messages).

    ``max_prompt_tokens`` cuts longer prompts from the left (as training does);
    ``stop`` strings cut a response after decoding (for models without a chat
    template, which run on to ``max_new_tokens``). Returns one string per prompt,
    special tokens removed, surrounding white space trimmed.
    """
    if max_new_tokens < 1:
        raise ConfigError("max_new_tokens", f"must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ConfigError("batch_size", f"must be >= 1, got {batch_size}")
    model, tok = lm.model, lm.tokenizer
    if not prompts:
        return []
    device = next(model.parameters()).device
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    encoded = []
    for p in prompts:
        ids = render_prompt_ids(tok, p)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            ids = ids[len(ids) - max_prompt_tokens:]
        encoded.append(ids)
    order = sorted(range(len(encoded)), key=lambda i: (-len(encoded[i]), i))
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                               pad_token_id=pad_id, eos_token_id=_stop_ids(model, tok) or None)
    out: list = [""] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        starts = range(0, len(order), batch_size)
        for s in tqdm(starts, desc="generating", unit="batch", leave=False, disable=not progress):
            idx = order[s:s + batch_size]
            T = max(len(encoded[i]) for i in idx)
            ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
            mask = torch.zeros((len(idx), T), dtype=torch.long)
            for r, i in enumerate(idx):  # left padding: every prompt ends at column T-1
                n = len(encoded[i])
                ids[r, T - n:] = torch.tensor(encoded[i])
                mask[r, T - n:] = 1
            with torch.no_grad():
                gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                     generation_config=gen_cfg)
            for r, i in enumerate(idx):
                text = tok.decode(gen[r, T:].tolist(), skip_special_tokens=True)
                out[i] = _cut_at_stop(text, stop).strip()
    finally:
        if was_training:
            model.train()
    return out


# --------------------------------------------------------------------------- checkers

class Checker(Protocol):
    """``(probe record, response) -> True when the response is correct``."""

    def __call__(self, record: dict, response: str) -> bool: ...


REFERENCE_FIELDS = ("reference", "answer", "target")


def reference_of(record: dict) -> str:
    """The record's reference answer (field ``reference``, else ``answer``, else ``target``)."""
    for f in REFERENCE_FIELDS:
        if f in record and record[f] is not None:
            return str(record[f])
    raise InputError(f"the probe record {record.get('id', '')!r} has no reference answer",
                     field="reference", fix="give each probe a 'reference' field")


def normalize(text: str) -> str:
    t = re.sub(r"\s+", " ", str(text)).strip().casefold()
    return t[:-1].rstrip() if t.endswith(".") else t


def exact_match(record: dict, response: str) -> bool:
    return normalize(response) == normalize(reference_of(record))


_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?\d+(?:,\d{3})*(?:\.\d+)?")


def _clean_number(text: str) -> float | None:
    t = str(text).strip().replace("$", "").replace(",", "").replace(" ", "")
    t = t.rstrip("%").rstrip(".")
    try:
        v = float(t)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def parse_number(text: str) -> float | None:
    """A number written as GSM8K writes them (``1,000``, ``$5``, ``-3.5``, ``12%``);
    for other text, its first number; ``None`` when there is none."""
    v = _clean_number(text)
    if v is None:
        m = _NUMBER.search(str(text))
        v = _clean_number(m.group(0)) if m else None
    return v


def _numbers(text: str) -> list:
    return [m.group(0) for m in _NUMBER.finditer(text)]


def extract_final_number(response: str) -> float | None:
    """The final answer of a GSM8K-style solution (see ``numeric_final_answer``)."""
    if "####" in response:
        nums = _numbers(response.rsplit("####", 1)[1])
        if nums:
            return parse_number(nums[0])
    low = response.lower()
    k = low.rfind("the answer is")
    if k >= 0:
        nums = _numbers(response[k:])
        if nums:
            return parse_number(nums[0])
    nums = _numbers(response)
    return parse_number(nums[-1]) if nums else None


def numbers_equal(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return False
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def numeric_final_answer(record: dict, response: str) -> bool:
    text = reference_of(record)
    ref = _clean_number(text)
    if ref is None:  # a whole worked solution as the reference: take its final answer
        ref = extract_final_number(text)
    return numbers_equal(extract_final_number(response), ref)


_OPTION = re.compile(r"^\(?([A-Za-z])\)?$")


def _answer_span(response: str) -> str:
    low = response.lower()
    k = low.rfind("the answer is")
    if k >= 0:
        text = response[k + len("the answer is"):].lstrip(" :")
        text = text.split("\n", 1)[0]
        m = re.match(r"(.*?)(?:\.\s|\.$|$)", text)
        return m.group(1) if m else text
    lines = [ln for ln in response.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def final_answer(record: dict, response: str) -> bool:
    ref = normalize(reference_of(record))
    got = normalize(_answer_span(response))
    if got == ref:
        return True
    m = _OPTION.match(ref)
    if m:  # option letters: "(B)", "B", "(B) 12/25/1937"
        letter = m.group(1).casefold()
        g = re.match(r"^\(?([a-z])\)?(?:\s|$)", got)
        return bool(g) and g.group(1) == letter
    return False


def regex(pattern: str, flags: str = "", compare: str = "reference") -> Checker:
    """Checker factory; see the module docstring."""
    if compare not in ("reference", "match"):
        raise ConfigError("checker.compare", f"unknown value {compare!r}", "use reference or match")
    fl = 0
    for ch in flags or "":
        if ch not in "imsx":
            raise ConfigError("checker.flags", f"unknown regex flag {ch!r}", "use a combination of i, m, s, x")
        fl |= {"i": re.I, "m": re.M, "s": re.S, "x": re.X}[ch]
    try:
        rx = re.compile(pattern, fl)
    except re.error as e:
        raise ConfigError("checker.pattern", f"{pattern!r} is not a valid regular expression: {e}") from e

    def check(record: dict, response: str) -> bool:
        matches = list(rx.finditer(response))
        if compare == "match":
            return bool(matches)
        if not matches:
            return False
        m = matches[-1]
        got = m.group(1) if rx.groups else m.group(0)
        return normalize(got or "") == normalize(reference_of(record))

    check.__name__ = f"regex({pattern!r})"
    return check


def leading_answer(record: dict, response: str) -> bool:
    """The response opens with the reference (after ``normalize``), followed by its end or
    a character that is not a letter or digit: ``"No, the sentence is not plausible"``
    answers ``no``; ``"Nobody"`` does not."""
    ref = normalize(reference_of(record))
    got = re.sub(r"\s+", " ", str(response)).strip().casefold()
    return bool(ref) and got.startswith(ref) and (len(got) == len(ref) or not got[len(ref)].isalnum())


_REFUSAL = re.compile(r"\b(sorry|apologi[sz]e|can(?:'|no)t|can not|won't|unable|not able|decline|afraid)\b", re.I)


def is_refusal(response: str, head_chars: int = 120) -> bool:
    """A refusal: its first ``head_chars`` characters hold an apology or a "can't / cannot /
    won't / unable / not able / decline / afraid" (a worked solution does not open that way)."""
    return bool(_REFUSAL.search(str(response)[:head_chars]))


def no_refusal(record: dict, response: str) -> bool:
    return not is_refusal(response)


BUILTIN_CHECKERS = {"exact_match": exact_match, "numeric_final_answer": numeric_final_answer,
                    "final_answer": final_answer, "no_refusal": no_refusal, "leading_answer": leading_answer}
def by_task(checkers: dict, default=None) -> Checker:
    """Checker factory: the checker of ``checkers[record["task"]]`` (each a checker spec,
    see :func:`load_checker`), else ``default``; a record whose task has neither is an
    :class:`InputError`."""
    if not isinstance(checkers, dict) or not checkers:
        raise ConfigError("checker.checkers", f"expected a mapping task -> checker, got {checkers!r}")
    table = {t: load_checker(c) for t, c in checkers.items()}
    fallback = load_checker(default) if default is not None else None

    def check(record: dict, response: str) -> bool:
        fn = table.get(record.get("task"), fallback)
        if fn is None:
            raise InputError(f"no checker for task {record.get('task')!r} of probe {record.get('id')!r}",
                             field="task", fix="add it to checker.checkers or set checker.default")
        return fn(record, response)

    check.__name__ = "by_task"
    return check


_FACTORIES = {"regex": regex, "by_task": by_task}


def load_checker(spec) -> Callable[[dict, str], bool]:
    """A checker from a config value: ``"numeric_final_answer"``, ``{"name": "regex",
    "pattern": "..."}``, or ``"package.module:function"`` (imports that module: only
    ever when the config names it)."""
    options: dict = {}
    if isinstance(spec, dict):
        if "name" not in spec:
            raise ConfigError("checker", f"a checker given as a mapping needs 'name'; got {sorted(spec)}",
                              "e.g. {name: regex, pattern: '####\\s*(\\S+)'}")
        options = {k: v for k, v in spec.items() if k != "name"}
        spec = spec["name"]
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("checker", f"expected a checker name, got {spec!r}")
    known = sorted(BUILTIN_CHECKERS) + sorted(_FACTORIES)
    if spec in BUILTIN_CHECKERS:
        if options:
            raise ConfigError("checker", f"{spec} takes no options, got {sorted(options)}")
        return BUILTIN_CHECKERS[spec]
    if spec in _FACTORIES:
        try:
            return _FACTORIES[spec](**options)
        except TypeError as e:
            raise ConfigError("checker", f"bad options for {spec}: {e}", "regex needs 'pattern'") from e
    if ":" not in spec:
        raise ConfigError("checker", f"unknown checker {spec!r}",
                          f"use one of {', '.join(known)}, or 'module:function' for your own code")
    mod_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError("checker", f"cannot import {mod_name!r} named by {spec!r}: {e}",
                          "put the module on PYTHONPATH (or install it)") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ConfigError("checker", f"{mod_name!r} has no callable {fn_name!r}")
    return fn(**options) if options else fn
