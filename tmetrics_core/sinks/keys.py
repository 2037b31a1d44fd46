"""Key rendering: from a structured record to one backend's metric key.

A key is family first, then the labels as ``/``-separated segments in a fixed order::

    metric / tensor / layer_LL / expert_EEE / stat

    layer-grad-l2/layer_03
    layer-expert-tokens/layer_03/expert_017
    layer-expert-load-imbalance/layer_03/max_over_mean
    tensor-grad-l2/layers.3.attn.q.weight

Indices are zero-padded (to at least 2 digits for layers and 3 for experts, wider when the
model needs it, see :func:`index_widths`) so keys sort in index order in every tracker.

Each backend accepts a different set of characters and a maximum length (:class:`KeyRules`).
A character outside the set becomes ``_``, a label that would not be a proper path segment
(empty, ``.`` or ``..``) has its characters replaced too, and a key over the length limit keeps
its head and ends with ``-`` plus an 8-hex-digit hash of the labels. Replacing characters can
map two label sets to one key (``a*b`` and ``a_b``); :class:`KeyBook` remembers which labels
produced each key and raises :class:`~tmetrics_core.errors.ConfigError` naming both label
sets, so a collision is never silent.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Iterable

from tmetrics_core.errors import ConfigError
from tmetrics_core.records import Labels

__all__ = [
    "KeyBook",
    "KeyRules",
    "MLFLOW_RULES",
    "PLAIN_RULES",
    "TENSORBOARD_RULES",
    "WANDB_RULES",
    "check_collisions",
    "index_widths",
]

_SEPARATOR = "/"
_REPLACEMENT = "_"
_HASH_DIGITS = 8


@dataclass(frozen=True, slots=True)
class KeyRules:
    """One backend's rules for metric keys.

    Args:
        name: the backend, used in error messages (``"tensorboard"``).
        allowed: a positive regex character class (``r"[-/\\w.]"``, ASCII meaning of ``\\w``)
            of the characters the backend accepts in a key. ``/`` is always the segment
            separator; inside a label it is replaced like any other disallowed character.
        max_len: the longest key the backend accepts, in characters.

    Raises:
        ValueError: ``allowed`` is not a ``[...]`` class, is negated, or does not accept
            ``_`` (the replacement character); ``max_len`` leaves no room for the hash suffix.
    """

    name: str
    allowed: str
    max_len: int
    _disallowed: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (self.allowed.startswith("[") and self.allowed.endswith("]")) or self.allowed.startswith("[^"):
            raise ValueError(
                f"KeyRules({self.name!r}).allowed must be a positive regex class like r'[-/\\w.]'; "
                f"got {self.allowed!r}"
            )
        if not re.fullmatch(self.allowed, _REPLACEMENT, flags=re.ASCII):
            raise ValueError(f"KeyRules({self.name!r}).allowed must accept {_REPLACEMENT!r}; got {self.allowed!r}")
        if self.max_len < 2 * (_HASH_DIGITS + 1):
            raise ValueError(f"KeyRules({self.name!r}).max_len must be >= {2 * (_HASH_DIGITS + 1)}; got {self.max_len}")
        # Inside a segment, "/" is never allowed: it would create a false segment.
        disallowed = re.compile("[^" + self.allowed[1:-1] + "]|/", flags=re.ASCII)
        object.__setattr__(self, "_disallowed", disallowed)

    def clean(self, text: str) -> str:
        """``text`` with every disallowed character (and ``/``) replaced by ``_``, one for one."""
        return self._disallowed.sub(_REPLACEMENT, text)

    def segment(self, label: str) -> str:
        """``label`` made legal as one path segment: :meth:`clean`, and an empty label or one
        made only of dots (``.``, ``..``, which path-like stores such as MLflow reject or
        collapse) has its characters replaced as well."""
        out = self._disallowed.sub(_REPLACEMENT, label)
        if not out.strip("."):
            return _REPLACEMENT * max(1, len(out))
        return out


PLAIN_RULES = KeyRules("plain", r"[-/\w.*]", 1024)
"""Readable keys for the ``jsonl`` and ``console`` sinks: family wildcards (``*``) kept."""

TENSORBOARD_RULES = KeyRules("tensorboard", r"[-/\w.]", 1024)
"""TensorBoard silently rewrites tag characters outside ``[-/\\w.]`` to ``_``; we do it first so
the tag we record is the tag it stores."""

MLFLOW_RULES = KeyRules("mlflow", r"[-/\w. :]", 250)
"""MLflow accepts alphanumerics and ``_ - . space : /`` in metric keys, 250 characters at most,
and rejects ``//``, a leading ``/`` and ``..`` segments."""

WANDB_RULES = KeyRules("wandb", r"[-/\w.]", 255)
"""W&B groups charts into sections by the text before the first ``/``; keys keep to
``[-/\\w.]`` so that ``define_metric`` glob patterns (``*``) never meet a literal ``*``."""


def index_widths(num_layers: int, num_experts: int) -> tuple[int, int]:
    """The zero-padding widths ``(layer_width, expert_width)`` for a model.

    At least ``(2, 3)``; wider when the largest index (``num_layers - 1``, ``num_experts - 1``)
    needs more digits, so that every key of the run has the same width and sorts by index.
    A count of 0 (no layers or no experts) gives the minimum.

    Raises:
        ValueError: a negative count.
    """
    if num_layers < 0 or num_experts < 0:
        raise ValueError(f"index_widths needs counts >= 0; got num_layers={num_layers}, num_experts={num_experts}")
    return max(2, len(str(max(num_layers - 1, 0)))), max(3, len(str(max(num_experts - 1, 0))))


def _index(prefix: str, value: int, width: int) -> str:
    if value < 0:
        raise ValueError(f"{prefix} index must be >= 0; got {value}")
    return f"{prefix}_{value:0{width}d}"


def _render(metric: str, labels: Labels, rules: KeyRules, layer_width: int, expert_width: int,
            prefix: str = "") -> str:
    segments = [rules.segment(metric)]
    if labels.tensor is not None:
        segments.append(rules.segment(labels.tensor))
    if labels.layer is not None:
        segments.append(_index("layer", labels.layer, layer_width))
    if labels.expert is not None:
        segments.append(_index("expert", labels.expert, expert_width))
    if labels.stat is not None:
        segments.append(rules.segment(labels.stat))
    key = prefix + _SEPARATOR.join(segments)
    if len(key) <= rules.max_len:
        return key
    # Too long: keep the head, append a hash of the labels so distinct labels stay distinct.
    identity = (metric, labels.layer, labels.expert, labels.tensor, labels.stat)
    digest = hashlib.blake2s(repr(identity).encode(), digest_size=_HASH_DIGITS // 2).hexdigest()
    head = key[: rules.max_len - _HASH_DIGITS - 1].rstrip(_SEPARATOR)
    return f"{head}-{digest}"


def _describe(metric: str, labels: Labels) -> str:
    return "{" + ", ".join(f"{n}={v!r}" for n, v in {"metric": metric, **labels.as_dict()}.items()) + "}"


class KeyBook:
    """Renders keys for one backend and remembers which labels produced each key.

    ``add`` is cheap for labels already seen (a dict look-up), so a sink may call it for
    every record of every step.

    Args:
        rules: the backend's :class:`KeyRules`.
        layer_width, expert_width: zero-padding widths, see :func:`index_widths`.
        prefix: put before every key (``"tmetrics/"`` in a tracker run tmetrics shares with its
            owner, so its keys never meet the owner's); counted in ``rules.max_len``.
    """

    __slots__ = ("rules", "layer_width", "expert_width", "prefix", "_key_of", "_series_of")

    def __init__(self, rules: KeyRules = PLAIN_RULES, *, layer_width: int = 2, expert_width: int = 3,
                 prefix: str = "") -> None:
        self.rules = rules
        self.prefix = prefix
        self.layer_width = layer_width
        self.expert_width = expert_width
        self._key_of: dict[tuple[str, Labels], str] = {}
        self._series_of: dict[str, tuple[str, Labels]] = {}

    def __len__(self) -> int:
        return len(self._series_of)

    def add(self, metric: str, labels: Labels = Labels()) -> str:
        """The key of the series ``metric`` with ``labels``, remembered.

        Segments: metric, then tensor, ``layer_LL``, ``expert_EEE`` and stat where set. The
        key is at most ``rules.max_len`` characters, has no empty segment, no leading ``/``,
        and only characters ``rules.allowed`` accepts.

        Raises:
            ConfigError: a different series already rendered to the same key; the message
                names the backend, the key and both label sets.
            ValueError: a negative layer or expert index.
        """
        series = (metric, labels)
        key = self._key_of.get(series)
        if key is not None:
            return key
        key = _render(metric, labels, self.rules, self.layer_width, self.expert_width, self.prefix)
        other = self._series_of.get(key)
        if other is not None:
            raise ConfigError(
                f"two label sets render to the same {self.rules.name} key {key!r}: {_describe(*other)} "
                f"and {_describe(metric, labels)}; characters outside {self.rules.allowed} become "
                f"{_REPLACEMENT!r}, so rename one of the tensors or stats (or select only one)",
                path=f"sinks.{self.rules.name}",
            )
        self._key_of[series] = key
        self._series_of[key] = series
        return key

    def series(self, key: str) -> tuple[str, Labels]:
        """The ``(metric, labels)`` that produced ``key``.

        Raises:
            KeyError: ``key`` was never returned by :meth:`add`.
        """
        return self._series_of[key]


def check_collisions(
    series: Iterable[tuple[str, Labels]],
    rules: KeyRules,
    *,
    layer_width: int = 2,
    expert_width: int = 3,
) -> None:
    """Check at configuration time that distinct series ``(metric, labels)`` get distinct keys.
    Every collision is reported at once.

    Raises:
        ConfigError: one or more keys are shared by different label sets; the message lists
            each key with both label sets.
    """
    book = KeyBook(rules, layer_width=layer_width, expert_width=expert_width)
    problems: list[str] = []
    for metric, labels in series:
        try:
            book.add(metric, labels)
        except ConfigError as error:
            problems.append(str(error).removeprefix(f"{error.path}: "))
    if problems:
        raise ConfigError(
            f"{len(problems)} key collision(s) for {rules.name}:\n  " + "\n  ".join(problems),
            path=f"sinks.{rules.name}",
        )
