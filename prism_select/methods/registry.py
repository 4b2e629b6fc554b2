"""The one registry of scoring methods: each method's name, function, options and facts.

A method file declares its methods with :func:`register`::

    @dataclass(frozen=True)
    class MyOptions:
        layer: int | None = None     # each field: an option, its type and default

    @register("mine", options=MyOptions, description="one line for `prism-select methods`")
    def mine_method(ctx): ...

The facts a :class:`Method` carries (``kind``, ``multi_task``, ``sharded``, ``control``,
``needs_pairs``, ``given_weights``) are what the settings check and the run asks of a
method by name. This module imports nothing of the package but :mod:`prism_select.errors`,
so that :mod:`prism_select.settings` can ask it; the method files themselves (which
import the settings) are imported the first time the registry is read
(:func:`load`: every module of :mod:`prism_select.methods`, so a new method file is
registered without being named anywhere else).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import pkgutil
import types
import typing
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError

#: what a method forms: ``direction``, a target direction of :mod:`prism_select.preference`
#: (PRISM, its ablations and the controls of its weights: scored by
#: :func:`prism_select.methods.prism.prism_method`); ``baseline``, a method of its own
KINDS = ("direction", "baseline")

#: the package whose modules :func:`load` imports
PACKAGE = __name__.rpartition(".")[0]

#: the method files in the order their methods are listed (``prism-select methods``, an
#: experiment's ``methods: all``); any other module of the package follows, by name
ORDER = ("prism", "random_scores", "ifguide", "concept", "saefeat", "less", "judge")


@dataclass(frozen=True)
class NoOptions:
    """The options of a method that takes none."""


@dataclass(frozen=True)
class Method:
    """One registered method.

    fn: ``(ctx: RunContext) -> (scores, pair_rows)``. options: the frozen dataclass of
    its options (:func:`parse_options`). kind: one of :data:`KINDS`. multi_task: scores
    several target sets (tasks) in one pass, each its own ``pi``, ``g_KL`` and ``v``
    (:mod:`prism_select.tasks`). sharded: runs under ``--shard fsdp`` (needs nothing
    beyond the direction and ``v``). control: a control of PRISM's weights, not a
    selector (left out of an experiment's ``methods: all``). needs_pairs: refused without
    target pairs. given_weights: its direction takes one weight per pair, formed from
    every pair's ``pi`` first (:data:`prism_select.preference.GIVEN_WEIGHTS`).
    """

    name: str
    fn: Callable
    options: type
    description: str
    kind: str = "baseline"
    multi_task: bool = False
    sharded: bool = False
    control: bool = False
    needs_pairs: bool = True
    given_weights: bool = False
    module: str = ""

    @property
    def streams(self) -> bool:
        """Scores the pool a window at a time under ``--stream`` (the target directions)."""
        return self.kind == "direction"

    def option_names(self) -> list:
        return [f.name for f in dataclasses.fields(self.options)]


_METHODS: dict = {}
_loaded = False
_loading = False


def register(name: str, *, options: type = NoOptions, description: str, kind: str = "baseline",
             multi_task: bool = False, sharded: bool = False, control: bool = False, needs_pairs: bool = True,
             given_weights: bool = False):
    """Register the decorated function as method ``name`` (stack it for several names).

    ``options``: a frozen dataclass, one field per option (its annotation the option's
    type, its default the option's default); its ``__post_init__`` may check values,
    raising :class:`ConfigError`. The other arguments: :class:`Method`.
    """
    if kind not in KINDS:
        raise TypeError(f"method {name!r}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not (dataclasses.is_dataclass(options) and isinstance(options, type)
            and options.__dataclass_params__.frozen):
        raise TypeError(f"method {name!r}: options must be a frozen dataclass, got {options!r}")

    def wrap(fn):
        if not callable(fn):
            raise TypeError(f"method {name!r} is not callable")
        if name in _METHODS:
            raise TypeError(f"method name {name!r} from {fn.__module__} is already taken by "
                            f"{_METHODS[name].module}")
        _METHODS[name] = Method(name, fn, options, description, kind, multi_task, sharded, control, needs_pairs,
                                given_weights, fn.__module__)
        return fn
    return wrap


def load() -> None:
    """Import every module of the methods package and its subpackages once (their
    :func:`register` calls fill the registry): those of :data:`ORDER` first, then the
    others by name. An import error inside a method file is not hidden."""
    global _loaded, _loading
    if _loaded or _loading:  # (a method file read the registry while it was being imported)
        return
    _loading = True
    try:
        _import_all()
        _loaded = True
    finally:
        _loading = False


def _import_all() -> None:
    package = importlib.import_module(PACKAGE)
    found = [m.name for m in pkgutil.walk_packages(package.__path__, f"{PACKAGE}.") if m.name != __name__]

    def place(full: str) -> tuple:
        top = full[len(PACKAGE) + 1:].split(".")[0]
        return (ORDER.index(top) if top in ORDER else len(ORDER), full)
    for mod in sorted(found, key=place):
        importlib.import_module(mod)


def names(kind: str | None = None, **facts) -> list:
    """The registered names in order, optionally only those of ``kind`` and with the given
    facts (e.g. ``names(multi_task=True)``)."""
    load()
    return [n for n, m in _METHODS.items() if (kind is None or m.kind == kind)
            and all(getattr(m, k) == v for k, v in facts.items())]


def get(name: str) -> Method:
    """The :class:`Method` named ``name``; :class:`ConfigError` (field ``method``) for an
    unknown name."""
    load()
    if not isinstance(name, str) or name not in _METHODS:
        raise ConfigError("method", f"unknown method {name!r}", f"use one of {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def describe_methods() -> dict:
    """Every scoring method (PRISM and its ablations first) -> one-line description."""
    load()
    return {n: m.description for n, m in _METHODS.items()}


# ----------------------------------------------------------------------------- options

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text", list: "a list",
               dict: "a mapping", type(None): "null", os.PathLike: "a path", pathlib.Path: "a path"}


def _allowed(annotation) -> tuple:
    """The plain types an option's annotation accepts (``object``: anything)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(annotation) for t in _allowed(a))
    if origin is not None:  # list[str], dict[str, str], ...
        return (origin,)
    if annotation is None:
        return (type(None),)
    return (annotation,)


def _fits(value, allowed: tuple) -> bool:
    for t in allowed:
        if t is object:
            return True
        if t is bool:
            if isinstance(value, bool):
                return True
        elif t in (int, float):
            if not isinstance(value, bool) and isinstance(value, (int, float) if t is float else int):
                return True
        elif t is list:
            if isinstance(value, (list, tuple)):
                return True
        elif isinstance(value, t):
            return True
    return False


def parse_options(name: str, given: dict | None):
    """``given`` (``ScoreSettings.method_options``: the CLI's ``--option KEY=VALUE``, an
    experiment's ``method_options``, the Python API's dict) as method ``name``'s options
    dataclass. An unknown key or a value of the wrong type is a :class:`ConfigError`
    naming the method, the key and the known keys (or the type)."""
    method = get(name)
    given = dict(given or {})
    known = method.option_names()
    unknown = [str(k) for k in given if k not in known]
    if unknown:
        problem = (f"method {name!r} has no option(s) {', '.join(unknown)}: it takes only {', '.join(known)}" if known
                   else f"method {name!r} takes no options, got {', '.join(unknown)}")
        raise ConfigError("method_options", problem,
                          "check the spelling (each method's options: docs/methods.md), "
                          "or drop the option")
    hints = typing.get_type_hints(method.options)
    for key, value in given.items():
        allowed = _allowed(hints[key])
        if not _fits(value, allowed):
            words = " or ".join(dict.fromkeys(_TYPE_WORDS.get(t, t.__name__) for t in allowed))
            raise ConfigError(key, f"method {name!r}'s option {key} must be {words}, got {value!r}",
                              f"pass e.g. --option {key}=VALUE with a JSON value of that type")
    return method.options(**given)


def options_dict(options) -> dict:
    """An options dataclass as a dict, its fields in order (what run.json records)."""
    return {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
