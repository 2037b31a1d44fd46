"""The options a catalogue metric declares, and the check of a config's options against them.

Every catalogue entry (built in or from an installed package, ``tmetrics_core.metrics.catalogue``)
declares the options it takes as :class:`MetricOption` values: a name, a type, a default and
what the option means. The config checks a metric's options against that declaration
(:func:`check_metric_options`, called by ``tmetrics_core.config.names.check_names`` and by
``build_metric``), so a misspelled or foreign option is refused at configuration time with the
options the metric does take.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tmetrics_core.config.checks import WHOLE_NUMBER, child_path, describe, suggest
from tmetrics_core.errors import ConfigError

__all__ = ["OPTION_TYPES", "MetricOption", "OptionType", "check_metric_options"]

OptionType = Literal["int", "float", "str", "bool", "strings"]
"""The value types an option may declare; ``strings`` is one string or a list of them (kept as a
tuple)."""

OPTION_TYPES: dict[str, str] = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
    "strings": "a string or a list of strings",
}
"""Each option type as an error message names it."""


@dataclass(frozen=True, slots=True)
class MetricOption:
    """One option a metric takes in its config entry (``{name: my-metric, window: 8}``).

    Attributes:
        name: the key in the metric's config entry; also the keyword its ``build`` receives.
        type: one of :data:`OptionType`.
        default: the value ``build`` receives when the entry omits the option; ``None``: the
            option is not passed at all (the metric's own default applies, as ``meaning`` says).
            An entry builds from its defaults alone: the catalogue builds each installed entry
            so when it loads, and leaves out a family whose entries do not.
        meaning: what the option does, with its unit and valid range (``tmetrics metrics``
            prints it).

    Raises:
        ConfigError: a name that is not a plain key, or a type outside :data:`OptionType`.
    """

    name: str
    type: OptionType
    default: Any
    meaning: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(f"option name {describe(self.name)} is not a plain key (letters, digits, '_')",
                              path="options")
        if self.type not in OPTION_TYPES:
            raise ConfigError(f"option {self.name!r} declares type {describe(self.type)}{suggest(self.type, OPTION_TYPES)}; "
                              f"need one of {', '.join(OPTION_TYPES)}", path=f"options.{self.name}")

    def check(self, value: Any, *, path: str) -> Any:
        """``value`` checked against the declared type; a ``strings`` value comes back as a tuple.

        Raises:
            ConfigError (``path``): a value of another type (a bool is not a number; an int is a
                valid ``float``).
        """
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
            "str": isinstance(value, str),
            "bool": isinstance(value, bool),
            "strings": isinstance(value, str) or (isinstance(value, (list, tuple))
                                                  and all(isinstance(v, str) for v in value)),
        }[self.type]
        if not ok:
            quoted = isinstance(value, str) and self.type in ("int", "float") and (
                WHOLE_NUMBER.fullmatch(value.strip()) or _is_number(value))
            hint = "; write it without quotes" if quoted else ""
            raise ConfigError(f"got {describe(value)}; need {OPTION_TYPES[self.type]} ({self.meaning}){hint}", path=path)
        if self.type == "strings":
            return (value,) if isinstance(value, str) else tuple(value)
        if self.type == "float":
            return float(value)
        return value

    def describe(self) -> dict[str, Any]:
        """The declaration as plain data (for ``tmetrics metrics --json``)."""
        default = list(self.default) if isinstance(self.default, tuple) else self.default
        return {"name": self.name, "type": self.type, "default": default, "meaning": self.meaning}


def check_metric_options(metric: str, declared: Sequence[MetricOption], given: Mapping[str, Any], *,
                         path: str = "") -> dict[str, Any]:
    """The options ``given`` to ``metric``, checked against what its entry ``declared``.

    Args:
        metric: the metric's canonical name (for the message).
        declared: the options its catalogue entry declares.
        given: option name -> value, as the config entry or the caller gives them.
        path: where the entry sits (``"metrics[2]"``); an error's path is ``path.<option>``.

    Returns:
        The given options with their values checked (``strings`` as tuples).

    Raises:
        ConfigError: an option the metric does not declare (the message lists the ones it
            takes, with a close match), or a value of the wrong type.
    """
    table = {option.name: option for option in declared}
    checked: dict[str, Any] = {}
    for name, value in given.items():
        where = child_path(path, name) if isinstance(name, str) else path
        if name not in table:
            takes = ", ".join(sorted(table)) or "no options"
            raise ConfigError(
                f"metric {metric!r} takes no {name!r} option{suggest(name, table)} (it takes: {takes}); remove "
                f"{name!r} from this metric's entry (`tmetrics metrics --json` lists each metric's options)",
                path=where)
        checked[name] = table[name].check(value, path=where)
    return checked


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
