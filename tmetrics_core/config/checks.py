"""Checks of single config values, and how config errors show values, paths and close matches.

Every config module words its errors through these, so a user reads one style: the bad value
(:func:`describe`), the valid set with a close match (:func:`suggest`), and the fix, with
``path`` naming the entry (:func:`child_path`, :func:`under`).
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from typing import Any

from tmetrics_core.config.globs import expand_braces
from tmetrics_core.errors import ConfigError, PlacementError
from tmetrics_core.placements import parse_placement

__all__ = [
    "WHOLE_NUMBER",
    "check_int",
    "check_name",
    "check_placement",
    "child_path",
    "describe",
    "field_names",
    "glob_list",
    "keys_of",
    "message_of",
    "placement_table",
    "plain",
    "sink_table",
    "suggest",
    "under",
]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_AXIS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
WHOLE_NUMBER = re.compile(r"[+-]?[0-9]+")
"""A whole number as a config string writes it (``"10"``, ``"-3"``)."""


def keys_of(value: Any, *, path: str, valid: tuple[str, ...]) -> dict[str, Any]:
    """``value`` (a config section) as a dict whose keys are all in ``valid``; ``None`` counts
    as empty.

    Raises:
        ConfigError: ``value`` is not a mapping (at ``path``), a key is not a string, or a key
            is not in ``valid`` (at ``path.key``, with the closest valid key).
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        where = f"the {path} section" if path else "the config"
        raise ConfigError(f"{where} must be a mapping with keys {', '.join(valid)}; got {describe(value)}", path=path)
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"key {key!r} is not a string; valid keys: {', '.join(valid)}", path=path)
        if key not in valid:
            raise ConfigError(
                f"unknown key {key!r}{suggest(key, valid)}; valid keys: {', '.join(valid)}",
                path=child_path(path, key),
            )
    return dict(value)


def sink_table(value: Any) -> dict[str, dict[str, Any]]:
    """The ``sinks:`` section as sink name -> its options (a deep copy, so the config never
    shares a mutable option with its source). ``None`` is no sink; a list of names, and a name
    mapped to nothing, give ``{}`` (the sink's defaults). The
    options themselves are checked later, by each sink's constructor.

    Raises:
        ConfigError: ``value`` is neither a mapping nor a list (path ``sinks``); a name is not
            :func:`check_name`-valid or is listed twice (``sinks[i]``, ``sinks.<name>``); a
            sink's options are not a mapping, or an option name is not a string.
    """
    if value is None:
        return {}
    if isinstance(value, (list, tuple)):
        value = _listed_sinks(value, path="sinks")
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"got {describe(value)}; need a mapping from sink name to its options, e.g. "
            f"{{tensorboard: {{}}, mlflow: {{experiment: demo}}}}",
            path="sinks",
        )
    table: dict[str, dict[str, Any]] = {}
    for name, options in value.items():
        where = child_path("sinks", name) if isinstance(name, str) else "sinks"
        check_name(name, path=where, what="a sink name such as 'tensorboard'")
        if options is None:
            options = {}
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"got {describe(options)}; need a mapping of option names to values, or nothing for the defaults",
                path=where,
            )
        for key in options:
            if not isinstance(key, str):
                raise ConfigError(f"option name {describe(key)} is not a string; write it in quotes", path=where)
        table[name] = copy.deepcopy(dict(options))
    return table


def _listed_sinks(names: list[Any] | tuple[Any, ...], *, path: str) -> dict[str, None]:
    table: dict[str, None] = {}
    for index, name in enumerate(names):
        check_name(name, path=f"{path}[{index}]", what="a sink name such as 'tensorboard'")
        if name in table:
            raise ConfigError(f"sink {name!r} is listed twice; list each sink once", path=f"{path}[{index}]")
        table[name] = None
    return table


def placement_table(value: Any) -> dict[str, dict[str, str]]:
    """The ``placements:`` section as glob on canonical tensor names -> ``{axis: placement}``,
    the placement strings kept as written (parsed where they are applied). ``None`` is empty.

    Raises:
        ConfigError: ``value`` is not a mapping (path ``placements``); a glob is not a
            non-empty string; its axes are not a non-empty mapping (``placements.<glob>``); an
            axis is not a name (letters, digits, ``_``, not starting with a digit); a placement
            does not parse (:func:`check_placement`, ``placements.<glob>.<axis>``).
    """
    if value is None:
        return {}
    shape = (
        "a mapping from a glob on canonical tensor names to {axis: placement}, "
        "e.g. {'layers.*.attn.q.weight': {tp: 'Shard(0)'}}"
    )
    if not isinstance(value, Mapping):
        raise ConfigError(f"got {describe(value)}; need {shape}", path="placements")
    table: dict[str, dict[str, str]] = {}
    for pattern, axes in value.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise ConfigError(f"glob {describe(pattern)} is not a non-empty string; need {shape}", path="placements")
        where = child_path("placements", pattern)
        if not isinstance(axes, Mapping) or not axes:
            raise ConfigError(
                f"got {describe(axes)}; need a non-empty mapping {{axis: placement}}, e.g. {{tp: 'Shard(0)'}}",
                path=where,
            )
        for axis, placement in axes.items():
            if not isinstance(axis, str) or not _AXIS.fullmatch(axis):
                raise ConfigError(
                    f"axis {describe(axis)} is not an axis name (letters, digits, '_'), e.g. tp, dp, ep", path=where
                )
            check_placement(placement, path=child_path(where, axis))
        table[pattern] = dict(axes)
    return table



def check_placement(value: Any, *, path: str) -> None:
    """Check one placement override: a string that :func:`~tmetrics_core.placements.parse_placement`
    reads (short ``R``, ``S0``, ``S*``, ``O1``, ``P(sum)`` or long ``Shard(0)``, ...), other than
    ``FlatShard``, whose range depends on each tensor's shape.

    Raises:
        ConfigError: at ``path``, with the forms an override takes.
    """
    forms = "overrides take 'R', 'S0', 'S*', 'O1', 'P(sum)' or their long forms ('Shard(0)', ...)"
    if not isinstance(value, str):
        raise ConfigError(f"got {describe(value)}; need a placement string; {forms}", path=path)
    try:
        parse_placement(value)
    except PlacementError as err:
        raise ConfigError(f"{err}; {forms}, not FlatShard (it depends on each tensor's shape)", path=path) from None


def check_name(value: Any, *, path: str, what: str) -> None:
    """Check a name (a metric's, a sink's): a string of letters, digits, ``-``, ``_`` and ``.``
    that starts with a letter or digit.

    Raises:
        ConfigError: at ``path``, saying the value is not ``what`` (e.g. "a sink name such as
            'tensorboard'").
    """
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigError(f"got {describe(value)}; need {what} (letters, digits, '-', '_', '.')", path=path)


def check_int(value: Any, *, path: str, minimum: int, meaning: str) -> None:
    """Check an ``int`` (a ``bool`` is refused) of at least ``minimum``; ``meaning`` (with its
    unit, e.g. "steps between two computations") goes into the error.

    Raises:
        ConfigError: at ``path``; for a quoted whole number (``"10"``), with the hint to write
            it without quotes.
    """
    need = f"need an integer >= {minimum} ({meaning})"
    if isinstance(value, bool) or not isinstance(value, int):
        hint = "; write it without quotes" if isinstance(value, str) and WHOLE_NUMBER.fullmatch(value.strip()) else ""
        raise ConfigError(f"got {describe(value)}; {need}{hint}", path=path)
    if value < minimum:
        raise ConfigError(f"got {value}; {need}", path=path)


def glob_list(value: Any, *, path: str, of: str) -> tuple[str, ...]:
    """A ``select:`` or ``modules:`` value as globs: ``None`` is none, a string is one glob, a
    list or tuple several; brace alternatives are expanded
    (:func:`~tmetrics_core.config.globs.expand_braces`) and repeats dropped, order kept.
    ``of``: what the globs match, for the error (e.g. "canonical tensor names").

    Raises:
        ConfigError: ``value`` is neither a string nor a list (at ``path``); an item is not a
            non-empty string, or its braces are unbalanced or hold one alternative (at
            ``path[i]``, or ``path`` for a single string).
    """
    items = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise ConfigError(f"got {describe(value)}; need a glob on {of} or a list of globs", path=path)
    for index, item in enumerate(items):
        if not isinstance(item, str) or not item.strip():
            where = path if isinstance(value, str) else f"{path}[{index}]"
            raise ConfigError(
                f"got {describe(item)}; need a non-empty glob on {of}, e.g. 'layers.*.mlp.*'", path=where
            )
    expanded: list[str] = []
    for index, item in enumerate(items):
        try:
            expanded += expand_braces(item)
        except ValueError as exc:
            raise ConfigError(f"{exc}", path=path if isinstance(value, str) else f"{path}[{index}]") from None
    return tuple(dict.fromkeys(expanded))


def describe(value: Any) -> str:
    """A value as an error message shows it: strings quoted, containers by kind, type named."""
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    kind = {bool: "a boolean", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )
    return f"{value!r} ({kind})"


def suggest(word: Any, choices: Iterable[str], *, n: int = 1) -> str:
    """`` (did you mean 'x'?)`` for the closest choices to ``word``, or nothing."""
    matches = difflib.get_close_matches(word, list(choices), n=n) if isinstance(word, str) else []
    return f" (did you mean {' or '.join(repr(m) for m in matches)}?)" if matches else ""



def child_path(path: str, key: str) -> str:
    """The config path of ``key`` under ``path``: ``sinks.tensorboard`` for a plain key
    (letters, digits, ``_``, ``-``), ``placements['layers.*.q']`` for any other; no leading
    ``.`` at the top level (``path`` empty)."""
    part = f".{key}" if _PLAIN_KEY.fullmatch(key) else f"[{key!r}]"
    return f"{path}{part}" if path else part.lstrip(".")


def field_names(kind: type) -> tuple[str, ...]:
    """The field names of the dataclass ``kind``, in declaration order: the valid keys of its
    config section.

    Raises:
        TypeError: ``kind`` is not a dataclass.
    """
    return tuple(f.name for f in fields(kind))


def message_of(err: ConfigError) -> str:
    """The message of ``err`` without the ``path: `` prefix ConfigError adds."""
    return str(err).removeprefix(f"{err.path}: ") if err.path else str(err)


@contextmanager
def under(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError from a nested dataclass with ``prefix`` in front of its path."""
    try:
        yield
    except ConfigError as err:
        inner = err.path
        path = (
            prefix if not inner else inner if not prefix else f"{prefix}{'' if inner.startswith('[') else '.'}{inner}"
        )
        raise ConfigError(message_of(err), path=path) from None


def plain(value: Any) -> Any:
    """``value`` as plain data, recursively: a dataclass instance and a mapping become dicts, a
    list or tuple a list, anything else a deep copy; what ``Config.to_dict()`` returns and a
    YAML or JSON dump takes."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return copy.deepcopy(value)
