"""HostCopy on the CPU: the values as they were when the copy started, in vector order."""
from __future__ import annotations

import torch

from tmetrics_core.distributed.host_copy import HostCopy


def test_a_write_after_the_copy_started_does_not_reach_it():
    buffer = torch.arange(6, dtype=torch.float64)
    copy = HostCopy([buffer[:2], buffer[4:]])  # views of a buffer the next step writes again
    alone = HostCopy([buffer[2:3]])  # one vector is copied too, not kept as the view it is
    buffer.fill_(-1.0)
    assert copy.ready() and copy.read() == [0.0, 1.0, 4.0, 5.0]
    assert alone.read() == [2.0]
