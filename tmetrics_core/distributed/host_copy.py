"""A due step's values on their way to the host: one copy, started without waiting for it."""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """``vectors`` (float64, 1-D, on one device; at least one) joined and copied to the host.

    On an accelerator the copy goes into pinned memory behind an event, so starting it does
    not wait for the device: the host waits only in :meth:`read`, and not at all once the
    device has passed the copy (a step later). On the CPU the values are copied at once (a
    later write into the memory a vector views, such as a row buffer reused by the next step,
    does not reach them).
    """

    def __init__(self, vectors: Sequence[torch.Tensor]) -> None:
        flat = torch.cat(list(vectors))  # a new tensor, even of one vector
        self._event: torch.Event | None = None
        if flat.device.type == "cpu":
            self._host = flat
            return
        self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        self._host.copy_(flat, non_blocking=True)
        self._event = torch.Event(device=flat.device)
        self._event.record()

    def ready(self) -> bool:
        """Whether :meth:`read` would return without waiting for the device."""
        return self._event is None or self._event.query()

    def read(self) -> list[float]:
        """The values, in the order of the vectors (waits for the copy where it is not done)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
