"""ShareGPT records (``conversations``: ``[{"from": ..., "value": ...}, ...]``) as pool and
target records.

A ShareGPT turn's ``from`` is ``human`` / ``user``, ``gpt`` / ``assistant``, ``system``
(an optional top-level ``system`` field is a leading system message too). The readers turn
such a record into the ``messages`` form before validating it:

* pool: ``conversations`` ending with the ``gpt`` turn to learn;
* targets (LLaMA-Factory's ShareGPT preference form): ``conversations`` (the prompt, ending
  with a ``human`` turn) + ``chosen`` + ``rejected``, each a ``{"from": "gpt", "value"}``
  turn or plain text.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "system": "system", "model": "assistant", "bot": "assistant"}
FIX = 'write [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]'


def is_sharegpt(rec: dict) -> bool:
    """A record in the ShareGPT form (and in no other form the readers know first)."""
    return "conversations" in rec and "messages" not in rec


def to_messages(conversations: Any, system: Any = None, field: str = "conversations") -> list[dict]:
    """ShareGPT turns as ``{"role", "content"}`` messages (roles mapped by :data:`ROLES`)."""
    if not isinstance(conversations, list) or not conversations:
        raise InputError("expected a non-empty list of ShareGPT turns", field=field, fix=FIX)
    out = []
    if isinstance(system, str) and system.strip():
        out.append({"role": "system", "content": system})
    for i, turn in enumerate(conversations):
        if not isinstance(turn, dict):
            raise InputError(f"turn {i}: expected an object", field=field, fix=FIX)
        who, value = turn.get("from"), turn.get("value")
        if who not in ROLES:
            raise InputError(f"turn {i}: 'from' is {who!r}, not one of {', '.join(sorted(ROLES))}",
                             field=field, fix=FIX)
        if not isinstance(value, str):
            raise InputError(f"turn {i}: 'value' must be a string", field=field, fix=FIX)
        out.append({"role": ROLES[who], "content": value})
    return out


def _answer(value: Any, field: str) -> Any:
    """A ShareGPT ``chosen`` / ``rejected``: one ``{"from", "value"}`` turn, or text."""
    if isinstance(value, dict):
        return to_messages([value], field=field)[-1]["content"]
    return value


def pool_record(rec: dict) -> dict:
    """The pool record in the ``messages`` form (other fields kept)."""
    out = {k: v for k, v in rec.items() if k not in ("conversations", "system")}
    out["messages"] = to_messages(rec["conversations"], rec.get("system"))
    return out


def target_record(rec: dict) -> dict:
    """The target record in the ``prompt`` + ``chosen`` + ``rejected`` form."""
    out = {k: v for k, v in rec.items() if k not in ("conversations", "system")}
    out["prompt"] = to_messages(rec["conversations"], rec.get("system"))
    for key in ("chosen", "rejected"):
        if key in rec:
            out[key] = _answer(rec[key], key)
    return out
