"""The update snapshot: the local parameters as they were before the optimizer step.

Update metrics read ``p - snapshot`` after the step, and metrics of parameters alone read the
snapshot itself when an update metric is due (see ``TensorMetrics``). :func:`snapshot` copies the
chosen parameters with one batched torch kernel, on any device.
"""

from __future__ import annotations

from typing import Iterator, MutableMapping, Sequence

import torch

from tmetrics_core.manifest.table import Manifest
from tmetrics_core.sources.params import local_view
from tmetrics_core import torch_private

__all__ = ["Snapshot", "snapshot"]

_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


class Snapshot(MutableMapping[str, torch.Tensor]):
    """``parameter name -> copy`` of the local tensor before the optimizer step.

    Args:
        copies: the copies, by parameter name.

    Entries are the caller's to pop or change in place; the parameter side reads them and
    leaves them unchanged.
    """

    __slots__ = ("_copies",)

    def __init__(self, copies: dict[str, torch.Tensor] | None = None) -> None:
        self._copies: dict[str, torch.Tensor] = dict(copies or {})

    def found(self, names: Sequence[str]) -> list[torch.Tensor | None]:
        """The copy of each of ``names``, None where it has none, in that order (one C-level
        lookup per name)."""
        return list(map(self._copies.get, names))

    def __getitem__(self, name: str) -> torch.Tensor:
        """The copy of ``name``, shaped as its tensor was.

        Raises:
            KeyError: a name without a copy.
        """
        return self._copies[name]

    def __setitem__(self, name: str, copy: torch.Tensor) -> None:
        self._copies[name] = copy

    def __delitem__(self, name: str) -> None:
        del self._copies[name]

    def __iter__(self) -> Iterator[str]:
        yield from list(self._copies)

    def __len__(self) -> int:
        return len(self._copies)

    def __contains__(self, name: object) -> bool:
        return name in self._copies


@torch.no_grad()
def snapshot(manifest: Manifest, names: Sequence[str] | None = None) -> Snapshot:
    """Copies of the local parameters (for updates), only of ``names`` when given (in that
    order; names without a local parameter are skipped), else of all in manifest order: one
    batched torch kernel (``x * 1.0`` is exact for every value: -0.0, NaN, inf)."""
    views = manifest.views
    local = manifest.local
    chosen = list(local) if names is None else list(filter(local.__contains__, names))  # C-level, per due step
    # local_view of a parameter (never None) is a tensor; a plain parameter is itself.
    tensors: list[torch.Tensor] = list(map(local.__getitem__, chosen))
    if not set(map(type, tensors)) <= _PLAIN:
        tensors = list(map(local_view, tensors))
    if views:
        tensors = [manifest.viewed(n, t) for n, t in zip(chosen, tensors)]
    copies = torch_private.foreach_mul(tensors, 1.0) if tensors else []
    return Snapshot(copies=dict(zip(chosen, copies)))
