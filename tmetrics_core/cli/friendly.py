"""How every ``tmetrics`` command reports tmetrics' own errors: one clear line, exit status 2."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import click

from tmetrics_core.errors import TMetricsError

__all__ = ["friendly"]


def friendly(func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command so a ``TMetricsError`` prints as ``tmetrics: error: ...`` on stderr and
    exits with status 2, without a traceback; any other exception passes through."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except TMetricsError as exc:
            click.echo(f"tmetrics: error: {exc}", err=True)
            sys.exit(2)
    return wrapper
