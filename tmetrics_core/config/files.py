"""Reading a config file: YAML, TOML or JSON into plain data, without running code from it.

The format follows the file's suffix (``.yaml``/``.yml``, ``.toml``, ``.json``). Every failure is
a :class:`~tmetrics_core.errors.ConfigError` whose ``path`` is the file path: an unreadable file
(missing, a directory, no permission) names the operating-system reason; a malformed one gives
the 1-based line and column where the parser stopped. Duplicate keys in one mapping are errors
in every format (YAML and JSON parsers would otherwise keep the last one silently), and YAML
tags that build Python objects (``!!python/object/apply:os.system``) are refused, not run.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

import yaml

from tmetrics_core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, published as ``tomli``
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

__all__ = ["SUFFIXES", "read_config_file"]

SUFFIXES = (".yaml", ".yml", ".toml", ".json")
"""File suffixes :func:`read_config_file` understands (case-insensitive)."""

_YAML_MERGE_TAG = "tag:yaml.org,2002:merge"
_TOML_POSITION = re.compile(r"^(?P<msg>.*) \(at line (?P<line>\d+), column (?P<col>\d+)\)$", re.DOTALL)


def read_config_file(path: str | os.PathLike[str]) -> Any:
    """Parse the config file at ``path`` into plain Python data (dicts, lists, scalars).

    Args:
        path: a ``.yaml``, ``.yml``, ``.toml`` or ``.json`` file, UTF-8 encoded.

    Returns:
        The parsed document as the format gives it; an empty YAML file gives ``None``.

    Raises:
        ConfigError: unknown suffix; the file cannot be read; it is not UTF-8; it is malformed
            (message starts ``line L, column C:``); a mapping repeats a key; a YAML tag asks for a
            Python object.
    """
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConfigError(
            f"unknown config file type {file.suffix or '(no suffix)'!r}; valid suffixes: "
            f"{', '.join(SUFFIXES)}; rename the file or convert it to one of these formats",
            path=str(file),
        )
    try:
        raw = file.read_bytes()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise ConfigError(
            f"cannot read the config file ({reason}); check that the path exists, is a file "
            f"and is readable by this process",
            path=str(file),
        ) from err
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"line {line}: the file is not UTF-8 text (byte {raw[err.start]:#04x}); save it as UTF-8",
            path=str(file),
        ) from err
    parse = _PARSERS[".yaml" if suffix == ".yml" else suffix]
    return parse(text, str(file))


class _StrictYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also refuses duplicate keys and names any unsupported tag."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _YAML_MERGE_TAG:
                continue  # merged keys (<<: *anchor) may be overridden on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # unhashable key: SafeLoader reports it below
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    f"while reading the mapping that starts at line {node.start_mark.line + 1}",
                    node.start_mark,
                    f"duplicate key {key!r} (first at line {first.start_mark.line + 1}); keep one",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


def _refuse_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    raise yaml.constructor.ConstructorError(
        None,
        None,
        f"tag {node.tag!r} is not allowed: a tmetrics config holds plain data only and no code "
        f"runs from it; remove the tag",
        node.start_mark,
    )


_StrictYamlLoader.add_multi_constructor("", _refuse_tag)


def _parse_yaml(text: str, file: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = err.problem or err.context or "syntax error"
        raise ConfigError(f"{where}malformed YAML: {problem}", path=file) from err
    except yaml.YAMLError as err:
        raise ConfigError(f"malformed YAML: {err}", path=file) from err


def _parse_toml(text: str, file: str) -> Any:
    if tomllib is None:
        raise ConfigError(
            "reading TOML on Python 3.10 needs the tomli package; run `pip install tomli`, or use "
            "a YAML or JSON config",
            path=file,
        )
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        line, col, message = _toml_position(err)
        where = f"line {line}, column {col}: " if line else ""
        raise ConfigError(f"{where}malformed TOML: {message}", path=file) from err


def _toml_position(err: Exception) -> tuple[int, int, str]:
    """(line, column, message) of a TOML error; line 0 when the parser gave no position."""
    lineno = getattr(err, "lineno", None)  # Python 3.14+ carries the position as attributes
    if lineno is not None:
        return int(lineno), int(getattr(err, "colno")), str(getattr(err, "msg"))
    found = _TOML_POSITION.match(str(err))
    if found is None:
        return 0, 0, str(err)
    return int(found["line"]), int(found["col"]), found["msg"]


def _parse_json(text: str, file: str) -> Any:
    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                raise ConfigError(f"malformed JSON: duplicate key {key!r} in one object; keep one", path=file)
            obj[key] = value
        return obj

    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as err:
        raise ConfigError(f"line {err.lineno}, column {err.colno}: malformed JSON: {err.msg}", path=file) from err


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    ".yaml": _parse_yaml,
    ".toml": _parse_toml,
    ".json": _parse_json,
}
