"""The three collectives the executor uses, behind one small seam.

``TorchCollectives`` calls ``torch.distributed`` with a bounded wait on every call, so a peer
that never arrives raises instead of hanging. Tests swap in an in-process simulation with the
same three methods, and benchmarks a recording one; nothing else in tmetrics talks to other
ranks (the manifest exchange at start-up included).
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from tmetrics_core.distributed.backends import object_device
from tmetrics_core.errors import TMetricsError

__all__ = ["Collectives", "TorchCollectives"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Collectives(Protocol):
    """``group`` is an axis's process group, or None for the default (world) group."""

    def all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> None:
        """Reduce ``tensor`` in place with ``op`` (``sum``, ``max``, ``min``)."""
        ...

    def all_gather(self, tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in group-rank order."""
        ...

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in group-rank order (slow path: errors only)."""
        ...


class TorchCollectives:
    """``torch.distributed`` collectives, each waited on for at most ``timeout_s`` seconds.

    Raises:
        TMetricsError: from every call when the wait fails (time out, or a peer lost), naming
            the operation and the bound; or when the backend refuses to start it (a group with
            no backend for the tensor's device), naming the group's backends and the device;
            the backend's error is the cause.
    """

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout = timedelta(seconds=timeout_s)

    def all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> None:
        what = f"all_reduce({op})"
        self._wait(self._start(lambda: dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=True), what,
                               tensor, group), what)

    def all_gather(self, tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        self._wait(self._start(lambda: dist.all_gather(out, tensor, group=group, async_op=True), "all_gather",
                               tensor, group), "all_gather")
        return out

    @staticmethod
    def _start(call: Callable[[], Any], what: str, tensor: torch.Tensor, group: Any) -> Any:
        try:
            return call()
        except RuntimeError as exc:  # refused before any rank waits: the same on every rank
            raise TMetricsError(
                f"a tmetrics {what} of a {tensor.device.type} tensor could not start on a group whose backends are "
                f"{dist.get_backend_config(group)!r} ({exc}). The group tmetrics was given (an axis of the topology, "
                "or the default group) needs a backend for that device: e.g. init_process_group('cpu:gloo,cuda:nccl') "
                "or axis groups made with a backend for it"
            ) from exc

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:  # gloo and NCCL raise RuntimeError (or DistBackendError) here
            seconds = self.timeout.total_seconds()
            raise TMetricsError(
                f"a tmetrics {what} did not complete within {seconds:g} s ({exc}): some rank never joined it. "
                "It crashed, hangs, or skipped a due `with metrics.step(n)`; every rank must enter every step "
                "scope. If the ranks are only slow, raise distributed.collective_timeout_s."
            ) from exc

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        """Pickled to bytes and sent in two bounded ``all_gather`` calls (lengths, then the bytes
        padded to the longest), on the CPU where the group has a CPU backend, else on the
        current accelerator (a group of NCCL alone)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(object_device(group))
        lengths = self.all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=data.device), group)
        longest = max(int(n.item()) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=data.device)
        padded[:data.numel()] = data
        return [pickle.loads(chunk[:int(n.item())].cpu().numpy().tobytes())
                for chunk, n in zip(self.all_gather(padded, group), lengths)]
