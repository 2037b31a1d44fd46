"""``Reporter``: the logging rank says each message (``once``: the first time its key comes),
every other rank says nothing, and both note the same keys."""

from __future__ import annotations

import logging

import pytest

from tmetrics_core.errors import ConfigError
from tmetrics_core.reporter import Reporter
from tmetrics_core.topology import Topology


def _rank_of(rank: int, world: int) -> Topology:
    """Rank ``rank`` of ``world``, no axes (no process group needed)."""
    return Topology((), global_rank=rank, world_size=world)


def test_the_log_rank_says_once_per_key_and_other_ranks_note_the_same_keys(caplog):
    speaker, quiet = Reporter(_rank_of(1, 2), log_rank=1), Reporter(_rank_of(0, 2), log_rank=1)
    assert (speaker.speaks, quiet.speaks) == (True, False)
    with caplog.at_level(logging.INFO, logger="tmetrics"):
        for reporter in (speaker, quiet):
            assert [reporter.once(("unfed", "m"), "tmetrics: %s found nothing", "m") for _ in range(3)] == [
                True, False, False]
            assert reporter.first("other") and not reporter.first("other")
            reporter.warning("tmetrics: w %d", 1)
            reporter.info("tmetrics: i %d", 2)
            reporter.log(logging.INFO, "tmetrics: l %d", 3)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "tmetrics: m found nothing"), (logging.WARNING, "tmetrics: w 1"),
        (logging.INFO, "tmetrics: i 2"), (logging.INFO, "tmetrics: l 3")]


def test_a_log_rank_outside_the_world_is_refused():
    with pytest.raises(ConfigError, match=r"distributed.log_rank: log_rank 2 is not a rank of this job, whose world "
                                          r"has 2 rank\(s\) \(0..1\)"):
        Reporter(_rank_of(0, 2), log_rank=2)
