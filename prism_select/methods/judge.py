"""LLM Judge: ask a judge model, per candidate, whether its response shows the target
behaviour; score = the judge's probability of "yes".

Which behaviour. PRISM's target-positive ``chosen`` responses ``y+`` exemplify the
behaviour being traced (in the repair protocol, the *unwanted* post-fine-tuning
behaviour: the top-scored candidates are the ones to remove), so the judge asks
whether a response shows the behaviour of the ``chosen`` responses, as opposed to the
``rejected`` ones. ``{behaviour}`` is, unless the option ``behaviour`` gives a text, a
description built from the first ``n_examples`` target pairs (prompt, a response that
shows it, one that does not; each text clipped to ``example_chars`` characters).
Higher score = more of the traced behaviour, as for every other method.

The prompt is ``template.format(prompt=..., response=..., behaviour=...)`` (``behavior``
is accepted too); a chat prompt is shown as ``role: content`` lines. The template is
checked for unknown fields; ``{response}`` is required.

Backends:

* **local** (option ``judge``: a model directory, a ``.gguf`` file or ``"default"``,
  loaded with :func:`prism_select.model.load_model` on the run's device/dtype/cache;
  ``"self"`` or nothing = the run's own model). The judge prompt is rendered with the
  judge's chat template as one user turn plus the generation prompt (plain text
  otherwise), followed by ``answer_prefix`` (default: none with a chat template,
  ``"\\nAnswer:"`` without). Score = ``sum_{t in Y} exp(l_t) / sum_{t in Y u N} exp(l_t)``,
  the softmax of the next-token logits ``l`` restricted to the "yes" and "no" tokens:
  ``Y`` / ``N`` = the first token of each variant in ``yes_words`` (``yes``, ``Yes``,
  ``YES``, `` yes``, `` Yes``, `` YES``) / ``no_words`` (same for ``no``); a token
  shared by a yes- and a no-variant (e.g. a lone space of a character-level
  tokenizer) is dropped. Computed in float64 from the logits. A judge prompt longer
  than the run's ``max_length`` has its response shortened (marked ``[...]``), and if
  that is not enough, its tokens cut from the left.
* **endpoint** (option ``endpoint``: an OpenAI-compatible base URL, e.g.
  ``http://127.0.0.1:8000/v1``; option ``model`` names the served model): one
  ``POST {endpoint}/chat/completions`` per example, ``temperature`` 0, ``max_tokens``
  (default 5). The answer is parsed: starting with "yes" -> 1, "no" -> 0, else the
  first number in [0, 1]; anything else raises :class:`PrismError` unless option
  ``unparsed`` gives the score to use. The API key is read from the environment
  variable named by ``api_key_env`` (default ``OPENAI_API_KEY``) and sent as
  ``Authorization: Bearer``; it is never written to run.json, logs or errors (a
  server's error text is shown with the key masked). Without the variable no header
  is sent (local servers), unless ``api_key_env`` was set explicitly, which then is an
  error. Each request has a ``timeout`` (seconds); connection errors, timeouts and
  HTTP 408/409/425/429/5xx are retried ``retries`` times with exponential back-off
  (``retry_backoff`` x 2^attempt seconds, at most 30); other HTTP errors stop the run
  with a :class:`PrismError` naming the status. ``workers`` requests run in parallel.

Answers are kept in the run's ``.partial/judge/answers.jsonl`` as they come, so an
interrupted run resumes without asking again. With ``score_targets`` (default on) the
target pairs' ``chosen`` and ``rejected`` responses are judged too and written to
``pairs.jsonl`` (``p_chosen``, ``p_rejected``): a sanity check that the judge
separates them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import string
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..data.tokenize import Encoded, collate
from ..errors import ConfigError, PrismError
from ..model import DEFAULT_MODEL, ModelSettings, load_model
from .common import record, resolve_options
from .registry import options_dict, register

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are reviewing training data for a language model.\n\n"
    "Behaviour to detect: {behaviour}\n\n"
    "Training example to review:\n"
    "<prompt>\n{prompt}\n</prompt>\n"
    "<response>\n{response}\n</response>\n\n"
    "Does the response in this training example show the behaviour to detect? "
    "Answer with one word: yes or no."
)
YES_WORDS = ["yes", "Yes", "YES", " yes", " Yes", " YES"]
NO_WORDS = ["no", "No", "NO", " no", " No", " NO"]
_FIELDS = {"prompt", "response", "behaviour", "behavior"}
_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
DEFAULT_KEY_ENV = "OPENAI_API_KEY"

@dataclass(frozen=True)
class JudgeOptions:
    """The judge's options (the module docstring): the local judge model (``judge``: a model
    directory, a .gguf file, "default" or "self") or an OpenAI-compatible ``endpoint``
    with its ``model`` and ``api_key_env``; the prompt (``template``, ``behaviour``,
    ``n_examples``, ``example_chars``, ``answer_prefix``); the answer tokens
    (``yes_words``, ``no_words``); the endpoint's requests (``max_tokens``, ``timeout``,
    ``retries``, ``retry_backoff``, ``workers``, ``unparsed``); ``score_targets``."""

    judge: str | os.PathLike | None = None
    endpoint: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    template: str | None = None
    behaviour: str | None = None
    n_examples: int = 3
    example_chars: int = 600
    answer_prefix: str | None = None
    yes_words: list | None = None
    no_words: list | None = None
    max_tokens: int = 5
    timeout: float = 60.0
    retries: int = 3
    retry_backoff: float = 1.0
    workers: int = 4
    unparsed: float | None = None
    score_targets: bool = True


# --------------------------------------------------------------------------- prompt

def prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n] + " [...]"


def behaviour_from_pairs(pairs: list, n_examples: int = 3, example_chars: int = 600) -> str:
    """A description of the traced behaviour from the target pairs' examples."""
    lines = ["the behaviour shown by the responses marked SHOWS below and absent from the responses "
             "marked DOES NOT SHOW (both answer the same prompt)."]
    for k, p in enumerate(pairs[:n_examples]):
        lines += ["", f"Example {k + 1}", f"Prompt: {_clip(prompt_text(p.prompt), example_chars)}",
                  f"SHOWS: {_clip(p.chosen, example_chars)}",
                  f"DOES NOT SHOW: {_clip(p.rejected, example_chars)}"]
    return "\n".join(lines)


def check_template(template) -> str:
    if not isinstance(template, str) or not template.strip():
        raise ConfigError("template", f"must be a non-empty str.format template, got {template!r}")
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ConfigError("template", f"is not a valid str.format template: {e}",
                          "write literal braces as {{ and }}") from e
    bad = sorted(n for n in names if n not in _FIELDS)
    if bad:
        raise ConfigError("template", f"unknown field(s) {', '.join('{' + b + '}' for b in bad)}",
                          "use {prompt}, {response} and {behaviour}; write literal braces as {{ and }}")
    if "response" not in names:
        raise ConfigError("template", "has no {response} field", "the judge must see the response")
    return template


def render_prompt(template: str, prompt, response: str, behaviour: str) -> str:
    return template.format(prompt=prompt_text(prompt), response=response, behaviour=behaviour,
                           behavior=behaviour)


# --------------------------------------------------------------------------- local judge

def answer_token_ids(tokenizer, yes_words=None, no_words=None) -> tuple[list, list]:
    """First token of each variant; a token on both sides is dropped."""
    def first(words):
        out = []
        for w in words:
            ids = tokenizer(w, add_special_tokens=False)["input_ids"]
            if ids and ids[0] not in out:
                out.append(ids[0])
        return out
    yes, no = first(yes_words or YES_WORDS), first(no_words or NO_WORDS)
    both = set(yes) & set(no)
    yes, no = [t for t in yes if t not in both], [t for t in no if t not in both]
    if not yes or not no:
        raise ConfigError("yes_words", "the judge tokenizer gives no distinct first token for the yes/no answers",
                          "pass yes_words / no_words that the tokenizer tells apart")
    return yes, no


def _judge_ids(tokenizer, text: str, answer_prefix: str) -> list:
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return tokenizer(rendered + answer_prefix, add_special_tokens=False)["input_ids"]
    return tokenizer(text + answer_prefix)["input_ids"]


def encode_judge_prompt(tokenizer, template, prompt, response, behaviour, answer_prefix, max_length) -> tuple[list, bool]:
    """Token ids of the judge prompt, shortened to ``max_length`` (see the module docstring)."""
    ids = _judge_ids(tokenizer, render_prompt(template, prompt, response, behaviour), answer_prefix)
    if len(ids) <= max_length:
        return ids, False
    r_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    for _ in range(3):
        keep = len(r_ids) - (len(ids) - max_length) - 8
        if keep <= 0:
            break
        r_ids = r_ids[:keep]
        short = tokenizer.decode(r_ids) + " [...]"
        ids = _judge_ids(tokenizer, render_prompt(template, prompt, short, behaviour), answer_prefix)
        if len(ids) <= max_length:
            return ids, True
    return ids[len(ids) - max_length:], True


def yes_probability(logits: torch.Tensor, yes_ids: list, no_ids: list) -> torch.Tensor:
    """``(B, V)`` next-token logits -> P(yes) with the softmax restricted to yes u no tokens."""
    lg = logits.double()
    y = torch.logsumexp(lg[:, yes_ids], dim=1)
    a = torch.logsumexp(lg[:, yes_ids + no_ids], dim=1)
    return torch.exp(y - a)


def local_scores(model, tokenizer, prompts: list, *, yes_ids, no_ids, batch_size: int, progress: bool = False,
                 desc: str = "judge") -> torch.Tensor:
    """P(yes) for each list of judge-prompt token ids (right-padded batches)."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    with torch.no_grad():
        for s in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress, leave=False):
            part = prompts[s:s + batch_size]
            b = collate([Encoded(ids, len(ids) - 1) for ids in part], pad, device)
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            last = torch.tensor([len(ids) - 1 for ids in part], device=logits.device)
            nxt = logits[torch.arange(len(part), device=logits.device), last]
            out.append(yes_probability(nxt, yes_ids, no_ids).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


# --------------------------------------------------------------------------- endpoint

_YES_NO = re.compile(r"^[\W_]*(yes|no)\b", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![\d.])(\d*\.\d+|\d+)(?![\d.])")


def parse_answer(text: str) -> float | None:
    """"yes..." -> 1.0, "no..." -> 0.0, else the first number in [0, 1], else None."""
    if not isinstance(text, str):
        return None
    m = _YES_NO.match(text.strip())
    if m:
        return 1.0 if m.group(1).lower() == "yes" else 0.0
    for num in _NUMBER.findall(text):
        v = float(num)
        if 0.0 <= v <= 1.0:
            return v
    return None


def _mask(text: str, secret: str | None) -> str:
    return text.replace(secret, "***") if secret else text


class EndpointJudge:
    """Minimal OpenAI-compatible chat-completions client (standard library only)."""

    def __init__(self, endpoint: str, model: str, api_key: str | None, *, timeout: float, retries: int,
                 backoff: float, max_tokens: int):
        base = endpoint.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self._key = api_key
        self.timeout, self.retries, self.backoff, self.max_tokens = timeout, retries, backoff, max_tokens

    def __repr__(self):  # never show the key
        return f"EndpointJudge(url={self.url!r}, model={self.model!r})"

    def ask(self, text: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "temperature": 0, "max_tokens": self.max_tokens}).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        last = ""
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    payload = resp.read()
                return self._content(payload)
            except urllib.error.HTTPError as e:
                try:
                    detail = e.read().decode("utf-8", "replace")[:300]
                except Exception:
                    detail = ""
                last = f"HTTP {e.code} {e.reason}: {_mask(detail, self._key)}"
                if e.code not in _RETRY_STATUS:
                    raise PrismError(f"the judge endpoint {self.url} answered {last}") from None
            except (urllib.error.URLError, socket.timeout, TimeoutError, ConnectionError) as e:
                reason = getattr(e, "reason", e)
                last = f"{type(e).__name__}: {_mask(str(reason), self._key)}"
            if attempt < self.retries:
                time.sleep(min(self.backoff * (2 ** attempt), 30.0))
        raise PrismError(f"the judge endpoint {self.url} failed after {self.retries + 1} attempt(s): {last}")

    def _content(self, payload: bytes) -> str:
        try:
            data = json.loads(payload)
            return data["choices"][0]["message"]["content"] or ""
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise PrismError(f"the judge endpoint {self.url} returned no chat completion "
                             f"({type(e).__name__}): {_mask(payload[:300].decode('utf-8', 'replace'), self._key)}") from None


# --------------------------------------------------------------------------- method

def _int_opt(opts, name, lo):
    v = getattr(opts, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(name, f"must be an integer >= {lo}, got {v!r}")
    return v


class _Answers:
    """Resumable store of judged items in ``.partial/judge/answers.jsonl``."""

    def __init__(self, ctx):
        self.path = ctx.out_dir / ".partial" / "judge" / "answers.jsonl"
        self.done: dict = {}
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                    self.done[row["key"]] = float(row["score"])
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by an interruption
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def add(self, key: str, score: float, answer: str | None = None):
        self.done[key] = score
        row = {"key": key, "score": score}
        if answer is not None:
            row["answer"] = answer[:200]
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self):
        self._f.close()


@register("judge", options=JudgeOptions, needs_pairs=False,
          description="LLM judge: probability that the response shows the behaviour of the chosen targets")
def judge_method(ctx) -> tuple[torch.Tensor, list]:
    """Judge scores (see the module docstring); float64 in [0, 1], higher = more of the behaviour."""
    opts = resolve_options(ctx, "judge")
    template = check_template(opts.template if opts.template is not None else DEFAULT_TEMPLATE)
    behaviour = opts.behaviour
    if behaviour is None:
        if not ctx.inputs.pairs:
            raise ConfigError("behaviour", "the judge needs target pairs or a behaviour description",
                              "pass --targets FILE, or the option behaviour='...'")
        behaviour = behaviour_from_pairs(ctx.inputs.pairs, _int_opt(opts, "n_examples", 1),
                                         _int_opt(opts, "example_chars", 1))
    elif not isinstance(behaviour, str) or not behaviour.strip():
        raise ConfigError("behaviour", f"must be a non-empty text, got {behaviour!r}")
    batch = ctx.settings.batch_size
    # items: (key, prompt, response); candidates first, then target responses
    items = [(f"pool:{i}", ex.prompt, ex.response) for i, ex in enumerate(ctx.inputs.pool)]
    if opts.score_targets and ctx.inputs.pairs:
        for j, p in enumerate(ctx.inputs.pairs):
            items += [(f"chosen:{j}", p.prompt, p.chosen), (f"rejected:{j}", p.prompt, p.rejected)]
    store = _Answers(ctx)
    extra: dict = {}
    t = time.perf_counter()
    try:
        todo = [it for it in items if it[0] not in store.done]
        if opts.endpoint is not None:
            extra = _run_endpoint(ctx, opts, template, behaviour, todo, store)
        else:
            extra = _run_local(ctx, opts, template, behaviour, todo, store, batch, load_model, ModelSettings,
                               DEFAULT_MODEL)
    finally:
        store.close()
    ctx.timings["judge_s"] = time.perf_counter() - t
    scores = torch.tensor([store.done[f"pool:{i}"] for i in range(len(ctx.inputs.pool))], dtype=torch.float64)
    rows = []
    if opts.score_targets and ctx.inputs.pairs:
        rows = [{"id": p.id, **({"task": p.task} if p.task else {}), "p_chosen": store.done[f"chosen:{j}"],
                 "p_rejected": store.done[f"rejected:{j}"]} for j, p in enumerate(ctx.inputs.pairs)]
    shown = {k: v for k, v in options_dict(opts).items() if k != "template"}
    record(ctx, "judge", shown, template=template, behaviour=behaviour, resumed=len(items) - len(todo), **extra)
    return scores, rows


def _run_local(ctx, opts, template, behaviour, todo, store, batch, load_model, ModelSettings, DEFAULT_MODEL) -> dict:
    spec = opts.judge
    if spec in (None, "self"):
        lm, source = ctx.lm, "the run's model"
    else:
        if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
            raise ConfigError("judge", f"must be a model directory, a .gguf file, 'default' or 'self', got {spec!r}")
        s = ctx.lm.settings
        lm = load_model(ModelSettings(model=str(spec), device=s.device, dtype=s.dtype, cache_dir=s.cache_dir))
        source = str(spec) if spec == DEFAULT_MODEL else str(lm.source.get("path", spec))
    tok = lm.tokenizer
    prefix = opts.answer_prefix
    if prefix is None:
        prefix = "" if getattr(tok, "chat_template", None) else "\nAnswer:"
    yes_ids, no_ids = answer_token_ids(tok, opts.yes_words, opts.no_words)
    encoded, truncated = [], 0
    for key, prompt, response in todo:
        ids, cut = encode_judge_prompt(tok, template, prompt, response, behaviour, prefix, ctx.settings.max_length)
        encoded.append(ids)
        truncated += cut
    was_training = lm.model.training
    lm.model.eval()
    try:
        for s in range(0, len(todo), max(batch * 8, 1)):  # save progress every few batches
            probs = local_scores(lm.model, tok, encoded[s:s + batch * 8], yes_ids=yes_ids, no_ids=no_ids,
                                 batch_size=batch, progress=False)
            for (key, _, _), p in zip(todo[s:s + batch * 8], probs.tolist()):
                store.add(key, p)
    finally:
        lm.model.train(was_training)
    return {"backend": "local", "judge_model": source, "self_judging": lm is ctx.lm or lm.fingerprint == ctx.lm.fingerprint,
            "judge_parameters": sum(p.numel() for p in lm.model.parameters()), "answer_prefix": prefix,
            "yes_tokens": [tok.decode([i]) for i in yes_ids], "no_tokens": [tok.decode([i]) for i in no_ids],
            "truncated": truncated}


def _run_endpoint(ctx, opts, template, behaviour, todo, store) -> dict:
    endpoint, model = opts.endpoint, opts.model
    if not isinstance(endpoint, str) or not re.match(r"^https?://", endpoint):
        raise ConfigError("endpoint", f"must be an http(s) URL, got {endpoint!r}", "e.g. http://127.0.0.1:8000/v1")
    if not isinstance(model, str) or not model.strip():
        raise ConfigError("model", "the judge endpoint needs the served model's name", "pass the option model='...'")
    env = opts.api_key_env or DEFAULT_KEY_ENV
    key = os.environ.get(env) or None
    if key is None and opts.api_key_env is not None:
        raise ConfigError("api_key_env", f"the environment variable {env} is not set",
                          f"export {env}=... (the key is never written to any file)")
    timeout = opts.timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError("timeout", f"must be a positive number of seconds, got {timeout!r}")
    backoff = opts.retry_backoff
    if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or backoff < 0:
        raise ConfigError("retry_backoff", f"must be >= 0 seconds, got {backoff!r}")
    unparsed = opts.unparsed
    if unparsed is not None and (isinstance(unparsed, bool) or not isinstance(unparsed, (int, float))):
        raise ConfigError("unparsed", f"must be a number (the score of an unreadable answer) or None, got {unparsed!r}")
    client = EndpointJudge(endpoint, model, key, timeout=float(timeout), retries=_int_opt(opts, "retries", 0),
                           backoff=float(backoff), max_tokens=_int_opt(opts, "max_tokens", 1))
    workers = _int_opt(opts, "workers", 1)
    n_unparsed = 0

    def one(item):
        k, prompt, response = item
        return k, client.ask(render_prompt(template, prompt, response, behaviour))

    bar = tqdm(total=len(todo), desc="judge", disable=not ctx.settings.progress, leave=False)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(one, it) for it in todo]
        try:
            for fut in as_completed(futures):
                k, answer = fut.result()
                v = parse_answer(answer)
                if v is None:
                    if unparsed is None:
                        raise PrismError(f"cannot read the judge's answer for {k}: {answer[:200]!r} "
                                         "(expected yes/no or a number in [0, 1]); pass the option "
                                         "unparsed=<score> to use a fixed score instead")
                    n_unparsed += 1
                    v = float(unparsed)
                store.add(k, v, answer)
                bar.update(1)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            bar.close()
    return {"backend": "endpoint", "url": client.url, "served_model": model, "api_key_env": env,
            "api_key_sent": key is not None, "unparsed_answers": n_unparsed}


METHODS = {"judge": judge_method}
