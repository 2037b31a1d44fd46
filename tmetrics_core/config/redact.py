"""Secret redaction for anything tmetrics logs: the run config, sink options, environment variables.

Two rules, applied to a copy:

1. **Secret keys.** A value whose key names a secret is replaced by ``"***"`` whole (a mapping or
   list under such a key too). A key names a secret when, split into words at ``_ - . /``,
   spaces and camelCase humps, it contains the word ``token``, ``auth``, ``authorization``,
   ``bearer`` or ``cookie``, or when, written without separators, it contains ``apikey``,
   ``password``, ``passwd``, ``secret``, ``credential`` or ``privatekey``. So ``WANDB_API_KEY``,
   ``apiKey``, ``MLFLOW_TRACKING_PASSWORD``, ``HF_TOKEN`` and ``basic_auth`` are secret, while
   ``tokenizer``, ``max_tokens`` and ``author`` are not. ``None``, booleans and empty strings under
   a secret key are kept: they show that no secret is set and hide nothing.
2. **Secret-looking strings**, under any key, are masked in place: W&B API keys (40 hex
   digits, alone or after a ``local-`` style prefix; a 40-digit git commit hash is masked too),
   the password in ``scheme://user:password@host``, secret-named URL query parameters
   (``?token=...``), ``Bearer <token>`` (8 characters or more), well-known prefixed tokens
   (Hugging Face ``hf_``, GitHub ``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_``/``github_pat_``) and
   PEM private-key blocks.

Only dicts (any mapping), lists and tuples are walked; other objects are returned as they are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["MASK", "is_secret_key", "mask_secrets", "redact"]

MASK = "***"
"""What a secret is replaced by."""

_SECRET_WORDS = frozenset({"token", "auth", "authorization", "bearer", "cookie"})
_SECRET_FRAGMENTS = ("apikey", "password", "passwd", "secret", "credential", "privatekey")
_WORD_BOUNDARY = re.compile(r"[^A-Za-z0-9]+|(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")

_STRING_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # PEM private key blocks: the whole block
    (
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL),
        MASK,
    ),
    # scheme://user:password@host -> scheme://user:***@host
    (re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*):[^\s/?#@]+@"), rf"\g<head>:{MASK}@"),
    # Bearer tokens in header-like text
    (re.compile(r"(?P<head>\bBearer\s+)[A-Za-z0-9\-._~+/]{8,}=*", re.IGNORECASE), rf"\g<head>{MASK}"),
    # well-known prefixed tokens
    (
        re.compile(r"(?<![A-Za-z0-9_])(?:hf_[A-Za-z0-9]{30,}|gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
        MASK,
    ),
    # W&B API keys: 40 hex digits not inside a longer word or number
    (re.compile(r"(?<![A-Za-z0-9])[0-9a-fA-F]{40}(?![A-Za-z0-9])"), MASK),
)
_QUERY_PARAMETER = re.compile(r"(?P<head>[?&;](?P<name>[^=&;#\s]+)=)(?P<value>[^&;#\s]*)")


def is_secret_key(key: str) -> bool:
    """Whether a mapping key or environment variable name names a secret (rule 1 above)."""
    compact = re.sub(r"[^a-z0-9]", "", key.lower())
    if any(fragment in compact for fragment in _SECRET_FRAGMENTS):
        return True
    return any(word.lower() in _SECRET_WORDS for word in _WORD_BOUNDARY.split(key) if word)


def mask_secrets(text: str) -> str:
    """``text`` with every secret-looking part replaced by ``***`` (rule 2 above)."""
    for pattern, replacement in _STRING_PATTERNS:
        text = pattern.sub(replacement, text)
    return _QUERY_PARAMETER.sub(_mask_query_value, text)


def redact(data: Any) -> Any:
    """A copy of ``data`` with secrets replaced by ``***``, walking mappings, lists and tuples.

    Mappings come back as ``dict``, lists as ``list``, tuples as ``tuple``; the input is not
    changed. Keys are never altered; only values are.
    """
    if isinstance(data, str):
        return mask_secrets(data)
    if isinstance(data, Mapping):
        return {key: _redact_item(key, value) for key, value in data.items()}
    if isinstance(data, list):
        return [redact(item) for item in data]
    if isinstance(data, tuple):
        return tuple(redact(item) for item in data)
    return data


def _redact_item(key: Any, value: Any) -> Any:
    if isinstance(key, str) and is_secret_key(key) and not _reveals_nothing(value):
        return MASK
    return redact(value)


def _reveals_nothing(value: Any) -> bool:
    return value is None or isinstance(value, bool) or (isinstance(value, str) and not value)


def _mask_query_value(found: re.Match[str]) -> str:
    if found["value"] and is_secret_key(found["name"]):
        return f"{found['head']}{MASK}"
    return found[0]
