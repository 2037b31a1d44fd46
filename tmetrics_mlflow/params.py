"""The run config as MLflow params: flattened to dotted keys, redacted, within MLflow's limits.

MLflow params are flat string pairs that can never change once logged, with keys of at most
250 characters from ``[-/\\w. :]`` and values of at most 6,000 characters (MLflow >= 2.x; 500
before). ``{"optimizer": {"lr": 3e-4}, "metrics": ["layer-grad-l2:10"]}`` becomes
``optimizer.lr = "0.0003"`` and ``metrics.0 = "layer-grad-l2:10"``: one param per leaf, so runs
compare field by field in the MLflow UI. The complete config is logged as a JSON artifact
beside them, so nothing cut here is lost.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import MLFLOW_RULES
from tmetrics_core.config.redact import redact

__all__ = ["PARAM_KEY_LIMIT", "PARAM_VALUE_LIMIT", "flatten_params"]

PARAM_KEY_LIMIT = 250
"""MLflow's longest param key, characters."""

PARAM_VALUE_LIMIT = 6000
"""MLflow's longest param value, characters (``mlflow.utils.validation.MAX_PARAM_VAL_LENGTH``)."""

_ELLIPSIS = "..."


def _value_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, allow_nan=True)
    except (TypeError, ValueError):
        return str(value)


def _leaves(prefix: str, data: Any, out: list[tuple[str, Any]]) -> None:
    if isinstance(data, Mapping) and data:
        for key, value in data.items():
            _leaves(f"{prefix}.{key}" if prefix else str(key), value, out)
    elif isinstance(data, (list, tuple)) and data:
        for index, value in enumerate(data):
            _leaves(f"{prefix}.{index}" if prefix else str(index), value, out)
    else:
        out.append((prefix, data))


def _param_key(path: str, key_limit: int) -> str:
    key = "/".join(MLFLOW_RULES.segment(part) for part in path.split("/")) if path else "_"
    if len(key) <= key_limit:
        return key
    digest = hashlib.blake2s(path.encode(), digest_size=4).hexdigest()
    return f"{key[: key_limit - len(digest) - 1]}-{digest}"


def flatten_params(
    config: Mapping[str, Any],
    *,
    value_limit: int = PARAM_VALUE_LIMIT,
    key_limit: int = PARAM_KEY_LIMIT,
) -> dict[str, str]:
    """``config`` as MLflow params ``{dotted key: text}``, after secret redaction.

    Nested mappings and lists give dotted paths (list items by index); an empty mapping or
    list is one param (``"{}"``, ``"[]"``). Strings stay as they are; other values are JSON
    (``true``, ``null``, ``0.0003``). Characters MLflow refuses in a key become ``_``; a key
    over ``key_limit`` keeps its head plus an 8-hex-digit hash of the full path. A value over
    ``value_limit`` keeps its head and ends with ``...``.

    Raises:
        ConfigError: two config paths give the same param key (e.g. a key ``"a.b"`` beside
            ``a: {b: ...}``); the message names both.
    """
    leaves: list[tuple[str, Any]] = []
    _leaves("", redact(dict(config)), leaves)
    params: dict[str, str] = {}
    origin: dict[str, str] = {}
    for path, value in leaves:
        key = _param_key(path, key_limit)
        if key in origin:
            raise ConfigError(
                f"config entries {origin[key]!r} and {path!r} both become the MLflow param {key!r}; "
                f"rename one of them",
                path="sinks.mlflow",
            )
        origin[key] = path
        text = _value_text(value)
        if len(text) > value_limit:
            text = text[: value_limit - len(_ELLIPSIS)] + _ELLIPSIS
        params[key] = text
    return params
