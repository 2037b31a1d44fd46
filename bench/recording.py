"""A simulated world of any size in one process: a recording collectives seam.

``python -m bench.scaling`` asks what one rank of a 16,384-rank job sends and receives, without
16,384 processes. In a job whose ranks differ only by a few *class* coordinates (the pipeline
stage and the expert-parallel rank decide which parameters a rank holds; data-parallel replicas
and tensor-parallel peers list the same tensors), every rank of a class does the same work on
the same data. :class:`SymmetricWorld` therefore runs one thread per class (its representative:
the rank of that class at coordinate 0 on every other axis), and :class:`RecordingCollectives`
implements tmetrics' collectives seam for a representative: a collective over a group of any
size is answered from the representatives of the classes in that group, each member's value
being its class's (a SUM counts each member, as in the real group). Nothing crosses a network;
every call is recorded with the bytes this rank would move:

* ``all_reduce``: the message (``tensor.nbytes``; a ring or tree moves about twice that per
  rank, whatever the group size);
* ``all_gather``: what the rank receives, the members' tensors together;
* ``all_gather_object``: as ``TorchCollectives`` sends it, the lengths (8 bytes per member) and
  the pickled objects padded to the longest (members x longest).

Calls are recorded under the axes the group spans (``pp``, ``pp+ep``) or ``world``.
"""

from __future__ import annotations

import pickle
import threading
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

from tmetrics_core.topology import Axis, Topology

__all__ = ["RecordingCollectives", "SymmetricWorld"]


class SymmetricWorld:
    """A row-major mesh of ``shape`` named ``names`` whose ranks are alike except along
    ``class_axes``; one thread per class runs the job (see the module docstring)."""

    def __init__(self, shape: Sequence[int], names: Sequence[str], class_axes: Sequence[str],
                 timeout: float = 120.0) -> None:
        self.shape = tuple(shape)
        self.names = tuple(names)
        self.class_dims = tuple(self.names.index(a) for a in class_axes)
        self.mesh = torch.arange(int(torch.tensor(self.shape).prod())).reshape(self.shape)
        self.world_size = self.mesh.numel()
        self.timeout = timeout
        self.cond = threading.Condition()
        self.slots: dict[tuple, dict[tuple, Any]] = {}
        self.readers: dict[tuple, int] = {}

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def klass(self, rank: int) -> tuple[int, ...]:
        coords = self.coords(rank)
        return tuple(coords[d] for d in self.class_dims)

    def representatives(self) -> list[int]:
        """One global rank per class: coordinate 0 on every axis but the class axes."""
        index: list[Any] = [0] * len(self.shape)
        for d in self.class_dims:
            index[d] = slice(None)
        return self.mesh[tuple(index)].reshape(-1).tolist()

    def topology(self, rank: int) -> Topology:
        """What ``rank`` sees: each axis's group is the tuple of its global ranks."""
        coords = self.coords(rank)
        axes = []
        for d, name in enumerate(self.names):
            index: list[Any] = list(coords)
            index[d] = slice(None)
            ranks = tuple(self.mesh[tuple(index)].tolist())
            axes.append(Axis(name, self.shape[d], coords[d], ranks if self.shape[d] > 1 else None, ranks))

        def new_groups(lists: list[list[int]]) -> tuple[int, ...]:
            return next(tuple(g) for g in lists if rank in g)

        return Topology(axes, global_rank=rank, world_size=self.world_size, mesh_ranks=self.mesh,
                        new_groups=new_groups)

    def run(self, fn: Callable[[int, "RecordingCollectives"], Any]) -> dict[int, Any]:
        """``fn(rank, seam)`` on one thread per representative; results by rank; the first
        exception re-raised."""
        reps = self.representatives()
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, RecordingCollectives(self, rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
                with self.cond:
                    self.cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in reps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.timeout * 4)
        if errors:
            raise errors[0]
        if any(t.is_alive() for t in threads):
            raise TimeoutError("simulated representatives still running (a hang)")
        return results


class RecordingCollectives:
    """tmetrics' collectives seam for representative ``rank`` of ``world``, recording
    ``calls[label]`` and ``bytes[label]`` (see the module docstring)."""

    def __init__(self, world: SymmetricWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.mine = world.klass(rank)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self._seq: dict[tuple, int] = defaultdict(int)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def _exchange(self, group: Any, payload: Any) -> tuple[str, list[Any]]:
        w = self.world
        classes: list[tuple[int, ...]] | None = None
        if group is None:  # every class, each standing for world_size / classes ranks
            varying: tuple[int, ...] = tuple(range(len(w.shape)))
            label = "world"
        else:
            coords = [w.coords(m) for m in group]
            varying = tuple(d for d in range(len(w.shape)) if len({c[d] for c in coords}) > 1)
            classes = [tuple(c[d] for d in w.class_dims) for c in coords]
            label = "+".join(w.names[d] for d in varying) or "self"
        distinct = tuple(sorted(set(classes))) if classes is not None else tuple(
            w.klass(r) for r in w.representatives())
        base = (group is None, varying, distinct)
        key = base + (self._seq[base],)
        self._seq[base] += 1
        with w.cond:
            w.slots.setdefault(key, {})[self.mine] = payload
            w.cond.notify_all()
            if not w.cond.wait_for(lambda: len(w.slots[key]) == len(distinct), timeout=w.timeout):
                raise TimeoutError(f"rank {self.rank}: classes of group {label} never joined")
            by_class = dict(w.slots[key])
            w.readers[key] = w.readers.get(key, 0) + 1
            if w.readers[key] == len(distinct):
                del w.slots[key], w.readers[key]
        self.calls[label] += 1
        if classes is None:
            per_class = w.world_size // len(distinct)
            return label, [v for v in by_class.values() for _ in range(per_class)]
        return label, [by_class[c] for c in classes]

    def all_reduce(self, tensor: torch.Tensor, op: str, group: Any) -> None:
        label, values = self._exchange(group, tensor.detach().clone())
        self.bytes[label] += tensor.nbytes
        stacked = torch.stack(values)
        out = stacked.sum(0) if op == "sum" else stacked.amax(0) if op == "max" else stacked.amin(0)
        tensor.copy_(out)

    def all_gather(self, tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
        label, values = self._exchange(group, tensor.detach().clone())
        self.bytes[label] += sum(v.nbytes for v in values)
        return [v.clone() for v in values]

    def all_gather_object(self, obj: Any, group: Any) -> list[Any]:
        size = len(pickle.dumps(obj))
        label, values = self._exchange(group, (size, obj))
        self.calls[label] += 1  # as TorchCollectives: the lengths, then the padded bytes
        self.bytes[label] += len(values) * (8 + max(s for s, _ in values))
        return [pickle.loads(pickle.dumps(o)) for _, o in values]
