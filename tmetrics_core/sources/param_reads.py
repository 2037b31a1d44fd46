"""Where the parameter side reads its tensors and sites: the manifest, flat buffers, Adam state.

:class:`ParamReads` is built once per ``TensorMetrics`` (the manifest, its local tensors and the
flat buffers do not change after construction): the sites of every parameter-side kind, what
the manifest fixes (:class:`ManifestFacts`), the flat buffers laid out over the model, and the
optimizer state keys of each state kind. :meth:`ParamReads.read` reads the local tensors of one
source for a list of manifest entries, as the due set's program asks for them on every due step.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, cast

import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.manifest.dtensor import dtensor_placements
from tmetrics_core.manifest.table import Manifest
from tmetrics_core.site import Site
from tmetrics_core.sources.flat import FLAT_KINDS, FlatBuffer, FlatSource
from tmetrics_core.sources.optimizer_state import state_keys, state_value
from tmetrics_core.kinds import OPTIMIZER_KINDS, PARAM_KINDS, STATE_KINDS
from tmetrics_core.sources.params import grad_of, grads_of, has_none, local_view, read_kind
from tmetrics_core.sources.snapshot import Snapshot
from tmetrics_core.topology import Topology
from tmetrics_core import torch_private

_LOW = frozenset({torch.bfloat16, torch.float16})
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")

__all__ = ["SOURCES", "ManifestFacts", "ParamReads", "grads_placed_as_params", "local_tensors"]

SOURCES = frozenset(PARAM_KINDS | OPTIMIZER_KINDS | {"before"})
"""What :meth:`ParamReads.read` reads: a parameter-side kind, or ``"before"`` (a parameter as it
was before the optimizer step: its snapshot copy)."""


@dataclass(frozen=True, slots=True)
class ManifestFacts:
    """What the parameter side reads off the manifest once (neither its entries nor its local
    tensors change after construction).

    Attributes:
        local: the local parameter of every manifest entry, in manifest order (None where held
            elsewhere).
        views: per entry, how its tensor is read from its parameter (an expert slice of a
            stacked tensor: ``Manifest.views``) or None (the whole tensor).
        partial_params: some ``param`` or ``update`` site is ``Partial`` on an axis (such
            parameters are materialized after reading, so their local moments are of one part).
        dtensor_params: some local parameter is a DTensor (its gradient may be placed otherwise).
    """

    local: tuple[torch.Tensor | None, ...]
    views: tuple[Any, ...]
    partial_params: bool
    dtensor_params: bool


class ParamReads:
    """The parameter side's tensors and sites (see the module docstring).

    Args:
        manifest: every tensor of the model, with its local tensor here.
        topology: named axes.
        optimizer: the unwrapped torch optimizer (Adam state), or None.
        flat: ZeRO-style flat buffers by source kind (they hold the kind instead of the
            parameters).
        metrics: every configured metric (the state kinds some reads are checked at start-up).

    Raises:
        ConfigError: a flat buffer of another kind than ``FLAT_KINDS``, or one that does not fit
            the model or the topology (:class:`~tmetrics_core.sources.flat.FlatSource`); an
            optimizer without the state some metric reads.
    """

    def __init__(self, manifest: Manifest, topology: Topology, *, optimizer: Any,
                 flat: Mapping[str, Sequence[FlatBuffer]], metrics: Sequence[TensorMetric]) -> None:
        self.manifest = manifest
        self.topology = topology
        self.optimizer = optimizer
        self.flat = flat
        self.kind_sites = {kind: manifest.sites(kind) for kind in sorted(PARAM_KINDS | OPTIMIZER_KINDS)}
        """The manifest's sites of every parameter-side kind, one per entry."""
        read = {k for m in metrics for k in m.source_kinds} & STATE_KINDS - set(flat)
        self.state_keys = state_keys(optimizer, read, "optimizer state") if optimizer is not None and read else {}
        """State kind -> the keys of the step's optimizers that hold it (checked at start-up)."""
        self.facts = ManifestFacts(
            local=tuple(manifest.local.get(e.name) for e in manifest.entries),
            views=tuple(manifest.views.get(e.name) for e in manifest.entries),
            partial_params=any(s.partial for kind in ("update", "param") for s in self.kind_sites[kind]),
            dtensor_params=any(dtensor_placements(p) is not None for p in manifest.local.values()))
        unknown = sorted(set(flat) - FLAT_KINDS)
        if unknown:
            raise ConfigError(f"flat buffers of kind {unknown}: a flat buffer holds one of {sorted(FLAT_KINDS)}")
        # Laid out here, so a buffer that does not fit the model fails at configuration time.
        self.flat_sources = {kind: FlatSource(buffers, manifest, topology.names) for kind, buffers in flat.items()}
        self._names = tuple(e.name for e in manifest.entries)
        self._viewed = any(v is not None for v in self.facts.views)
        self._held = [p for p in self.facts.local if p is not None]
        """The parameters held here (fixed with the manifest)."""
        self.device = local_view(self._held[0]).device if self._held else torch.device("cpu")
        """Where a tensor this rank does not read is stood in for (the device of the parameters)."""

    def read(self, source: str, entries: Sequence[int], snapshot: Snapshot | None) -> list[torch.Tensor | None]:
        """The local tensors of ``source`` (one of :data:`SOURCES`) of manifest ``entries``, in
        that order, None where this rank has none: held elsewhere, no gradient this step, no Adam
        state yet, no snapshot. A kind a flat buffer holds is read from it; the others as the
        entry reads them (an expert slice's view of its parameter, gradient, state, snapshot).
        ``update``: the parameter now less its ``snapshot`` copy (one batched subtraction; a
        bfloat16 or float16 parameter widened to float32 first, so the update is exact, not its
        rounding), None without a snapshot. ``before``: the snapshot's copy, or the parameter
        itself without a snapshot (no optimizer step ran in the scope, so nothing changed it).

        Raises:
            ValueError: a parameter whose shape or dtype no longer matches its snapshot (the
                optimizer replaced or resized it); an expert slice's state not shaped as its
                stored parameter.
        """
        if source in self.flat:
            return self.flat_tensors(source, entries)
        if source == "param" or (source == "before" and snapshot is None):
            return self._params(entries)
        if source == "grad":
            return self._grads(entries)
        if source in STATE_KINDS:
            return self.state_tensors([(source, e) for e in entries])
        if source == "before":  # a parameter without a copy (held elsewhere) reads None
            assert snapshot is not None
            return list(map(snapshot.get, map(self._names.__getitem__, entries)))
        if source == "update":
            return self._updates(entries, snapshot)
        raise ValueError(f"no parameter-side source {source!r}; known: {sorted(SOURCES)}")

    def grads_differ(self) -> bool:
        """Whether some DTensor gradient is placed otherwise than its parameter this step (then
        :meth:`grad_sites` differs from the manifest's gradient sites)."""
        return not grads_placed_as_params(self._held)

    def _params(self, entries: Sequence[int]) -> list[torch.Tensor | None]:
        """The local parameter of each entry, as it reads it (C-level maps: no Python per tensor
        for plain parameters without expert views)."""
        params = list(map(self.facts.local.__getitem__, entries))
        return self._as_read(local_tensors(params) if self.facts.dtensor_params else params, entries)

    def _grads(self, entries: Sequence[int]) -> list[torch.Tensor | None]:
        """The local gradient of each entry (:func:`grads_of`), as it reads it."""
        params = list(map(self.facts.local.__getitem__, entries))
        if has_none(params):  # held elsewhere: no gradient here
            held = list(itertools.compress(range(len(params)), map(operator.is_not, params, itertools.repeat(None))))
            found: list[torch.Tensor | None] = [None] * len(params)
            for k, grad in zip(held, grads_of([params[k] for k in held])):  # type: ignore[misc]
                found[k] = grad
        else:
            found = grads_of(params)  # type: ignore[arg-type]
        return self._as_read(local_tensors(found) if self.facts.dtensor_params else found, entries)

    def _updates(self, entries: Sequence[int], snapshot: Snapshot | None) -> list[torch.Tensor | None]:
        """``parameter now - snapshot`` of each entry with a copy in ``snapshot``, else None
        (C-level maps: no Python frame per tensor on a due step)."""
        if snapshot is None:
            return [None] * len(entries)
        found = list(map(snapshot.get, map(self._names.__getitem__, entries)))
        out: list[torch.Tensor | None] = [None] * len(entries)
        if not has_none(found):
            held = list(range(len(entries)))
        else:
            held = list(itertools.compress(range(len(entries)), map(operator.is_not, found, itertools.repeat(None))))
            if not held:
                return out
            entries, found = [entries[k] for k in held], [found[k] for k in held]
        now = cast("list[torch.Tensor]", self._params(entries))
        copies = cast("list[torch.Tensor]", found)
        if (list(map(_SHAPE, now)) != list(map(_SHAPE, copies))
                or list(map(_DTYPE, now)) != list(map(_DTYPE, copies))):
            raise ValueError("a parameter's shape or dtype changed in the optimizer step")
        if _LOW.intersection(map(_DTYPE, now)):
            now = [t.float() if t.dtype in _LOW else t for t in now]
        updates = torch_private.foreach_sub(now, copies)
        if len(held) == len(out):
            return list(updates)
        for k, update in zip(held, updates):
            out[k] = update
        return out

    def _as_read(self, tensors: list[torch.Tensor | None], entries: Sequence[int]) -> list[torch.Tensor | None]:
        """``tensors`` with each entry's view applied (an expert slice of a stacked tensor)."""
        if not self._viewed:
            return tensors
        views = self.facts.views
        return [t if t is None or (view := views[e]) is None else view(t) for t, e in zip(tensors, entries)]

    def sites_of(self, kind: str) -> list[Site]:
        """The sites of ``kind``, one per manifest entry: a flat buffer's where one holds it."""
        return self.flat_sources[kind].sites if kind in self.flat else self.kind_sites[kind]

    def flat_tensors(self, kind: str, entries: Sequence[int]) -> list[torch.Tensor | None]:
        """The local tensors of ``kind`` of manifest ``entries`` from its flat buffers, those no
        buffer holds read as ``read_kind`` reads them (a gradient or Adam state viewed as its
        entry reads it)."""
        source = self.flat_sources[kind]
        held = source.tensors()
        covered = source.covered
        if source.complete or all(covered[i] for i in entries):
            return [held[i] for i in entries]
        plain = read_kind(kind, self.manifest, self.optimizer, keys=self.state_keys)
        return [held[i] if covered[i] else plain[i] for i in entries]

    def state_tensors(self, reads: Sequence[tuple[str, int]]) -> list[torch.Tensor | None]:
        """The local Adam state of each ``(kind, manifest entry)`` of ``reads`` (viewed as the
        entry reads it), None where the optimizer has none yet, as ``read_kind`` reads it.

        Raises:
            ValueError: an expert slice whose state is not shaped as its stored parameter.
        """
        flat: dict[str, dict[int, torch.Tensor | None]] = {}
        for kind in {k for k, _ in reads} & set(self.flat):  # ZeRO: a FlatShard of the entry
            entries = [e for k, e in reads if k == kind]
            flat[kind] = dict(zip(entries, self.flat_tensors(kind, entries)))
        out: list[torch.Tensor | None] = []
        states = self.optimizer.state if self.optimizer is not None else {}
        for kind, entry in reads:
            if kind in flat:
                out.append(flat[kind][entry])
                continue
            param = self.facts.local[entry]
            if param is None:  # held elsewhere (another pipeline stage): no state here
                out.append(None)
                continue
            value = local_view(state_value(states.get(param, {}), self.state_keys.get(kind, (kind,))))
            view = self.facts.views[entry]
            if value is not None and view is not None:
                if value.shape != local_view(param).shape:
                    raise ValueError(f"optimizer state {kind!r} of {self.manifest.entries[entry].name} has shape "
                                     f"{list(value.shape)}, not its stored parameter's: no expert slice of it")
                value = view(value)
            out.append(value)
        return out

    def grad_sites(self) -> list[Site]:
        """Gradient sites with the gradient's own DTensor placements where they differ from the
        parameter's: a replicated weight fed by sequence-parallel activations has a
        ``Partial(sum)`` gradient, which is reduced before any norm is taken. Only the axes of
        the gradient's mesh whose placement came from DTensor change: a DTensor on a sub-mesh
        keeps its inferred or declared placements on the other axes (an expert ``Owned`` on
        ``ep``, a stage on ``pp``). Without DTensor parameters these are the manifest's sites."""
        if not self.facts.dtensor_params:
            return self.kind_sites["grad"]
        sites = []
        for site, entry in zip(self.kind_sites["grad"], self.manifest.entries):
            param = self.manifest.local.get(entry.name)
            held = grad_of(param) if param is not None else None
            grad = dtensor_placements(held) if held is not None else None
            if grad is not None and held is not None and entry.name in self.manifest.slices:
                # An expert slice: the gradient's placements as the slice sees them (Owned on
                # the expert axes, Partial kept); a gradient sharded otherwise raises here.
                grad = self.manifest.slice_placements(entry.name, held, self.topology)
            if grad is not None:
                merged = dict(site.placements)
                merged.update((a, p) for a, p in grad if entry.origin(a) == "dtensor")
                placements = tuple((a, merged[a]) for a in self.topology.names
                                   if a in merged and not merged[a].is_replica())
                if placements != site.placements:
                    site = dataclasses.replace(site, placements=placements)
            sites.append(site)
        return sites


def local_tensors(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The local tensor of each (:func:`~tmetrics_core.sources.params.local_view`)."""
    return list(map(local_view, tensors))


def grads_placed_as_params(params: Sequence[torch.Tensor]) -> bool:
    """Whether every gradient is placed as its parameter: a DTensor on the same mesh with the
    same placements for a DTensor parameter, a plain tensor for a plain one (then the manifest's
    gradient sites hold, as :meth:`ParamReads.grad_sites` would find)."""
    from torch.distributed.tensor import DTensor

    for param, grad in zip(params, map(grad_of, params)):
        if grad is None:
            continue
        if isinstance(param, DTensor) and isinstance(grad, DTensor):
            # The specs' mesh and placements, compared by identity first (FSDP2 gives a
            # gradient its parameter's): the properties and the placements' equality are
            # Python calls per tensor and step.
            mine, theirs = torch_private.dtensor_spec(grad), torch_private.dtensor_spec(param)
            if ((mine.mesh is not theirs.mesh and mine.mesh != theirs.mesh)
                    or (mine.placements is not theirs.placements and mine.placements != theirs.placements)):
                return False
        elif isinstance(param, DTensor) or isinstance(grad, DTensor):
            return False
    return True
