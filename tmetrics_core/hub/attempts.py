"""Calls to a sink with retries and backoff, each failure counted: the worker's retry policy.

tenacity drives the attempts; this module decides what is retried (anything but a
:class:`~tmetrics_core.errors.ConfigError`, which is deterministic, and :class:`Abandoned`), how
long the waits are (capped exponential backoff with jitter) and that every failed attempt is
counted in the sink's counters before it is retried or raised.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_when_event_set,
    wait_exponential_jitter,
)

from tmetrics_core.errors import ConfigError
from tmetrics_core.hub.report import SinkCounters

__all__ = ["Abandoned", "RetryCallState", "call_counted", "retrying"]


class Abandoned(Exception):
    """The hub gave up on a worker; its items now belong to ``SinkHub.close``."""


def _retryable(error: BaseException) -> bool:
    return not isinstance(error, (Abandoned, ConfigError))


def retrying(*, backoff: float, backoff_max: float, sleep: Callable[[float], None],
             before_sleep: Callable[[RetryCallState], None], attempts: int | None = None,
             until: threading.Event | None = None) -> Retrying:
    """The retry policy: ``attempts`` attempts in all, or until the event ``until`` is set;
    waits from ``backoff`` seconds doubling up to ``backoff_max``, plus up to ``backoff`` of
    jitter, slept by ``sleep``; ``before_sleep`` sees each failed attempt that is retried.

    Raises:
        ValueError: not exactly one of ``attempts`` and ``until`` given.
    """
    stop: stop_after_attempt | stop_when_event_set
    if attempts is not None and until is None:
        stop = stop_after_attempt(attempts)
    elif until is not None and attempts is None:
        stop = stop_when_event_set(until)
    else:
        raise ValueError("a retry policy stops after `attempts` or when `until` is set: give exactly one")
    return Retrying(stop=stop, wait=wait_exponential_jitter(initial=backoff, max=backoff_max, jitter=backoff),
                    sleep=sleep, retry=retry_if_exception(_retryable), before_sleep=before_sleep, reraise=True)


def call_counted(policy: Retrying, call: Callable[[], Any], counters: SinkCounters,
                 abandoned: threading.Event) -> None:
    """Run ``call`` under ``policy``; each exception is counted in ``counters`` (by type) before
    it is retried or raised. Raises :class:`Abandoned` before an attempt once ``abandoned`` is set,
    and the last attempt's exception when the policy gives up."""
    def attempt() -> None:
        if abandoned.is_set():
            raise Abandoned
        try:
            call()
        except Exception as error:
            counters.error(error)
            raise

    policy(attempt)
