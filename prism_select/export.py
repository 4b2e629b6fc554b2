"""Write a selected subset in the formats common SFT trainers read.

``export_subset(pool_path, ids, out_dir, name, fmt)`` reads the pool with
:func:`prism_select.data.load_pool` (so prompts and responses are exactly what was
scored: an ``instruction`` + ``input`` record becomes ``instruction\\n\\ninput``) and
writes the examples whose id is in ``ids``, in pool order:

* ``fmt="llamafactory"``: ``<out_dir>/<name>.json`` (a JSON list) plus an entry
  ``name`` in ``<out_dir>/dataset_info.json`` (created, or updated keeping the other
  entries), so LLaMA-Factory can train with ``dataset_dir: <out_dir>``, ``dataset: <name>``.

  - ``style="alpaca"``: ``{"instruction", "input": "", "output", "system", "history"}``
    where a chat prompt is split into its system message, earlier (user, assistant)
    turns (``history``) and last user message (``instruction``). Entry columns:
    prompt=instruction, query=input, response=output, system=system, history=history.
  - ``style="sharegpt"``: ``{"messages": [{"role", "content"}, ...]}`` (OpenAI-style
    roles, an optional leading system message). Entry: ``formatting: sharegpt``,
    ``columns: {messages: messages}``, ``tags`` naming role/content keys and the
    user/assistant/system role values.
  - ``style=None`` (default): alpaca when every prompt is plain text, else sharegpt.

  LLaMA-Factory needs alternating user/assistant turns; other layouts raise
  :class:`InputError` naming the record.

* ``fmt="trl"``: ``<out_dir>/<name>.jsonl`` for TRL's ``SFTTrainer``:

  - ``style="messages"`` (default): ``{"messages": [...prompt messages..., {"role":
    "assistant", "content": response}]}`` (conversational; pass
    ``assistant_only_loss=True`` to TRL to train on the response only, as PRISM scores).
  - ``style="prompt_completion"``: ``{"prompt": [...messages...], "completion":
    [{"role": "assistant", "content": response}]}`` (conversational prompt-completion:
    TRL applies the chat template and, by default, trains on the completion only).

  Plain-text prompts become one user message in both styles, as in PRISM's encoding.

Ids are matched as :func:`~prism_select.data.load_pool` assigns them (the ``id`` field,
else the row number); an id given as text also matches an integer id with the same
digits. Ids not in the pool raise :class:`InputError` before anything is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from .data import load_pool
from .errors import ConfigError, InputError
from .io import atomic_write_json, atomic_write_jsonl

FORMATS = ("llamafactory", "trl")
STYLES = {"llamafactory": ("alpaca", "sharegpt"), "trl": ("messages", "prompt_completion")}

ALPACA_COLUMNS = {"prompt": "instruction", "query": "input", "response": "output",
                  "system": "system", "history": "history"}
SHAREGPT_TAGS = {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                 "assistant_tag": "assistant", "system_tag": "system"}


def _messages(prompt) -> list:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _check_alternating(ex, msgs: list) -> None:
    body = msgs[1:] if msgs and msgs[0]["role"] == "system" else msgs
    for i, m in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            raise InputError(f"LLaMA-Factory needs an optional system message then alternating user/assistant "
                             f"turns; message {i} of the prompt has role {m['role']!r} where {want!r} is expected",
                             row=ex.row, field="prompt",
                             fix="merge consecutive turns, or export with fmt='trl'")
    if not body or body[-1]["role"] != "user":
        raise InputError("the prompt must end with a user turn", row=ex.row, field="prompt",
                         fix="export with fmt='trl'")


def _alpaca(ex) -> dict:
    msgs = _messages(ex.prompt)
    _check_alternating(ex, msgs)
    system = ""
    if msgs[0]["role"] == "system":
        system, msgs = msgs[0]["content"], msgs[1:]
    history = [[msgs[i]["content"], msgs[i + 1]["content"]] for i in range(0, len(msgs) - 1, 2)]
    return {"instruction": msgs[-1]["content"], "input": "", "output": ex.response,
            "system": system, "history": history}


def _sharegpt(ex) -> dict:
    msgs = _messages(ex.prompt)
    _check_alternating(ex, msgs)
    return {"messages": msgs + [{"role": "assistant", "content": ex.response}]}


def _trl(ex, style: str) -> dict:
    msgs = _messages(ex.prompt)
    answer = {"role": "assistant", "content": ex.response}
    if style == "messages":
        return {"messages": msgs + [answer]}
    return {"prompt": msgs, "completion": [answer]}


def _select(pool_path, ids: Iterable[Any]) -> list:
    wanted = list(ids)
    if not wanted:
        raise ConfigError("ids", "no id selected", "pass at least one id")
    pool = load_pool(pool_path).items
    by_id = {ex.id: ex for ex in pool}
    by_text = {str(ex.id): ex for ex in pool}
    picked, missing = set(), []
    for i in wanted:
        ex = by_id.get(i) if isinstance(i, (str, int)) and not isinstance(i, bool) else None
        if ex is None:
            ex = by_text.get(str(i))
        if ex is None:
            missing.append(i)
        else:
            picked.add(id(ex))
    if missing:
        raise InputError(f"{len(missing)} selected id(s) are not in this pool (e.g. "
                         f"{', '.join(map(repr, missing[:5]))})", path=pool_path,
                         fix="pass the pool that was scored")
    return [ex for ex in pool if id(ex) in picked]


def export_subset(pool_path, ids: Iterable[Any], out_dir, name: str, fmt: str = "llamafactory",
                  style: str | None = None) -> dict:
    """Write the examples of ``pool_path`` whose id is in ``ids``; see the module docstring.

    Returns ``{"path", "count", "format", "style"}`` plus ``"dataset_info"`` (the file)
    and ``"entry"`` (the entry written) for LLaMA-Factory.
    """
    if fmt not in FORMATS:
        raise ConfigError("fmt", f"unknown export format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    if style is not None and style not in STYLES[fmt]:
        raise ConfigError("style", f"{style!r} is not a {fmt} style", f"use one of {', '.join(STYLES[fmt])}")
    if not isinstance(name, str) or not name.strip() or "/" in name or os.sep in name or name.startswith("."):
        raise ConfigError("name", f"must be a plain dataset name, got {name!r}", "e.g. prism_top5")
    out_dir = Path(out_dir)
    examples = _select(pool_path, ids)
    if fmt == "trl":
        style = style or "messages"
        path = out_dir / f"{name}.jsonl"
        n = atomic_write_jsonl(path, (_trl(ex, style) for ex in examples))
        return {"path": str(path), "count": n, "format": fmt, "style": style}
    if style is None:
        style = "alpaca" if all(isinstance(ex.prompt, str) for ex in examples) else "sharegpt"
    rows = [_alpaca(ex) if style == "alpaca" else _sharegpt(ex) for ex in examples]
    path = out_dir / f"{name}.json"
    atomic_write_json(path, rows)
    if style == "alpaca":
        entry = {"file_name": path.name, "columns": dict(ALPACA_COLUMNS)}
    else:
        entry = {"file_name": path.name, "formatting": "sharegpt", "columns": {"messages": "messages"},
                 "tags": dict(SHAREGPT_TAGS)}
    info_path = out_dir / "dataset_info.json"
    info = {}
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read the existing dataset_info.json: {e}", path=info_path,
                             fix="fix or remove it") from e
        if not isinstance(info, dict):
            raise InputError("is not a JSON object", path=info_path, fix="fix or remove it")
    info[name] = entry
    atomic_write_json(info_path, info)
    return {"path": str(path), "count": len(rows), "format": fmt, "style": style,
            "dataset_info": str(info_path), "entry": entry}


# ------------------------------------------------------------------ one file per format (select --format)

SHAREGPT_FROM = {"user": "human", "assistant": "gpt", "system": "system"}


def _sharegpt_conversations(ex) -> dict:
    msgs = _messages(ex.prompt) + [{"role": "assistant", "content": ex.response}]
    return {"conversations": [{"from": SHAREGPT_FROM.get(m["role"], m["role"]), "value": m["content"]}
                              for m in msgs]}


def write_trainer_file(pool_path, ids: Iterable[Any], out_path, fmt: str) -> dict:
    """Write the examples of ``pool_path`` whose id is in ``ids`` to ``out_path`` in ``fmt``:

    * ``llamafactory``: :func:`export_subset` into ``out_path``'s folder, the dataset named
      by its stem (``out_path`` must end in ``.json``), with its ``dataset_info.json`` entry;
    * ``trl``: :func:`export_subset`'s ``messages`` style (``out_path`` ends in ``.jsonl``);
    * ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}``;
    * ``alpaca``: ``{"instruction", "input", "output", "system", "history"}`` as above.

    ``sharegpt`` and ``alpaca`` are JSON Lines, or a JSON list when ``out_path`` ends in ``.json``.
    Returns ``{"path", "count", "format"}`` (plus ``dataset_info`` for LLaMA-Factory).
    """
    out = Path(out_path)
    if fmt in ("llamafactory", "trl"):
        want = ".json" if fmt == "llamafactory" else ".jsonl"
        if out.suffix != want:
            raise ConfigError("out", f"--format {fmt} writes {want} files, got {out.name}",
                              f"give --out {out.stem}{want}")
        return export_subset(pool_path, ids, out.parent, out.stem, fmt)
    if fmt not in ("sharegpt", "alpaca"):
        raise ConfigError("format", f"unknown trainer format {fmt!r}", "use llamafactory, trl, sharegpt or alpaca")
    examples = _select(pool_path, ids)
    rows = [_sharegpt_conversations(ex) if fmt == "sharegpt" else _alpaca(ex) for ex in examples]
    if out.suffix == ".json":
        atomic_write_json(out, rows)
    else:
        atomic_write_jsonl(out, rows)
    return {"path": str(out), "count": len(rows), "format": fmt}
