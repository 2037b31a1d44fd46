"""``Reporter``: the one object that decides which rank prints tmetrics' warnings.

Every rank runs the same checks and reaches the same warnings; only the logging rank (global
rank ``distributed.log_rank``, default 0, :meth:`~tmetrics_core.topology.Topology.logs`) says
them, so a job of 512 ranks prints each warning once. Code that warns takes a ``Reporter``
and calls :meth:`Reporter.warning`, :meth:`Reporter.info` or :meth:`Reporter.once`; it never
tests a rank itself.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

from tmetrics_core.topology import Topology

__all__ = ["Reporter"]

log = logging.getLogger("tmetrics")


class Reporter:
    """Says tmetrics' warnings on the logging rank; on every other rank it keeps quiet.

    Args:
        topology: this job's ranks.
        log_rank: the global rank that speaks (config ``distributed.log_rank``).

    Raises:
        ConfigError: ``log_rank`` is not a rank of this world (path ``distributed.log_rank``).
    """

    def __init__(self, topology: Topology, log_rank: int = 0) -> None:
        self.speaks = topology.logs(log_rank)
        """Whether this rank is the logging rank (the same answer for the whole run)."""
        self._said: set[Hashable] = set()

    def warning(self, message: str, *args: Any) -> None:
        """``message % args`` at WARNING on the logging rank (``logging`` formatting, read lazily)."""
        if self.speaks:
            log.warning(message, *args)

    def info(self, message: str, *args: Any) -> None:
        """``message % args`` at INFO on the logging rank."""
        if self.speaks:
            log.info(message, *args)

    def log(self, level: int, message: str, *args: Any) -> None:
        """``message % args`` at ``level`` (``logging.INFO``, ...) on the logging rank."""
        if self.speaks:
            log.log(level, message, *args)

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` is asked about, on every rank alike (then False): for a
        warning said once whose text costs something to build, built only then."""
        if key in self._said:
            return False
        self._said.add(key)
        return True

    def once(self, key: Hashable, message: str, *args: Any, level: int = logging.WARNING) -> bool:
        """``message % args`` at ``level`` on the logging rank, the first time ``key`` is reported
        (:meth:`first`); returns whether this was the first time."""
        if not self.first(key):
            return False
        self.log(level, message, *args)
        return True
