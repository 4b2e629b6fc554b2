"""Tokenisation of (prompt, response) pairs with a response-only loss mask.

With a chat template the prompt is rendered with ``add_generation_prompt=True`` and
the response is the rest of the full rendered conversation (so the end-of-turn
token belongs to the response and is trained on). Without a template the text is
``prompt + response + EOS``. Prompt and response are tokenised separately so the
boundary is exact. Too long: the prompt is cut from the left; a response that
cannot fit (with at least one prompt token to predict it from) is invalid.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from ..io import sha256_json
from ..settings import DEFAULT_MAX_LENGTH  # noqa: F401 (re-exported)


@dataclass
class Encoded:
    """Token ids of one example; ``input_ids[response_start:]`` are the response
    tokens, each predicted from the token before it."""

    input_ids: list
    response_start: int
    truncated: bool = False

    @property
    def n_response(self) -> int:
        return len(self.input_ids) - self.response_start


def _as_messages(prompt) -> list:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def _plain_prompt(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt) + "\n"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, prompt, response: str) -> tuple[str, str]:
    """Return (prompt_text, response_text) as they appear in the model's input."""
    if has_chat_template(tokenizer):
        messages = _as_messages(prompt)
        p = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": response}], tokenize=False
        )
        if not full.startswith(p):
            # Some templates render the last assistant turn differently (e.g. strip
            # reasoning); fall back to appending the response to the prompt.
            eos = tokenizer.eos_token or ""
            return p, response + eos
        return p, full[len(p):]
    return _plain_prompt(prompt), response


#: characters tokenised per token of ``max_length`` before a text is known to be longer:
#: a token of a real vocabulary rarely spans more than a few characters, so a prefix of
#: this many characters per token holds more than ``max_length`` tokens of ordinary text
#: (a text that packs into fewer tokens is tokenised in longer prefixes, 4x each time)
CHARS_PER_TOKEN_BOUND = 16


def _bounded_ids(tokenizer, text: str, max_length: int, special: bool, from_end: bool) -> list | None:
    """The token ids of ``text``, tokenising only as much of it as ``max_length`` can use,
    so that a record of millions of characters costs no more than one that just fits.

    A response (``from_end`` False) is tokenised in growing prefixes: None when a prefix
    already holds more than twice ``max_length`` tokens (the whole text then cannot fit;
    twice, so that a token cut at the prefix's end cannot decide it). A prompt
    (``from_end`` True), which is cut from the left, is tokenised in growing suffixes
    until a suffix holds twice ``max_length`` tokens: only its last ``max_length``
    tokens are ever kept, and those lie far from the cut."""
    limit = 2 * max(max_length, 1)
    n = limit * CHARS_PER_TOKEN_BOUND
    while n < len(text):
        part = text[len(text) - n:] if from_end else text[:n]
        ids = tokenizer(part, add_special_tokens=special)["input_ids"]
        if len(ids) > limit:
            return list(ids) if from_end else None
        n *= 4
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def encode(tokenizer, prompt, response: str, max_length: int = DEFAULT_MAX_LENGTH,
           *, path=None, row=None, field: str = "response", line=None) -> Encoded:
    """Encode one example; raise :class:`InputError` (at ``path``, ``row``, ``line``) if
    the response cannot fit."""
    p_text, r_text = render(tokenizer, prompt, response)
    templated = has_chat_template(tokenizer)
    r_ids = _bounded_ids(tokenizer, r_text, max_length, False, from_end=False)
    if r_ids is None:
        raise InputError(
            f"the response has more than {max_length} tokens and cannot fit in max_length={max_length} "
            "with at least one prompt token", path=path, row=row, line=line, field=field,
            fix="raise --max-length or shorten the response")
    p_ids = _bounded_ids(tokenizer, p_text, max_length, not templated, from_end=True)
    if not templated and tokenizer.eos_token_id is not None:
        r_ids = list(r_ids) + [tokenizer.eos_token_id]
    if len(r_ids) == 0:
        raise InputError("the response is empty after tokenisation", path=path, row=row, line=line,
                         field=field, fix="give a non-empty response")
    if len(p_ids) == 0:
        # A response needs a token to be predicted from; use BOS/EOS as a stand-in.
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        p_ids = [start]
    if len(r_ids) > max_length - 1:
        raise InputError(
            f"the response has {len(r_ids)} tokens and cannot fit in max_length={max_length} "
            "with at least one prompt token", path=path, row=row, line=line, field=field,
            fix="raise --max-length or shorten the response")
    truncated = False
    room = max_length - len(r_ids)
    if len(p_ids) > room:
        p_ids = p_ids[len(p_ids) - room:]
        truncated = True
    return Encoded(list(p_ids) + list(r_ids), len(p_ids), truncated)


def collate(batch: list, pad_id: int, device=None) -> dict:
    """Right-padded batch: ``input_ids``, ``attention_mask`` and ``labels`` (-100 off
    the response). Right padding keeps every real token at its own position, so an
    example's logits do not depend on the batch it is in."""
    T = max(len(e.input_ids) for e in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    for i, e in enumerate(batch):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        mask[i, :n] = 1
        labels[i, e.response_start:n] = ids[i, e.response_start:n]
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example summed response loss ``l(x, y)`` and response token counts.

    ``logits[:, t]`` predicts ``labels[:, t + 1]``. Computed in float32 at least.
    """
    logits = logits[:, :-1]
    target = labels[:, 1:]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    mask = target != -100
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), target.clamp(min=0).reshape(-1), reduction="none"
    ).view(target.shape)
    ce = ce * mask
    return ce.sum(dim=1), mask.sum(dim=1)


def encoded_fingerprint(encoded: list) -> str:
    """sha256 over the token ids and response boundaries: what the numbers depend on."""

    h = hashlib.sha256()
    for e in encoded:
        h.update(np.asarray([len(e.input_ids), e.response_start], dtype=np.int64).tobytes())
        h.update(np.asarray(e.input_ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what :func:`encode` depends on besides the text: the vocabulary and rules
    (a fast tokenizer's serialised form, else its vocabulary), the chat template and the
    special tokens."""

    backend = getattr(tokenizer, "backend_tokenizer", None)
    core = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return sha256_json({"class": type(tokenizer).__name__,
                        "core": hashlib.sha256(core.encode()).hexdigest(),
                        "chat_template": getattr(tokenizer, "chat_template", None),
                        "special": {k: getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")}})
